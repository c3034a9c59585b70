"""The relay: the trainer sends each version to the parameter server (``train_to_ps``), which stores it and
sends it on to every rollout (``ps_to_rollout``), each on a lane of its own.

    trainer                         param_server                         rollout.i
      |--WeightsPublished(v, epoch)-->|                                      |
      |==buckets (send/recv)========>|  hash, pack, store v                 |
      |<--------WeightsStored(v)------|                                      |
      |                               |--LinkReform(e, members)------------>|   (when the ready set changes)
      |                               |== both join epoch e ===============|
      |                               |--WeightsReady(v, e, p2p)---------->|   (a request, per lane)
      |                               |==buckets (send/recv)==============>|   update_weights, verify hash
      |                               |<--------------WeightsAck(v, hash)---|
"""
from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from actors.engines.checkpoint import bucketize, iter_checkpoint_tensors
from actors.engines.lora import start_tensors
from actors.runtime.recovery import held_start_weights
from actors.runtime.threads import in_thread
from actors.weights import weights_hash
from topology.experiment import ExperimentConfig
from transport.bulk import BulkError, BulkLink, LinkConfig, PackedBucket, pack_buckets
from transport.bus import BusError
from transport.protocol import LinkReform, WeightsAck, WeightsPublished, WeightsReady, WeightsStored

from .base import (Accepted, Fanout, Formation, PushEnd, StoredVersion, Transfer, WeightSender, WeightSyncConfigError,
                   WeightsRejected)

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

    async def publish(self, version: int, packed: list[PackedBucket], stages: list[Any]) -> None:
        # No hash: the parameter server hashes what it received itself, after it answered (hashing 15 GB
        # here would hold every step).
        for attempt in range(1, PUBLISH_ATTEMPTS + 1):
            try:
                await self._attempt(version, packed)
                return
            except (BusError, BulkError, TimeoutError) as exc:
                self.counters["publish_retries"] += 1
                self.log.warning("publish_failed", version=version, attempt=attempt, epoch=self.epoch,
                                 error=str(exc)[:300])
                self.epoch += 1
        raise RuntimeError(f"version {version} could not reach the parameter server in {PUBLISH_ATTEMPTS} "
                           f"attempts")

    async def _attempt(self, version: int, packed: list[PackedBucket]) -> None:
        """Announce the version and the link epoch, join that epoch if the link is elsewhere (the parameter
        server joins it on the announcement), send the buckets."""
        link, epoch = self.link, self.epoch
        dst = link.config.rank_of(self.param_server)
        reply = asyncio.ensure_future(self.bus.request(self.param_server, WeightsPublished(
            version=version, n_buckets=len(packed), weights_hash="", link_epoch=epoch,
            incarnation=self.incarnation), timeout=link.config.timeout_s + 30))

        def send_all() -> None:
            if link.epoch != epoch:
                link.reform(epoch)
            for p in packed:
                link.send_packed(p, dst)

        try:
            await in_thread(send_all)   # a collective: never on the default executor (actors/runtime/threads.py)
        except BaseException:
            reply.cancel()
            await asyncio.gather(reply, return_exceptions=True)
            raise
        answer = await reply
        if not isinstance(answer, WeightsStored) or answer.version != version:
            raise RuntimeError(f"param server answered {answer!r} to version {version}")

    def close(self) -> None:
        self.link.close()


def load_start_weights(cfg: ExperimentConfig, run_dir: Any, bucket_bytes: int) -> StoredVersion:
    """The start weights as stored buckets, in the dtype the rollouts hold them (so the hashes agree)."""
    dtype_name = cfg.model.dtype
    dtype = getattr(torch, str(dtype_name)) if dtype_name else None
    if dtype_name and not isinstance(dtype, torch.dtype):
        raise WeightSyncConfigError(f"model.dtype: {dtype_name!r} is not a torch dtype")
    with held_start_weights(cfg, run_dir, "param_server") as (version, model_dir):
        # a LoRA run starts from its adapter when it has one (the rollouts hold the base): lora.start_tensors
        adapter = start_tensors(model_dir, cfg.model.lora.adapter) if cfg.model.lora is not None else None
        named = [(n, t.to(dtype) if dtype is not None else t) for n, t in adapter or iter_checkpoint_tensors(model_dir)]
    named = [(n, t) for n, t in named if not n.endswith("rotary_emb.inv_freq")]
    buckets = list(bucketize(named, bucket_bytes))
    packed = pack_buckets(buckets)
    return StoredVersion(version, weights_hash(named), packed, sum(p.flat.numel() for p in packed))


