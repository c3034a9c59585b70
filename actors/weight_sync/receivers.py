"""The rollout's side of each path: the actor receives on a bulk link (:class:`LinkReceiver`: the relay
through the parameter server, or the trainer's direct bulk link), or its SGLang server joins the trainer's
NCCL groups and receives itself (:class:`ServerGroupReceiver`)."""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from actors.engines.base import EngineError, GenerationEngine, WeightBucket
from actors.runtime.threads import in_thread
from transport.bulk import BulkLink, LinkConfig
from transport.protocol import LinkReform, WeightsAck, WeightsReady

from .base import WeightReceiver, WeightSyncError, weight_group_name

Verify = Callable[[WeightsReady], Awaitable[tuple[str, str]]]


class _Receiver(WeightReceiver):
    """What both receivers share: the engine, the actor's counters and log, how it verifies an update, and
    the running transfer (which a newer epoch abandons)."""

    def __init__(self, config: LinkConfig, engine: GenerationEngine, counters: Counter, log: Any, verify: Verify,
                 active: Callable[[], int]) -> None:
        self.config, self.engine, self.counters, self.log = config, engine, counters, log
        self.verify, self.active = verify, active
        self._transfer: tuple[int, asyncio.Future] | None = None   # (epoch, task) of a running receive

    def abandon_before(self, epoch: int) -> None:
        """The parameter server left a transfer of an older epoch (a member it waited for was lost):
        nobody finishes it."""
        if self._transfer is not None and self._transfer[0] < epoch:
            self._transfer[1].cancel()

    def _running(self, epoch: int, fut: asyncio.Future) -> None:
        self._transfer = (epoch, fut)

        def ended(done: asyncio.Future) -> None:
            if self._transfer is not None and self._transfer[1] is done:
                self._transfer = None
        fut.add_done_callback(ended)


class LinkReceiver(_Receiver):
    """This process receives the buckets on a bulk link (point to point from the parameter server, or the
    trainer's broadcast) and feeds them to ``engine.update_weights`` as they arrive, while generation goes
    on (``interruptible``) or paused around the swap."""

    def __init__(self, link: BulkLink, engine: GenerationEngine, counters: Counter, log: Any, verify: Verify,
                 active: Callable[[], int], interruptible: bool) -> None:
        super().__init__(link.config, engine, counters, log, verify, active)
        self.link, self.interruptible = link, interruptible

    @property
    def epoch(self) -> int | None:   # type: ignore[override]
        return self.link.epoch

    async def form(self, msg: LinkReform) -> None:
        await in_thread(self.link.reform, msg.epoch, msg.members or None)

    async def receive(self, msg: WeightsReady) -> WeightsAck:
        engine, link = self.engine, self.link
        t0 = time.monotonic()
        # The receiver runs on its own so the link is always drained, even if the engine rejects a
        # bucket: leaving the broadcast half-done would stall the parameter server and every peer.
        queue: asyncio.Queue[WeightBucket | BaseException | None] = asyncio.Queue()
        received_at: list[float] = []

        async def receive() -> None:
            try:
                for _ in range(msg.n_buckets):
                    queue.put_nowait(await in_thread(link.recv, 0, msg.epoch) if msg.point_to_point
                                     else await in_thread(link.broadcast, None, 0, msg.epoch))
            except BaseException as exc:
                queue.put_nowait(exc)
                raise
            finally:
                received_at.append(time.monotonic())
                queue.put_nowait(None)

        async def buckets() -> AsyncIterator[WeightBucket]:
            # A broken transfer must fail update_weights before it swaps: a partial source would
            # otherwise be applied as version K with the rest of the weights still at K-1.
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise WeightSyncError(f"version {msg.version}: receiving buckets failed: {item}") from item
                yield item

        receiver = asyncio.ensure_future(receive())
        self._running(msg.epoch, receiver)
        swaps_before = len(getattr(engine, "swaps", []))
        stall = 0.0
        try:
            if self.interruptible:
                await engine.update_weights(msg.version, buckets())
            else:
                paused = time.monotonic()
                await engine.pause()
                try:
                    await engine.update_weights(msg.version, buckets())
                finally:
                    await engine.resume()
                    stall = time.monotonic() - paused
        except Exception as exc:
            await asyncio.gather(receiver, return_exceptions=True)
            self.counters["weight_update_failures"] += 1
            self.log.error("weights_update_failed", version=msg.version, error=repr(exc))
            raise WeightSyncError(f"version {msg.version}: {exc}") from exc
        await receiver  # raises the link error, if any (update_weights then saw a short source)
        receive_s = received_at[0] - t0
        swaps = getattr(engine, "swaps", [])
        if self.interruptible and len(swaps) > swaps_before:
            stall = swaps[-1].swap_s + swaps[-1].rebuild_s   # the decode loop's pause at the boundary
        digest, how = await self.verify(msg)
        self.log.info("weights_updated", version=msg.version, epoch=msg.epoch, buckets=msg.n_buckets,
                      receive_s=round(receive_s, 4), stall_s=round(stall, 4),
                      total_s=round(time.monotonic() - t0, 4), interruptible=self.interruptible,
                      active_groups=self.active(), verified=how)
        return WeightsAck(version=msg.version, weights_hash=digest, receive_seconds=receive_s,
                          stall_seconds=stall, verified=how)

    def close(self) -> None:
        self.link.close()


