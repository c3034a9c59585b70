"""The weights the evaluator evaluates during the run (``eval.every_versions`` N > 0): every stored version
that is a multiple of N (the start version included) is kept here, and the evaluator
(``actors/evaluator/actor.py``) asks for it bucket by bucket with :class:`EvalWeightsRequest` on the bus, at
its own pace. Nothing waits for it: a newer multiple replaces a kept one it has not fetched yet. Relay mode
only (with direct weights the parameter server holds no weights).

The parameter server hands each version it takes to :meth:`EvalWeightsStore.keep` and answers each request
with :meth:`EvalWeightsStore.serve`; the store holds a reference (stored buckets are never changed)."""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import torch

from actors.weight_sync import StoredVersion
from transport.protocol import EvalWeights, EvalWeightsRequest

__all__ = ["EvalWeightsStore", "kept_for_eval"]


def kept_for_eval(version: int, every: int) -> bool:
    """Whether a version is one the evaluator evaluates: a multiple of ``eval.every_versions`` (0: off)."""
    return every > 0 and version % every == 0


class EvalWeightsStore:
    """The newest version kept for the evaluator, and the requests waiting for the next one."""

    def __init__(self, every: int, holds_weights: bool, counters: Counter) -> None:
        self.every = every                   # eval.every_versions (0: no evaluation during the run)
        self.holds_weights = holds_weights   # False with direct weights: there is nothing to keep
        self.counters = counters
        self.kept: StoredVersion | None = None
        self._changed = asyncio.Event()      # replaced by a fresh one each time it is set
        self._closing = False                # stopping: a waiting request returns at once

    def keep(self, stored: StoredVersion) -> None:
        """Keep ``stored`` if the evaluator evaluates it (and this server holds its bytes)."""
        if kept_for_eval(stored.version, self.every) and stored.packed:
            self.kept = stored
            self._wake()

    def close(self) -> None:
        """The server drains: a request waiting for the next kept version would hold it up to its timeout."""
        self._closing = True
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def serve(self, msg: EvalWeightsRequest, newest: Callable[[], int]) -> EvalWeights:
        """One bucket of the kept version ``msg`` asks for (``msg.version``), or of the next one kept after
        ``msg.after``, waiting up to ``msg.timeout_s`` for it; ``newest()``: the newest version stored."""
        if not self.holds_weights or self.every <= 0:
            why = ("evaluation during the run needs the relay through the parameter server: with direct "
                   "weights it holds none") if not self.holds_weights else \
                "eval.every_versions is 0 in the parameter server's settings"
            return self._none(msg, newest(), why)
        if msg.version < 0 and self._wanted(msg) is None and msg.timeout_s > 0:
            try:
                async with asyncio.timeout(msg.timeout_s):
                    while self._wanted(msg) is None and not self._closing:
                        await self._changed.wait()
            except TimeoutError:
                pass
        kept = self._wanted(msg)
        if kept is None or not 0 <= msg.bucket < len(kept.packed):
            return self._none(msg, newest())
        packed = kept.packed[msg.bucket]
        self.counters["eval_buckets_sent"] += 1
        return EvalWeights(version=kept.version, newest=newest(), weights_hash=kept.weights_hash,
                           n_buckets=len(kept.packed), bucket=msg.bucket, header=packed.header, flat=packed.flat)

    def _wanted(self, msg: EvalWeightsRequest) -> StoredVersion | None:
        kept = self.kept
        if kept is None:
            return None
        if msg.version >= 0:
            return kept if kept.version == msg.version else None
        return kept if kept.version > msg.after else None

    @staticmethod
    def _none(msg: EvalWeightsRequest, newest: int, unavailable: str = "") -> EvalWeights:
        return EvalWeights(version=-1, newest=newest, weights_hash="", n_buckets=0, bucket=msg.bucket, header={},
                           flat=torch.empty(0, dtype=torch.uint8), unavailable=unavailable)
