"""`python -m tools.bench ablation [--json] [--steps N] [--etas 0,1,4,16] [--losses ...] [--plot FILE]`: the staleness
and loss ablation.

AReaL's central algorithmic claim (arXiv 2505.24298, section 5.3): with large staleness, plain PPO degrades
while the decoupled objective keeps the final accuracy. This runs, from the same warm start, data and seed,
the embedded default (`topology/local.yaml`) once per eta x objective:

  decoupled   the trust region around the proximal policy, the behaviour policy only in the importance
              weight (algo.decoupled=true, the default)
  ppo         plain PPO: the trust region around the behaviour policy (algo.decoupled=false)

`--losses` adds the loss axis (algo.loss: each run sets every key its paper fixes, topology/experiment.py
LOSS_SETTINGS), `--corrections` the off-policy corrections (CORRECTIONS below) and `--seeds` the experiment seed;
the grid is eta x objective x loss x correction x seed. Each cell also reports the step monitors averaged over
its steps: the engine/trainer KL on current-weight tokens, the share of tokens each correction masked or
truncated, the clip ratio, the entropy and the answer length.

Each run checkpoints every `--eval-every` steps and every checkpoint is evaluated afterwards on the held-out
split (greedy only: `experiment.eval.samples=0`), so held-out accuracy is known along the run, against samples trained. The training reward
comes from the trainer's metrics.jsonl. The staleness the runs actually reached is reported next to eta:
a cell whose staleness never reached its eta says nothing about that eta (see `--minibatches`).

Printed as a table; `--json` prints one object; `--plot FILE` writes a PNG of held-out accuracy and
training reward against samples, one line per run.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from topology.experiment import LOSS_SETTINGS
from tools.bench.e2e import ROOT, TOPOLOGY, run_local

OBJECTIVES = {"decoupled": "true", "ppo": "false"}
# Named corrections and the settings each runs with (docs/algo.md: TIS's cap 2 as verl's rollout_is_threshold
# default, IcePop's [0.5, 5], M2PO's tau 0.04, a geometric-mean band of +-25 %).
CORRECTIONS: dict[str, list[str]] = {
    "none": [],
    "tis": ["experiment.algo.tis_cap=2.0"],
    "icepop": ["experiment.algo.rejection=icepop"],
    "m2po": ["experiment.algo.m2po_tau=0.04"],
    "geometric": ["experiment.algo.rejection=geometric", "experiment.algo.rejection_upper=1.25"],
}
# Held-out accuracy is greedy here: the final evaluation's 8 sampled answers a problem would be 8 times the work.
GREEDY_ONLY = "experiment.eval.samples=0"
# The step monitors a cell reports, averaged over its steps (metrics.jsonl keys; `step_monitors`).
MONITORS = ("mismatch_kl_k3", "actor_clip_ratio", "behav_masked_frac", "rejected_frac", "tis_truncated_frac",
            "m2po_masked_frac", "entropy", "avg_seq_len")


def loss_overrides(loss: str) -> list[str]:
    """algo.loss and every key it fixes, as overrides: a config file's own values of those keys give way."""
    def text(v: Any) -> str:
        return "true" if v is True else "false" if v is False else str(v)
    return [f"experiment.algo.loss={loss}", *(f"experiment.algo.{k}={text(v)}" for k, v in LOSS_SETTINGS[loss].items())]


def run_cell(eta: int, objective: str, steps: int, eval_every: int, extra: list[str], out: Path,
             log: Any, loss: str = "ppo", correction: str = "none", seed: int | None = None) -> dict[str, Any]:
    """One run of the grid, its held-out accuracy at each checkpoint, its staleness and its monitors."""
    name = f"eta{eta}-{objective}" + (f"-{loss}" if loss != "ppo" else "") + \
        (f"-{correction}" if correction != "none" else "") + (f"-seed{seed}" if seed is not None else "")
    overrides = [f"experiment.algo.eta={eta}", f"experiment.algo.decoupled={OBJECTIVES[objective]}",
                 f"experiment.run.checkpoint_every_steps={eval_every}",
                 "experiment.run.keep_checkpoints=0", GREEDY_ONLY, *(loss_overrides(loss) if loss != "ppo" else []),
                 *CORRECTIONS[correction], *([f"experiment.seed={seed}"] if seed is not None else []), *extra]
    summary = run_local(name, steps, overrides, out, log, bench="ablation")
    run_dir = Path(summary["run_dir"])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    samples, seen = [], 0.0
    for m in metrics:
        seen += m["n_seqs"]
        samples.append(seen)
    curve = held_out_curve(run_dir, summary, samples, extra, log, name)
    stale = [m["staleness_mean"] for m in metrics]
    monitors = step_monitors(metrics)
    return {"eta": eta, "objective": objective, "loss": loss, "correction": correction, "seed": seed,
            "monitors": monitors, "run_dir": str(run_dir), "steps": len(metrics),
            "final_accuracy": summary["greedy_accuracy"]["final"],
            "start_accuracy": summary["greedy_accuracy"].get("start"),
            "staleness_max": max(m["staleness_max"] for m in metrics),
            "staleness_mean": sum(stale) / len(stale),
            "reward_curve": [[s, m["task_reward"]] for s, m in zip(samples, metrics)],
            "held_out_curve": curve, "wall_seconds": summary.get("wall_seconds")}