class ServerGroupReceiver(_Receiver):
    """The rollout's server receives itself (SGLang's /init_weights_update_group and
    /update_weights_from_distributed): it joins the trainer's groups as ``ranks`` ranks, one per
    tensor-parallel rank, one group per trainer pipeline stage (each stage sends its own layers)."""

    def __init__(self, config: LinkConfig, engine: Any, counters: Counter, log: Any, verify: Verify,
                 active: Callable[[], int], ranks: int) -> None:
        super().__init__(config, engine, counters, log, verify, active)
        self._ranks = max(1, ranks)
        self.epoch: int | None = None
        self.groups: list[str] = []     # in stage order

    @property
    def ranks(self) -> int:
        return self._ranks

    async def form(self, msg: LinkReform) -> None:
        stages = len(msg.master_ports)
        if (msg.world_size <= 0 or msg.rank_offset < 1 or not stages or len(msg.master_addrs) != stages
                or min(msg.master_ports) <= 0):
            raise EngineError(f"link {self.config.name!r}: LinkReform {msg} has no server group to join")
        for name in self.groups:
            try:
                await self.engine.destroy_weights_group(name)
            except EngineError:  # a restarted server no longer has it
                pass
        self.groups, self.epoch = [], None
        # One stage at a time, in order: every member joins stage k's group before any joins k + 1.
        for stage, (addr, port) in enumerate(zip(msg.master_addrs, msg.master_ports)):
            name = weight_group_name(self.config.name, msg.epoch, stage)
            await self.engine.init_weights_group(addr, port, msg.rank_offset, msg.world_size, group_name=name,
                                                 backend=self.config.backend)
            self.groups.append(name)
        self.epoch = msg.epoch

    async def receive(self, msg: WeightsReady) -> WeightsAck:
        """The server receives the buckets the trainer broadcasts, one /update_weights_from_distributed each,
        inside one pause of its generation (the engine's interruption)."""
        t0 = time.monotonic()
        update = asyncio.ensure_future(self._update(msg))
        self._running(msg.epoch, update)
        try:
            await update
        except asyncio.CancelledError:
            if not update.cancelled() or asyncio.current_task().cancelling():
                raise
            self.counters["weight_updates_abandoned"] += 1
            raise WeightSyncError(f"version {msg.version}: abandoned, the weights group is being formed "
                                  f"again without this transfer") from None
        except Exception as exc:
            self.counters["weight_update_failures"] += 1
            self.log.error("weights_update_failed", version=msg.version, error=repr(exc))
            raise WeightSyncError(f"version {msg.version}: {exc}") from exc
        seconds = time.monotonic() - t0
        digest, how = await self.verify(msg)
        self.log.info("weights_updated", version=msg.version, epoch=msg.epoch, buckets=msg.n_buckets,
                      total_s=round(seconds, 4), through_server=True, active_groups=self.active(), verified=how)
        # generation pauses for the whole receive (SGLang aborts and resumes around it)
        return WeightsAck(version=msg.version, weights_hash=digest, receive_seconds=seconds, stall_seconds=seconds,
                          verified=how)

    async def _update(self, msg: WeightsReady) -> None:
        if len(msg.specs) != msg.n_buckets:
            raise EngineError(f"version {msg.version}: {msg.n_buckets} buckets but specs for {len(msg.specs)}")
        per_stage = list(msg.stage_buckets) or [msg.n_buckets]
        if sum(per_stage) != msg.n_buckets or len(per_stage) != len(self.groups):
            raise EngineError(f"version {msg.version}: buckets per stage {per_stage} do not fit {msg.n_buckets} "
                              f"buckets on {len(self.groups)} groups")
        groups = [name for name, n in zip(self.groups, per_stage) for _ in range(n)]
        await self.engine.update_weights_from_distributed(msg.version, msg.specs, group_name=groups)

    def server_lost(self) -> None:
        self.groups, self.epoch = [], None

    def close(self) -> None:
        self.server_lost()
