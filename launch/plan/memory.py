"""Memory per GPU of every trainer and rollout group of a topology, term by term.

Trainer (Megatron-core, bf16, `actors/engines/megatron.py`): bf16 weights, float32 gradient buffers
(`grad_reduce_in_fp32`), Adam states and float32 main weights sharded over data-parallel ranks by the
distributed optimizer (Megatron-LM docs, "Distributed Optimizer": 6 + 12/d bytes per parameter); activations
of one micro-batch of `algo.max_tokens_per_mb` tokens, counted tensor by tensor for a Qwen2 layer with flash
attention (no s^2 term: `recompute: selective`, which recomputes core attention, then saves next to
nothing), split over tensor-parallel ranks and, with sequence parallelism, the hidden-sized ones too;
`recompute: full` keeps each layer's input plus one layer's activations while it is recomputed; pipeline
stages hold up to pp micro-batches in flight (1F1B); the logits and the float32 log-softmax intermediates,
over `logprob_chunk_tokens` rows at a time. Publishing a version: the export sender holds a few buckets on the
GPU at a time (`transport.bulk.pack_to_host` streams each into page-locked host memory as it is exported), the
"publish transient"; the host memory is a note, not a GPU term: where the trainer broadcasts weights itself, the
stage sender keeps versions there (`actors.weight_sync.KeptVersions`: the newest while the next comes in, or
`weights_kept_mb`), else one version waits there until the parameter server has it. With `algo.kl_coef` > 0 the
frozen reference model is a second engine of the same layout: its weights, plus the float32 gradient buffer
and main-weight shard Megatron allocates for any engine it builds (never used: the reference only computes
log-probs).

Mixture of experts (Qwen3-MoE): expert parallelism splits each sparse layer's experts over ep ranks (expert
tensor parallelism tp, Megatron's default), so a rank holds 1 / (tp x ep) of the experts and 1 / tp of the
rest; the distributed optimizer shards the experts' states over the expert data-parallel group (dp / ep
ranks), the rest over dp. A sparse layer saves its router's float32 logits, each token's k dispatched copies
of its hidden state and the experts' outputs before they are combined (split only by sequence parallelism),
and each copy's expert activations (gate and up outputs, SiLU, the down projection's input; split by tensor
parallelism).

With `model.lora` the base is frozen: gradients and Adam's moments are the float32 adapters' only (plus the
adapters themselves), and a published version is the adapters alone.

Rollout (SGLang): weights over tp GPUs; the KV pool is what `mem_fraction_static` of the GPU leaves after
the weights (SGLang sizes it so), hence the most answers of the configured length that fit at once.
"""
from __future__ import annotations

import dataclasses

from launch.plan import hardware
from launch.plan.shapes import ModelShape
from topology.schema import expert_data_parallel, expert_tensor_parallel
from topology.settings import RolloutSettings, TrainerSettings

#: SGLang picks mem_fraction_static by a heuristic when it is not set; the planner then assumes this.
DEFAULT_MEM_FRACTION_STATIC = 0.8
#: Float32 tensors the size of the (chunk's) logits alive at once in the vocabulary-parallel log-softmax:
#: the cast logits, their exponentials and the probabilities (docs/engines-megatron.md, "Memory at 32k").
LOGSOFTMAX_FP32_COPIES = 3
#: The prompt budget an answer of the configured length includes (the GPU configs' max_new_tokens is
#: "32k context minus a 1k prompt").
PROMPT_BUDGET_TOKENS = 1024
#: Versions of the weights the trainer's stage sender keeps when it broadcasts to the rollouts itself (unset
#: `weights_kept_mb`: the newest while the next is exported).
KEPT_VERSIONS = 2
#: Exported buckets on the export sender's GPU at once while a version is published: the copies to host memory
#: in flight (`pack_to_host`'s in_flight, 2), the bucket being laid out in Hugging Face layout and its converted
#: copy (2), and the next bucket's tensor-parallel all-gather started ahead (its own shard and the gathered
#: parts, up to 2); holding every bucket and a packed copy of each would take twice the stage's weights.
PUBLISH_BUCKETS_ON_GPU = 6


