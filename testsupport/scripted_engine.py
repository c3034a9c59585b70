"""A `GenerationEngine` whose "model" is a script: what it would write after a given context.

For tests of what drives an engine (episodes, tools) where a random model would never write what the test
needs (a tool call, an answer). Everything but the choice of tokens is done as the embedded engine does it
(actors/engines/torch_gen.py): requests are validated (in-flight rid, vocabulary, context limit), generation
stops after the first of the request's stop tokens ("stop", the stop token kept) or at ``max_new_tokens`` or
the context limit ("length"), every token records the version of the weights "sampling" it and a
log-prob, `abort` ends requests in flight with "abort" and their tokens so far. ``requests`` keeps every
request received, in order, so a test can check what a caller sent.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from actors.engines.base import (EngineError, GenerationEngine, GenerationRequest, GenerationResult, RequestError,
                                 WeightSource)

# (context token ids, sample index) -> the tokens the model would write next (the engine applies the limits)
Script = Callable[[Sequence[int], int], Sequence[int]]


def scripted_logprob(context_len: int, position: int) -> float:
    """The log-prob the scripted engine reports for a token: a function of where it stands, so a test can
    tell which request produced which token."""
    return -0.001 * (context_len + position + 1)


class ScriptedEngine(GenerationEngine):
    """See the module docstring. ``vocab_size`` and ``context_limit`` are the model's; ``hold`` is set:
    a request whose script returns ``hold_token`` first waits there until `abort` (a decode that is still
    running when the drain comes)."""

    def __init__(self, script: Script, *, vocab_size: int = 512, context_limit: int = 256, version: int = 0,
                 hold_token: int | None = None) -> None:
        self.script = script
        self.vocab_size, self.context_limit = vocab_size, context_limit
        self._version = version
        self.hold_token = hold_token
        self.requests: list[GenerationRequest] = []
        self._in_flight: dict[str, asyncio.Event] = {}
        self._running = False

    async def start(self) -> None:
        self._running = True

    async def stop(self) -> None:
        await self.abort()
        self._running = False

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """Tokens generated from now on carry ``version`` (as after a weight update)."""
        self._version = version

    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        if not self._running:
            raise EngineError("scripted engine is not running (call start())")
        if len(request.input_ids) >= self.context_limit:
            raise RequestError(f"request {request.rid!r}: input_ids has {len(request.input_ids)} tokens, the "
                               f"context limit is {self.context_limit}")
        bad = [t for t in request.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"request {request.rid!r}: token {bad[0]} outside the vocabulary ({self.vocab_size})")
        if request.rid in self._in_flight:
            raise RequestError(f"request {request.rid!r}: rid is already in flight")
        self.requests.append(request)
        aborted = self._in_flight[request.rid] = asyncio.Event()
        try:
            return [await self._sample(request, i, aborted) for i in range(request.n)]
        finally:
            self._in_flight.pop(request.rid, None)

    async def _sample(self, request: GenerationRequest, index: int, aborted: asyncio.Event) -> GenerationResult:
        sp = request.sampling
        planned = [int(t) for t in self.script(request.input_ids, index)]
        out: list[int] = []
        reason = ""
        for token in planned:
            if token == self.hold_token:
                await aborted.wait()
            if aborted.is_set():
                reason = "abort"
                break
            out.append(token)
            if token in sp.stop_token_ids:
                reason = "stop"
                break
            if len(out) >= sp.max_new_tokens or len(request.input_ids) + len(out) >= self.context_limit:
                reason = "length"
                break
        if not reason:   # a model never just stops: the script must reach a stop token or a limit
            raise AssertionError(f"the script ended before a stop token or a limit after {list(request.input_ids)[-8:]}")
        n = len(request.input_ids)
        return GenerationResult(request.rid, index, out, [scripted_logprob(n, p) for p in range(len(out))],
                                [self._version] * len(out), reason, n)

    async def abort(self, rid: str | None = None) -> int:
        hit = [r for r in self._in_flight if rid is None or r == rid]
        for r in hit:
            self._in_flight[r].set()
        return len(hit)

    async def update_weights(self, version: int, source: WeightSource) -> None:
        self._version = version

    async def pause(self) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def health(self) -> dict[str, Any]:
        return {"ok": self._running, "version": self._version, "running": len(self._in_flight), "waiting": 0}


class IntCodec:
    """Token ids as decimal words: "5 7" <-> [5, 7]: an episode's codec for a random-vocabulary model, which
    has no text."""

    def encode(self, text: str) -> list[int]:
        return [int(w) for w in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(i) for i in ids)
