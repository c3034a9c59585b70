"""What `srun` starts on every node of a multi-node run: ``python -m tools.node_agent RUN_DIR``.

The launcher (tools/up.py) wrote one plan per node, ``RUN_DIR/nodes/<host>.json``, holding that node's
ActorSpecs and the supervisor settings. The agent finds its own by the SLURM node name (fake nodes
on one machine share a host name, so ``SLURMD_NODENAME`` comes first), starts those actors under
``actors.runtime.supervisor.Supervisor``, waits until they are ready, and publishes its status to
``RUN_DIR/nodes/<host>.status.json`` for the launcher's progress view. It exits 0 when its actors
finish, when the launcher asks for a stop (it writes ``RUN_DIR/nodes/STOP`` on Ctrl-C; srun itself
would kill the step rather than pass SIGTERM on) or on SIGTERM, and 1 when an actor
cannot be kept up, which makes ``srun --kill-on-bad-exit`` stop the other nodes.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path

from actors.runtime.run import keep_files_private
from tools.up import supervise


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m tools.node_agent RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    keep_files_private()
    host = node_name()
    path = run_dir / "nodes" / f"{host}.json"
    try:
        plan = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"node_agent on {host}: cannot read its plan {path}: {exc}", file=sys.stderr)
        return 2
    status = run_dir / "nodes" / f"{host}.status.json"
    if not plan["specs"]:
        status.write_text(json.dumps({"state": "stopped", "actors": {}}))
        return 0
    code = asyncio.run(supervise(plan["specs"], run_dir, plan["supervisor"], title=plan["title"], progress=False,
                                 duration=None, node_of={s["name"]: host for s in plan["specs"]},
                                 status_file=status, stop_file=run_dir / "nodes" / "STOP"))
    if code != 0:
        info = json.loads(status.read_text()) if status.exists() else {}
        info["reason"] = f"{host}: an actor could not be kept up (see {run_dir}/logs)"
        status.write_text(json.dumps(info, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