@dataclasses.dataclass(frozen=True)
class TrainerLayout:
    """What decides a trainer rank's memory."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1                       # expert parallelism (a mixture-of-experts model's experts over ep ranks)
    etp: int | None = None            # the experts' tensor parallelism (None: topology.schema.expert_tensor_parallel)
    bf16: bool = True
    distributed_optimizer: bool = True
    sequence_parallel: bool = False
    recompute: str = "none"           # none | selective | full
    micro_batch_tokens: int = 4096
    logprob_chunk_tokens: int = 0     # 0: the whole micro-batch at once
    keeps_weights: bool = False       # the stage sender keeps versions of its stage's weights (direct weights)
    bucket_bytes: int = 64 << 20      # one bucket of published weights (weight_bucket_mb)
    kept_bytes: int | None = None     # weights_kept_mb in bytes; None: KEPT_VERSIONS versions
    reference: bool = False           # algo.kl_coef > 0: a frozen reference model of the same layout
    lora_rank: int = 0                # model.lora: adapters of this rank train on the frozen model; 0 is full weights
    lora_targets: tuple[str, ...] = ()

    @property
    def expert_tp(self) -> int:
        return expert_tensor_parallel(self.tp, self.ep, self.etp)

    @property
    def expert_dp(self) -> int:
        return expert_data_parallel(self.dp, self.tp, self.ep, self.etp)

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


def activation_elements_per_token(shape: ModelShape) -> tuple[float, float]:
    """Saved activation elements of one layer per token, on average over the layers: (ones that only sequence
    parallelism splits, ones tensor parallelism splits). Hidden-sized: both norms' inputs and both blocks'
    linear inputs. Split: q, k, v after RoPE and their RoPE inputs, the attention output (the projection's
    input), the MLP's gate and up outputs, SiLU(gate) and the down projection's input. A sparse layer has,
    instead of the MLP's, its router's float32 logits (2 elements an expert) and the k dispatched copies of
    the token and the k expert outputs (hidden-sized), and each copy's gate, up, SiLU and down input."""
    h, q, kv, f = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    attention = (q + 2 * kv) + (q + kv) + q
    dense_mlp = 2 * f + f + f
    sparse = shape.sparse_layers / shape.layers
    k, fe = shape.experts_per_token, shape.moe_intermediate
    shared = 4 * h + sparse * (2 * shape.experts + 2 * k * h)
    return shared, attention + (1 - sparse) * dense_mlp + sparse * k * 4 * fe


