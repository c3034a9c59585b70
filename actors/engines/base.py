"""The two engine interfaces the RL actors drive, and the plain data that crosses them.

The rollout actor drives a `GenerationEngine`, the trainer a `TrainEngine`. The embedded torch
engines (`torch_gen.py`, `torch_train.py`) implement them on CPU or one GPU; an SGLang server behind
HTTP and a Megatron-core trainer (tensor/pipeline/data parallel) implement the same ones later. That
is why everything here is narrow plain data: token ids in; token ids, per-token log-probs and
per-token weight versions out; weights move as Hugging Face-named tensors in buckets.

Conventions both sides rely on (see docs/engines.md):

* Behaviour log-prob of a generated token = `log_softmax(logits / T)[token]` over the FULL vocabulary,
  where `logits` are the model's float32 logits and `T` the request's temperature (`T == 0`, greedy,
  counts as `T = 1`). It is taken before top-k/top-p truncation, so a trainer recomputes exactly the
  same number with `TrainEngine.compute_logprobs(batch, temperature=T)`.
* Packed micro-batch log-probs are aligned with the input tokens: `logprobs[t] = log p(x_t | x_<t)`
  inside x_t's own sequence, and 0 at the first token of every sequence (nothing predicts it).
* A loss function returns the SUM of its per-token losses over one micro-batch; `train_step`
  divides by the global token count, so gradient accumulation over micro-batches (and, later, over
  data-parallel ranks) gives the same gradient as one big batch.
"""
from __future__ import annotations

import abc
import dataclasses
import os
import socket
from collections.abc import AsyncIterable, Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, Union

import torch

FinishReason = Literal["stop", "length", "abort"]
# One bucket of a weight transfer: Hugging Face parameter names and their tensors.
WeightBucket = list[tuple[str, torch.Tensor]]
WeightSource = Union[Iterable[WeightBucket], AsyncIterable[WeightBucket]]


class EngineError(RuntimeError):
    """An engine could not do what was asked (bad request, bad weights, engine stopped)."""


class RequestError(EngineError, ValueError):
    """A request or batch is malformed; the message names the field at fault."""


def require_device(device: str) -> None:
    """Raises unless `device` is usable in this process (called where the engine is built, not at dry run)."""
    if device == "cuda" and not torch.cuda.is_available():
        where = (os.environ.get("SLURMD_NODENAME") or socket.gethostname())
        raise EngineError(f"device: 'cuda' but this process sees no CUDA device on {where} "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                          f"set the group's settings.device: cpu to run on the CPU")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample; the same fields SGLang's `sampling_params` takes.

    temperature 0 means greedy. top_k <= 0 and top_p >= 1 disable those filters. `seed` makes a
    request's samples reproducible whatever else is in the batch (None: engine-chosen seed).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise RequestError(f"sampling.temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"sampling.top_p must be in (0, 1], got {self.top_p!r}")
        if int(self.top_k) != self.top_k:
            raise RequestError(f"sampling.top_k must be an integer, got {self.top_k!r}")
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise RequestError(f"sampling.max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One prompt, `n` independent answers that share the prompt's prefill."""

    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    n: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.rid, str) or not self.rid:
            raise RequestError(f"request.rid must be a non-empty string, got {self.rid!r}")
        ids = tuple(int(t) for t in self.input_ids)
        if not ids:
            raise RequestError(f"request {self.rid!r}: input_ids is empty")
        object.__setattr__(self, "input_ids", ids)
        if int(self.n) != self.n or self.n < 1:
            raise RequestError(f"request {self.rid!r}: n must be an integer >= 1, got {self.n!r}")


@dataclasses.dataclass
class GenerationResult:
    """One answer (sample `index` of request `rid`). All per-token lists have len(output_ids).

    `versions[i]` is the weight version that sampled `output_ids[i]`; it can change inside one
    answer when weights are swapped mid-generation.
    """

    rid: str
    index: int
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    prompt_len: int = 0
    # Mixture-of-experts models, when the engine records routing: the experts each sparse layer routed each token
    # fed to the model to (the prompt and every answer token but the last), [prompt_len + len(output_ids) - 1,
    # sparse layers, top-k], uint8 or int16 (moe.compact_routes). None when not recorded.
    routed_experts: torch.Tensor | None = None


