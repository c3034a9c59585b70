"""Free TCP ports, for the rendezvous, link, server and bus ports a run or a test picks at start."""
from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

__all__ = ["free_port", "free_port_range"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on `host` now. Another process may take it before it is bound again, so
    callers that can retry on EADDRINUSE should."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux; the IANA range elsewhere)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 49152, 65535


def free_port_range(count: int, tries: int = 100) -> int:
    """The first of `count` consecutive ports free on loopback now (a tcp bus's ports, one per actor from
    bus.base_port). Picked below the ephemeral range: a range the OS may hand out to outgoing connections
    gets taken by the run's own connects between this check and the last actor's bind (seen in the chaos
    bench's tcp runs); random, so that runs started side by side do not pick the same one."""
    lo, _ = ephemeral_ports()
    top = (lo if lo - 1024 > count else 65536) - count
    pick = random.Random()   # seeded from the OS: side-by-side callers must differ
    for _ in range(tries):
        base = pick.randrange(1024, top)
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports found in {tries} tries")
