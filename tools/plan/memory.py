"""Memory per GPU of every trainer and rollout group of a topology, term by term.

Trainer (Megatron-core, bf16, `actors/engines/megatron.py`): bf16 weights, float32 gradient buffers
(`grad_reduce_in_fp32`), Adam states and float32 main weights sharded over data-parallel ranks by the
distributed optimizer (Megatron-LM docs, "Distributed Optimizer": 6 + 12/d bytes per parameter); activations
of one micro-batch of `algo.max_tokens_per_mb` tokens, counted tensor by tensor for a Qwen2 layer with flash
attention (no s^2 term: `recompute: selective`, which recomputes core attention, then saves next to
nothing), split over tensor-parallel ranks and, with sequence parallelism, the hidden-sized ones too;
`recompute: full` keeps each layer's input plus one layer's activations while it is recomputed; pipeline
stages hold up to pp micro-batches in flight (1F1B); the logits and the float32 log-softmax intermediates,
over `logprob_chunk_tokens` rows at a time. Where the trainer broadcasts weights itself, the stage sender
keeps the buckets of the current and previous version in host memory (`actors.weight_sync.KeptVersions`): a note, not a
GPU term.

Rollout (SGLang): weights over tp GPUs; the KV pool is what `mem_fraction_static` of the GPU leaves after
the weights (SGLang sizes it so), hence the most answers of the configured length that fit at once.
"""
from __future__ import annotations

import dataclasses

from tools.plan import hardware
from tools.plan.shapes import ModelShape
from topology.settings import RolloutSettings, TrainerSettings

#: SGLang picks mem_fraction_static by a heuristic when it is not set; the planner then assumes this.
DEFAULT_MEM_FRACTION_STATIC = 0.8
#: Float32 tensors the size of the (chunk's) logits alive at once in the vocabulary-parallel log-softmax:
#: the cast logits, their exponentials and the probabilities (docs/engines-megatron.md, "Memory at 32k").
LOGSOFTMAX_FP32_COPIES = 3
#: The prompt budget an answer of the configured length includes (the GPU configs' max_new_tokens is
#: "32k context minus a 1k prompt").
PROMPT_BUDGET_TOKENS = 1024
#: Versions of the weights the trainer's stage sender keeps when it broadcasts to the rollouts itself.
KEPT_VERSIONS = 2


@dataclasses.dataclass(frozen=True)
class TrainerLayout:
    """What decides a trainer rank's memory."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    bf16: bool = True
    distributed_optimizer: bool = True
    sequence_parallel: bool = False
    recompute: str = "none"           # none | selective | full
    micro_batch_tokens: int = 4096
    logprob_chunk_tokens: int = 0     # 0: the whole micro-batch at once
    keeps_weights: bool = False       # the stage sender keeps KEPT_VERSIONS of its stage's weights

    def __post_init__(self) -> None:
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute: {self.recompute!r} is not one of 'none', 'selective', 'full'")


@dataclasses.dataclass
class GroupMemory:
    """Bytes per GPU of one actor group, by term, against the GPU's capacity."""

    group: str
    kind: str                              # "trainer" | "rollout"
    terms: dict[str, float]
    capacity: float
    notes: list[str] = dataclasses.field(default_factory=list)
    answers_at_once: int | None = None     # rollout: answers of the configured length the KV pool holds
    kv_tokens: int | None = None

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity and (self.answers_at_once is None or self.answers_at_once >= 1)

    @property
    def largest(self) -> tuple[str, float]:
        return max(self.terms.items(), key=lambda kv: kv[1])

    def problem(self) -> str | None:
        """Why the group does not fit, naming its largest term; None when it fits."""
        if self.fits:
            return None
        name, size = self.largest
        if self.kind == "rollout" and self.total <= self.capacity:
            return (f"actors.{self.group}: the KV cache holds {self.kv_tokens or 0:,} tokens, fewer than one answer "
                    f"of the configured length; largest term: {name} {size / hardware.GB:.1f} GB per GPU")
        return (f"actors.{self.group}: needs {self.total / hardware.GB:.1f} GB per GPU, more than the "
                f"{self.capacity / hardware.GB:.0f} GB it has; largest term: {name} {size / hardware.GB:.1f} GB")


def activation_elements_per_token(shape: ModelShape) -> tuple[int, int]:
    """Saved activation elements of one layer per token: (hidden-sized ones that only sequence parallelism
    splits, ones tensor parallelism splits). Hidden-sized: both norms' inputs and both blocks' linear
    inputs. Split: q, k, v after RoPE and their RoPE inputs, the attention output (the projection's input),
    the MLP's gate and up outputs, SiLU(gate) and the down projection's input."""
    h, kv, f = shape.hidden, shape.kv_dim, shape.intermediate
    return 4 * h, (h + 2 * kv) + (h + kv) + h + 2 * f + f + f


