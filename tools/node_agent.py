"""What `srun` starts on every node of a multi-node run: ``python -m tools.node_agent RUN_DIR``.

The launcher (launch/nodes.py) wrote one plan per node, ``RUN_DIR/nodes/<host>.json``, holding that
node's ActorSpecs and the supervisor settings. The agent finds its own by the SLURM node name (fake nodes
on one machine share a host name, so ``SLURMD_NODENAME`` comes first), starts those actors under
``actors.runtime.supervisor.Supervisor``, waits until they are ready, and publishes its status to
``RUN_DIR/nodes/<host>.status.json`` for the launcher's progress view. It exits 0 when its actors
finish, when the launcher asks for a stop (it writes ``RUN_DIR/nodes/STOP`` on Ctrl-C; srun itself
would kill the step rather than pass SIGTERM on) or on SIGTERM, and 1 when an actor
cannot be kept up, which makes ``srun --kill-on-bad-exit`` stop the other nodes (`launch.nodes.run_node`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from launch.nodes import run_node


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m tools.node_agent RUN_DIR", file=sys.stderr)
        return 2
    return run_node(Path(argv[0]))


if __name__ == "__main__":
    sys.exit(main())
