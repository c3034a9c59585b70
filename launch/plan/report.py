"""Text tables of the planner's results (shared by `tools.plan` and `tools.up --dry-run`)."""
from __future__ import annotations

from launch.plan import hardware
from launch.plan.memory import GroupMemory


def gb(x: float) -> str:
    return f"{x / hardware.GB:.1f}"


def memory_table(setup_line: str, groups: list[GroupMemory]) -> list[str]:
    """One row per group: every term in GB per GPU, the total against the capacity, and the verdict."""
    if not groups:
        return ["memory per GPU: no GPU trainer or rollout group"]
    lines = [f"memory per GPU (GB; {setup_line})"]
    for m in groups:
        terms = ", ".join(f"{k} {gb(v)}" for k, v in m.terms.items())
        verdict = "fits" if m.fits else "DOES NOT FIT"
        extra = f"; {m.answers_at_once} answers of the configured length at once" if m.answers_at_once is not None else ""
        lines.append(f"  {m.group:<10} {gb(m.total):>6} / {gb(m.capacity)}  {verdict}{extra}")
        lines.append(f"    {terms}")
        lines.extend(f"    {n}" for n in m.notes)
    return lines
