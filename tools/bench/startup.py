"""`python -m tools.bench startup [--topology PATH] [--repeats N] [--launch-steps N] [--json]`: what starting
costs, in CPU seconds (user + system) of fresh processes.

Every actor is its own process and every launch (and dry run) imports each actor class to check its settings,
so a run pays each class's imports once per actor process and once more in the launcher. Measured per
actor class of the topology (a fresh ``python3 -c 'from MODULE import CLASS'``, the mean of N), for ``import torch``
alone, and for a dry run of the topology. ``--launch-steps N`` also launches a short run (the chaos
benchmark's small assets: a tiny random model, 4 groups of 4 a step) of 1 step and of N steps and reports the
CPU of each launch's whole process tree: the difference is what the extra steps cost, the rest is starting and
stopping.
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


def launch_cpu(steps: int, base: Path) -> float:
    """CPU seconds of one short local launch of `steps` steps (launcher and every actor process)."""
    from tools.bench.chaos import launch, make_assets

    assets = make_assets(base / "assets", train_per_level=40)
    before = _children_cpu()
    with open(base / "launch.out", "w") as out:
        proc = launch(assets, base / "run", steps=steps, ckpt_every=steps, stdout=out)
        if proc.wait(timeout=1800) != 0:
            raise SystemExit(f"the {steps}-step launch failed (exit {proc.returncode}); see {base / 'launch.out'}")
    return _children_cpu() - before


def run(topology: str, repeats: int, launch_steps: int | None) -> dict[str, float]:
    python = sys.executable
    out = {"import torch": process_cpu([python, "-c", "import torch"], repeats)}
    for group, (module, cls) in actor_classes(topology).items():
        statement = f"from {module} import {cls}"
        out[f"{group}: {statement}"] = process_cpu([python, "-c", statement], repeats)
    out[f"tools.up {topology} --dry-run"] = process_cpu([python, "-m", "tools.up", topology, "--dry-run"], repeats)
    if launch_steps:
        for steps in sorted({1, launch_steps}):
            with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
                out[f"launch of {steps} step(s)"] = launch_cpu(steps, Path(tmp))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench startup", description=__doc__.split("\n")[0])
    ap.add_argument("--topology", default="topology/local.yaml")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per import measured (mean)")
    ap.add_argument("--launch-steps", type=int, default=None,
                    help="also time a 1-step and an N-step local launch (CPU of the whole run)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats: at least 1")
    result = run(args.topology, args.repeats, args.launch_steps)
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
