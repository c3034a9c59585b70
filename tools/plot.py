"""`python -m tools.plot RUN_DIR [--out DIR]`: PNG plots of a training run.

Reads RUN_DIR/metrics.jsonl (one JSON object per trainer step, as `actors/trainer/actor.py` writes it) and,
when present, RUN_DIR/eval.jsonl (held-out evaluations: objects with "step" or "time" and accuracy keys
such as `tools.eval`'s "overall"/"by_level" summaries, or flat "accuracy"/"greedy_accuracy"; the evaluator
actor's points during the run, "kind": "periodic", are a series of their own). Writes,
into `--out` (default RUN_DIR/plots):

  reward.png       task_reward, accuracy, accuracy_by_level per level, held-out accuracy (during the
                   run and final)
  throughput.png   effective_throughput (trained tokens per second of step time)
  staleness.png    staleness_mean, staleness_max
  timing.png       step_seconds, train_seconds, weight_sync_seconds, wait_seconds (the trainer's stall),
                   weight_push_seconds, gen_stall_seconds
  utilisation.png  rollout_utilisation

The x axis is seconds since the first step ("time"), or the step number with `--x step` (or when
the metrics carry no time). Keys a run does not record are skipped with a note; a plot with nothing
to show is not written. A missing or empty metrics file, or a malformed line, is an error naming the
file and line (a torn last line, from a run still writing, is skipped with a note).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"

# plot name -> (title, panels: [(y label, [(key, label)])]); the "accuracy" panel also gets the
# per-level training accuracy and the held-out accuracy of eval.jsonl.
PLOTS: dict[str, tuple[str, list[tuple[str, list[tuple[str, str]]]]]] = {
    "reward": ("Reward and accuracy", [("task reward", [("task_reward", "task reward")]),
                                       ("accuracy", [("accuracy", "training accuracy")])]),
    "throughput": ("Effective training throughput", [("tokens / s", [("effective_throughput", "effective throughput")])]),
    "staleness": ("Sample staleness", [("versions", [("staleness_mean", "mean"), ("staleness_max", "max")])]),
    "timing": ("Step, weight-sync and stall times",
               [("seconds", [("step_seconds", "step"), ("train_seconds", "train"),
                             ("weight_sync_seconds", "weight sync"), ("wait_seconds", "trainer stall (waiting for a batch)"),
                             ("weight_push_seconds", "weight push to rollouts (until acked)"),
                             ("gen_stall_seconds", "generation stall (weight swap)")])]),
    "utilisation": ("Rollout utilisation", [("fraction of time with work", [("rollout_utilisation", "rollouts")])]),
}


class PlotError(ValueError):
    """The run directory cannot be plotted; the message names the file (and line) at fault."""


def read_jsonl(path: Path, required: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """(objects, notes). A malformed line is a PlotError, except a torn last line (noted, skipped)."""
    if not path.is_file():
        if required:
            raise PlotError(f"{path}: no such file (is this a run directory?)")
        return [], []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    rows, notes = [], []
    for pos, (line_no, line) in enumerate(numbered):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if pos == len(numbered) - 1 and len(numbered) > 1:
                notes.append(f"{path}:{line_no}: incomplete last line skipped (run still writing?)")
                continue
            raise PlotError(f"{path}:{line_no}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise PlotError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
        rows.append(obj)
    if required and not rows:
        raise PlotError(f"{path}: empty (no metrics recorded yet)")
    return rows, notes


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def x_values(rows: Sequence[dict[str, Any]], axis: str, t0: float | None) -> tuple[list[float | None], str]:
    if axis == "time" and t0 is not None:
        return [(_number(r.get("time")) - t0) if _number(r.get("time")) is not None else None for r in rows], \
            "seconds since the first step"
    return [_number(r.get("step")) if _number(r.get("step")) is not None else float(i + 1)
            for i, r in enumerate(rows)], "step"


def series(rows: Sequence[dict[str, Any]], xs: Sequence[float | None], key: str) -> tuple[list[float], list[float]]:
    px, py = [], []
    for x, row in zip(xs, rows):
        y = _number(row.get(key))
        if x is not None and y is not None:
            px.append(x)
            py.append(y)
    return px, py


def eval_accuracy(row: dict[str, Any]) -> tuple[float | None, dict[str, float]]:
    """Overall held-out accuracy and accuracy per level of one eval.jsonl entry."""
    overall = row.get("overall") if isinstance(row.get("overall"), dict) else row
    acc = None
    for key in ("greedy_accuracy", "accuracy", "pass@1"):
        acc = _number(overall.get(key))
        if acc is not None:
            break
    levels: dict[str, float] = {}
    by_level = row.get("by_level") or row.get("accuracy_by_level")
    if isinstance(by_level, dict):
        for level, value in by_level.items():
            v = _number(value.get("greedy_accuracy", value.get("pass@1"))) if isinstance(value, dict) else _number(value)
            if v is not None:
                levels[str(level)] = v
    return acc, levels


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None, axis: str = "time") -> tuple[list[Path], list[str]]:
    """Write the PNGs; returns (files written, notes about what was skipped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    if not run.is_dir():
        raise PlotError(f"{run}: no such directory")
    rows, notes = read_jsonl(run / METRICS_FILE, required=True)
    evals, eval_notes = read_jsonl(run / EVAL_FILE, required=False)
    notes += eval_notes
    if not (run / EVAL_FILE).is_file():
        notes.append(f"{run / EVAL_FILE}: absent, no held-out accuracy plotted")
    times = [t for t in (_number(r.get("time")) for r in rows) if t is not None]
    t0 = min(times) if times else None
    if axis == "time" and t0 is None:
        notes.append("metrics carry no 'time': x axis is the step")
    xs, xlabel = x_values(rows, axis, t0)
    out = Path(out_dir) if out_dir is not None else run / "plots"
    out.mkdir(parents=True, exist_ok=True)
    present = {k for r in rows for k, v in r.items() if _number(v) is not None or isinstance(v, dict)}
    written: list[Path] = []
    for name, (title, panels) in PLOTS.items():
        fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3.2 * len(panels) + 1), sharex=True, squeeze=False)
        drawn = 0
        for ax, (ylabel, keys) in zip(axes[:, 0], panels):
            here = 0
            for key, label in keys:
                if key not in present:
                    notes.append(f"{name}.png: no '{key}' in the metrics, skipped")
                    continue
                px, py = series(rows, xs, key)
                ax.plot(px, py, label=label, marker="." if len(px) < 50 else None)
                here += 1
            if ylabel == "accuracy":
                here += _plot_levels(ax, rows, xs, notes)
                here += _plot_evals(ax, evals, rows, axis, t0, notes)
            if here:
                ax.set_ylabel(ylabel)
                ax.grid(alpha=0.3)
                ax.legend(fontsize="small")
            drawn += here
        if not drawn:
            notes.append(f"{name}.png: nothing to plot, not written")
            plt.close(fig)
            continue
        axes[0, 0].set_title(title)
        axes[-1, 0].set_xlabel(xlabel)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written, notes


