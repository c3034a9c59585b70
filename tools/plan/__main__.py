"""`python -m tools.plan TOPOLOGY [key.sub=value ...] [--json] [--plot DIR] [--sweep] [--steps N] [--seeds S] [--costs FILE]`

Prints the memory per GPU of every trainer and rollout group, then simulates the run in virtual time, driving
the buffer's and the parameter server's own decision code (tools/plan/sim.py): asynchronous (the configured
eta) against synchronous on the same GPUs (eta = 0 with the same split, and generation then training on all
GPUs), with effective training throughput, step time, staleness, each group's time shares (rollouts
decoding / prefilling / paused for weights / idle; trainer training / exporting / waiting) and the
decisions' counters (groups issued and re-issued, expired, dropped stale, late results, SGLang
retractions, requests interrupted by weight updates, groups in flight per rollout). `--sweep` also
simulates inference/training splits from 25 % to 87.5 % and eta from 0 to 16, each over `--seeds` seeds
(mean and min-max), and names the best; `--plot DIR` writes timeline.png (which GPU group is busy when)
and, with --sweep, sweep.png.
Overrides are those of `tools.up` (topology keys, or experiment.* for the config). Exit status 2: a group
does not fit its GPUs, or the topology is invalid.

A topology whose engines run on CPUs is simulated from costs measured on the machine (`--costs FILE`, made
by `python -m tools.plan.calibrate`; default docs/measurements/local-costs.json) and the workload recorded
in it (`--workload NAME`), async against sync on the same cores; `--against E2E_JSON` (default for
topology/local.yaml: docs/measurements/local-e2e.json) puts `python -m tools.bench e2e --json`'s measured
async/sync throughput ratio and step times beside the simulated ones.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from launch.plan import report, sizing
from launch.plan.shapes import ShapeError
from tools.plan import setup, sim
from tools.plan.costs import MeasuredCosts
import topology as topo_mod

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_COSTS = "docs/measurements/local-costs.json"
#: The measured e2e run the local topology's simulation is compared with (docs/plan.md).
DEFAULT_AGAINST = {"local": "docs/measurements/local-e2e.json"}
SYNC = "sync (eta=0, same split)"

SWEEP_ETAS = (0, 1, 2, 4, 8, 16)
SWEEP_SPLITS = (0.25, 0.375, 0.5, 0.625, 0.75, 0.875)


def compare(found: sizing.Setup, steps: int, trace: bool = False) -> dict[str, sim.Result]:
    """The configured run, its synchronous twin on the same split, and the colocated synchronous baseline
    (``trace``: the configured run keeps its trace records, `sim.Result.records`)."""
    runs = {"async": dict(), SYNC: dict(eta=0), "sync (colocated, all GPUs)": dict(colocated=True)}
    out = {}
    for name, kw in runs.items():
        print(f"simulating {name}: {steps} steps", file=sys.stderr, flush=True)
        out[name] = sim.simulate(setup.sim_config(found, steps=steps, **kw), trace=trace and name == "async")
    return out


def compare_cpu(found: sizing.Setup, steps: int, measured: MeasuredCosts,
                workloads: dict[str, dict[str, Any] | None], trace: bool = False) -> dict[str, sim.Result]:
    """The configured run and its synchronous twin on the same cores, from measured costs, each with its
    workload (`workloads["async"]`, `workloads["sync"]`). (No colocated row: there every actor gets both
    cores with two threads, which a one-thread calibration does not cover.)"""
    return {"async": sim.simulate(setup.sim_config(found, steps=steps, measured=measured,
                                                   workload=workloads["async"]), trace=trace),
            SYNC: sim.simulate(setup.sim_config(found, eta=0, steps=steps, measured=measured,
                                                workload=workloads["sync"]))}


def against(results: dict[str, sim.Result], e2e: dict[str, Any], source: str) -> dict[str, Any]:
    """Simulated against measured (`tools.bench e2e --json`): the async/sync effective-throughput ratio and
    each run's step time, both as tools.up's summary counts them: every step, the first included (from the
    trainer's start, so the pipeline's fill too), tokens over wall time and wall time over steps."""
    runs = e2e["runs"]
    measured = {"throughput_ratio": runs["async"]["effective_throughput"] / runs["sync"]["effective_throughput"],
                "async_step_s": runs["async"]["wall_seconds"] / runs["async"]["steps"],
                "sync_step_s": runs["sync"]["wall_seconds"] / runs["sync"]["steps"]}

    def whole(r: sim.Result) -> tuple[float, float]:   # (tokens per second, seconds per step) from t = 0
        return sum(s.tokens for s in r.steps) / r.end, r.end / len(r.steps)
    (a_tps, a_step), (s_tps, s_step) = whole(results["async"]), whole(results[SYNC])
    predicted = {"throughput_ratio": a_tps / s_tps, "async_step_s": a_step, "sync_step_s": s_step}
    return {"source": source, "steps": e2e.get("steps"), "rows": [
        {"figure": k, "predicted": predicted[k], "measured": measured[k], "ratio": predicted[k] / measured[k],
         "within_15pct": abs(predicted[k] / measured[k] - 1) <= 0.15} for k in measured]}


def _fmt_against(cmp: dict[str, Any]) -> list[str]:
    lines = [f"against the measured run ({cmp['source']}, {cmp['steps']} steps each):",
             "  figure            predicted  measured  ratio"]
    for r in cmp["rows"]:
        lines.append(f"  {r['figure']:<16} {r['predicted']:>10.3f} {r['measured']:>9.3f}  {r['ratio']:.2f}"
                     f"{'' if r['within_15pct'] else '  (off by more than 15 %)'}")
    return lines


def sweep(found: sizing.Setup, steps: int, seeds: int = 1, progress: bool = False,
          splits: Sequence[float] | None = None, etas: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Throughput at each split (share of GPUs generating, in whole servers) and eta: the mean over `seeds`
    seeds, with its min and max, and how settled each run's measured steps were (the widest spread of a
    step around its run's mean, the largest drift between their halves: `sim.Result.stability`)."""
    base = setup.sim_config(found)
    total = base.servers * base.server_tp + base.trainer.dp * base.trainer.tp * base.trainer.pp
    unit_train, unit_infer = base.trainer.tp * base.trainer.pp, base.server_tp
    rows = []
    cases = []
    for share in SWEEP_SPLITS if splits is None else splits:
        infer = int(round(total * share / unit_infer)) * unit_infer
        infer = total - ((total - infer) // unit_train) * unit_train
        if infer <= 0 or infer >= total:
            continue
        cases += [(infer, eta) for eta in (SWEEP_ETAS if etas is None else etas)]
    for i, (infer, eta) in enumerate(cases):
        if progress:
            print(f"sweep {i + 1}/{len(cases)}: {infer} inference GPUs, eta {eta}", file=sys.stderr, flush=True)
        runs = [sim.simulate(setup.sim_config(found, eta=eta, rollout_gpus=infer, steps=steps, seed=s))
                for s in range(seeds)]
        tput = [r.throughput for r in runs]
        settled = [r.stability() for r in runs]
        rows.append({"inference_gpus": infer, "training_gpus": total - infer, "share": infer / total, "eta": eta,
                     "throughput": float(sum(tput) / len(tput)), "throughput_min": min(tput),
                     "throughput_max": max(tput), "step_time_s": float(sum(r.step_time for r in runs) / len(runs)),
                     "seeds": seeds, "steps": steps,
                     "step_spread": [min(x["step_min_over_mean"] for x in settled),
                                     max(x["step_max_over_mean"] for x in settled)],
                     "drift_max": max(abs(x["drift"]) for x in settled)})
        if progress:
            print(f"  -> {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    return rows


def _fmt_results(results: dict[str, sim.Result]) -> list[str]:
    rows = [("run", "step s", "tokens/s", "train s", "weights s", "rollout idle", "trainer idle", "staleness")]
    for name, r in results.items():
        stale = " ".join(f"{k}:{v:.0%}" for k, v in r.staleness.items())
        summ = r.summary()
        rows.append((name, f"{r.step_time:,.1f}", f"{r.throughput:,.0f}", f"{summ['train_s']:,.1f}",
                     f"{summ['weight_sync_s']:.2f}", f"{r.rollout_idle:.0%}", f"{r.trainer_idle:.0%}", stale))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    base = results[SYNC].throughput
    line = f"  async / sync on the same split: {results['async'].throughput / base:.2f}x"
    if "sync (colocated, all GPUs)" in results:
        line += f"; async / colocated sync: {results['async'].throughput / results['sync (colocated, all GPUs)'].throughput:.2f}x"
    lines.append(line)
    for name, r in results.items():
        sh = r.shares()
        c = r.counters
        lines.append(f"  {name}: rollouts " + ", ".join(f"{k} {v:.0%}" for k, v in sh["rollout"].items())
                     + "; trainer " + ", ".join(f"{k} {v:.0%}" for k, v in sh["trainer"].items())
                     + f"; param server pushing {sh['param_server']['push']:.0%}")
        lines.append(f"    decisions: issued {c['issued']}, re-issued {c['reissued']} (dropped stale "
                     f"{c['dropped_stale']}, handed back {c['handed_back']} of which expired {c['expired']}; late results "
                     f"{c['late_groups']}), dropped uniform "
                     f"{c['dropped_uniform']}, aborted before re-issue {c['aborted_before_reissue']}, "
                     f"interrupted by weight updates {c['interrupted_requests']}, KV-pool retractions "
                     f"{c['retractions']} (max {c['retractions_per_server']['max']} on one server), groups in "
                     f"flight per rollout {c['inflight_groups_per_rollout']['mean']:.1f} mean / "
                     f"{c['inflight_groups_per_rollout']['max']} max")
        srv = c["inflight_per_server"]
        lines.append(f"    in flight per server (min / mean / max over servers): groups "
                     f"{srv['groups']['min']:.1f} / {srv['groups']['mean']:.1f} / {srv['groups']['max']:.1f}, "
                     f"running requests {srv['running_requests']['min']:.1f} / {srv['running_requests']['mean']:.1f} / "
                     f"{srv['running_requests']['max']:.1f} (peak {srv['running_requests_peak']['max']:.0f}), "
                     f"longest queue {srv['waiting_requests_peak']['max']:.0f}; aborted requests "
                     f"{c['aborted_requests']}; stability: {r.stability()['steps']} measured steps, "
                     f"{r.stability()['step_min_over_mean']:.2f}-{r.stability()['step_max_over_mean']:.2f} of their "
                     f"mean, drift {r.stability()['drift']:+.1%}")
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("topology")
    ap.add_argument("overrides", nargs="*", help="key.sub=value (topology keys, or experiment.* for the config)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    ap.add_argument("--plot", metavar="DIR", help="write timeline.png (and sweep.png with --sweep) here")
    ap.add_argument("--trace", metavar="FILE", help="write the simulated asynchronous run as a Chrome/Perfetto "
                    "trace, in the format of `python -m tools.trace RUN_DIR` (tools/trace/simulated.py)")
    ap.add_argument("--sweep", action="store_true", help="also sweep inference/training splits and eta")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps per simulation, the first is warm-up (default: eta + 6 on GPUs, so that the "
                         "gate has filled; on CPUs the measured run's steps, else 40)")
    ap.add_argument("--seeds", type=int, default=1, help="--sweep: simulations per point (mean, min-max)")
    ap.add_argument("--costs", metavar="FILE", help=f"measured costs for CPU topologies (default {DEFAULT_COSTS})")
    ap.add_argument("--workload", metavar="NAME", help="the cost file's workload to simulate both runs with "
                    "(default: the async run with the one named 'async' and the sync run with 'sync' where the "
                    "file has them, else its first for both)")
    ap.add_argument("--against", metavar="E2E_JSON", help="a `tools.bench e2e --json` result to compare with "
                    "(CPU topologies; default for topology/local.yaml: docs/measurements/local-e2e.json)")
    return ap.parse_args(argv)


def _resolve(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() or p.exists() else ROOT / p


def _cpu_inputs(args: argparse.Namespace, name: str) -> tuple[MeasuredCosts, dict[str, dict[str, Any] | None],
                                                              str | None, dict[str, Any] | None]:
    """The cost file's costs and each run's workload, and the e2e result to compare with (if any)."""
    path = _resolve(args.costs or DEFAULT_COSTS)
    data = json.loads(path.read_text())
    workloads = data.get("workloads") or {}
    if args.workload and args.workload not in workloads:
        raise ValueError(f"--workload: {args.workload!r} is not in {path} (it has: {', '.join(workloads) or 'none'})")
    first = next(iter(workloads), None)
    chosen = {mode: args.workload or (mode if mode in workloads else first) for mode in ("async", "sync")}
    e2e_path = args.against or DEFAULT_AGAINST.get(name)
    e2e = None
    if e2e_path and (args.against or _resolve(e2e_path).exists()):
        e2e = json.loads(_resolve(e2e_path).read_text())
    return MeasuredCosts.from_dict(data, str(args.costs or DEFAULT_COSTS)), \
        {m: dict(workloads[w], name=w) if w else None for m, w in chosen.items()}, e2e_path if e2e else None, e2e


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.steps is not None and args.steps < 2:
        print("--steps: must be >= 2 (the first step is warm-up)", file=sys.stderr)
        return 2
    if args.seeds < 1:
        print("--seeds: must be >= 1", file=sys.stderr)
        return 2
    try:
        plan = topo_mod.load(args.topology, args.overrides, check_imports=False)
        found = sizing.read(plan)
    except (topo_mod.TopologyError, ShapeError, ValueError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    groups = sizing.group_memory(found)
    out: dict[str, Any] = {"topology": plan.topology.source, "model": found.shape.name if found.shape else None,
                           "gpu": found.gpu.name, "memory": [
                               {"group": m.group, "fits": m.fits, "total_gb": m.total / 1e9, "capacity_gb": m.capacity / 1e9,
                                "terms_gb": {k: v / 1e9 for k, v in m.terms.items()},
                                "answers_at_once": m.answers_at_once} for m in groups]}
    text = report.memory_table(f"{out['model']}, {found.gpu.name} {found.gpu.memory_bytes / 1e9:.0f} GB", groups)
    problems = [p for m in groups if (p := m.problem())]
    results: dict[str, sim.Result] = {}
    if any(g.device == "cuda" for g in found.groups) and not problems:
        args.steps = args.steps or found.experiment.algo.eta + 6
        results = compare(found, args.steps, trace=bool(args.trace))
        out["simulation"] = {k: r.summary() for k, r in results.items()}
        text += ["", f"simulation ({args.steps} steps each, the first is warm-up)", *_fmt_results(results)]
    elif sizing.on_cpus(found) and found.of_kind("trainer") and found.of_kind("rollout"):
        try:
            measured, workloads, e2e_path, e2e = _cpu_inputs(args, plan.topology.name)
        except (OSError, ValueError, KeyError) as exc:
            print(f"--costs: {exc}", file=sys.stderr)
            return 2
        args.steps = args.steps or int((e2e or {}).get("steps") or 40)
        results = compare_cpu(found, args.steps, measured, workloads, trace=bool(args.trace))
        devices, engines = sizing.cpu_servers(found.of_kind("rollout")[0])
        out["costs"], out["workloads"] = measured.source, workloads
        out["simulation"] = {k: r.summary() for k, r in results.items()}
        text += ["", f"simulation on CPUs ({args.steps} steps each, the first is warm-up), costs {measured.source}; "
                 f"{devices} rollout core(s), {engines} engine(s) each"]
        for mode, w in workloads.items():
            text.append(f"  {mode} workload " + (
                f"{w['name']!r}: answers {w['mean_answer_tokens']:.1f} tokens ({w['cut_share']:.0%} cut), prompts "
                f"{w['prompt_tokens']:.1f} tokens, {w['kept_group_share']:.0%} of groups kept" if w else
                "none in the cost file: answers at max_new_tokens"))
        text += _fmt_results(results)
        if e2e is not None:
            out["comparison"] = against(results, e2e, str(e2e_path))
            text += ["", *_fmt_against(out["comparison"])]
    elif not problems:
        text += ["", "simulation: no trainer and rollout group in this topology, nothing to simulate"]
    rows: list[dict[str, Any]] = []
    if args.sweep and results and not sizing.on_cpus(found):   # the split of a CPU topology is its cores
        rows = sweep(found, args.steps, args.seeds, progress=True)
        best = max(rows, key=lambda r: r["throughput"])
        out["sweep"], out["best"] = rows, best
        text += ["", f"sweep (inference share, eta -> tokens/s; {args.steps} steps, mean and min-max over "
                     f"{args.seeds} seed(s))"]
        for r in rows:
            text.append(f"  {r['inference_gpus']:>4} inference / {r['training_gpus']:>4} training GPUs ({r['share']:.0%}), "
                        f"eta {r['eta']}: {r['throughput']:,.0f} tokens/s ({r['throughput_min']:,.0f}-"
                        f"{r['throughput_max']:,.0f}), step {r['step_time_s']:,.1f} s (steps {r['step_spread'][0]:.2f}-"
                        f"{r['step_spread'][1]:.2f} of their run's mean, drift up to {r['drift_max']:.1%})")
        text.append(f"  best: {best['share']:.0%} inference ({best['inference_gpus']} GPUs), eta {best['eta']}")
    if args.plot and results:
        from tools.plan import plots
        out["plots"] = plots.write(Path(args.plot), results["async"], rows)
        text.append(f"plots: {', '.join(out['plots'])}")
    if args.trace and results:
        from tools.trace.simulated import write_simulated
        out["trace"] = str(write_simulated(results["async"], args.trace, f"simulation of {plan.topology.source}"))
        text.append(f"trace of the simulated run: {out['trace']} (open at https://ui.perfetto.dev)")
    print(json.dumps(out, indent=1) if args.json else "\n".join(text))
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
