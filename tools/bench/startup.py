"""`python -m tools.bench startup [--topology PATH] [--repeats N] [--launch-steps N] [--compare-starts N] [--json]`:
what starting costs, in CPU seconds (user + system) of fresh processes.

Every actor is its own process and every launch (and dry run) imports each actor class to check its settings,
so a run pays each class's imports once per actor process and once more in the launcher. Measured per
actor class of the topology (a fresh ``python3 -c 'from MODULE import CLASS'``, the mean of N), for ``import torch``
alone, and for a dry run of the topology. ``--launch-steps N`` also launches a short run (the chaos
benchmark's small assets: a tiny random model, 4 groups of 4 a step) of 1 step and of N steps and reports the
CPU of each launch's whole process tree: the difference is what the extra steps cost, the rest is starting and
stopping. ``--compare-starts N`` launches that 1-step run N times with each way of starting actors, alternately
(``supervisor.fork_start``: forked from the start template, or each a fresh interpreter), and reports the CPU
of each launch's whole tree (the template included), the mean CPU of one actor process, and their ratios.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu(argv: list[str], repeats: int) -> float:
    """The mean CPU seconds of running `argv` to its end in a fresh process (its whole waited-for tree)."""
    total = 0.0
    for _ in range(repeats):
        before = _children_cpu()
        subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        total += _children_cpu() - before
    return total / repeats


def actor_classes(topology: str) -> dict[str, tuple[str, str]]:
    """Group name -> (module, class) of its actor class, as the topology names it."""
    from topology import load

    plan = load(topology, check_imports=False)
    return {name: (group.cls.partition(":")[0], group.cls.partition(":")[2])
            for name, group in plan.topology.groups.items()}


def launch_cpu(steps: int, base: Path, fork_start: bool = True) -> tuple[float, list[float]]:
    """CPU seconds of one short local launch of `steps` steps (launcher, start template and every actor
    process), and of each actor process alone."""
    from tools.bench.chaos import launch, make_assets
    from tools.plan.cpushare import watch

    assets = make_assets(base / "assets", train_per_level=40)
    before = _children_cpu()
    with open(base / "launch.out", "w") as out:
        proc = launch(assets, base / "run", steps=steps, ckpt_every=steps, stdout=out,
                      extra=(f"supervisor.fork_start={str(fork_start).lower()}",))
        actors = watch(proc, interval=0.2)
        if proc.wait(timeout=1800) != 0:
            raise SystemExit(f"the {steps}-step launch failed (exit {proc.returncode}); see {base / 'launch.out'}")
    return _children_cpu() - before, [row["cpu_s"] for row in actors]


def compare_starts(launches: int) -> dict[str, float]:
    """1-step launches with forked and with exec-started actors, alternately: CPU of the whole launch and of
    one actor process (means), and fork / exec ratios."""
    totals: dict[bool, list[float]] = {True: [], False: []}
    actors: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(launches):
        for fork_start in (False, True):
            with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
                total, per_actor = launch_cpu(1, Path(tmp), fork_start)
            totals[fork_start].append(total)
            actors[fork_start].extend(per_actor)
    out = {}
    for fork_start, name in ((False, "exec"), (True, "fork")):
        out[f"launch of 1 step, {name} starts"] = sum(totals[fork_start]) / launches
        out[f"one actor process, {name} start (mean of {len(actors[fork_start])})"] = \
            sum(actors[fork_start]) / max(len(actors[fork_start]), 1)
    exec_total, fork_total = out["launch of 1 step, exec starts"], out["launch of 1 step, fork starts"]
    exec_actor, fork_actor = (sum(actors[f]) / max(len(actors[f]), 1) for f in (False, True))
    out["ratio fork / exec, whole launch"] = fork_total / exec_total
    out["ratio fork / exec, one actor process"] = fork_actor / exec_actor if exec_actor else float("nan")
    return out


def run(topology: str, repeats: int, launch_steps: int | None, starts: int | None = None) -> dict[str, float]:
    python = sys.executable
    out = {"import torch": process_cpu([python, "-c", "import torch"], repeats)}
    for group, (module, cls) in actor_classes(topology).items():
        statement = f"from {module} import {cls}"
        out[f"{group}: {statement}"] = process_cpu([python, "-c", statement], repeats)
    out[f"tools.up {topology} --dry-run"] = process_cpu([python, "-m", "tools.up", topology, "--dry-run"], repeats)
    if launch_steps:
        for steps in sorted({1, launch_steps}):
            with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
                out[f"launch of {steps} step(s)"] = launch_cpu(steps, Path(tmp))[0]
    if starts:
        out.update(compare_starts(starts))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench startup", description=__doc__.split("\n")[0])
    ap.add_argument("--topology", default="topology/local.yaml")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per import measured (mean)")
    ap.add_argument("--launch-steps", type=int, default=None,
                    help="also time a 1-step and an N-step local launch (CPU of the whole run)")
    ap.add_argument("--compare-starts", type=int, default=None, metavar="N",
                    help="also launch a 1-step run N times with forked and N times with exec-started actors")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats: at least 1")
    if args.compare_starts is not None and args.compare_starts < 1:
        ap.error("--compare-starts: at least 1")
    result = run(args.topology, args.repeats, args.launch_steps, args.compare_starts)
    if args.json:
        print(json.dumps({"cpu_seconds": result, "repeats": args.repeats}, indent=1))
        return 0
    width = max(map(len, result))
    print(f"{'process':<{width}}  CPU s (user + system)")
    for what, seconds in result.items():
        print(f"{what:<{width}}  {seconds:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
