"""The relay: the trainer sends each version to the parameter server (``train_to_ps``), which stores it and
sends it on to every rollout (``ps_to_rollout``), each on a lane of its own.

    trainer                         param_server                         rollout.i
      |--WeightsPublished(v, epoch)-->|                                      |
      |==buckets (send/recv)========>|  hash, pack, store v                 |
      |<--------WeightsStored(v)------|                                      |
      |                               |--LinkReform(g, members)------------>|   (when the ready set changes)
      |                               |== both join generation g ==========|
      |                               |--WeightsReady(v, g, p2p)---------->|   (a request, per lane)
      |                               |==buckets (send/recv)==============>|   update_weights, verify hash
      |                               |<--------------WeightsAck(v, hash)---|
"""
from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from typing import Any

from transport.bulk import BulkError, BulkLink
from transport.bus import BusError
from transport.protocol import WeightsPublished, WeightsReady, WeightsStored

from .base import Bucket, Fanout, WeightSender, in_thread

# A parameter server restarted in place answers within a few seconds; each attempt is bounded by the link's
# timeout, so this bounds how long a step waits for one that does not come back.
PUBLISH_ATTEMPTS = 10


class RelaySender(WeightSender):
    """Trainer rank 0: each version's buckets point to point to the parameter server on the train link. A
    failed transfer (the parameter server died or restarted in place) is tried again on a fresh epoch of
    the link, which the next WeightsPublished names (the parameter server joins the epoch it is told)."""

    def __init__(self, link: BulkLink, bus: Any, param_server: str, incarnation: str, counters: Counter,
                 log: Any) -> None:
        self.link, self.bus, self.param_server, self.incarnation = link, bus, param_server, incarnation
        self.counters, self.log = counters, log
        self.epoch = 0   # the train link's epoch; a failed transfer moves both sides to a new one

    async def publish(self, version: int, buckets: list[Bucket], stages: list[Any]) -> None:
        # No hash: the parameter server hashes what it received itself, after it answered (hashing 15 GB
        # here would hold every step).
        for attempt in range(1, PUBLISH_ATTEMPTS + 1):
            try:
                await self._attempt(version, buckets)
                return
            except (BusError, BulkError, TimeoutError) as exc:
                self.counters["publish_retries"] += 1
                self.log.warning("publish_failed", version=version, attempt=attempt, epoch=self.epoch,
                                 error=str(exc)[:300])
                self.epoch += 1
        raise RuntimeError(f"version {version} could not reach the parameter server in {PUBLISH_ATTEMPTS} "
                           f"attempts")

    async def _attempt(self, version: int, buckets: list[Bucket]) -> None:
        """Announce the version and the link epoch, join that epoch if the link is elsewhere (the parameter
        server joins it on the announcement), send the buckets."""
        link, epoch = self.link, self.epoch
        dst = link.config.rank_of(self.param_server)
        reply = asyncio.ensure_future(self.bus.request(self.param_server, WeightsPublished(
            version=version, n_buckets=len(buckets), weights_hash="", link_epoch=epoch,
            incarnation=self.incarnation), timeout=link.config.timeout_s + 30))

        def send_all() -> None:
            if link.generation != epoch:
                link.reform(epoch)
            for b in buckets:
                link.send(b, dst)

        try:
            await asyncio.to_thread(send_all)
        except BaseException:
            reply.cancel()
            await asyncio.gather(reply, return_exceptions=True)
            raise
        answer = await reply
        if not isinstance(answer, WeightsStored) or answer.version != version:
            raise RuntimeError(f"param server answered {answer!r} to version {version}")

    def close(self) -> None:
        self.link.close()


class RelayFanout(Fanout):
    """The parameter server's own link to the rollouts (it is rank 0): it forms each generation itself and
    sends every member the stored buckets on a lane of its own, so a late or hung member holds up nobody
    else."""

    holds_weights = True

    def __init__(self, server: Any, link: BulkLink) -> None:
        self.server, self.link = server, link   # the ParamServerActor that coordinates
        self._lanes: dict[str, asyncio.Future] = {}   # each rollout's running transfer and ack

    async def form(self, generation: int, members: list[str]) -> dict[str, Any] | None:
        ps = self.server
        names = [ps.name, *members]   # the link's master first
        for name in members:
            await ps.send_link_reform(name, generation, names)
        if not await ps.await_formation(members, in_thread(self.link.reform, generation, names), generation):
            return None
        return {}

    def busy(self, rollout: str) -> bool:
        return rollout in self._lanes

    def lost(self, rollout: str, why: str) -> None:
        if (lane := self._lanes.get(rollout)) is not None:
            lane.cancel(f"{rollout}: {why}")

    async def push(self, stored: Any, generation: int, members: list[str]) -> bool:
        """A lane per member: its buckets sent point to point on a thread of its own, then its ack. The push
        ends when every lane has, or `late_s` after the first one did; a late lane runs on (its member is
        skipped until it ends, then catches up), and a lost member's lane is abandoned."""
        ps, link = self.server, self.link
        members = [n for n in members if n not in self._lanes]
        t0 = time.monotonic()
        ready = WeightsReady(version=stored.version, n_buckets=stored.n_buckets, weights_hash=stored.weights_hash,
                             generation=generation, point_to_point=True)
        summary: dict[str, dict[str, Any]] = {}

        def send(rank: int) -> None:
            for packed in stored.packed:
                link.send_packed(packed, rank, generation)

        async def lane(name: str) -> None:
            ack = asyncio.ensure_future(ps.bus.request(name, ready, timeout=ps.ack_timeout))
            try:
                await in_thread(send, link.members.index(name))
                ps.record_ack(name, await ack, stored, summary)
            finally:
                ack.cancel()

        def ended(name: str, fut: asyncio.Future) -> None:
            if self._lanes.get(name) is fut:
                del self._lanes[name]
            if not fut.cancelled() and fut.exception() is not None:
                ps.need_reform = True   # its side of the group is broken: it joins a fresh one
            ps.kick()

        lanes = {name: asyncio.ensure_future(lane(name)) for name in members}
        for name, fut in lanes.items():
            self._lanes[name] = fut
            fut.add_done_callback(functools.partial(ended, name))
        _, running = await asyncio.wait(lanes.values(), return_when=asyncio.FIRST_COMPLETED)
        if running:
            await asyncio.wait(running, timeout=ps.late_s)
        sync_s = time.monotonic() - t0
        for name, fut in lanes.items():
            if not fut.done():
                ps.counters["late_rollouts"] += 1
                summary[name] = {"error": f"late: no ack {ps.late_s:g} s after the first (it runs on)"}
            elif fut.cancelled() or fut.exception() is not None:
                reason = (f"abandoned: {fut.cancelled() and 'member lost'}" if fut.cancelled() else str(fut.exception()))
                ps.counters["ack_failures"] += 1
                ps.log.error("weights_ack_failed", rollout=name, version=stored.version, error=reason)
                summary[name] = {"error": reason[:200]}
        return ps.pushed(stored, generation, members, summary, sync_s, sync_s)

    def close(self) -> None:
        self.link.close()
