"""`python -m tools.plan TOPOLOGY [key.sub=value ...] [--json] [--plot DIR] [--sweep] [--steps N]`

Prints the memory per GPU of every trainer and rollout group, then simulates the run in virtual time:
asynchronous (the configured eta) against synchronous on the same GPUs (eta = 0 with the same split, and
generation then training on all GPUs), with effective training throughput, step time, staleness and idle
fractions. `--sweep` also simulates inference/training splits and values of eta and names the best;
`--plot DIR` writes timeline.png (which GPU group is busy when) and, with --sweep, sweep.png.
Overrides are those of `tools.up` (topology keys, or experiment.* for the config). Exit status 2: a group
does not fit its GPUs, or the topology is invalid.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from tools import topology as topo_mod
from tools.plan import report, setup, sim
from tools.plan.shapes import ShapeError

SWEEP_ETAS = (0, 1, 2, 4, 8)
SWEEP_SPLITS = (0.5, 0.625, 0.75, 0.875)


def compare(found: setup.Setup, steps: int) -> dict[str, sim.Result]:
    """The configured run, its synchronous twin on the same split, and the colocated synchronous baseline."""
    return {"async": sim.simulate(setup.sim_config(found, steps=steps)),
            "sync (eta=0, same split)": sim.simulate(setup.sim_config(found, eta=0, steps=steps)),
            "sync (colocated, all GPUs)": sim.simulate(setup.sim_config(found, colocated=True, steps=steps))}


def sweep(found: setup.Setup, steps: int) -> list[dict[str, Any]]:
    """Throughput at each split (share of GPUs generating, in whole servers) and eta."""
    base = setup.sim_config(found)
    total = base.servers * base.server_tp + base.trainer.dp * base.trainer.tp * base.trainer.pp
    unit_train, unit_infer = base.trainer.tp * base.trainer.pp, base.server_tp
    rows = []
    for share in SWEEP_SPLITS:
        infer = int(round(total * share / unit_infer)) * unit_infer
        infer = total - ((total - infer) // unit_train) * unit_train
        if infer <= 0 or infer >= total:
            continue
        for eta in SWEEP_ETAS:
            r = sim.simulate(setup.sim_config(found, eta=eta, rollout_gpus=infer, steps=steps))
            rows.append({"inference_gpus": infer, "training_gpus": total - infer, "share": infer / total, "eta": eta,
                         "throughput": r.throughput, "step_time_s": r.step_time})
    return rows


def _fmt_results(results: dict[str, sim.Result]) -> list[str]:
    rows = [("run", "step s", "tokens/s", "train s", "weights s", "rollout idle", "trainer idle", "staleness")]
    for name, r in results.items():
        stale = " ".join(f"{k}:{v:.0%}" for k, v in r.staleness.items())
        rows.append((name, f"{r.step_time:,.1f}", f"{r.throughput:,.0f}", f"{r.summary()['train_s']:,.1f}",
                     f"{r.weight_sync_s:.2f}", f"{r.rollout_idle:.0%}", f"{r.trainer_idle:.0%}", stale))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    base = results["sync (eta=0, same split)"].throughput
    lines.append(f"  async / sync on the same split: {results['async'].throughput / base:.2f}x; async / colocated "
                 f"sync: {results['async'].throughput / results['sync (colocated, all GPUs)'].throughput:.2f}x")
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("topology")
    ap.add_argument("overrides", nargs="*", help="key.sub=value (topology keys, or experiment.* for the config)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    ap.add_argument("--plot", metavar="DIR", help="write timeline.png (and sweep.png with --sweep) here")
    ap.add_argument("--sweep", action="store_true", help="also sweep inference/training splits and eta")
    ap.add_argument("--steps", type=int, default=3, help="training steps per simulation (the first is warm-up)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.steps < 2:
        print("--steps: must be >= 2 (the first step is warm-up)", file=sys.stderr)
        return 2
    try:
        plan = topo_mod.load(args.topology, args.overrides, check_imports=False)
        found = setup.read(plan)
    except (topo_mod.TopologyError, ShapeError, ValueError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    groups = setup.group_memory(found)
    out: dict[str, Any] = {"topology": plan.topology.source, "model": found.shape.name if found.shape else None,
                           "gpu": found.gpu.name, "memory": [
                               {"group": m.group, "fits": m.fits, "total_gb": m.total / 1e9, "capacity_gb": m.capacity / 1e9,
                                "terms_gb": {k: v / 1e9 for k, v in m.terms.items()},
                                "answers_at_once": m.answers_at_once} for m in groups]}
    text = report.memory_table(f"{out['model']}, {found.gpu.name} {found.gpu.memory_bytes / 1e9:.0f} GB", groups)
    problems = [p for m in groups if (p := m.problem())]
    results: dict[str, sim.Result] = {}
    if any(g.device == "cuda" for g in found.groups) and not problems:
        results = compare(found, args.steps)
        out["simulation"] = {k: r.summary() for k, r in results.items()}
        text += ["", f"simulation ({args.steps} steps each, the first is warm-up)", *_fmt_results(results)]
    elif not problems:
        text += ["", "simulation: this topology runs on CPUs; the cost model covers GPU groups (docs/plan.md)"]
    rows: list[dict[str, Any]] = []
    if args.sweep and results:
        rows = sweep(found, args.steps)
        best = max(rows, key=lambda r: r["throughput"])
        out["sweep"], out["best"] = rows, best
        text += ["", "sweep (inference share, eta -> tokens/s)"]
        for r in rows:
            text.append(f"  {r['inference_gpus']:>4} inference / {r['training_gpus']:>4} training GPUs ({r['share']:.0%}), "
                        f"eta {r['eta']}: {r['throughput']:,.0f} tokens/s, step {r['step_time_s']:,.1f} s")
        text.append(f"  best: {best['share']:.0%} inference ({best['inference_gpus']} GPUs), eta {best['eta']}")
    if args.plot and results:
        from tools.plan import plots
        out["plots"] = plots.write(Path(args.plot), results["async"], rows)
        text.append(f"plots: {', '.join(out['plots'])}")
    print(json.dumps(out, indent=1) if args.json else "\n".join(text))
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
