"""Direct weights (GPU topologies: one link of ``[trainer.0, rollout]``, the parameter server in none): the
trainer keeps its last two exported versions and sends them to the rollouts itself, when the parameter
server, which holds no weights, asks. The group is carried one of two ways, which the parameter server
picks for each epoch from what the rollouts said in their hellos:

* the bulk link (:class:`LinkCarrier`): the rollout actors receive (LinkReform has no world size);
* the rollouts' SGLang servers (:class:`actors.weight_sync.servers.ServerGroupCarrier`): the trainer hosts
  an NCCL group per pipeline stage, each server joins at its rank offset (LinkReform has the world size).

    trainer                          param_server                          rollout.i
      |--WeightsPublished(v, specs)--->|                                       |
      |<---------WeightsStored(v)------|   (at once: no bytes travel to it)    |
      |                                |--LinkReform(e, members or offsets)-->|   (when the ready set changes)
      |<--LinkReform(e[, world_size])--|                                       |
      |--LinkFormed(e[, addrs, ports])>|                                       |
      |== group e formed (bulk link, or the servers join the hosted groups) ==|
      |                                |--WeightsReady(v, e, specs)---------->|   (a request)
      |<-----WeightsBroadcast(v, e)----|                                       |
      |== broadcast each bucket of v =========================================>|
      |--WeightsBroadcastDone--------->|<--------------------WeightsAck(v)-----|
"""
from __future__ import annotations

import abc
import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from actors.runtime.threads import in_thread
from actors.weights import combine_digests, tensor_digests
from transport.bulk import BulkError, BulkLink, PackedBucket, flat_order, pack_to_host, unpack_bucket
from transport.bus import BusError
from transport.protocol import (LinkFormed, LinkReform, WeightsAck, WeightsBroadcast, WeightsBroadcastDone,
                                WeightsPublished, WeightsReady, WeightsStored)

from .base import (Accepted, Bucket, Fanout, Formation, PushEnd, StoredVersion, Transfer, WeightSender,
                   WeightSyncConfigError, push_stream)


