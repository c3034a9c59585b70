"""A tcp bus's port range for tests and benches: free, and out of the range outgoing connections draw from."""
from __future__ import annotations

import socket

from transport.ports import ephemeral_ports, free_port_range


def test_a_bus_range_is_free_and_below_the_ports_outgoing_connections_take() -> None:
    lo, hi = ephemeral_ports()
    assert 0 < lo <= hi <= 65535
    bases = {free_port_range(16) for _ in range(5)}
    for base in bases:
        # the run's own connects take local ports from [lo, hi]: a range there can be taken before its actor binds
        assert 1024 <= base and base + 16 <= lo
        with socket.socket() as s:
            s.bind(("127.0.0.1", base + 15))
    assert len(bases) > 1, "side-by-side callers must not all get the same range"
