"""The trainer's publisher: brings each new version the trainer makes to the parameter server, beside training.

The trainer tells it of each version it makes (:meth:`VersionPublisher.made`); its task (:meth:`run`) exports
the newest version whenever the last one has reached the parameter server, through the trainer's weights
sender (actors/weight_sync), and the trainer's steps wait on it (:meth:`published_at`) as the trainer's
module docstring explains (actors/trainer/actor.py). Versions made while a publish runs are skipped, not
queued; a failed publish is logged and tried again with the newest version; only a placement error, which no
retry mends, stops the run. The engine is used by one of the trainer's step, an export or a save at a time
(``engine_lock``): an export sees whole steps.

It also asks the parameter server what the trainer's metrics and its end need to know of the pushes
(:meth:`rollouts_at`, :meth:`last_version_pushed`, the push figures of each step).
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

from actors.runtime.threads import in_thread
from actors.trainer.step import TrainerConfigError
from actors.weight_sync import StageExport, WeightSender, WeightSyncConfigError
from transport.bus import BusError
from transport.protocol import WeightsStatus, WeightsStatusRequest

__all__ = ["PUBLISH_RETRY_S", "PUBLISH_WAIT_MIN_S", "VersionPublisher"]

PUBLISH_RETRY_S = 2.0     # the pause after a failed publish, times the failures in a row (at most 30 s)
PUBLISH_WAIT_MIN_S = 30.0   # the least a step waits for its version's publish (wait_s)

Export = Callable[[], tuple[list[Any], list[StageExport]]]


class VersionPublisher:
    """Publishes the trainer's newest version through ``sender`` (None: no parameter server, nothing to
    publish), exported by ``export`` (blocking: it leads the other ranks) under ``engine_lock``."""

    def __init__(self, sender: WeightSender | None, export: Export, engine_lock: asyncio.Lock, bus: Any,
                 param_server: str | None, version: int, counters: Counter, log: Any, trace: Any) -> None:
        self.sender, self.export, self.engine_lock = sender, export, engine_lock
        self.bus, self.param_server = bus, param_server
        self.counters, self.log, self.trace = counters, log, trace
        self.newest = version                   # the newest version the trainer made
        self.published = version                # the newest version the weights path took (and its push figures)
        self.publish_seconds = 0.0              # export and publish of that version
        self._publish_seconds_max = 0.0
        # The parameter server's view after the newest publish; before one, what it reports with no push made.
        self.push_stats: dict[str, float] = (
            {"weight_push_seconds": 0.0, "gen_stall_seconds": 0.0} if sender is not None else {})
        self._new_version = asyncio.Event()     # a version newer than the published one exists
        self._published_changed = asyncio.Event()

    def made(self, version: int) -> None:
        """The trainer made ``version``: publish it once the running publish (if any) is done."""
        self.newest = version
        self._new_version.set()

    async def run(self) -> None:
        """Publish the newest version whenever one is newer than the last published."""
        failures = 0
        while True:
            await self._new_version.wait()
            self._new_version.clear()
            while self.published < self.newest:
                if self.sender is None:
                    self.published = self.newest
                    break
                t0 = time.time()
                async with self.engine_lock:   # between steps: the export is of one whole version
                    version = self.newest
                    t_export = time.time()
                    buckets, stages = await in_thread(self.export)   # a collective on the stages' ranks
                exported = time.time()
                error: Exception | None = None
                try:
                    await self.sender.publish(version, buckets, stages)
                except (WeightSyncConfigError, TrainerConfigError):
                    raise
                except Exception as exc:   # the parameter server is away, frozen or restarting: try again
                    error = exc
                finally:
                    del buckets, stages   # not held while waiting to retry: the next export may need the memory
                if error is not None:
                    failures += 1
                    self.counters["publish_failures"] += 1
                    self.log.warning("publish_failed_will_retry", version=version, failures=failures,
                                     error=repr(error)[:300])
                    await asyncio.sleep(min(PUBLISH_RETRY_S * failures, 30.0))
                    continue
                failures = 0
                self.publish_seconds = time.time() - t0
                if self.trace is not None:
                    self.trace.write("publish", version=version, export=[t_export, exported],
                                     send=[exported, time.time()])
                self._publish_seconds_max = max(self._publish_seconds_max, self.publish_seconds)
                self.push_stats = await self._push_stats() or self.push_stats   # kept when the server is away
                self.published = version
                self._published_changed.set()
            self._published_changed.set()

    def wait_s(self) -> float:
        """How long a step waits for its version's publish: 5 times the longest publish so far, at least
        PUBLISH_WAIT_MIN_S."""
        return max(PUBLISH_WAIT_MIN_S, 5 * self._publish_seconds_max)

    async def published_at(self, version: int, timeout: float | None,
                           unless: asyncio.Event | None = None) -> Literal["published", "timeout", "unless"]:
        """Wait until ``version`` (or a newer one) is published, unless ``timeout`` passes or ``unless`` is set
        (before or while waiting) first; which of the three ended the wait."""
        async def reached() -> Literal["published", "unless"]:
            while self.published < version:
                if unless is not None and unless.is_set():
                    return "unless"
                self._published_changed.clear()
                waits = [asyncio.ensure_future(self._published_changed.wait())]
                if unless is not None:
                    waits.append(asyncio.ensure_future(unless.wait()))
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
            return "published"
        try:
            return await asyncio.wait_for(reached(), timeout)
        except asyncio.TimeoutError:
            return "timeout"

    async def _push_stats(self) -> dict[str, float]:
        """The parameter server's latest view: how long the last push to every rollout took until acked, and
        how long generation stalled for it (mean over rollouts of their last ack's stall_seconds)."""
        if self.sender is None:
            return {}
        try:
            status = await self.bus.request(self.param_server, WeightsStatusRequest(), timeout=10.0)
        except (BusError, TimeoutError) as exc:   # metrics must not stop training
            self.log.warning("weights_status_unavailable", error=str(exc))
            return {}
        stalls = [r.stall_seconds for r in status.rollouts.values()]
        return {"weight_push_seconds": status.last_sync_seconds,
                "gen_stall_seconds": sum(stalls) / len(stalls) if stalls else 0.0}

    async def last_version_pushed(self) -> None:
        """The run's end waits (briefly, once) for the rollouts to hold its last version, as a step waits in
        synchronous mode: the run ends with every live rollout on the final weights, not in mid-push."""
        if self.sender is None or self.published < self.newest:
            return
        try:
            status = await self.bus.request(self.param_server, WeightsStatusRequest(
                min_version=self.newest, timeout_s=10.0), timeout=30.0)
        except (BusError, TimeoutError) as exc:
            self.log.warning("last_version_push_unknown", error=str(exc)[:200])
            return
        if isinstance(status, WeightsStatus) and not status.reached:
            self.log.warning("last_version_not_on_every_rollout", version=self.newest)

    async def rollouts_at(self, version: int) -> None:
        """Synchronous mode: return once every rollout samples with ``version``."""
        if self.sender is None:
            return
        for _ in range(60):  # bounded: a rollout that never catches up stops the run with a clear error
            status = await self.bus.request(self.param_server, WeightsStatusRequest(min_version=version, timeout_s=10.0),
                                            timeout=30.0)
            if isinstance(status, WeightsStatus) and status.reached:
                return
        raise RuntimeError(f"rollouts did not reach version {version} within 10 minutes (synchronous mode)")