class KeptVersions:
    """A sender's packed buckets of recent versions in host memory (page-locked where there is a GPU), for
    the parameter server to ask for; newest last.

    A new version streams in bucket by bucket as it is exported (:func:`transport.bulk.pack_to_host`), so the
    GPU holds a few buckets, never the version. ``max_bytes`` caps the host memory: before a version comes
    in, older ones are dropped (oldest first) until the kept ones and one more of the newest's size fit, and
    once it is in, until they all fit; the newest is never dropped. Unset, the newest version is kept
    while the next one comes in (two versions at most; keeping the last two as well would make three while
    one is exported). A push asked for a dropped version fails, and the parameter server pushes a newer one.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.versions: dict[int, list[PackedBucket]] = {}

    def nbytes(self, version: int | None = None) -> int:
        """Host bytes of one kept version, or of all."""
        kept = [self.versions[version]] if version is not None else list(self.versions.values())
        return sum(p.flat.numel() for packed in kept for p in packed)

    def _drop_until(self, fits: Callable[[], bool], spare: int | None = None) -> None:
        for old in sorted(self.versions):
            if fits() or old == spare:
                return
            del self.versions[old]

    def keep(self, version: int, buckets: Iterable[Bucket]) -> list[PackedBucket]:
        """Take ``version`` as its buckets come (blocking: every bucket is exported meanwhile); returns its
        packed buckets."""
        newest = max(self.versions, default=None)
        if self.max_bytes is None:
            self._drop_until(lambda: len(self.versions) <= 1)
        else:
            incoming = self.nbytes(newest) if newest is not None else 0
            self._drop_until(lambda: self.nbytes() + incoming <= self.max_bytes)
        # Widest dtype first within each bucket: an SGLang server receives it back to back, where a tensor
        # must start at a multiple of its element size (fp32 norms beside bf16 matrices).
        packed = list(pack_to_host(flat_order(b) for b in buckets))
        self.versions[version] = packed
        if self.max_bytes is not None:
            self._drop_until(lambda: self.nbytes() <= self.max_bytes, spare=version)
        return packed

    def get(self, version: int) -> list[PackedBucket]:
        packed = self.versions.get(version)
        if packed is None:
            raise RuntimeError(f"version {version} is not kept here (kept: {sorted(self.versions)})")
        return packed


class Carrier(abc.ABC):
    """How a direct group is formed and a kept version broadcast on it."""

    epoch: int | None = None

    @abc.abstractmethod
    async def form(self, msg: LinkReform) -> LinkFormed: ...

    @abc.abstractmethod
    async def broadcast(self, version: int, epoch: int, packed: list[PackedBucket]) -> None: ...

    def close(self) -> None: ...


class LinkCarrier(Carrier):
    """The bulk link: the trainer is its rank 0 and broadcasts; the rollout actors receive."""

    def __init__(self, link: BulkLink, log: Any) -> None:
        self.link, self.log = link, log
        self._broadcasting: tuple[int, asyncio.Future] | None = None   # (epoch, task) of a running broadcast

    @property
    def epoch(self) -> int | None:   # type: ignore[override]
        return self.link.epoch

    def abandon_before(self, epoch: int) -> None:
        # The parameter server left that broadcast (a member it waited for was lost): nobody finishes it.
        if self._broadcasting is not None and self._broadcasting[0] < epoch:
            self._broadcasting[1].cancel()

    async def form(self, msg: LinkReform) -> LinkFormed:
        t0 = time.monotonic()
        await in_thread(self.link.reform, msg.epoch, msg.members or None)
        self.log.info("weights_link_formed", epoch=msg.epoch, members=msg.members,
                      seconds=round(time.monotonic() - t0, 3))
        return LinkFormed(epoch=msg.epoch, seconds=time.monotonic() - t0)

    async def broadcast(self, version: int, epoch: int, packed: list[PackedBucket]) -> None:
        if self.link.epoch != epoch:
            raise RuntimeError(f"link {self.link.config.name!r} is at epoch {self.link.epoch}, "
                               f"not {epoch}")
        link = self.link

        def send(bucket: PackedBucket) -> None:
            with push_stream(link.config.backend == "nccl"):
                link.broadcast_packed(bucket, 0, epoch)

        async def broadcast() -> None:
            for bucket in packed:
                await in_thread(send, bucket)
        task = asyncio.ensure_future(broadcast())
        self._broadcasting = (epoch, task)
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled() or asyncio.current_task().cancelling():
                raise
            raise RuntimeError(f"broadcast of version {version} on epoch {epoch} "
                               f"abandoned: the link is being formed again") from None
        finally:
            self._broadcasting = None

    def close(self) -> None:
        self.link.close()


class DirectSender(WeightSender):
    """Trainer rank 0 of the rollouts' link: keeps each version and broadcasts it when asked, on the bulk
    link or into the servers' groups (the LinkReform of each epoch says which)."""

    def __init__(self, link: LinkCarrier, servers: Carrier, bus: Any, param_server: str, lock: asyncio.Lock,
                 stages: bool, kept_bytes: int | None = None) -> None:
        self.link, self.servers, self.bus, self.param_server = link, servers, bus, param_server
        self.lock = lock          # formation and broadcasts one at a time (they lead the stages' ranks)
        self.stages = stages      # a pipeline-parallel trainer: every stage's sender broadcasts its own layers
        self.kept = KeptVersions(kept_bytes)
        self.carrier: Carrier = link

    def take(self, version: int, buckets: Iterable[Bucket]) -> list[PackedBucket]:
        return self.kept.keep(version, buckets)

    async def publish(self, version: int, packed: list[PackedBucket], stages: list[Any]) -> None:
        digest = ""
        if self.carrier is self.link and not self.stages:
            # Only rollouts that receive on the bulk link check a hash against the trainer's. SGLang servers
            # are checked by the version they report.
            digests = await asyncio.to_thread(lambda: tensor_digests([kv for p in packed for kv in unpack_bucket(p)]))
            digest = combine_digests(digests + [d for s in stages for d in s.digests])
        specs = [p.metas() for p in packed] + [m for s in stages for m in s.specs]
        stage_buckets = [len(packed)] + [len(s.specs) for s in stages] if stages else []
        reply = await self.bus.request(self.param_server, WeightsPublished(
            version=version, n_buckets=len(specs), weights_hash=digest, specs=specs,
            stage_buckets=stage_buckets), timeout=60.0)
        if not isinstance(reply, WeightsStored) or reply.version != version:
            raise RuntimeError(f"param server answered {reply!r} to version {version}")

    async def form(self, msg: LinkReform) -> LinkFormed:
        """Join the rollouts' group of this epoch as its rank 0 (the rendezvous master). With
        ``world_size`` set, the rollouts' servers join themselves: host a fresh group (each pipeline stage's
        sender one of its own), reply with them at once, and finish joining in the background."""
        self.link.abandon_before(msg.epoch)
        async with self.lock:
            if msg.world_size > 0:
                self.carrier = self.servers
            elif self.stages:
                raise WeightSyncConfigError("parallel.pp > 1: every pipeline stage sends its own layers, which needs "
                                      "rollouts whose servers join the weights group (SGLang); these rollouts "
                                      "receive on the bulk link")
            else:
                self.carrier = self.link
            return await self.carrier.form(msg)

    async def broadcast(self, msg: WeightsBroadcast) -> WeightsBroadcastDone:
        """Broadcast a kept version to the rollouts (they receive after WeightsReady)."""
        packed = self.kept.get(msg.version)
        async with self.lock:
            t0 = time.monotonic()
            await self.carrier.broadcast(msg.version, msg.epoch, packed)
        return WeightsBroadcastDone(version=msg.version, seconds=time.monotonic() - t0)

    def close(self) -> None:
        self.link.close()
        self.servers.close()


