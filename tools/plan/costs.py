"""The cost model: seconds of GPU work from FLOPs and bytes moved, at the utilisations of `hardware`.

Decode: one step of a continuous batch of n answers holding K tokens of KV cache reads the server's share of
the weights and of the KV cache, and does 2 FLOPs per active parameter per answer plus 4 * layers * q_dim per
KV token read; it takes the longer of the two (a roofline). Of a mixture-of-experts model's experts a step
reads only those its n answers route to (`ModelShape.experts_read`). Prefill and training are compute-bound:
2 FLOPs per active parameter a token, and causal attention adds 2 * layers * q_dim * L^2 FLOPs per forward
pass of a sequence of L tokens; a training pass is three forward passes' worth, full recompute adds one
more, and the trainer first recomputes the proximal log-probs (one forward pass) as `actors.trainer.actor`
does. With expert parallelism every forward and backward pass of a sparse layer sends each token's hidden
state to its experts' ranks and back (Megatron's alltoall dispatcher), `ep_alltoall_seconds`.

On CPUs (`MeasuredCosts`) the same quantities come from a cost file measured on the machine: a decode step
is a + b_row * n + b_kv * K, a prefill a + b * tokens + c * sum of squared lengths, a training step
a + b * tokens, and a weight update and a group's grading take their measured seconds.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from algo.packing import allocate_micro_batches
from launch.plan import hardware
from launch.plan.shapes import ModelShape
from topology.schema import expert_data_parallel, expert_tensor_parallel


@dataclasses.dataclass(frozen=True)
class DecodeCost:
    """One decode step's seconds as max(a_mem + b_mem * K, a_flop + b_flop * K) for a batch of n answers
    holding K KV tokens in all: linear pieces, so that sums over many steps have a closed form."""

    a_mem: float
    b_mem: float
    a_flop: float
    b_flop: float

    def step(self, kv_tokens: float) -> float:
        return max(self.a_mem + self.b_mem * kv_tokens, self.a_flop + self.b_flop * kv_tokens)

    def steps(self, kv0: float, n: int, j: int) -> float:
        """Seconds of steps 0..j-1, where step i reads kv0 + i * n KV tokens."""
        if j <= 0:
            return 0.0
        # l_mem(i) - l_flop(i) is linear in i: one crossover at most.
        da = (self.a_mem - self.a_flop) + (self.b_mem - self.b_flop) * kv0
        db = (self.b_mem - self.b_flop) * n
        if db == 0:
            cross = j if da >= 0 else 0
            mem_first = True
        else:
            root = -da / db          # l_mem >= l_flop for i <= root when db < 0, for i >= root when db > 0
            mem_first = db < 0
            cross = int(min(j, max(0.0, np.floor(root) + 1))) if mem_first else int(min(j, max(0.0, np.ceil(root))))
        first, second = ((self.a_mem, self.b_mem), (self.a_flop, self.b_flop)) if mem_first else \
            ((self.a_flop, self.b_flop), (self.a_mem, self.b_mem))
        return _linear_sum(*first, kv0, n, 0, cross) + _linear_sum(*second, kv0, n, cross, j)


def _linear_sum(a: float, b: float, kv0: float, n: int, p: int, q: int) -> float:
    """sum over i in [p, q) of a + b * (kv0 + i * n)."""
    if q <= p:
        return 0.0
    k = q - p
    return k * (a + b * kv0) + b * n * k * (p + q - 1) / 2


def kv_bytes_per_gpu(shape: ModelShape, tp: int) -> float:
    """KV cache bytes per token on one of tp GPUs: the KV heads are split over them (replicated past one each)."""
    return shape.kv_bytes_per_token() / min(tp, shape.kv_heads)


def allreduce_seconds(gpu: hardware.GPU, tp: int, nbytes: float) -> float:
    """One all-reduce of `nbytes` over tp GPUs of a node: the decode microbenchmark's latency plus the ring's
    2 (tp - 1) / tp x bytes over one direction of NVLink (nccl-tests doc/PERFORMANCE.md, "bus bandwidth")."""
    if tp <= 1:
        return 0.0
    return hardware.TP_ALLREDUCE_LATENCY_S + 2 * (tp - 1) / tp * nbytes / (
        gpu.nvlink_bytes_per_s / 2 * hardware.NVLINK_EFFICIENCY)


#: Float32 passes over a decode step's n x vocabulary logits: the lm_head's write, then SGLang 0.5.6's sampler
#: (layers/sampler.py Sampler.forward) with temperature and log-probs: div_ (:117, read and write), softmax
#: in place (:122, read and write), sampling from the probabilities (:128/:142, read), log and clamp of the
#: log-probs (:184, read and write).
SAMPLER_PASSES = 8


def decode_cost(shape: ModelShape, gpu: hardware.GPU, tp: int, n: int) -> DecodeCost:
    """A decode step of n answers on a tp-GPU server: the fixed cost of its layers (`hardware`), two
    tensor-parallel all-reduces a layer, and the longer of the bytes it reads (weights, KV cache, the
    sampler's passes over the logits) and the FLOPs it does, per GPU."""
    bw = gpu.hbm_bytes_per_s * hardware.HBM_EFFICIENCY
    flops = gpu.bf16_flops * hardware.PREFILL_MFU
    fixed = hardware.DECODE_FIXED_PER_LAYER_S * shape.layers + \
        2 * shape.layers * allreduce_seconds(gpu, tp, n * shape.hidden * 2)
    weights = decode_weight_bytes(shape, n) / tp + n * shape.vocab * 4 * SAMPLER_PASSES / tp
    return DecodeCost(a_mem=fixed + weights / bw, b_mem=kv_bytes_per_gpu(shape, tp) / bw,
                      a_flop=fixed + 2 * shape.active_params * n / tp / flops,
                      b_flop=4 * shape.layers * shape.q_dim / tp / flops)


def decode_weight_bytes(shape: ModelShape, n: int) -> float:
    """bf16 weight bytes a decode step of n answers reads (the whole server's): everything but the experts,
    and of each sparse layer's experts the ones its answers route to (uniform routing, `experts_read`)."""
    expert_bytes = 2 * 3 * shape.hidden * shape.moe_intermediate * shape.sparse_layers * shape.experts_read(n)
    return 2 * shape.dense_params + expert_bytes


def forward_flops(shape: ModelShape, tokens: float, sum_sq: float) -> float:
    """One forward pass over sequences with `tokens` tokens in all and sum of squared lengths `sum_sq`."""
    return 2 * shape.active_params * tokens + 2 * shape.layers * shape.q_dim * sum_sq


def prefill_seconds(shape: ModelShape, gpu: hardware.GPU, tp: int, tokens: float, sum_sq: float) -> float:
    """One prefill forward pass (a batch of prompts, or contexts recomputed): its layers' fixed cost, its
    FLOPs at the training utilisation, and two all-reduces a layer of its tokens' activations."""
    if tokens <= 0:
        return 0.0
    return (hardware.DECODE_FIXED_PER_LAYER_S * shape.layers
            + forward_flops(shape, tokens, sum_sq) / (gpu.bf16_flops * hardware.PREFILL_MFU * tp)
            + 2 * shape.layers * allreduce_seconds(gpu, tp, tokens * shape.hidden * 2))


@dataclasses.dataclass(frozen=True)
class TrainerShape:
    tp: int
    pp: int
    dp: int
    micro_batch_tokens: int
    minibatches: int
    recompute: str
    gpus_per_node: int
    #: expert-parallel degree: each sparse layer's experts split over ep ranks, each expert over etp of them
    #: (None: topology.schema.expert_tensor_parallel: 1 with ep > 1, the experts whole and the expert-parallel
    #: group folded over the TP ranks); the experts' data parallelism is dp x tp / (etp x ep)
    ep: int = 1
    etp: int | None = None
    #: algo.kl_coef > 0: every data-parallel rank computes the frozen reference model's log-probs of the whole
    #: batch (actors/trainer/step.py `rank_samples` / `train_share`: the penalty enters the batch-wide advantages)
    reference: bool = False
    #: model.lora: the adapters' parameters over the whole model (`launch.plan.memory.lora_params`); 0 is full
    #: fine-tuning. The base is frozen: no weight gradients for it (`train_flops`), and the data-parallel
    #: reduction and each published version are the adapters alone
    lora_params: int = 0

    @property
    def expert_tp(self) -> int:
        return expert_tensor_parallel(self.tp, self.ep, self.etp)


def train_flops(shape: ModelShape, tokens: float, sum_sq: float, passes: int, lora_params: int = 0) -> float:
    """FLOPs of a training pass of `passes` forward passes' worth (forward and backward are 3, full recompute
    adds one, the proximal log-probs one) over `tokens` tokens. The backward pass of a matmul is two of its
    forward's FLOPs: the gradient of its input (the activation gradient, which every layer above the lowest
    trained one needs) and the gradient of its weight. With LoRA the base's weights are frozen, so the
    second is not computed: one forward pass's worth of the weights' matmuls (2 x active parameters a token)
    less, while attention's score and value products, which have no weights, cost what they did; the adapters
    themselves pay every pass in full (2 x their parameters a token each). The LoRA paper (Hu et al. 2021,
    arXiv:2106.09685, section 4.2) gives this reason for the 25 % speedup it measured on GPT-3 175B ("we do not
    need to calculate the gradient for the vast majority of the parameters"); CE-LoRA (arXiv:2502.01378) finds
    the activation gradients that remain are most of LoRA's backward pass."""
    flops = passes * forward_flops(shape, tokens, sum_sq)
    if lora_params:
        flops += -2 * shape.active_params * tokens + passes * 2 * lora_params * tokens
    return flops


def train_step_seconds(shape: ModelShape, gpu: hardware.GPU, lay: TrainerShape, lengths: list[int],
                       group_of: list[int]) -> float:
    """One training step as the trainer runs it: PPO minibatches of every minibatches-th group, each packed
    by `algo.packing.allocate_micro_batches` over the data-parallel ranks; the slowest rank sets the pace,
    pipeline bubbles add (pp - 1) micro-batch slots per minibatch, and every minibatch ends with the
    distributed optimizer's gradient reduce-scatter and parameter all-gather over the data-parallel group.
    A mixture-of-experts model pays its all-to-alls on top (`ep_alltoall_seconds`, not overlapped)."""
    lens = np.asarray(lengths, dtype=np.int64)
    groups = sorted(set(group_of))
    passes = 3 + (1 if lay.recompute == "full" else 0) + 1   # forward+backward, recompute, proximal log-probs
    alltoall_rounds = 2 + (1 if lay.recompute == "full" else 0) + 1   # the same passes, backward counted once
    rate = gpu.bf16_flops * hardware.TRAIN_MFU * lay.tp * lay.pp
    total = 0.0
    for m in range(lay.minibatches):
        chosen = set(groups[m::lay.minibatches])
        ids = [i for i, g in enumerate(group_of) if g in chosen]
        if not ids:
            continue
        sub = lens[ids]
        mbs = allocate_micro_batches(sub, lay.micro_batch_tokens, n_groups=lay.dp)
        per_rank = len(mbs) // lay.dp
        rank_seconds = []
        for r in range(lay.dp):
            rank = [i for mb in mbs[r * per_rank:(r + 1) * per_rank] for i in mb]
            tokens = float(sub[rank].sum())
            rank_seconds.append(train_flops(shape, tokens, float((sub[rank] ** 2).sum()), passes, lay.lora_params) / rate
                                + ep_alltoall_seconds(shape, gpu, lay, tokens, alltoall_rounds))
        bubble = (lay.pp - 1) / max(per_rank, 1)
        total += max(rank_seconds) * (1 + bubble) + dp_sync_seconds(shape, gpu, lay)
    if lay.reference:   # one forward pass of the reference model over every sequence, on each replica
        total += forward_flops(shape, float(lens.sum()), float((lens.astype(np.float64) ** 2).sum())) / rate \
            + ep_alltoall_seconds(shape, gpu, lay, float(lens.sum()), 1)
    return total


def ep_alltoall_seconds(shape: ModelShape, gpu: hardware.GPU, lay: TrainerShape, tokens: float, rounds: int) -> float:
    """The expert-parallel all-to-alls of `rounds` passes (forward, backward, recompute, log-probs) over a
    replica's `tokens` tokens: in each pass each sparse layer dispatches every token's bf16 hidden state to its
    experts_per_token experts and combines their outputs back (Megatron's alltoall dispatcher sends one copy per
    routed expert), 2 x k x hidden x 2 bytes a token, of which (ep - 1) / ep leave the GPU; the tokens are the
    replica's, spread over its tp x pp GPUs (each pipeline stage has its own layers). The expert-parallel
    group is etp x ep consecutive ranks (Megatron's rank order tp-cp-ep-dp-pp): NVLink while it fits in a
    node, else each GPU's share of the node's network."""
    if lay.ep <= 1 or not shape.sparse_layers:
        return 0.0
    per_gpu_tokens = tokens / lay.tp
    sent = rounds * (shape.sparse_layers / lay.pp) * 2 * shape.experts_per_token * shape.hidden * 2 \
        * per_gpu_tokens * (lay.ep - 1) / lay.ep
    within = lay.expert_tp * lay.ep <= lay.gpus_per_node
    bw = (gpu.nvlink_bytes_per_s / 2 * hardware.NVLINK_EFFICIENCY if within
          else hardware.ROCE_NODE_BYTES_PER_S / lay.gpus_per_node * hardware.NIC_EFFICIENCY)
    return sent / bw


def dp_sync_seconds(shape: ModelShape, gpu: hardware.GPU, lay: TrainerShape) -> float:
    """Reduce-scatter of float32 gradients and all-gather of bf16 weights (ring): everything but the experts over
    the data-parallel group, a rank's experts (1 / (etp x pp x ep) of them) over the expert data-parallel group
    of dp x tp / (etp x ep) ranks. With LoRA only the adapters have gradients and change."""
    if lay.dp == 1:
        return 0.0
    dense = (lay.lora_params or shape.dense_params) / (lay.tp * lay.pp)
    experts = 0 if lay.lora_params else shape.expert_params / (lay.expert_tp * lay.pp * lay.ep)
    edp = expert_data_parallel(lay.dp, lay.tp, lay.ep, lay.etp)
    across_nodes = lay.dp * lay.tp * lay.pp > lay.gpus_per_node
    bw = (hardware.ROCE_NODE_BYTES_PER_S / lay.gpus_per_node * hardware.NIC_EFFICIENCY if across_nodes
          else gpu.nvlink_bytes_per_s / 2 * hardware.NVLINK_EFFICIENCY)
    return (4 + 2) * (dense * (lay.dp - 1) / lay.dp + experts * (edp - 1) / edp) / bw


@dataclasses.dataclass(frozen=True)
class WeightSync:
    """One version's way to the servers with direct weights: the trainer's export (each pipeline stage's
    rank 0 gathers its tensor-parallel shards over NVLink and keeps the packed buckets in host memory,
    `actors.weight_sync.KeptVersions`) and the push (each bucket back up and broadcast to every server over
    NCCL, pipelined, so the time is the bytes over the slowest link, plus a fixed cost per bucket; stages in
    parallel). The servers stop generating for the push.

    With LoRA a version is the adapters alone (`launch.plan.memory.lora_params`: rank x (in + out) a targeted
    linear layer), bf16 as the weights are, gathered, copied and broadcast the same way, and each rollout
    then writes it as a PEFT-layout directory and SGLang loads it (`/load_lora_adapter`) inside the same pause:
    its bytes once more down to host memory and up to the GPU over PCIe (`load_s`, part of `push_s`). Not
    modelled: the HTTP round trips and SGLang's own bookkeeping of the load, nor the adapters' cost in decode
    steps."""

    export_s: float
    push_s: float
    load_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.export_s + self.push_s


def weight_sync(shape: ModelShape, gpu: hardware.GPU, tp: int, pp: int, gpus_per_node: int, across_nodes: bool,
                bucket_bytes: int = 64 << 20, ep: int = 1, lora_params: int = 0, etp: int | None = None) -> WeightSync:
    """The export gathers the stage's weights to its first rank: all but the experts from its tp ranks, the
    experts from its etp x ep ranks (over the network when those span more than a node). ``lora_params``: the
    version is these adapter parameters alone (counted as split over the tp ranks, the most gathering)."""
    expert_ranks = expert_tensor_parallel(tp, ep, etp) * ep
    if lora_params:
        stage_bytes = lora_params * 2 / pp
        gathered = stage_bytes * (1 - 1 / tp)
    else:
        stage_bytes = shape.params * 2 / pp
        gathered = (shape.dense_params * (1 - 1 / tp) + shape.expert_params * (1 - 1 / expert_ranks)) * 2 / pp
    gather_bw = (gpu.nvlink_bytes_per_s / 2 * hardware.NVLINK_EFFICIENCY if max(tp, expert_ranks) <= gpus_per_node
                 else hardware.ROCE_NODE_BYTES_PER_S / gpus_per_node * hardware.NIC_EFFICIENCY)
    gather = gathered / gather_bw
    pcie = gpu.pcie_bytes_per_s * hardware.PCIE_EFFICIENCY
    to_host = stage_bytes / pcie
    link = (hardware.ROCE_NODE_BYTES_PER_S / gpus_per_node * hardware.NIC_EFFICIENCY if across_nodes
            else gpu.nvlink_bytes_per_s / 2 * hardware.NVLINK_EFFICIENCY)
    send = stage_bytes / min(link, pcie) + -(-stage_bytes // bucket_bytes) * hardware.BUCKET_LATENCY_S
    load = 2 * stage_bytes * pp / pcie if lora_params else 0.0   # the whole adapter, to disk and into SGLang
    return WeightSync(export_s=gather + to_host, push_s=send + load, load_s=load)


@dataclasses.dataclass(frozen=True)
class MeasuredCosts:
    """Per-token costs measured on a machine by `python -m tools.plan.calibrate` (a JSON cost file), in
    place of the roofline when the engines run on CPUs: there a step's fixed Python and kernel-launch cost,
    not its bytes or FLOPs, sets the pace of a tiny model."""

    decode_a_s: float        # per decode step, whatever its size
    decode_row_s: float      # per answer in the step
    decode_kv_s: float       # per KV token the step reads
    prefill_a_s: float
    prefill_token_s: float
    prefill_sq_s: float      # per squared sequence length (attention)
    train_a_s: float         # per training step (proximal log-probs + forward/backward + optimizer)
    train_token_s: float
    weights_s: float         # one weight update, trainer to every rollout
    reward_s: float          # a group's grading
    source: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "") -> MeasuredCosts:
        d, p, t = data["decode"], data["prefill"], data["train"]
        return cls(decode_a_s=d["a_s"], decode_row_s=d["b_row_s"], decode_kv_s=d["b_kv_s"], prefill_a_s=p["a_s"],
                   prefill_token_s=p["b_token_s"], prefill_sq_s=p.get("b_sq_s", 0.0), train_a_s=t["a_s"],
                   train_token_s=t["b_token_s"], weights_s=data["weights"]["seconds"],
                   reward_s=data["reward"]["seconds"], source=source)

    @classmethod
    def from_file(cls, path: str | Path) -> MeasuredCosts:
        return cls.from_dict(json.loads(Path(path).read_text()), str(path))

    def decode(self, n: int, engines: int = 1) -> DecodeCost:
        """A step of n answers on a device that `engines` busy engines time-share: each engine pays its own
        fixed cost per step, the answers' costs add up. One linear piece (the other is zero, never larger)."""
        return DecodeCost(a_mem=engines * self.decode_a_s + self.decode_row_s * n, b_mem=self.decode_kv_s,
                          a_flop=0.0, b_flop=0.0)

    def prefill(self, tokens: float, sum_sq: float) -> float:
        return max(0.0, self.prefill_a_s + self.prefill_token_s * tokens + self.prefill_sq_s * sum_sq)

    def train_step(self, lengths: list[int]) -> float:
        return self.train_a_s + self.train_token_s * float(sum(lengths))
