"""Actor specs and link settings for tests that run actors on this machine, over ipc sockets and gloo."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from actors.base import ActorSpec
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