class TrainerFanout(Fanout):
    """The parameter server's side of direct weights: it holds no bytes; the trainer forms each epoch
    (LinkReform as a request) and broadcasts (WeightsBroadcast) while the rollouts receive."""

    def __init__(self, bus: Any, log: Any, counters: Counter, ack_timeout: float, late_s: float, trainer: str,
                 rollouts: list[str], start_version: int) -> None:
        super().__init__(bus, log, counters, ack_timeout, late_s)
        self.trainer = trainer
        self.rollouts = list(rollouts)
        self.start_version = start_version   # the version the run starts from (actors.runtime.recovery.start_weights)
        self._acks: dict[str, asyncio.Future] = {}    # the running push's WeightsReady requests, by rollout
        self._abandoned: dict[str, str] = {}          # ... given up on, and why

    async def start_weights(self) -> StoredVersion:
        """Only the start version's number: nothing is loaded here, so its hash is unknown and a rollout at it
        counts as up to date; a restarted rollout is brought to the newest version from the trainer's copy."""
        return StoredVersion(self.start_version, "", [], 0, n_buckets=0)

    async def accept(self, msg: WeightsPublished, current: int | None) -> Accepted:
        """The trainer keeps the bytes: only what the rollouts must be told of them is stored."""
        stored = StoredVersion(msg.version, msg.weights_hash, [], 0, n_buckets=msg.n_buckets,
                               specs=msg.specs, stage_buckets=msg.stage_buckets)
        return Accepted(WeightsStored(version=msg.version, receive_seconds=0.0), stored=stored)

    async def form(self, epoch: int, members: list[str], ranks: dict[str, int]) -> Formation:
        if any(ranks.values()):
            return await self._form_with_servers(epoch, members, ranks)
        self.watch.begin(members)
        names = [self.trainer, *members]   # the link's master first
        for name in members:
            await self.bus.send(name, LinkReform(epoch=epoch, members=names))
        try:
            await self._trainer_forms(LinkReform(epoch=epoch, members=names))
        except (BulkError, BusError, TimeoutError) as exc:
            return Formation(error=str(exc), members_failed=True)
        return Formation()

    async def _trainer_forms(self, reform: LinkReform) -> LinkFormed:
        """The trainer's answer to ``reform``; Abandoned when a member watched since ``watch.begin`` is lost
        first (a group it was to be part of could never complete)."""
        work = asyncio.ensure_future(self.bus.request(self.trainer, reform, timeout=self.ack_timeout))
        return await self.watch.unless_lost(work, f"forming epoch {reform.epoch}")

    async def _form_with_servers(self, epoch: int, members: list[str], ranks: dict[str, int]) -> Formation:
        """The trainer hosts a group of 1 + the servers' ranks; each rollout's server joins at its rank offset.
        The group is complete when the trainer's first broadcast finds every rank joined (it waits for that,
        bounded by the link timeout)."""
        if not all(ranks[n] > 0 for n in members):
            return Formation(error="some rollouts receive on the link and some through their servers: "
                                   f"{ {n: ranks[n] for n in members} }")
        world = 1 + sum(ranks[n] for n in members)
        # A member lost meanwhile (its server died) abandons the formation, as on the plain path: the group
        # would be one whose broadcast waits the link timeout for ranks that cannot join.
        self.watch.begin(members)
        try:
            formed = await self._trainer_forms(LinkReform(epoch=epoch, world_size=world))
        except (BulkError, BusError, TimeoutError) as exc:
            return Formation(error=str(exc))
        offset = 1
        for name in members:
            await self.bus.send(name, LinkReform(epoch=epoch, master_addrs=formed.master_addrs,
                                                 master_ports=formed.master_ports, rank_offset=offset,
                                                 world_size=world))
            offset += ranks[name]
        return Formation({"ranks": world, "servers": True, "stages": len(formed.master_ports)})

    def lost(self, rollout: str, why: str) -> None:
        """A rollout that died or restarted will never ack the running push: stop waiting for it now rather
        than after ack_timeout_s (the others' acks still count; it gets the weights on the next group)."""
        super().lost(rollout, why)
        fut = self._acks.get(rollout)
        if fut is not None and not fut.done():
            self._abandoned[rollout] = why
            fut.cancel()

    def push(self, stored: StoredVersion, epoch: int, members: list[str]) -> Transfer:
        """The trainer broadcasts (WeightsBroadcast) on the group it hosts; every member acks."""
        self.watch.begin(members)
        ready = WeightsReady(version=stored.version, n_buckets=stored.n_buckets, weights_hash=stored.weights_hash,
                             epoch=epoch, specs=stored.specs, stage_buckets=stored.stage_buckets)
        # each ack counts as it comes (the parameter server watches them): a late member holds nobody else's
        self._acks = {name: asyncio.ensure_future(self.bus.request(name, ready, timeout=self.ack_timeout))
                      for name in members}
        return Transfer(dict(self._acks), asyncio.ensure_future(self._broadcast(stored, epoch, self._acks)))

    async def _broadcast(self, stored: StoredVersion, epoch: int, acks: dict[str, asyncio.Future]) -> PushEnd:
        t0 = time.monotonic()
        try:
            sending = asyncio.ensure_future(self.bus.request(
                self.trainer, WeightsBroadcast(version=stored.version, epoch=epoch), timeout=self.ack_timeout))
            await self.watch.unless_lost(sending, f"pushing version {stored.version}")
        except (BulkError, BusError, TimeoutError) as exc:
            for fut in acks.values():
                fut.cancel()
            await asyncio.gather(*acks.values(), return_exceptions=True)
            self._acks = {}
            return PushEnd({}, time.monotonic() - t0, time.monotonic() - t0, failed=str(exc))
        sent_s = time.monotonic() - t0
        results = await asyncio.gather(*acks.values(), return_exceptions=True)
        self._acks = {}
        abandoned, self._abandoned = self._abandoned, {}
        errors = {}
        for name, res in zip(acks, results):
            if isinstance(res, WeightsAck):
                continue
            self.counters["ack_failures"] += 1
            reason = (str(res) if isinstance(res, (BusError, TimeoutError))
                      else f"abandoned: {abandoned.get(name, 'cancelled')}"
                      if isinstance(res, asyncio.CancelledError) else repr(res))
            self.log.error("weights_ack_failed", rollout=name, version=stored.version, error=reason)
            errors[name] = reason
        return PushEnd(errors, sent_s, time.monotonic() - t0)