class GenerationEngine(abc.ABC):
    """The rollout side: asynchronous, many concurrent `generate` calls from one event loop.

    Implementations must never block the caller's event loop (decode in a thread, or a remote server).
    """

    @abc.abstractmethod
    async def start(self) -> None:
        """Load weights / connect; afterwards `generate` is accepted."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Abort everything in flight (partial results are returned to their callers) and shut down."""

    @abc.abstractmethod
    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        """Generate `request.n` answers; returns one result per sample, ordered by index.

        On abort the results hold the tokens generated so far, with finish_reason "abort".
        """

    @abc.abstractmethod
    async def abort(self, rid: str | None = None) -> int:
        """Abort one request (or all when rid is None); returns how many requests were aborted."""

    @abc.abstractmethod
    async def update_weights(self, version: int, source: WeightSource) -> None:
        """Receive weights for `version` bucket by bucket while decoding continues, then swap at a
        decode-step boundary (in-flight sequences keep their tokens, their KV cache is rebuilt).

        Returns once tokens are being sampled with the new weights. A source may hold a subset of the
        parameters; the rest keep their values.
        """

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop decoding at the next step boundary; in-flight requests wait (nothing is lost)."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continue after `pause`."""

    @abc.abstractmethod
    async def health(self) -> dict[str, Any]:
        """Liveness and load: at least {"ok": bool, "version": int, "running": int, "waiting": int}."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Weight version new tokens are sampled with."""


@dataclasses.dataclass
class PackedBatch:
    """One padding-free micro-batch: several sequences concatenated into one 1-D stream.

    `cu_seqlens` has S+1 entries, [0, len0, len0+len1, ...]; `position_ids` restart at 0 for every
    sequence. `fields` holds any per-token tensors aligned with input_ids (loss_mask, advantages,
    old_logprobs, ...) that the loss function reads; the trainer moves them to its device untouched.
    """

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    position_ids: torch.Tensor
    fields: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 1:
            raise RequestError(f"PackedBatch.input_ids must be 1-D, got shape {tuple(self.input_ids.shape)}")
        n = self.input_ids.numel()
        cu = self.cu_seqlens
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != n:
            raise RequestError(
                f"PackedBatch.cu_seqlens must be 1-D, start at 0 and end at len(input_ids)={n}, got {cu.tolist()}")
        if bool((cu[1:] <= cu[:-1]).any()):
            raise RequestError(f"PackedBatch.cu_seqlens must be strictly increasing, got {cu.tolist()}")
        if tuple(self.position_ids.shape) != (n,):
            raise RequestError(f"PackedBatch.position_ids must have shape ({n},), got {tuple(self.position_ids.shape)}")
        for key, value in self.fields.items():
            if value.shape[:1] != (n,):
                raise RequestError(f"PackedBatch.fields[{key!r}] must have {n} rows (one per token), got {tuple(value.shape)}")

    @classmethod
    def from_sequences(cls, sequences: list[list[int]], fields: Mapping[str, list[list[float]]] | None = None,
                       ) -> PackedBatch:
        """Pack token lists (and per-token field lists of the same lengths) into one micro-batch."""
        if not sequences:
            raise RequestError("PackedBatch.from_sequences: no sequences")
        lengths = [len(s) for s in sequences]
        for i, length in enumerate(lengths):
            if length == 0:
                raise RequestError(f"PackedBatch.from_sequences: sequence {i} is empty")
        cu = torch.zeros(len(sequences) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
        input_ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64)
        position_ids = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])
        packed_fields: dict[str, torch.Tensor] = {}
        for key, rows in (fields or {}).items():
            if len(rows) != len(sequences) or any(len(r) != n for r, n in zip(rows, lengths)):
                raise RequestError(f"PackedBatch.from_sequences: field {key!r} does not match the sequence lengths")
            packed_fields[key] = torch.tensor([v for r in rows for v in r], dtype=torch.float32)
        return cls(input_ids, cu, position_ids, packed_fields)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    def seq_lens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def loss_tokens(self) -> float:
        """How many tokens the loss counts: the loss mask's sum, or, without a mask, every token but each
        sequence's first (the ones a next-token loss predicts)."""
        if "loss_mask" in self.fields:
            return float(self.fields["loss_mask"].sum())
        return float(self.num_tokens - self.num_seqs)

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(self.input_ids.to(device), self.cu_seqlens.to(device), self.position_ids.to(device),
                           {k: v.to(device) for k, v in self.fields.items()})


