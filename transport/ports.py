"""Free TCP ports, for the rendezvous, link, server and bus ports a run or a test picks at start."""
from __future__ import annotations

import contextlib
import socket

__all__ = ["free_port", "free_port_range"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on `host` now. Another process may take it before it is bound again, so
    callers that can retry on EADDRINUSE should."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port_range(count: int, tries: int = 100) -> int:
    """The first of `count` consecutive ports free on loopback now (a tcp bus's ports, one per actor from
    bus.base_port); the same race as `free_port`, narrowed by checking every port of the range."""
    for _ in range(tries):
        base = free_port()
        if base + count > 65535:
            continue
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports found in {tries} tries")
