"""`python -m tools.up TOPOLOGY [key.sub=value ...] [--dry-run | --show-config]`: validate a topology and start the run.

* ``key.sub=value`` overrides a key of the topology file, or of the experiment config under ``experiment.``;
  the value is read as YAML and checked by the same models as the files (topology.loading describes the grammar).
* ``--show-config`` prints every key of the resolved configuration, one ``key = value  # source`` line each,
  the source being default, topology file, config file or override; then exits 0.

* ``--record`` turns message logs on for every actor (``RUN_DIR/msglog/<name>.msglog``, inbound and
  outbound, tensors stored) so that any actor can be replayed with ``tools.replay --into``.
* ``--dry-run`` prints the placement (node -> actors -> GPUs / cores / CPU workers), the bus endpoints,
  the NCCL/gloo group of every link and the command each node would run, then exits 0; consecutive nodes
  holding the same actors are shown once with their count, every node with ``--full``. It exits 2 on what
  the launch would refuse, each actor class's check of its instances' settings included.
* One node and no SLURM allocation: every actor starts on this machine under ``actors.runtime.supervisor``.
* Several nodes: inside a SLURM allocation (``salloc``/``sbatch``) the launcher writes one plan file per
  node into the run directory and ``srun`` starts one ``tools.node_agent`` per node, which runs that
  node's actors under the same supervisor; ``--sbatch`` submits the allocation first. No SSH.

The run directory (``runs/<name>/<timestamp>`` unless ``--run-dir``) holds the plan, the ActorSpecs,
logs, message logs, metrics and checkpoints. Exit status: 0 clean end, 2 invalid topology or input, 1 failed
run (an actor that cannot be kept up, or a run that stopped making progress: launch/watchdog.py
prints a diagnosis), 128 + N for a training run stopped by signal N before its last step.

This module parses the command line; the launching itself is the library's (launch/).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import topology as topo_mod
from launch.launcher import dry_run, launch
from launch.options import EXIT_INVALID, EXIT_OK, LaunchRequest
from topology import Plan, TopologyError
from topology.schema import SupervisorSection


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.up", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("topology", help="topology YAML, e.g. topology/local.yaml")
    ap.add_argument("overrides", nargs="*",
                    help="key.sub=value, value read as YAML: a topology key (actors.rollout.count=4), or experiment.* "
                         "for the experiment config (experiment.algo.eta=2); checked by the same models as the files")
    ap.add_argument("--dry-run", action="store_true", help="print the placement and commands, start nothing")
    ap.add_argument("--full", action="store_true",
                    help="with --dry-run: a row per node (by default consecutive nodes holding the same actors "
                         "are shown once with their count)")
    ap.add_argument("--show-config", action="store_true",
                    help="print every key of the resolved configuration with where its value came from (default, "
                         "topology file, config file, override), start nothing")
    ap.add_argument("--run-dir", help="run directory (default: <run_root>/<name>/<timestamp>)")
    ap.add_argument("--ready-timeout", type=float, default=None,
                    help="seconds to wait for every actor's ready, where the topology's supervisor section does not "
                         "say (the override supervisor.ready_timeout=S sets that key itself; default "
                         f"{SupervisorSection.model_fields['ready_timeout'].default:g})")
    ap.add_argument("--duration", type=float, default=None, help="stop the run after this many seconds")
    ap.add_argument("--no-progress", action="store_true", help="plain log lines instead of a live display")
    ap.add_argument("--sbatch", action="store_true", help="submit a SLURM allocation and launch inside it")
    ap.add_argument("--record", action="store_true",
                    help="message logs for every actor (in and out, tensors stored): RUN_DIR/msglog/<name>.msglog, "
                         "replayable with tools.replay --into")
    ap.add_argument("--no-import-check", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_intermixed_args(argv)


def load_plan(args: argparse.Namespace) -> Plan:
    return topo_mod.load(args.topology, args.overrides, check_imports=not args.no_import_check)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.show_config:
            print(topo_mod.show_config(args.topology, args.overrides, check_imports=not args.no_import_check))
            return EXIT_OK
        plan = load_plan(args)
    except TopologyError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_INVALID
    if args.dry_run:
        return dry_run(plan, args.overrides, full=args.full)
    return launch(plan, LaunchRequest(overrides=args.overrides, run_dir=args.run_dir, ready_timeout=args.ready_timeout,
                                      duration=args.duration, progress=not args.no_progress, record=args.record,
                                      sbatch=args.sbatch))


if __name__ == "__main__":
    sys.exit(main())