@dataclasses.dataclass
class TokenLogProbs:
    """Per-token outputs of a forward pass on a packed batch, aligned with its input_ids."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None  # [tokens, sparse layers, top-k] int64, when asked to record


# loss_fn(outputs, batch) -> (sum of per-token losses in this micro-batch, stats). `outputs.logprobs`
# carries gradient. Stats are floats; train_step reports their token-weighted means.
LossFn = Callable[[TokenLogProbs, PackedBatch], tuple[torch.Tensor, Mapping[str, float]]]


def step_loss_weights(batches: list[PackedBatch], loss_denominator: float | None,
                      total: Callable[[float], float] = float) -> tuple[list[float], float]:
    """Each micro-batch's loss tokens and the step's loss denominator: ``loss_denominator`` when given, else
    ``total`` of this rank's loss tokens (a data-parallel trainer sums them over its ranks, so that every
    rank divides by the same count). A step without micro-batches, or a denominator that is not positive,
    is refused, since the loss would be undefined."""
    if not batches:
        raise RequestError("train_step: no micro-batches")
    weights = [mb.loss_tokens() for mb in batches]
    denominator = float(loss_denominator) if loss_denominator is not None else total(sum(weights))
    if not denominator > 0:
        raise RequestError(f"train_step: loss denominator must be positive, got {denominator}")
    return weights, denominator


class TrainEngine(abc.ABC):
    """The trainer side: forward/backward on packed micro-batches, optimizer, weight export, checkpoints.

    A distributed implementation runs one instance per rank; the batch each rank receives is its own
    data-parallel share and `loss_denominator` is the global token count across ranks.
    """

    @abc.abstractmethod
    def compute_logprobs(self, batch: PackedBatch, temperature: float = 1.0,
                         with_entropy: bool = False) -> TokenLogProbs:
        """Log-probs of the batch's own tokens under the current weights (no gradient)."""

    @abc.abstractmethod
    def train_step(self, micro_batches: list[PackedBatch], loss_fn: LossFn, temperature: float = 1.0,
                   loss_denominator: float | None = None, with_entropy: bool = False) -> dict[str, float]:
        """One optimizer step over all micro-batches (gradient accumulation).

        The summed loss is divided by `loss_denominator`, by default the total of the "loss_mask"
        field over all micro-batches (without a mask: their tokens minus one per sequence). Returns stats:
        loss, grad_norm, lr, tokens, seqs, step, version, and the loss function's stats.
        """

    @abc.abstractmethod
    def export_weights(self, bucket_bytes: int = 64 << 20) -> Iterator[WeightBucket]:
        """Current weights as Hugging Face-named tensors, grouped into buckets of about bucket_bytes."""

    @abc.abstractmethod
    def save(self, path: str) -> None:
        """Checkpoint: the model in Hugging Face layout plus optimizer, scheduler, RNG and step."""

    @abc.abstractmethod
    def load(self, path: str) -> None:
        """Restore exactly what `save` wrote (training continues bit-for-bit on the same device)."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Weight version: the initial version plus the optimizer steps taken."""

    # A single-process engine is its own data-parallel world; distributed ones override these three.
    @property
    def data_parallel(self) -> tuple[int, int]:
        """(rank, size) among data-parallel replicas: each trains on its own share of a batch."""
        return 0, 1

    @property
    def reports_stats(self) -> bool:
        """Whether this rank's loss-function statistics count: one rank per data-parallel replica (the
        others of its tensor/pipeline group see the same data or no loss at all)."""
        return True

    def data_parallel_sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over the data-parallel replicas (a collective: every rank calls it)."""
        return [float(v) for v in values]