def step_monitors(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """MONITORS over a run's steps: the mismatch KL weighted by the current-weight tokens each step measured it
    on (past eta 0 most steps have none and log 0, which is no measurement), the others a plain mean."""
    tokens = [m.get("mismatch_tokens", 0.0) for m in metrics]
    out = {k: sum(m.get(k, 0.0) for m in metrics) / len(metrics) for k in MONITORS}
    if sum(tokens):
        out["mismatch_kl_k3"] = sum(t * m.get("mismatch_kl_k3", 0.0) for t, m in zip(tokens, metrics)) / sum(tokens)
    return out


def held_out_curve(run_dir: Path, summary: dict[str, Any], samples: list[float], extra: list[str], log: Any,
                   name: str) -> list[list[float]]:
    """[samples trained, held-out greedy accuracy] at the start and at every kept checkpoint."""
    from actors.runtime.recovery import checkpoint_dir
    import topology
    from actors.evaluator.harness import evaluate_held_out

    config = topology.load(ROOT / TOPOLOGY, [*extra, GREEDY_ONLY]).topology.config
    test = str(ROOT / str(config.data.test))
    curve = [[0.0, summary["greedy_accuracy"].get("start", float("nan"))]]
    for step in range(1, len(samples) + 1):
        model = checkpoint_dir(run_dir, step) / "model"
        if not model.is_dir():
            continue
        if step == len(samples):
            acc = summary["greedy_accuracy"]["final"]   # the launcher evaluated it already
        else:
            log(f"bench ablation: {name}: held-out evaluation of step {step}")
            acc = evaluate_held_out(str(model), config, test)["overall"]["greedy_accuracy"]
        curve.append([samples[step - 1], acc])
    return curve


def plot(cells: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_method = len({(c.get("loss"), c.get("correction")) for c in cells}) > 1
    if by_method:
        plot_methods(cells, path, plt)
        return
    fig, (ax_acc, ax_rew) = plt.subplots(1, 2, figsize=(12, 4.5))
    # One colour per eta, the objective in the line style.
    etas = sorted({c["eta"] for c in cells})
    colours = {eta: plt.get_cmap("viridis")(i / max(len(etas) - 1, 1)) for i, eta in enumerate(etas)}
    for c in cells:
        style = "-" if c["objective"] == "decoupled" else "--"
        label = f"eta {c['eta']} {cell_label(c)}"
        ax_acc.plot(*zip(*c["held_out_curve"]), style, marker="o", color=colours[c["eta"]], label=label)
        ax_rew.plot(*zip(*c["reward_curve"]), style, color=colours[c["eta"]], label=label)
    ax_acc.set(title="Held-out greedy accuracy", xlabel="samples trained", ylabel="accuracy")
    ax_rew.set(title="Training reward (task_reward)", xlabel="samples trained", ylabel="reward")
    ax_acc.legend(fontsize=7)
    fig.suptitle("Staleness ablation: decoupled PPO (solid) vs plain PPO (dashed)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_methods(cells: list[dict[str, Any]], path: Path, plt: Any) -> None:
    """The loss axis: per method (loss, or decoupled PPO with a correction), a bar of the seeds' mean held-out
    gain over the warm start at each eta, each seed a dot on it; many methods read better as bars than lines."""
    method = (lambda c: c.get("loss", "ppo") if c.get("correction", "none") == "none" else f"ppo + {c['correction']}")
    methods = list(dict.fromkeys(method(c) for c in cells))
    etas = sorted({c["eta"] for c in cells})
    width = 0.8 / len(etas)
    fig, ax = plt.subplots(figsize=(max(8, 0.4 * len(methods) * len(etas) + 2), 4.5))
    for j, eta in enumerate(etas):
        for i, m in enumerate(methods):
            gains = [100 * (c["final_accuracy"] - (c["start_accuracy"] or 0.0)) for c in cells
                     if c["eta"] == eta and method(c) == m]
            if not gains:
                continue
            x = i + (j - (len(etas) - 1) / 2) * width
            ax.bar(x, sum(gains) / len(gains), width, color=plt.get_cmap("tab10")(j), label=f"eta {eta}" if i == 0 else None)
            ax.plot([x] * len(gains), gains, "k.", markersize=4)
    ax.axhline(30, color="grey", linestyle=":", linewidth=1)
    ax.set_xticks(range(len(methods)), methods, rotation=35, ha="right")
    ax.set(ylabel="held-out gain over the warm start (points)",
           title="Loss and correction ablation: mean of the seeds (bars), each seed (dots)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cell_label(c: dict[str, Any]) -> str:
    """objective, then the loss, correction and seed where they are not the defaults."""
    parts = [c["objective"]]
    parts += [c["loss"]] if c.get("loss", "ppo") != "ppo" else []
    parts += [c["correction"]] if c.get("correction", "none") != "none" else []
    parts += [f"seed {c['seed']}"] if c.get("seed") is not None else []
    return " ".join(parts)


def seed_means(cells: list[dict[str, Any]]) -> list[str]:
    """A Markdown table with one row per eta x method (loss and correction): the held-out start, each seed's
    final accuracy, the mean gain in points over the start, and the monitors averaged over the seeds."""
    groups: dict[tuple[int, str, str, str], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["eta"], c["objective"], c.get("loss", "ppo"), c.get("correction", "none")), []).append(c)
    rows = ["| eta | loss | correction | held-out start | final, per seed | mean gain | staleness mean / max | "
            "mismatch KL (k3) | masked or truncated | entropy | answer length |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (eta, objective, loss, correction), group in sorted(groups.items(), key=lambda kv: kv[0][0]):
        mean = (lambda key: sum(c["monitors"].get(key, 0.0) for c in group) / len(group))
        gains = [100 * (c["final_accuracy"] - (c["start_accuracy"] or 0.0)) for c in group]
        touched = sum(mean(k) for k in ("behav_masked_frac", "rejected_frac", "m2po_masked_frac", "tis_truncated_frac"))
        name = loss if objective == "decoupled" else f"{loss} (plain PPO objective)"
        rows.append(f"| {eta} | {name} | {correction} | {100 * (group[0]['start_accuracy'] or 0.0):.1f} % | "
                    + " / ".join(f"{100 * c['final_accuracy']:.1f} %" for c in group)
                    + f" | {sum(gains) / len(gains):+.1f} | "
                    f"{sum(c['staleness_mean'] for c in group) / len(group):.2f} / "
                    f"{max(c['staleness_max'] for c in group):.0f} | {mean('mismatch_kl_k3'):.1e} | "
                    f"{100 * touched:.2f} % | {mean('entropy'):.2f} | {mean('avg_seq_len'):.1f} |")
    return rows


def table(cells: list[dict[str, Any]]) -> list[str]:
    rows = [("eta", "objective", "steps", "staleness mean/max", "held-out start", "held-out final", "best",
             "mismatch kl", "clip", "masked", "entropy", "length")]
    for c in cells:
        best = max(a for _, a in c["held_out_curve"])
        m = c.get("monitors") or {}
        masked = sum(m.get(k, 0.0) for k in ("behav_masked_frac", "rejected_frac", "m2po_masked_frac"))
        rows.append((str(c["eta"]), cell_label(c), str(c["steps"]),
                     f"{c['staleness_mean']:.2f} / {c['staleness_max']:.0f}",
                     f"{100 * (c['start_accuracy'] or 0):.1f}%", f"{100 * c['final_accuracy']:.1f}%",
                     f"{100 * best:.1f}%", f"{m.get('mismatch_kl_k3', 0.0):.1e}",
                     f"{100 * m.get('actor_clip_ratio', 0.0):.1f}%", f"{100 * masked:.1f}%",
                     f"{m.get('entropy', 0.0):.2f}", f"{m.get('avg_seq_len', 0.0):.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(col.ljust(w) for col, w in zip(r, widths)) for r in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench ablation", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    ap.add_argument("--etas", default="0,1,4,16", help="comma list of max staleness values (default 0,1,4,16)")
    ap.add_argument("--objectives", default=None,
                    help="comma list of decoupled, ppo (default both; decoupled alone with --losses or --corrections)")
    ap.add_argument("--losses", default="ppo", help=f"comma list of algo.loss names (default ppo): {', '.join(LOSS_SETTINGS)}")
    ap.add_argument("--corrections", default="none", help=f"comma list of {', '.join(CORRECTIONS)} (default none)")
    ap.add_argument("--seeds", default=None, help="comma list of experiment seeds (default: the config's)")
    ap.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every N steps (default 10)")
    ap.add_argument("--minibatches", type=int, default=1,
                    help="PPO minibatches per step (default 1, as configs/local.yaml; AReaL uses 4): more updates per batch "
                         "slows the trainer so that the rollouts run ahead and staleness reaches eta")
    ap.add_argument("--out", default=None, help="folder for the run directories (default: a temp dir)")
    ap.add_argument("--plot", default=None, help="write the PNG here")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--report", default=None, help="also write the JSON report to this file after every cell")
    ap.add_argument("--combine", nargs="+", metavar="REPORT", default=None,
                    help="run nothing: read these --report files (a grid run in parts) and print their cells with "
                         "--json, or else a Markdown table of the seeds' means; --plot draws them")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides applied to every run")
    args = ap.parse_args(argv)
    if args.combine:
        return combine([Path(p) for p in args.combine], args.plot, args.json)
    try:
        etas = [int(e) for e in args.etas.split(",") if e]
    except ValueError:
        ap.error(f"--etas: expected comma-separated integers, got {args.etas!r}")
    if any(e < 0 for e in etas):
        ap.error(f"--etas: staleness must be >= 0, got {etas}")
    losses = [x for x in args.losses.split(",") if x]
    if not losses or any(x not in LOSS_SETTINGS for x in losses):
        ap.error(f"--losses: choose from {', '.join(LOSS_SETTINGS)}, got {args.losses!r}")
    corrections = [x for x in args.corrections.split(",") if x]
    if not corrections or any(x not in CORRECTIONS for x in corrections):
        ap.error(f"--corrections: choose from {', '.join(CORRECTIONS)}, got {args.corrections!r}")
    default_objectives = "decoupled,ppo" if losses == ["ppo"] and corrections == ["none"] else "decoupled"
    objectives = [o for o in (args.objectives or default_objectives).split(",") if o]
    if not objectives or any(o not in OBJECTIVES for o in objectives):
        ap.error(f"--objectives: choose from {', '.join(OBJECTIVES)}, got {args.objectives!r}")
    if "ppo" in objectives and corrections != ["none"]:
        ap.error("--corrections: the plain ppo objective has no behaviour weight to correct (use --objectives decoupled)")
    try:
        seeds: list[int | None] = [int(x) for x in args.seeds.split(",") if x] if args.seeds else [None]
    except ValueError:
        ap.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if not 0 < args.eval_every <= args.steps:
        ap.error(f"--eval-every must be in 1..--steps ({args.steps}), got {args.eval_every}")
    if args.minibatches < 1:
        ap.error(f"--minibatches must be >= 1, got {args.minibatches}")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-ablation-"))
    log = (lambda m: print(m, file=sys.stderr, flush=True))
    extra = [f"experiment.algo.ppo_minibatches={args.minibatches}", *args.overrides]
    # The first run prepares the shared data and warm start; the others reuse them (tools/prepare.py).
    cells: list[dict[str, Any]] = []
    report = {"steps": args.steps, "minibatches": args.minibatches, "overrides": args.overrides, "cells": cells}
    for eta in etas:
        for obj in objectives:
            for loss in losses:
                for corr in corrections:
                    for seed in seeds:
                        cells.append(run_cell(eta, obj, args.steps, args.eval_every, extra, out, log, loss, corr, seed))
                        if args.report:   # a long grid's finished cells survive its interruption
                            Path(args.report).write_text(json.dumps(report))
    if args.plot:
        plot(cells, Path(args.plot))
        report["plot"] = args.plot
    if args.json:
        print(json.dumps(report))
        return 0
    print("\n".join(table(cells)))
    print(f"run directories under {out}" + (f"; plot {args.plot}" if args.plot else ""))
    return 0


def combine(reports: list[Path], plot_path: str | None, as_json: bool) -> int:
    """The cells of several reports as one: printed, tabulated by seed means, plotted. A cell whose run
    directory is still there has its monitors read again from the run's metrics."""
    cells: list[dict[str, Any]] = []
    for path in reports:
        try:
            cells += json.loads(path.read_text())["cells"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"bench ablation: --combine {path}: not an ablation report ({e})", file=sys.stderr)
            return 2
    for c in cells:   # where a run directory is still there, its monitors are read again from its metrics
        metrics = Path(c.get("run_dir", "")) / "metrics.jsonl"
        if c.get("run_dir") and metrics.is_file():
            c["monitors"] = step_monitors([json.loads(x) for x in metrics.read_text().splitlines() if x.strip()])
    if plot_path:
        plot(cells, Path(plot_path))
    print(json.dumps({"reports": [str(p) for p in reports], "cells": cells}) if as_json else "\n".join(seed_means(cells)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