def stage_params(shape: ModelShape, pp: int) -> tuple[float, float]:
    """(everything but the experts, the experts) of the most loaded pipeline stage: its layers, with the
    embedding table and the output table (both on a single stage, or tied)."""
    layers_per_stage = -(-shape.layers // pp)
    experts = shape.expert_params * layers_per_stage / shape.layers
    stage = layers_per_stage * shape.layer_params + shape.embedding_params * (1 if pp > 1 or shape.tied else 2)
    return stage - experts, experts


def trainer_terms(shape: ModelShape, lay: TrainerLayout) -> dict[str, float]:
    """Bytes on the most loaded rank (a pipeline stage with an embedding table, the stage sender)."""
    t, p = lay.tp, lay.pp
    layers_per_stage = -(-shape.layers // p)
    stage_dense, stage_experts = stage_params(shape, p)
    rank_dense, rank_experts = stage_dense / t, stage_experts / (lay.expert_tp * lay.ep)
    rank_params = rank_dense + rank_experts
    wbytes = 2 if lay.bf16 else 4
    # Megatron's optimizer: float32 main weights (bf16 only) plus Adam's two moments, sharded over dp (the
    # experts' over the expert data-parallel group, dp x tp / (etp x ep)).
    opt_bytes = (4 if lay.bf16 else 0) + 8
    optimizer = opt_bytes * (rank_dense / (lay.dp if lay.distributed_optimizer else 1)
                             + rank_experts / (lay.expert_dp if lay.distributed_optimizer else 1))
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
    published = published_params(shape, lay)   # a version's parameters on this stage's sender
    if lay.lora_rank:
        # the base frozen: no gradients or optimizer for it; float32 adapters with their gradients and Adam's moments
        adapters = lora_params(shape, lay.lora_rank, lay.lora_targets, t) * layers_per_stage / shape.layers
        terms.update(gradients=adapters * 4, optimizer=adapters * 8, adapters=adapters * 4)
    if lay.reference:
        # weights, Megatron's float32 gradient buffer, and (bf16) the distributed optimizer's float32 main-weight shard
        terms["reference model"] = rank_params * (wbytes + 4) + (4 * optimizer / opt_bytes if lay.bf16 else 0)
    terms["publish transient"] = min(PUBLISH_BUCKETS_ON_GPU * lay.bucket_bytes, 2 * published * 2)
    terms["CUDA/NCCL reserve"] = hardware.PROCESS_RESERVE_BYTES
    return terms


def published_params(shape: ModelShape, lay: TrainerLayout) -> float:
    """Parameters of one published version on the most loaded stage's sender: the stage's weights, or with
    `model.lora` the stage's adapters alone (its share of the layers' adapters; lm_head's adapter counted in)."""
    layers_per_stage = -(-shape.layers // lay.pp)
    if lay.lora_rank:
        return lora_params(shape, lay.lora_rank, lay.lora_targets) * layers_per_stage / shape.layers
    return sum(stage_params(shape, lay.pp))


def lora_params(shape: ModelShape, rank: int, targets: tuple[str, ...], tp: int = 1) -> float:
    """Parameters of rank-``rank`` adapters on the ``targets`` of every layer (rank * (in + out) each), on one of
    ``tp`` tensor-parallel ranks: a column-parallel projection's B is split and its A replicated, a row-parallel
    one's (o_proj, down_proj) A split and its B replicated (actors/engines/megatron_lora.py)."""
    h, q, kv, f = shape.hidden, shape.heads * shape.head_dim, shape.kv_dim, shape.intermediate
    dims = {"q_proj": (h, q / tp), "k_proj": (h, kv / tp), "v_proj": (h, kv / tp), "o_proj": (q / tp, h),
            "gate_proj": (h, f / tp), "up_proj": (h, f / tp), "down_proj": (f / tp, h)}
    per_layer = sum(rank * sum(dims[t]) for t in targets if t in dims)
    return shape.layers * per_layer + (rank * (h + shape.vocab) if "lm_head" in targets else 0)


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
    """Page-locked host memory of the export sender's published buckets (bf16 weights, or adapters, of its
    stage): the kept versions (direct weights: KEPT_VERSIONS, or at most `weights_kept_mb` and never less than
    one), else the version on its way to the parameter server."""
    version = published_params(shape, lay) * 2
    if not lay.keeps_weights:
        return version
    return KEPT_VERSIONS * version if lay.kept_bytes is None else max(float(lay.kept_bytes), version)


def trainer_memory(group: str, shape: ModelShape, lay: TrainerLayout, capacity: float) -> GroupMemory:
    notes = []
    what = "kept versions" if lay.keeps_weights else "a version on its way to the parameter server"
    notes.append(f"published buckets: {kept_bytes(shape, lay) / hardware.GB:.1f} GB of page-locked host memory "
                 f"({what}), not GPU; on the GPU {PUBLISH_BUCKETS_ON_GPU} buckets of "
                 f"{lay.bucket_bytes / 2**20:.0f} MiB at most while a version is exported")
    if lay.recompute == "selective":
        notes.append("recompute: selective saves little here: with flash attention core attention keeps no "
                     "s^2 scores")
    return GroupMemory(group, "trainer", trainer_terms(shape, lay), capacity, notes)


def trainer_layout(cfg: TrainerSettings, keeps_weights: bool) -> TrainerLayout:
    """The layout a trainer group's first instance settings give (the rules of `actors.trainer.actor`)."""
    parallel = cfg.instance.parallel
    megatron = cfg.backend == "megatron"
    return TrainerLayout(tp=parallel.get("tp", 1), pp=parallel.get("pp", 1), dp=parallel.get("dp", 1),
                         ep=parallel.get("ep", 1), etp=parallel.get("etp"),
                         # Megatron runs on GPUs, where bf16 is on unless the settings turn it off
                         bf16=megatron and cfg.bf16 is not False, distributed_optimizer=megatron,
                         sequence_parallel=megatron and cfg.sequence_parallel,
                         recompute=cfg.recompute if megatron else "none",
                         micro_batch_tokens=cfg.algo.max_tokens_per_mb,
                         logprob_chunk_tokens=cfg.logprob_chunk_tokens,
                         keeps_weights=keeps_weights, bucket_bytes=cfg.weight_bucket_mb << 20,
                         kept_bytes=None if cfg.weights_kept_mb is None else cfg.weights_kept_mb << 20,
                         reference=cfg.algo.kl_coef > 0,
                         lora_rank=cfg.model.lora.rank if cfg.model.lora else 0,
                         lora_targets=tuple(cfg.model.lora.target_modules) if cfg.model.lora else ())


def rollout_layout(cfg: RolloutSettings) -> RolloutLayout:
    fraction = cfg.sglang.mem_fraction_static
    return RolloutLayout(tp=cfg.instance.parallel.get("tp", 1),
                         mem_fraction_static=fraction if fraction is not None else DEFAULT_MEM_FRACTION_STATIC,
                         answer_tokens=PROMPT_BUDGET_TOKENS + cfg.gen.max_new_tokens)