def _plot_levels(ax: Any, rows: Sequence[dict[str, Any]], xs: Sequence[float | None], notes: list[str]) -> int:
    levels = sorted({str(k) for r in rows if isinstance(r.get("accuracy_by_level"), dict)
                     for k in r["accuracy_by_level"]}, key=lambda s: (not s.isdigit(), int(s) if s.isdigit() else 0, s))
    if not levels:
        notes.append("reward.png: no 'accuracy_by_level' in the metrics, skipped")
        return 0
    for level in levels:
        px, py = [], []
        for x, row in zip(xs, rows):
            by = row.get("accuracy_by_level")
            y = _number(by.get(level)) if isinstance(by, dict) and x is not None else None
            if y is not None:
                px.append(x)
                py.append(y)
        ax.plot(px, py, label=f"accuracy L{level}", linewidth=0.8, alpha=0.7)
    return len(levels)


def _plot_evals(ax: Any, evals: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]], axis: str,
                t0: float | None, notes: list[str]) -> int:
    """Held-out accuracy: the evaluator's points during the run ("kind": "periodic", placed where the step
    of their version was trained) and the launcher's final evaluation, as two series."""
    if not evals:
        return 0
    use_time = axis == "time" and t0 is not None
    step_time = {int(r["step"]): _number(r.get("time")) for r in rows if _number(r.get("step")) is not None}
    drawn = 0
    for periodic, label, style in ((True, "held-out accuracy during the run (eval/accuracy)", {"color": "tab:green", "marker": "s"}),
                                   (False, "held-out accuracy", {"color": "black", "marker": "o", "linestyle": "--"})):
        px, py = [], []
        for row in evals:
            if (row.get("kind") == "periodic") != periodic:
                continue
            acc, _ = eval_accuracy(row)
            step = _number(row.get("step"))
            if use_time:
                x = step_time.get(int(step)) if periodic and step is not None else None
                x = _number(row.get("time")) if x is None else x
                x = None if x is None else max(x - t0, 0.0)
            else:
                x = step
            if x is not None and acc is not None:
                px.append(x)
                py.append(acc)
        if px:
            ax.plot(px, py, label=label, **style)
            drawn += 1
    if not drawn:
        notes.append(f"{EVAL_FILE}: no entry with both {'time' if use_time else 'step'} and an accuracy, skipped")
    return drawn


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="run directory holding metrics.jsonl")
    ap.add_argument("--out", help="directory for the PNG files (default RUN_DIR/plots)")
    ap.add_argument("--x", choices=("time", "step"), default="time", help="x axis")
    args = ap.parse_args(argv)
    try:
        written, notes = plot_run(args.run_dir, args.out, args.x)
    except PlotError as e:
        print(f"plot: error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
