"""The embedded generation engine: continuous batching with a KV cache, interruptible weight updates.

One decode thread owns the model and the KV cache; the asyncio side only hands it requests and
commands and awaits futures, so the rollout actor's event loop never blocks (torch releases the GIL
inside its ops). The thread loops over step boundaries:

    apply aborts -> swap weights if a new version is fully staged (then rebuild the KV cache of every
    in-flight sequence under the new weights) -> admit waiting requests (one prefill per prompt, copied
    into its n sample rows) -> one decode step for all live rows -> retire finished rows

Rows are kept compacted at the front of the cache so a decode step works on views. Sampling is
vectorised over rows; each row's random numbers come from a counter-based hash of (request seed,
sample index, token position), so a request's samples do not depend on what else is in the batch.

Log-probs: `log_softmax(logits / T)` over the full vocabulary (float32 logits; T = 1 when greedy),
before top-k/top-p truncation -- `model.token_logprobs`, the same function the trainer uses.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
import threading
import time
from collections.abc import AsyncIterable, Callable
from typing import Any

import torch

from actors.weights import weights_hash

from .base import (EngineError, GenerationEngine, GenerationRequest, GenerationResult, RequestError,
                   WeightSource)
from .checkpoint import CheckpointError, hf_state_dict, load_model
from .lora import LoraError, LoraSpec, is_adapter_name, lora_problem, merged_weights, read_adapter, resolve_start, target_linears
from .model import Qwen2ForCausalLM, token_logprobs
from .moe import RoutingTrace, compact_routes

# splitmix64 constants as signed int64 (torch has no uint64 arithmetic); products wrap around.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    # `>>` is arithmetic on int64; masking makes it the logical shift splitmix64 needs.
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def counter_uniform(seeds: torch.Tensor, streams: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Uniform [0, 1) float32 per row, a pure function of (seed, stream, counter)."""
    x = _mix64(seeds * _GOLDEN + streams)
    x = _mix64(x + (counters + 1) * _GOLDEN)
    return ((x >> 40) & ((1 << 24) - 1)).float() / float(1 << 24)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                  uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (tokens [B], behaviour log-probs [B]).

    temperature 0 rows are greedy. Filtering (top-k, then top-p on the kept mass) only changes which
    token is drawn; the returned log-prob is always log_softmax(logits / T) over the full vocabulary.
    """
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / temp[:, None]
    logp_full = scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    filtering = bool(((k < vocab) | (top_p < 1.0)).any())
    if filtering:
        sorted_logp, order = logp_full.sort(dim=-1, descending=True)
        probs = sorted_logp.exp()
        rank = torch.arange(vocab, device=logits.device)[None, :]
        mass_before = probs.cumsum(-1) - probs
        drop = (rank >= k[:, None]) | ((mass_before >= top_p[:, None]) & (rank > 0))
        probs = probs.masked_fill(drop, 0.0)
    else:
        probs, order = logp_full.exp(), None
    cdf = probs.cumsum(-1)
    target = (uniform * cdf[:, -1])[:, None]
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1).squeeze(-1)
    tokens = order.gather(-1, pick[:, None]).squeeze(-1) if order is not None else pick
    tokens = torch.where(greedy, logits.argmax(-1), tokens)
    return tokens, logp_full.gather(-1, tokens[:, None]).squeeze(-1)


@dataclasses.dataclass
class _Request:
    req: GenerationRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    seed: int
    results: list[GenerationResult | None]
    done: int = 0


@dataclasses.dataclass
class _Row:
    """One sample being decoded. The cache holds prompt + output[:-1]; output[-1] is fed next."""

    owner: _Request
    index: int
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    # When the engine records routing: [tokens, sparse layers, top-k] chunks for the tokens in the cache.
    routes: list[torch.Tensor] = dataclasses.field(default_factory=list)

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.owner.req.input_ids

    @property
    def cache_len(self) -> int:
        return len(self.prompt) + len(self.output) - 1


@dataclasses.dataclass
class _Swap:
    version: int
    tensors: dict[str, torch.Tensor]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    staged_at: float
    adapter: dict[str, torch.Tensor] | None = None   # a LoRA version: the adapter the merged tensors came from


@dataclasses.dataclass
class SwapRecord:
    """Timing of one weight swap, for health() and the benchmark."""

    version: int
    staged_at: float      # all buckets received
    swapped_at: float     # parameters replaced (a step boundary)
    swap_s: float         # replacing the parameters
    rebuild_s: float      # re-prefilling in-flight sequences under the new weights
    rows_rebuilt: int
    tokens_rebuilt: int


class TorchGenerationEngine(GenerationEngine):
    """Embedded `GenerationEngine` on one torch device (CPU by default)."""

    def __init__(self, model_dir: str | None = None, *, model: Qwen2ForCausalLM | None = None, version: int = 0,
                 device: str = "cpu", dtype: torch.dtype | str | None = None, max_running: int = 256,
                 max_prefill_tokens: int = 8192, seed: int = 0, step_log: int = 100_000,
                 record_routing: bool = False, lora: LoraSpec | None = None, start_adapter: str | None = None) -> None:
        """``record_routing``: a mixture-of-experts model's results carry the experts each token was routed to
        (GenerationResult.routed_experts), for the trainer to replay (algo.routing_replay: r3).
        ``lora``: weight versions may be LoRA adapters (lora.py), merged into a kept copy of the base weights of
        the targeted layers, so each adapter replaces the previous one; ``model_dir`` is then the base or a LoRA
        checkpoint, and ``start_adapter`` an adapter the engine starts with."""
        if (model_dir is None) == (model is None):
            raise EngineError("TorchGenerationEngine needs exactly one of model_dir or model")
        self._model_dir, self._model = model_dir, model
        self._lora, self._start_adapter = lora, start_adapter
        self._base: dict[str, torch.Tensor] = {}          # LoRA: the targeted layers' base weights, never modified
        self._adapter: dict[str, torch.Tensor] | None = None   # LoRA: the adapter merged now, as it was received
        self._device, self._dtype = device, dtype
        self._version = version
        self.max_running, self.max_prefill_tokens = max_running, max_prefill_tokens
        self.record_routing = record_routing
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._aborts: list[str | None] = []
        self._pending_swap: _Swap | None = None
        self._pause_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._paused = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._rows: list[_Row] = []
        self._in_flight: dict[str, _Request] = {}
        self._cache = None
        self._error: BaseException | None = None
        # (end time, seconds, rows) per decode step, for the benchmark's stall measurement.
        self.step_log: collections.deque[tuple[float, float, int]] = collections.deque(maxlen=step_log)
        self.swaps: list[SwapRecord] = []
        self.tokens_generated = 0
        self.steps = 0
        # Called in the decode thread after every decode step with the step count (instrumentation, tests).
        self.on_step: Callable[[int], None] | None = None

    # --- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        adapter_dir = None
        if self._model is None:
            base_dir = self._model_dir
            if self._lora is not None:
                base_dir, adapter_dir = await asyncio.to_thread(resolve_start, self._model_dir, self._start_adapter)
            self._model = await asyncio.to_thread(load_model, base_dir, self._dtype, self._device)
        self._model.eval().requires_grad_(False)
        if self._lora is not None:
            problem = lora_problem(self._model.config, self._lora)
            if problem:
                raise EngineError(problem)
            self._base = {name + ".weight": m.weight.data for name, m in target_linears(self._model, self._lora)}
            if adapter_dir is not None:
                adapter = (await asyncio.to_thread(read_adapter, adapter_dir))[1]
                params = dict(self._model.named_parameters())
                for name, tensor in merged_weights(self._base, adapter, self._lora.scaling).items():
                    params[name].data = tensor
                self._adapter = adapter
        if not self._model.config.sparse_layers:
            self.record_routing = False  # a dense model routes nothing
        self._cache = self._model.new_cache(8, 64)
        self._thread = threading.Thread(target=self._run, name="torch-gen-decode", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        await asyncio.to_thread(self._thread.join, 60.0)
        self._thread = None

    @property
    def model(self) -> Qwen2ForCausalLM:
        if self._model is None:
            raise EngineError("engine not started")
        return self._model

    @property
    def version(self) -> int:
        return self._version

    # --- requests ----------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        self._check_running()
        limit = self.model.config.max_position_embeddings
        if len(request.input_ids) >= limit:
            raise RequestError(f"request {request.rid!r}: input_ids has {len(request.input_ids)} tokens, the model's "
                               f"max_position_embeddings is {limit}")
        vocab = self.model.config.vocab_size
        bad = [t for t in request.input_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"request {request.rid!r}: input_ids has token {bad[0]} outside the vocabulary (size {vocab})")
        loop = asyncio.get_running_loop()
        seed = request.sampling.seed if request.sampling.seed is not None else self._rng.getrandbits(62)
        entry = _Request(request, loop, loop.create_future(), seed, [None] * request.n)
        with self._cond:
            if request.rid in self._in_flight:
                raise RequestError(f"request {request.rid!r}: rid is already in flight")
            self._in_flight[request.rid] = entry
            self._waiting.append(entry)
            self._cond.notify_all()
        try:
            return await entry.future
        except asyncio.CancelledError:
            await self.abort(request.rid)
            raise

    async def abort(self, rid: str | None = None) -> int:
        with self._cond:
            count = len(self._in_flight) if rid is None else int(rid in self._in_flight)
            if count:
                self._aborts.append(rid)
                self._cond.notify_all()
        return count

    async def pause(self) -> None:
        self._check_running()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            self._paused = True
            self._pause_waiters.append((loop, future))
            self._cond.notify_all()
        await future

    async def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    async def health(self) -> dict[str, Any]:
        alive = self._thread is not None and self._thread.is_alive() and self._error is None
        with self._cond:
            waiting = sum(r.req.n for r in self._waiting)
            running = sum(r.req.n for r in self._in_flight.values()) - waiting
        last = dataclasses.asdict(self.swaps[-1]) if self.swaps else None
        return {"ok": alive, "version": self._version, "running": running, "waiting": waiting,
                "paused": self._paused, "tokens_generated": self.tokens_generated, "steps": self.steps,
                "last_swap": last, "error": repr(self._error) if self._error else None}

    # --- weights -----------------------------------------------------------------------------------
    async def update_weights(self, version: int, source: WeightSource) -> None:
        """Stage every bucket (decoding continues meanwhile), then swap at the next step boundary."""
        self._check_running()
        params = dict(self.model.named_parameters(remove_duplicate=False))
        tied = self.model.config.tie_word_embeddings
        staged: dict[str, torch.Tensor] = {}
        adapter: dict[str, torch.Tensor] = {}
        device = self.model.device

        def stage(bucket: list[tuple[str, torch.Tensor]]) -> None:
            for name, tensor in bucket:
                if tied and name == "lm_head.weight":
                    continue
                if self._lora is not None and is_adapter_name(name):
                    # kept as sent: the hash the trainer announced is of these bytes
                    adapter[name] = tensor.detach().to(device=device, copy=True).contiguous()
                    continue
                param = params.get(name)
                if param is None:
                    raise CheckpointError(f"weights v{version}: unexpected tensor {name!r} (not a parameter of "
                                          f"{self.model.config.ARCHITECTURE})")
                if tuple(tensor.shape) != tuple(param.shape):
                    raise CheckpointError(f"weights v{version}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                          f"expected {tuple(param.shape)}")
                # A private copy: the sender may reuse its buffers once the bucket is handed over.
                staged[name] = tensor.detach().to(device=param.device, dtype=param.dtype, copy=True).contiguous()

        if isinstance(source, AsyncIterable):
            async for bucket in source:
                await asyncio.to_thread(stage, bucket)
        else:
            iterator = iter(source)
            done = object()
            while (bucket := await asyncio.to_thread(next, iterator, done)) is not done:
                await asyncio.to_thread(stage, bucket)
        if adapter:
            if staged:
                raise CheckpointError(f"weights v{version}: both adapter and base tensors; a version is one or the other")
            try:   # merged here, off the decode loop: the swap at the boundary stays a pointer swap
                staged = await asyncio.to_thread(merged_weights, self._base, adapter, self._lora.scaling)
            except LoraError as exc:
                raise CheckpointError(f"weights v{version}: {exc}") from None
        loop = asyncio.get_running_loop()
        swap = _Swap(version, staged, loop, loop.create_future(), time.perf_counter(), adapter or None)
        with self._cond:
            if self._pending_swap is not None:  # a newer version supersedes one not yet applied
                self._pending_swap.loop.call_soon_threadsafe(_settle, self._pending_swap.future, None)
            self._pending_swap = swap
            self._cond.notify_all()
        await swap.future

    async def verify_weights(self, version: int) -> tuple[str, str]:
        """``(hash, "hash")`` of what this engine last received: the adapter it merged (a LoRA version), else
        every weight (rollout.actor.verify_engine_weights)."""
        adapter = self._adapter
        named = adapter.items() if adapter is not None else hf_state_dict(self.model).items()
        return await asyncio.to_thread(weights_hash, sorted(named)), "hash"

    # --- the decode thread -------------------------------------------------------------------------
    def _check_running(self) -> None:
        if self._thread is None or self._stopping:
            raise EngineError("generation engine is not running (call start())")
        if self._error is not None:
            raise EngineError(f"generation engine failed: {self._error!r}")

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while self._boundary():
                    if self._rows:
                        self._decode_step()
                        self.steps += 1
                        if self.on_step is not None:
                            self.on_step(self.steps)
        except BaseException as e:  # report to every waiter instead of hanging them
            self._error = e
            self._finish_all("abort")
            raise
        finally:
            with self._cond:
                self._stopping = True
                waiters, self._pause_waiters = self._pause_waiters, []
                if self._pending_swap is not None:
                    swap, self._pending_swap = self._pending_swap, None
                    swap.loop.call_soon_threadsafe(_settle, swap.future, EngineError("engine stopped"))
            for loop, fut in waiters:
                loop.call_soon_threadsafe(_settle, fut, None)

    def _boundary(self) -> bool:
        """Everything that happens between decode steps; returns False to stop the thread."""
        with self._cond:
            while not (self._stopping or self._aborts or self._pending_swap or self._pause_waiters
                       or (not self._paused and (self._rows or self._waiting))):
                self._cond.wait()
            if self._stopping:
                aborts, swap = [None], None
            else:
                aborts, self._aborts = self._aborts, []
                swap, self._pending_swap = self._pending_swap, None
            waiters, self._pause_waiters = self._pause_waiters, []
            admitted = [] if (self._paused or self._stopping) else self._take_waiting()
        if self._stopping:
            for rid in aborts:
                self._abort(rid)
            return False
        if swap is not None:
            self._swap(swap)  # before admission: new requests prefill under the new weights
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_settle, fut, None)
        if admitted:
            self._admit(admitted)
        # After admission: a request taken from the queue at this same boundary is no longer "waiting",
        # so aborting first would miss it and let it run to its full length.
        for rid in aborts:
            self._abort(rid)
        return True

    def _take_waiting(self) -> list[_Request]:
        taken, rows, tokens = [], len(self._rows), 0
        while self._waiting:
            entry = self._waiting[0]
            n, plen = entry.req.n, len(entry.req.input_ids)
            if taken and (rows + n > self.max_running or tokens + plen > self.max_prefill_tokens):
                break
            if not taken and self._rows and rows + n > self.max_running:
                break
            taken.append(self._waiting.popleft())
            rows, tokens = rows + n, tokens + plen
        return taken

    def _abort(self, rid: str | None) -> None:
        with self._cond:
            waiting = [e for e in self._waiting if rid is None or e.req.rid == rid]
            for entry in waiting:
                self._waiting.remove(entry)
        for entry in waiting:
            for i in range(entry.req.n):
                self._finish_sample(entry, _Row(entry, i), "abort")
        keep = []
        for row in self._rows:
            if rid is None or row.owner.req.rid == rid:
                self._finish_sample(row.owner, row, "abort")
            else:
                keep.append(row)
        if len(keep) != len(self._rows):
            self._compact(keep)

    def _finish_all(self, reason: str) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for entry in waiting:
            for i in range(entry.req.n):
                self._finish_sample(entry, _Row(entry, i), reason)
        for row in self._rows:
            self._finish_sample(row.owner, row, reason)
        self._rows = []

    def _finish_sample(self, entry: _Request, row: _Row, reason: str) -> None:
        routes = None
        if self.record_routing and row.routes:
            routes = compact_routes(torch.cat(row.routes), self.model.config.num_experts).cpu()
        entry.results[row.index] = GenerationResult(entry.req.rid, row.index, row.output, row.logprobs, row.versions,
                                                    reason, len(entry.req.input_ids), routes)
        entry.done += 1
        if entry.done == entry.req.n:
            with self._cond:
                self._in_flight.pop(entry.req.rid, None)
            entry.loop.call_soon_threadsafe(_settle, entry.future, list(entry.results))

    def _swap(self, swap: _Swap) -> None:
        model = self.model
        t0 = time.perf_counter()
        params = dict(model.named_parameters())
        for name, tensor in swap.tensors.items():
            params[name].data = tensor  # pointer swap at a step boundary: no copy on the critical path
        if self._lora is not None:   # an adapter replaces the last; full weights are a new base without one
            if swap.adapter is None:
                self._base = {name: params[name].data for name in self._base}
            self._adapter = swap.adapter
        self._version = swap.version
        t1 = time.perf_counter()
        rows, tokens = len(self._rows), sum(r.cache_len for r in self._rows)
        if self._rows:
            # The rebuilt cache routes every token under the new weights: that is the routing its next tokens see.
            _, routes = self._prefill_rows([list(r.prompt) + r.output[:-1] for r in self._rows], 0)
            for row, route in zip(self._rows, routes):
                row.routes = [route]
        t2 = time.perf_counter()
        self.swaps.append(SwapRecord(swap.version, swap.staged_at, t1, t1 - t0, t2 - t1, rows, tokens))
        swap.loop.call_soon_threadsafe(_settle, swap.future, None)

    def _prefill_rows(self, sequences: list[list[int]], row_start: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Prefill sequences into cache rows row_start.. in chunks of ~max_prefill_tokens. Returns their
        last-token logits and, when recording routing, each sequence's routed experts (else an empty list)."""
        device = self.model.device
        out, routes, i = [], [], 0
        while i < len(sequences):
            j, longest = i, 0
            while j < len(sequences) and (j == i or max(longest, len(sequences[j])) * (j + 1 - i) <= self.max_prefill_tokens):
                longest = max(longest, len(sequences[j]))
                j += 1
            chunk = sequences[i:j]
            ids = torch.zeros((len(chunk), longest), dtype=torch.long)
            for r, seq in enumerate(chunk):
                ids[r, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            lengths = torch.tensor([len(s) for s in chunk])
            trace = RoutingTrace(record=True) if self.record_routing else None
            out.append(self.model.prefill(ids.to(device), lengths.to(device), self._cache, row_start + i, trace))
            if trace is not None:
                chosen = trace.experts().view(len(chunk), longest, *trace.experts().shape[1:])
                routes += [chosen[r, :len(seq)] for r, seq in enumerate(chunk)]
            i = j
        return torch.cat(out), routes

    def _admit(self, entries: list[_Request]) -> None:
        start = len(self._rows)
        prompts = [list(e.req.input_ids) for e in entries]
        total = start + sum(e.req.n for e in entries)
        self._cache.reserve(total, max(len(p) for p in prompts) + 1)
        logits, routes = self._prefill_rows(prompts, start)
        # Samples 1..n-1 of each prompt reuse its prefill: copy the prompt's cache row.
        new_rows, row_logits = [], []
        extra = start + len(entries)
        for k, entry in enumerate(entries):
            new_rows.append(_Row(entry, 0, routes=routes[k:k + 1]))
            row_logits.append(k)
        for k, entry in enumerate(entries):
            for i in range(1, entry.req.n):
                self._cache.copy_row(start + k, extra, len(entry.req.input_ids))
                new_rows.append(_Row(entry, i, routes=routes[k:k + 1]))
                row_logits.append(k)
                extra += 1
        self._rows.extend(new_rows)
        self._sample_and_retire(logits[torch.tensor(row_logits, device=logits.device)], start)

    def _decode_step(self) -> None:
        t0 = time.perf_counter()
        device = self.model.device
        tokens = torch.tensor([r.output[-1] for r in self._rows], dtype=torch.long, device=device)
        lens = torch.tensor([r.cache_len for r in self._rows], dtype=torch.long, device=device)
        trace = RoutingTrace(record=True) if self.record_routing else None
        logits = self.model.decode(tokens, lens, self._cache, routing=trace)
        if trace is not None:
            chosen = trace.experts()
            for i, row in enumerate(self._rows):
                row.routes.append(chosen[i:i + 1])
        self._sample_and_retire(logits, 0)
        t1 = time.perf_counter()
        self.step_log.append((t1, t1 - t0, tokens.shape[0]))

    def _sample_and_retire(self, logits: torch.Tensor, first: int) -> None:
        """Sample the next token of rows first.. from their logits, then retire finished rows."""
        rows = self._rows[first:]
        device = logits.device
        sp = [r.owner.req.sampling for r in rows]
        temperature = torch.tensor([s.temperature for s in sp], dtype=torch.float32, device=device)
        top_p = torch.tensor([s.top_p for s in sp], dtype=torch.float32, device=device)
        top_k = torch.tensor([s.top_k for s in sp], dtype=torch.long, device=device)
        seeds = torch.tensor([r.owner.seed for r in rows], dtype=torch.long, device=device)
        streams = torch.tensor([r.index for r in rows], dtype=torch.long, device=device)
        counters = torch.tensor([len(r.output) for r in rows], dtype=torch.long, device=device)
        tokens, logps = sample_tokens(logits, temperature, top_p, top_k, counter_uniform(seeds, streams, counters))
        limit = self.model.config.max_position_embeddings
        version = self._version
        keep, finished = self._rows[:first], []
        for row, token, logp, s in zip(rows, tokens.tolist(), logps.tolist(), sp):
            row.output.append(token)
            row.logprobs.append(logp)
            row.versions.append(version)
            if token in s.stop_token_ids:
                finished.append((row, "stop"))
            elif len(row.output) >= s.max_new_tokens or len(row.prompt) + len(row.output) >= limit:
                finished.append((row, "length"))
            else:
                keep.append(row)
        self.tokens_generated += len(rows)
        for row, reason in finished:
            self._finish_sample(row.owner, row, reason)
        if finished:
            self._compact(keep)

    def _compact(self, keep: list[_Row]) -> None:
        """Move surviving rows to the front of the cache (copying only rows that must move)."""
        slot = {id(r): i for i, r in enumerate(self._rows)}
        for target, row in enumerate(keep):
            source = slot[id(row)]
            if source != target:
                self._cache.copy_row(source, target, row.cache_len)
        self._rows = keep


def _settle(future: asyncio.Future, value: Any) -> None:
    if future.done():
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


__all__ = ["TorchGenerationEngine", "SwapRecord", "sample_tokens", "counter_uniform", "token_logprobs"]
