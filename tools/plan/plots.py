"""PNG plots of a simulation: which GPU group is busy when, and the split/eta sweep."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.plan.sim import Result

TIMELINE_SERVERS = 8   # server lanes drawn (of possibly hundreds)


def write(out: Path, result: Result, sweep_rows: list[dict[str, Any]]) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    lanes = ["trainer", "weights", "push"] + [f"rollout.{i}" for i in range(min(result.config.servers, TIMELINE_SERVERS))]
    fig, ax = plt.subplots(figsize=(11, 0.4 * len(lanes) + 1.5))
    colours = {"trainer": "tab:orange", "weights": "tab:red", "push": "tab:purple"}
    for y, lane in enumerate(lanes):
        spans = [(a, b - a) for name, a, b in result.timeline if name == lane]
        ax.broken_barh(spans, (y - 0.4, 0.8), color=colours.get(lane, "tab:blue"))
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("virtual time (s)")
    ax.set_title(f"busy time per group: {len(result.steps)} steps, eta {result.config.eta} "
                 f"({TIMELINE_SERVERS if result.config.servers > TIMELINE_SERVERS else result.config.servers} of "
                 f"{result.config.servers} servers shown)")
    written = [str(out / "timeline.png")]
    fig.tight_layout()
    fig.savefig(written[0], dpi=110)
    plt.close(fig)
    if sweep_rows:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for eta in sorted({r["eta"] for r in sweep_rows}):
            rows = [r for r in sweep_rows if r["eta"] == eta]
            ax.plot([100 * r["share"] for r in rows], [r["throughput"] for r in rows], marker="o", label=f"eta {eta}")
        ax.set_xlabel("GPUs generating (%)")
        ax.set_ylabel("effective training throughput (tokens/s)")
        ax.legend()
        fig.tight_layout()
        written.append(str(out / "sweep.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written