def trainer_terms(shape: ModelShape, lay: TrainerLayout) -> dict[str, float]:
    """Bytes on the most loaded rank (a pipeline stage with an embedding table, the stage sender)."""
    t, p = lay.tp, lay.pp
    layers_per_stage = -(-shape.layers // p)
    stage_params = layers_per_stage * shape.layer_params + shape.embedding_params * (1 if p > 1 or shape.tied else 2)
    rank_params = stage_params / t
    wbytes = 2 if lay.bf16 else 4
    # Megatron's optimizer: float32 main weights (bf16 only) plus Adam's two moments, sharded over dp.
    opt_bytes = (4 if lay.bf16 else 0) + 8
    optimizer = rank_params * opt_bytes / (lay.dp if lay.distributed_optimizer else 1)
    s = lay.micro_batch_tokens
    shared, split = activation_elements_per_token(shape)
    sp = lay.sequence_parallel and t > 1
    per_layer = 2 * s * (shared / (t if sp else 1) + split / t)
    layer_input = 2 * s * shape.hidden / (t if sp else 1)
    in_flight = p   # 1F1B: the first stage holds pp micro-batches' activations before its first backward
    if lay.recompute == "full":
        activations = in_flight * layers_per_stage * layer_input + per_layer
    else:
        activations = in_flight * layers_per_stage * per_layer
    vocab_rank = shape.vocab / t
    chunk = min(lay.logprob_chunk_tokens or s, s)
    # bf16 logits of the micro-batch and their gradient, plus the float32 log-softmax over one chunk.
    logits = 2 * (2 * s * vocab_rank) + LOGSOFTMAX_FP32_COPIES * 4 * chunk * vocab_rank
    terms = {"weights": rank_params * wbytes, "gradients": rank_params * 4, "optimizer": optimizer,
             "activations": activations, "logits": logits}
    terms["CUDA/NCCL reserve"] = hardware.PROCESS_RESERVE_BYTES
    return terms


@dataclasses.dataclass(frozen=True)
class RolloutLayout:
    tp: int = 1
    mem_fraction_static: float = DEFAULT_MEM_FRACTION_STATIC
    answer_tokens: int = 1024          # prompt + max_new_tokens
    weight_bytes: int = 2


def rollout_memory(group: str, shape: ModelShape, lay: RolloutLayout, capacity: float) -> GroupMemory:
    weights = shape.params * lay.weight_bytes / lay.tp
    static = lay.mem_fraction_static * capacity
    kv_pool = max(0.0, static - weights)
    kv_tokens = int(kv_pool * lay.tp // shape.kv_bytes_per_token(lay.weight_bytes))
    terms = {"weights": weights, "KV cache": kv_pool}
    notes = [f"mem_fraction_static {lay.mem_fraction_static:g}: KV pool {kv_tokens:,} tokens "
             f"({shape.kv_bytes_per_token(lay.weight_bytes) / 1024:.0f} KiB per token over tp={lay.tp}); the rest "
             f"({(capacity - max(static, weights)) / hardware.GB:.1f} GB) is SGLang's for activations and CUDA graphs"]
    return GroupMemory(group, "rollout", terms, capacity, notes, answers_at_once=kv_tokens // lay.answer_tokens,
                       kv_tokens=kv_tokens)


def kept_bytes(shape: ModelShape, lay: TrainerLayout) -> float:
    """Host memory the stage sender's kept buckets take (bf16, KEPT_VERSIONS versions of its stage)."""
    layers_per_stage = -(-shape.layers // lay.pp)
    stage_params = layers_per_stage * shape.layer_params + shape.embedding_params * (1 if lay.pp > 1 or shape.tied else 2)
    return KEPT_VERSIONS * stage_params * 2


def trainer_memory(group: str, shape: ModelShape, lay: TrainerLayout, capacity: float) -> GroupMemory:
    notes = []
    if lay.keeps_weights:
        notes.append(f"kept buckets: {kept_bytes(shape, lay) / hardware.GB:.1f} GB of host memory (pinned), not GPU")
    if lay.recompute == "selective":
        notes.append("recompute: selective saves little here: with flash attention core attention keeps no "
                     "s^2 scores")
    return GroupMemory(group, "trainer", trainer_terms(shape, lay), capacity, notes)


def trainer_layout(cfg: TrainerSettings, keeps_weights: bool) -> TrainerLayout:
    """The layout a trainer group's first instance settings give (the rules of `actors.trainer`)."""
    parallel = cfg.instance.parallel
    megatron = cfg.backend == "megatron"
    return TrainerLayout(tp=parallel.get("tp", 1), pp=parallel.get("pp", 1), dp=parallel.get("dp", 1),
                         # Megatron runs on GPUs, where bf16 is on unless the settings turn it off
                         bf16=megatron and cfg.bf16 is not False, distributed_optimizer=megatron,
                         sequence_parallel=megatron and cfg.sequence_parallel,
                         recompute=cfg.recompute if megatron else "none",
                         micro_batch_tokens=cfg.algo.max_tokens_per_mb,
                         logprob_chunk_tokens=cfg.logprob_chunk_tokens,
                         keeps_weights=keeps_weights)


def rollout_layout(cfg: RolloutSettings) -> RolloutLayout:
    fraction = cfg.sglang.mem_fraction_static
    return RolloutLayout(tp=cfg.instance.parallel.get("tp", 1),
                         mem_fraction_static=fraction if fraction is not None else DEFAULT_MEM_FRACTION_STATIC,
                         answer_tokens=PROMPT_BUDGET_TOKENS + cfg.gen.max_new_tokens)
