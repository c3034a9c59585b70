"""Actor specs and link settings for tests that run actors on this machine, over ipc sockets and gloo."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from actors.runtime.base import ActorSpec
from transport.bulk import LinkConfig


def ipc_endpoints(sock_dir: Path | str, names: list[str]) -> dict[str, str]:
    """An ipc endpoint per actor name, all in ``sock_dir``."""
    return {n: f"ipc://{sock_dir}/{n}" for n in names}


def actor_spec(name: str, cls: str, endpoints: dict[str, str], settings: dict[str, Any], run_dir: Path | str,
               env: dict[str, str] | None = None) -> ActorSpec:
    """The spec of actor ``name`` bound at ``endpoints[name]``, every other endpoint its peer."""
    return ActorSpec(name=name, cls=cls, endpoint=endpoints[name],
                     peers={n: e for n, e in endpoints.items() if n != name}, settings=settings,
                     run_dir=str(run_dir), env=env if env is not None else {"OMP_NUM_THREADS": "1"})


def gloo_link(name: str, port: int, members: list[str], member: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The settings of bulk link ``name`` as ``member`` sees it: gloo on this machine, the first member master."""
    return LinkConfig(name=name, backend="gloo", master_addr="127.0.0.1", master_port=port,
                      rank=members.index(member), world_size=len(members), members=members,
                      timeout_s=timeout_s).to_dict()


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped, does not count)."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


def ready_pids(run_dir: Path) -> list[int]:
    """The process ids in a run's ready files: the actors that came up and have not stopped cleanly."""
    return [json.loads(p.read_text())["pid"] for p in (Path(run_dir) / "ready").glob("*.json")]


def wait_for_ready(proc: subprocess.Popen, run_dir: Path, count: int, timeout: float, what: str) -> list[int]:
    """Wait until ``count`` actors of the run ``proc`` launched have written their ready files and return their
    process ids; an AssertionError saying ``what`` if the run ends first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while len(list((Path(run_dir) / "ready").glob("*.json"))) < count:
        assert proc.poll() is None and time.monotonic() < deadline, what
        time.sleep(0.1)   # polling files another process writes
    return ready_pids(run_dir)
