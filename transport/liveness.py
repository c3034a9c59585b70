"""Peer liveness: which of a bus's peers are alive, which restarted, judged from what the bus hears.

The bus (transport/bus.py) tells it what it hears: any message from a peer (`heard`), the incarnation a
peer's ping carries (`incarnation`); and, every heartbeat, asks it who fell silent (`check`). It answers
with what changed, and the bus calls the actor's ``on_peer_dead`` / ``on_peer_alive`` / ``on_peer_restarted``.
Plain state and clock readings: no sockets, no tasks.

* A peer silent for ``heartbeat_timeout`` is dead; one never heard from since this bus started is given
  ``first_contact_timeout`` instead (the run's processes start seconds apart; its ``peer_dead`` line says
  ``never_heard``). Any message from it makes it alive again.
* Silence is counted only while the bus's own loop runs: a heartbeat that comes late by more than an interval
  means the loop was blocked, and what the peers sent meanwhile waits unread in the sockets, so that time is
  not counted against them (``heartbeat_stalled``).
* A known peer whose ping carries an incarnation other than the last one seen from it is a new process (the
  first one seen is not a restart; a peer that was only silent keeps its incarnation).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PeerLiveness", "PeerState"]


@dataclass
class PeerState:
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True
    heard: bool = False     # anything received from it yet
    incarnation: str = ""   # the last one its pings carried ("": none seen yet)


class PeerLiveness:
    """The liveness of one bus's peers (``stats`` and ``log`` are the bus's)."""

    def __init__(self, heartbeat_interval: float | None, heartbeat_timeout: float,
                 first_contact_timeout: float, stats: Counter, log: Any) -> None:
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.first_contact_timeout = first_contact_timeout
        self.stats, self.log = stats, log
        self.peers: dict[str, PeerState] = {}
        self._ticked = time.monotonic()

    def started(self) -> None:
        """The heartbeats start now (the first one is late only if the loop was blocked after this)."""
        self._ticked = time.monotonic()

    def track(self, name: str, incarnation: str = "") -> None:
        """Start watching ``name`` (``incarnation``: the last one seen of it, for a peer that moved)."""
        self.peers[name] = PeerState(incarnation=incarnation)

    def forget(self, name: str) -> PeerState | None:
        return self.peers.pop(name, None)

    def alive(self, name: str) -> bool:
        return self.peers[name].alive

    def dead(self) -> list[str]:
        return sorted(n for n, s in self.peers.items() if not s.alive)

    def heard(self, name: str) -> bool:
        """Something came from ``name``: True if it was dead and is alive again."""
        state = self.peers[name]
        state.last_seen = time.monotonic()
        state.heard = True
        if state.alive:
            return False
        state.alive = True
        self.stats["peer_alive"] += 1
        self.log.info("peer_alive", peer=name)
        return True

    def incarnation(self, name: str, incarnation: str) -> bool:
        """``name``'s ping named the process that sent it: True if it is a new one (the one before is gone)."""
        state = self.peers[name]
        if incarnation == state.incarnation:
            return False
        before, state.incarnation = state.incarnation, incarnation
        if not before:
            return False      # the first one seen from it: nothing to compare with
        self.stats["peer_restarted"] += 1
        self.log.warning("peer_restarted", peer=name)
        return True

    def check(self) -> list[str]:
        """A heartbeat: the peers that fell silent since the last one (now dead)."""
        assert self.heartbeat_interval is not None
        now = time.monotonic()
        late = now - self._ticked - self.heartbeat_interval
        if late > self.heartbeat_interval:
            # This loop did not run for `late` seconds (a blocking call in the actor, a machine that gave the
            # process no core): what the peers sent meanwhile waits unread in the sockets, so that silence is
            # ours, not theirs. It is not counted against them.
            self.stats["heartbeat_stalled"] += 1
            self.log.warning("heartbeat_stalled", stalled_s=round(late, 3),
                             hint="this actor's event loop was blocked: no peer is judged on that time")
            for state in self.peers.values():
                state.last_seen = min(now, state.last_seen + late)
        self._ticked = now
        died = []
        for name, state in list(self.peers.items()):
            timeout = self.heartbeat_timeout if state.heard else self.first_contact_timeout
            if state.alive and now - state.last_seen > timeout:
                state.alive = False
                self.stats["peer_dead"] += 1
                self.log.warning("peer_dead", peer=name, silent_s=round(now - state.last_seen, 3),
                                 **({} if state.heard else {"never_heard": True}))
                died.append(name)
        return died