class RelayFanout(Fanout):
    """The parameter server between the trainer and the rollouts. It receives each version on the train link
    (``up``; it joins the epoch the trainer names), stores it packed, and is rank 0 of the rollouts' link
    (``down``): it forms each epoch itself and sends every member the stored buckets on a lane of its
    own, so a late or hung member holds up nobody else."""

    holds_weights = True

    def __init__(self, bus: Any, log: Any, counters: Counter, ack_timeout: float, late_s: float, up: BulkLink,
                 down: BulkLink, trainer_rank: int, make_link: Callable[[LinkConfig], BulkLink],
                 start: Callable[[], StoredVersion]) -> None:
        super().__init__(bus, log, counters, ack_timeout, late_s)
        self.up, self.link, self.trainer_rank = up, down, trainer_rank
        self.make_link = make_link   # a fresh train link, to meet the trainer on the epoch it names
        self.start = start           # loads the start weights (blocking)
        self.master = down.config.members[0]   # this server: rank 0 of the rollouts' link
        self.rollouts = down.config.members[1:]
        self._lanes: dict[str, asyncio.Future] = {}   # each rollout's running transfer and ack
        self._up_lock = asyncio.Lock()
        self._up_epoch = 0   # the newest train-link epoch the trainer has named
        self._trainer_incarnation = ""

    async def start_weights(self) -> StoredVersion:
        return await asyncio.to_thread(self.start)

    async def accept(self, msg: WeightsPublished, current: int | None) -> Accepted:
        """Receive the announced version's buckets on the train link; with an announced hash they are checked
        before the answer, else hashed and packed after it (off the trainer's step)."""
        restarted = msg.incarnation != self._trainer_incarnation
        if restarted:   # the trainer restarted: its epochs start again
            self._trainer_incarnation, self._up_epoch = msg.incarnation, msg.link_epoch
        self._up_epoch = max(self._up_epoch, msg.link_epoch)
        if restarted or self.up.epoch != msg.link_epoch:
            # First contact, a restart of either side, or a transfer that failed: meet the trainer on the epoch
            # it names (it is the rendezvous master and joins that epoch too), on a link object of its own: an
            # announcement older than a restart may still be waiting for its epoch in another thread. A
            # restarted trainer names the epoch the link of its old process may still be at: that link is
            # broken, and a restarted trainer waits at the rendezvous for this side to join (for the link's
            # whole timeout, where it was taken for the same link).
            link = self.make_link(self.up.config)
            try:
                await in_thread(link.open, msg.link_epoch)
            except BulkError as exc:
                self.counters["train_link_failures"] += 1
                raise WeightsRejected(f"version {msg.version}: the train link did not form at epoch "
                                      f"{msg.link_epoch}: {exc}") from None
            if msg.link_epoch == self._up_epoch:
                self.up = link
                self.log.info("train_link_formed", link=link.config.name, epoch=msg.link_epoch)
        async with self._up_lock:
            if self.up.epoch != msg.link_epoch:
                raise WeightsRejected(f"version {msg.version}: epoch {msg.link_epoch} of the train link was "
                                      f"superseded by epoch {self._up_epoch}")
            t0 = time.monotonic()
            buckets = []
            try:
                for _ in range(msg.n_buckets):
                    buckets.append(await in_thread(self.up.recv, self.trainer_rank))
            except BulkError as exc:
                self.counters["receive_failures"] += 1
                self.log.error("weights_receive_failed", version=msg.version, received=len(buckets),
                               expected=msg.n_buckets, error=str(exc))
                raise WeightsRejected(f"version {msg.version}: receiving bucket {len(buckets)} of "
                                      f"{msg.n_buckets} failed: {exc}") from exc
            receive_s = time.monotonic() - t0
        answer = WeightsStored(version=msg.version, receive_seconds=receive_s)
        if current is not None and msg.version <= current:
            self.log.warning("stale_version_ignored", version=msg.version, current=current)
            return Accepted(answer)
        if msg.weights_hash:   # announced: checked before the answer, so a mismatch fails the publish
            return Accepted(answer, stored=await self._store(msg.version, buckets, msg.weights_hash))
        # hashed and packed after the answer: off the trainer's step (the rollouts wait for it)
        return Accepted(answer, storing=self._store(msg.version, buckets))

    async def _store(self, version: int, buckets: list, announced: str = "") -> StoredVersion:
        """Hash and pack a received version."""
        named = [kv for b in buckets for kv in b]
        digest = await asyncio.to_thread(weights_hash, named)
        if announced and digest != announced:
            self.counters["published_hash_mismatches"] += 1
            self.log.error("published_hash_mismatch", version=version, announced=announced, got=digest)
            raise WeightsRejected(f"version {version}: buckets hash to {digest}, the trainer announced {announced}")
        packed = await asyncio.to_thread(pack_buckets, buckets)
        return StoredVersion(version, digest, packed, sum(p.flat.numel() for p in packed))

    async def form(self, epoch: int, members: list[str], ranks: dict[str, int]) -> Formation:
        self.watch.begin(members)
        names = [self.master, *members]   # the link's master first
        for name in members:
            await self.bus.send(name, LinkReform(epoch=epoch, members=names))
        try:
            await self.watch.unless_lost(in_thread(self.link.reform, epoch, names), f"forming epoch {epoch}")
        except (BulkError, BusError, TimeoutError) as exc:
            return Formation(error=str(exc), members_failed=True)
        return Formation()

    def busy(self, rollout: str) -> bool:
        return rollout in self._lanes

    def lost(self, rollout: str, why: str) -> None:
        super().lost(rollout, why)
        if (lane := self._lanes.get(rollout)) is not None:
            lane.cancel(f"{rollout}: {why}")

    def push(self, stored: StoredVersion, epoch: int, members: list[str]) -> Transfer:
        """A lane per member: its buckets sent point to point on a thread of its own, then its ack (the
        lane's result). The push ends when every lane has, or `late_s` after the first one did; a late lane
        runs on (its member is skipped until it ends, then catches up), and a lost member's lane is
        abandoned."""
        link = self.link
        members = [n for n in members if n not in self._lanes]
        ready = WeightsReady(version=stored.version, n_buckets=stored.n_buckets, weights_hash=stored.weights_hash,
                             epoch=epoch, point_to_point=True)

        def send(rank: int) -> None:
            for packed in stored.packed:
                link.send_packed(packed, rank, epoch)

        async def lane(name: str) -> WeightsAck:
            ack = asyncio.ensure_future(self.bus.request(name, ready, timeout=self.ack_timeout))
            try:
                await in_thread(send, link.members.index(name))
                return await ack
            finally:
                ack.cancel()

        def ended(name: str, fut: asyncio.Future) -> None:
            if self._lanes.get(name) is fut:
                del self._lanes[name]

        lanes = {name: asyncio.ensure_future(lane(name)) for name in members}
        for name, fut in lanes.items():
            self._lanes[name] = fut
            fut.add_done_callback(functools.partial(ended, name))
        return Transfer(lanes, asyncio.ensure_future(self._wait(stored, lanes)), lanes=True)

    async def _wait(self, stored: StoredVersion, lanes: dict[str, asyncio.Future]) -> PushEnd:
        t0 = time.monotonic()
        _, running = await asyncio.wait(lanes.values(), return_when=asyncio.FIRST_COMPLETED)
        if running:
            await asyncio.wait(running, timeout=self.late_s)
        sync_s = time.monotonic() - t0
        errors = {}
        for name, fut in lanes.items():
            if not fut.done():
                self.counters["late_rollouts"] += 1
                errors[name] = f"late: no ack {self.late_s:g} s after the first (it runs on)"
            elif fut.cancelled() or fut.exception() is not None:
                reason = (f"abandoned: {fut.cancelled() and 'member lost'}" if fut.cancelled() else str(fut.exception()))
                self.counters["ack_failures"] += 1
                self.log.error("weights_ack_failed", rollout=name, version=stored.version, error=reason)
                errors[name] = reason
        return PushEnd(errors, sync_s, sync_s)

    def close(self) -> None:
        self.up.close()
        self.link.close()
