"""``python -m tools.report RUN_DIR [--out FILE]``: one self-contained HTML page of a run (default
RUN_DIR/report.html; every plot an inline PNG, nothing fetched from anywhere).

The page: the timeline (each actor's spans, as `python -m tools.trace` writes them for Perfetto); reward and
held-out accuracy; the staleness of every trained answer (histogram); each actor's
utilisation over time (the share of each time bin its timeline spans cover); the step-time breakdown (waiting
for the batch, log-probs, forward/backward, optimizer, the rest of the step, the wait for its publish); weight-sync
latency (push to every rollout until acked, generation stall, each push at the parameter server); the
mismatch monitors (importance weights, the proximal/behaviour log-prob gap, approximate KL, clipped and
capped tokens); answer lengths. It reads what `python -m tools.trace` reads (tools/trace/records.py); a plot
whose data the run did not record is replaced by a line saying what is missing.
"""
from __future__ import annotations

import argparse
import base64
import html
import io
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from tools.plot import eval_accuracy
from tools.trace import timeline
from tools.trace.records import NotARunDir, RunRecords, read_run

REPORT_FILE = "report.html"
UTILISATION_BINS = 40


def _steps(rec: RunRecords, key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for m in rec.metrics:
        if isinstance(m.get("step"), (int, float)) and isinstance(m.get(key), (int, float)):
            xs.append(m["step"])
            ys.append(m[key])
    return xs, ys


def plot_reward(rec: RunRecords, ax: Any) -> str | None:
    xs, ys = _steps(rec, "task_reward")
    if not xs:
        return "metrics.jsonl has no task_reward"
    ax.plot(xs, ys, label="task reward (training batch)", color="tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("task reward")
    acc = ax.twinx()
    ax_, ay = _steps(rec, "accuracy")
    acc.plot(ax_, ay, label="training accuracy", color="tab:orange", alpha=0.7)
    last = max(xs)
    for periodic, label, style in ((True, "held-out accuracy (evaluator)", dict(color="tab:green", marker="s")),
                                   (False, "held-out accuracy (final)", dict(color="black", marker="o", linestyle=""))):
        px, py = [], []
        for row in rec.evals:
            if (row.get("kind") == "periodic") != periodic:
                continue
            value, _ = eval_accuracy(row)
            step = row.get("step", last if not periodic else None)
            if value is not None and isinstance(step, (int, float)):
                px.append(step)
                py.append(value)
        if px:
            acc.plot(px, py, label=label, **style)
    acc.set_ylabel("accuracy")
    acc.set_ylim(0, 1)
    lines = ax.get_legend_handles_labels()[0] + acc.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], loc="lower right", fontsize=8)
    return None


def _trained_answers(rec: RunRecords) -> list[tuple[int, list[Any]]]:
    """(step, answer record) of every answer in a served batch."""
    buffer = (rec.by_role("buffer") or ["buffer"])[0]
    groups = {r["group"]: r for r in rec.records(buffer, "group")}
    return [(b["step"], a) for b in rec.records(buffer, "batch") for g in b["groups"]
            for a in (groups.get(g) or {}).get("answers", [])]


def plot_staleness(rec: RunRecords, ax: Any) -> str | None:
    # A step N batch trains on the weights of version N - 1; an answer's staleness counts from its oldest token.
    values = [step - 1 - a[0] for step, a in _trained_answers(rec) if a[0] >= 0]
    if not values:
        return "no trace records of trained groups (trace/buffer.jsonl)"
    top = max(values)
    ax.hist(values, bins=[x - 0.5 for x in range(0, top + 2)], color="tab:purple", rwidth=0.8)
    ax.set_xlabel("staleness of a trained answer (versions behind the trainer)")
    ax.set_ylabel("answers")
    return None


