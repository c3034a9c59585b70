"""`python -m tools.prepare TOPOLOGY [key.sub=value ...] [--ship]`: make what a topology's experiment needs (its
data and warm start, as its prepare section says) without starting the run; `--ship` trains the warm start from
scratch and writes it, with its manifest, where the recipe ships it. The stage itself is launch/prepare/stage.py,
which every launch runs first."""
from __future__ import annotations

import argparse
import sys

from launch.prepare.stage import PrepareError, prepare


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.prepare",
                                 description="Make what a topology's experiment needs (its data and warm start) "
                                             "without starting the run.")
    ap.add_argument("topology", help="topology YAML, e.g. topology/local.yaml")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides, as tools.up takes them")
    ap.add_argument("--ship", action="store_true",
                    help="train the warm start from scratch and write it, with its manifest, to "
                         "prepare.warm_start.shipped (the copy a fresh clone uses)")
    args = ap.parse_args(argv)
    import topology
    from launch.local import use_trainer_threads

    try:
        plan = topology.load(args.topology, args.overrides, check_imports=False)
    except topology.TopologyError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    use_trainer_threads(plan)
    command = " ".join(["python3 -m tools.prepare", args.topology, *args.overrides, "--ship"]) if args.ship else None
    try:
        prepared = prepare(plan.topology.experiment, ship_command=command)
    except PrepareError as exc:
        print(f"{args.topology}: experiment.{exc}", file=sys.stderr)
        return 2
    print(f"prepare: the run starts from {prepared['model']['path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
