"""Offline re-training: a replayed trainer's metrics beside the recorded run's, one row per step."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["TRAIN_COLUMNS", "metrics_table", "read_metrics"]


# Per step, side by side: what an algorithm change does to the update (the trainer's metrics.jsonl keys).
TRAIN_COLUMNS = (("loss", "loss"), ("kl", "ppo_approx_kl"), ("clip ratio", "actor_clip_ratio"),
                 ("grad norm", "grad_norm"))


def read_metrics(path: Path) -> list[dict]:
    """A metrics.jsonl's records, the last one of each step (a restarted trainer writes re-done steps again)."""
    if not path.exists():
        return []
    by_step: dict[Any, dict] = {}
    for line in path.read_text().splitlines():
        if line.endswith("}"):
            rec = json.loads(line)
            by_step[rec.get("step")] = rec
    return list(by_step.values())


def metrics_table(recorded: list[dict], replayed: list[dict]) -> str:
    """The recorded run's and the replay's loss, KL, clip ratio and grad norm, one row per step."""
    old = {r.get("step"): r for r in recorded}
    head = f"{'step':>5} " + " ".join(f"{name + ' (rec/new)':>27}" for name, _ in TRAIN_COLUMNS)
    rows = [head]
    for rec in replayed:
        step = rec.get("step")
        cells = []
        for _, key in TRAIN_COLUMNS:
            a, b = old.get(step, {}).get(key), rec.get(key)
            fmt = lambda v: f"{v:.6g}" if isinstance(v, (int, float)) else "-"   # noqa: E731
            cells.append(f"{fmt(a):>13}/{fmt(b):<13}")
        rows.append(f"{step:>5} " + " ".join(cells))
    if not recorded:
        rows.append("(the recorded run's metrics.jsonl, next to its msglog directory, was not found)")
    return "\n".join(rows)