def spans_by_kind(doc: dict[str, Any]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Per process of a trace document, per kind of span (its name's first word), the intervals in seconds; the
    trainer's main-track phases nested in a step are kept apart from it ("log-probs", "forward/backward"...)."""
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    begins: dict[tuple[Any, Any], tuple[float, str]] = {}
    for e in doc["traceEvents"]:
        name = names.get(e.get("pid"))
        if name is None or name == "run":
            continue
        kind = str(e.get("name", "")).split(" ")[0]
        if e["ph"] == "X":
            out.setdefault(name, {}).setdefault(kind, []).append((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
        elif e["ph"] == "b":
            begins[(e["pid"], e["id"])] = (e["ts"], kind)
        elif e["ph"] == "e" and (e["pid"], e["id"]) in begins:
            start, kind = begins.pop((e["pid"], e["id"]))
            out.setdefault(name, {}).setdefault(kind, []).append((start / 1e6, e["ts"] / 1e6))
    return out


TIMELINE_COLOURS = {"generate": "tab:blue", "grade": "tab:olive", "wait": "lightgrey", "serve": "tab:orange",
                    "step": "tab:red", "log-probs": "tab:pink", "forward/backward": "darkred", "optimizer": "black",
                    "publish": "tab:grey", "export": "tab:purple", "send": "tab:cyan", "push": "tab:green",
                    "receive": "tab:cyan", "swap": "tab:brown", "evaluate": "gold"}


def plot_timeline(doc: dict[str, Any], ax: Any) -> str | None:
    """A Gantt chart of the trace: a row per actor, spans coloured by kind (overlapping groups drawn translucent)."""
    spans = spans_by_kind(doc)
    if not spans:
        return "no spans in the timeline"
    actors = sorted(spans, key=lambda a: (a not in ("trainer", "buffer", "param_server"), a))
    seen: set[str] = set()
    for row, actor in enumerate(actors):
        for kind, intervals in spans[actor].items():
            colour = TIMELINE_COLOURS.get(kind, "tab:grey")
            nested = kind in ("log-probs", "forward/backward", "optimizer")
            ax.broken_barh([(a, max(b - a, 1e-3)) for a, b in intervals], (row - (0.25 if nested else 0.4),
                           0.5 if nested else 0.8), facecolors=colour, alpha=0.35 if kind in ("generate", "grade") else 0.9,
                           label=None if kind in seen else kind)
            seen.add(kind)
    ax.set_yticks(range(len(actors)))
    ax.set_yticklabels(actors, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run's first record")
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    return None


def busy_intervals(doc: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """Per process of a trace document, the intervals its spans cover (waits excluded), in seconds."""
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    out: dict[str, list[tuple[float, float]]] = {}
    begins: dict[tuple[Any, Any], float] = {}
    for e in doc["traceEvents"]:
        name = names.get(e.get("pid"))
        if name is None or name == "run":
            continue
        if e["ph"] == "X" and e.get("tid") == timeline.MAIN and not str(e["name"]).startswith("wait"):
            out.setdefault(name, []).append((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
        elif e["ph"] == "b":
            begins[(e["pid"], e["id"])] = e["ts"]
        elif e["ph"] == "e" and (e["pid"], e["id"]) in begins:
            out.setdefault(name, []).append((begins.pop((e["pid"], e["id"])) / 1e6, e["ts"] / 1e6))
    return out


def utilisation(intervals: list[tuple[float, float]], edges: list[float]) -> list[float]:
    """The share of each bin [edges[i], edges[i+1]) that the union of ``intervals`` covers."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    shares = []
    for lo, hi in zip(edges, edges[1:]):
        covered = sum(max(0.0, min(hi, e) - max(lo, s)) for s, e in merged)
        shares.append(covered / (hi - lo) if hi > lo else 0.0)
    return shares


def plot_utilisation(doc: dict[str, Any], ax: Any) -> str | None:
    busy = busy_intervals(doc)
    if not busy:
        return "no spans in the timeline"
    end = max(e for spans in busy.values() for _, e in spans)
    if end <= 0:
        return "the timeline spans no time"
    edges = [end * i / UTILISATION_BINS for i in range(UTILISATION_BINS + 1)]
    mids = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
    for name in sorted(busy):
        ax.plot(mids, utilisation(busy[name], edges), label=name)
    ax.set_xlabel("seconds since the run's first record")
    ax.set_ylabel("share of time busy")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, ncol=2)
    return None


STEP_PARTS = (("wait_seconds", "waiting for the batch"), ("logprobs_seconds", "log-probs"),
              ("forward_backward_seconds", "forward/backward"), ("optimizer_seconds", "optimizer"))


def plot_step_breakdown(rec: RunRecords, ax: Any) -> str | None:
    rows = [m for m in rec.metrics if isinstance(m.get("step"), (int, float)) and "step_seconds" in m]
    if not rows:
        return "metrics.jsonl has no step_seconds"
    steps = [m["step"] for m in rows]
    bottom = [0.0] * len(rows)
    parts = [(label, [float(m.get(key) or 0.0) for m in rows]) for key, label in STEP_PARTS]
    parts.append(("rest of the train step", [max(float(m.get("train_seconds") or 0.0) - sum(
        float(m.get(k) or 0.0) for k, _ in STEP_PARTS[1:]), 0.0) for m in rows]))
    parts.append(("publish wait and the rest", [max(m["step_seconds"] - sum(p[1][i] for p in parts), 0.0)
                                                for i, m in enumerate(rows)]))
    for label, values in parts:
        ax.bar(steps, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)
    return None


def plot_weight_sync(rec: RunRecords, ax: Any) -> str | None:
    drawn = 0
    for key, label in (("weight_push_seconds", "push to every rollout, until acked"),
                       ("gen_stall_seconds", "generation stall (swap)"), ("weight_sync_seconds", "trainer's publish")):
        xs, ys = _steps(rec, key)
        if xs:
            ax.plot(xs, ys, marker=".", label=label)
            drawn += 1
    if not drawn:
        return "metrics.jsonl has no weight-sync times"
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    return None


MONITORS = (("importance_weight", "importance weight (mean)"), ("importance_weight_max", "importance weight (max)"),
            ("logprob_gap_max", "max |proximal - behaviour| log-prob, current version"),
            ("ppo_approx_kl", "approx. KL"), ("actor_clip_ratio", "clipped tokens"),
            ("behav_masked_frac", "tokens past the behaviour cap"))


def plot_mismatch(rec: RunRecords, ax: Any) -> str | None:
    drawn = 0
    for key, label in MONITORS:
        xs, ys = _steps(rec, key)
        if xs:
            ax.plot(xs, ys, label=label)
            drawn += 1
    if not drawn:
        return "metrics.jsonl has none of the mismatch monitors"
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    return None


def plot_lengths(rec: RunRecords, ax: Any) -> str | None:
    buffer = (rec.by_role("buffer") or ["buffer"])[0]
    lengths = [a[2] for r in rec.records(buffer, "group") for a in r.get("answers") or []]
    if lengths:
        ax.hist(lengths, bins=30, color="tab:cyan")
        ax.set_xlabel("answer tokens (every answer generated)")
        ax.set_ylabel("answers")
        return None
    xs, ys = _steps(rec, "avg_seq_len")
    if not xs:
        return "no answer lengths recorded (trace/buffer.jsonl, metrics.jsonl avg_seq_len)"
    ax.plot(xs, ys)
    ax.set_xlabel("step")
    ax.set_ylabel("mean answer tokens")
    return None


def _png(draw: Callable[[Any], str | None], size: tuple[float, float] = (8, 3.6)) -> tuple[str | None, str | None]:
    """(base64 PNG, None) or (None, why nothing was drawn)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size, dpi=90)
    try:
        missing = draw(ax)
        if missing is not None:
            return None, missing
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return base64.b64encode(buf.getvalue()).decode(), None
    finally:
        plt.close(fig)


def render(rec: RunRecords) -> tuple[str, int]:
    """(the page, the number of plots drawn)."""
    doc = timeline.build(rec)
    sections: list[tuple[str, Callable[[Any], str | None]]] = [
        ("Timeline", lambda ax: plot_timeline(doc, ax)),
        ("Reward and held-out accuracy", lambda ax: plot_reward(rec, ax)),
        ("Staleness of trained answers", lambda ax: plot_staleness(rec, ax)),
        ("Utilisation of each actor over time", lambda ax: plot_utilisation(doc, ax)),
        ("Step-time breakdown", lambda ax: plot_step_breakdown(rec, ax)),
        ("Weight-sync latency", lambda ax: plot_weight_sync(rec, ax)),
        ("Mismatch monitors", lambda ax: plot_mismatch(rec, ax)),
        ("Answer lengths", lambda ax: plot_lengths(rec, ax)),
    ]
    body, drawn = [], 0
    for title, draw in sections:
        png, missing = _png(draw, (11, 4.8) if title == "Timeline" else (8, 3.6))
        body.append(f"<section><h2>{html.escape(title)}</h2>")
        if png is not None:
            drawn += 1
            body.append(f'<img class="plot" alt="{html.escape(title)}" src="data:image/png;base64,{png}">')
        else:
            body.append(f'<p class="missing">not drawn: {html.escape(missing or "")}</p>')
        body.append("</section>")
    last = rec.metrics[-1] if rec.metrics else {}
    final = [eval_accuracy(r)[0] for r in rec.evals if r.get("kind") != "periodic"]
    facts = [("run directory", str(rec.run_dir)), ("steps trained", str(last.get("step", 0))),
             ("last task reward", f"{last['task_reward']:.3f}" if "task_reward" in last else "-"),
             ("final held-out accuracy", f"{final[-1]:.1%}" if final and final[-1] is not None else "-"),
             ("actors", ", ".join(rec.actors()))]
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in rec.notes)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>run report: {html.escape(rec.run_dir.name)}</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:1em auto;color:#222}}
table td{{padding:0 1em 0 0}} .missing{{color:#a40}} img.plot{{max-width:100%}}</style></head>
<body><h1>Run report</h1>
<table>{''.join(f'<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>' for k, v in facts)}</table>
{f'<h3>Missing or unreadable</h3><ul>{notes}</ul>' if notes else ''}
{''.join(body)}
<p>The timeline of this run: <code>python -m tools.trace {html.escape(str(rec.run_dir))}</code></p>
</body></html>
"""
    return page, drawn


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, help=f"the page (default RUN_DIR/{REPORT_FILE})")
    args = ap.parse_args(argv)
    try:
        rec = read_run(args.run_dir)
    except NotARunDir as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 2
    page, drawn = render(rec)
    out = args.out or args.run_dir / REPORT_FILE
    out.write_text(page)
    for note in rec.notes:
        print(f"missing: {note}", file=sys.stderr)
    print(f"{out}: {drawn} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
