"""A free TCP port, for the rendezvous, link and server ports a run or a test picks at start."""
from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on `host` now. Another process may take it before it is bound again, so
    callers that can retry on EADDRINUSE should."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
