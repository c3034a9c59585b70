"""The Megatron-core trainer backend: Qwen2, Qwen3 and Qwen3-MoE as a Megatron `GPTModel`, tensor/pipeline/
data/expert parallel.

One `MegatronTrainEngine` runs per rank (launched by torchrun or the trainer actor's rank processes);
every rank calls the same methods in the same order, because they run collectives. What it does:

* Builds a `GPTModel` from a Hugging Face `config.json` of a family of `MEGATRON_FAMILIES`
  (`transformer_config`): rotary embeddings (theta from the config), grouped-query attention (fused
  `linear_qkv`; q/k/v bias for Qwen2, per-head q/k RMSNorm for Qwen3), SwiGLU (`gated_linear_unit`, silu),
  RMSNorm, optionally tied embeddings; Qwen3-MoE's sparse layers as megatron-core's MoE layer (a top-k router,
  SequentialMLP experts, the alltoall token dispatcher). Parallel sizes, expert parallelism included, go
  through `parallel_state.initialize_model_parallel`.
* Converts Hugging Face weights into Megatron's layout and back (`hf_to_megatron_shard`,
  `megatron_shards_to_hf`), including the fused QKV layout under tensor parallelism (per query group:
  its query heads, then its key head, then its value head; each TP rank holds whole query groups), the
  per-rank [gate; up] halves of `linear_fc1`, and a vocabulary padded to a multiple of the TP size.
* Trains on packed micro-batches in Megatron's THD format (`PackedSeqParams`, one [1, N] stream per
  micro-batch, rotary positions restarting at every `cu_seqlens` boundary) through Megatron's
  forward-backward schedule, its DDP with the distributed optimizer and its gradient clipping.
* Computes log-probs over the tensor-parallel vocabulary shards without gathering the full logits: an
  all-reduce of the max, of the sum of exponentials and of the target logit (`vocab_parallel_logprobs`).
* Exports weights in Hugging Face-named buckets without gathering the model on one device: each pipeline
  stage exports its own layers, tensor-parallel shards are gathered one bucket at a time (one all-gather
  per bucket), and the gather of the next bucket runs while the caller sends the current one; with expert
  parallelism each bucket's experts are first all-gathered over the expert-parallel group.
* Replays the rollout's expert routing (``fields["routed_experts"]``, algo.routing_replay r3) in its routers.

Attention: with Transformer Engine installed on a GPU, the TE layer spec runs THD through TE's fused
attention. Without it (CPU, or a GPU without TE), the local spec runs with `TorchPackedAttention`, a core
attention module of ours that understands THD packed sequences on an O(L)-memory kernel (flash-attn's
variable-length kernel where installed, else one 4-D SDPA per sequence, which torch's flash and
memory-efficient kernels take) — Megatron's own local `DotProductAttention` rejects packed sequences. Every
norm of the local spec is torch's RMSNorm (Megatron would pick Apex's LayerNorm-only fused norm where Apex is
installed). See docs/engines-megatron.md.

Numerics follow the embedded torch backend (torch_train.py): same log-prob definition (base.py), same
loss normalisation (loss_fn returns a sum, divided by the global token count), AdamW with the same
hyper-parameters and schedule (`TrainConfig.lr_factor`), no weight decay on biases and norms, the same
skip of a step whose gradient norm is not finite.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import os
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from safetensors import safe_open
from torch.nn.attention import SDPBackend

from .base import (EngineError, LossFn, PackedBatch, RequestError, TokenLogProbs, TrainEngine, WeightBucket,
                   step_loss_weights)
from topology.schema import expert_tensor_parallel
from transport.bulk import rendezvous_store
from transport.files import atomic_write
from transport.ports import free_port

from .checkpoint import (CONFIG_FILE, SINGLE_FILE, CheckpointError, _weight_files, load_config,
                         shard_file_name, write_weights_file, write_weights_index,
                         read_tokenizer_files, write_tokenizer_files)
from .lora import (LoraError, LoraSpec, adapter_problem, copy_base_config, initial_adapter, is_adapter_name,
                   read_adapter, resolve_start, write_adapter)
from .megatron_lora import LORA_LINEARS, adapter_param_names, add_parallel_lora
from .model import Qwen2Config, sdpa
from .moe import ROUTE_NATIVE
from .torch_train import TrainConfig

try:  # megatron-core is an optional (GPU-cluster) dependency; importing this module without it is fine
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.moe import moe_utils as _moe_utils
    if not hasattr(_moe_utils, "te_general_gemm"):
        # megatron-core 0.16.1 without Transformer Engine: the router's gating GEMM tests `te_general_gemm is not
        # None`, a name moe_utils imports only from TE (transformer/moe/moe_utils.py, RouterGatingLinearFunction),
        # so every router forward raised NameError; None selects its torch.mm path, as it means there.
        _moe_utils.te_general_gemm = None
    MEGATRON_IMPORT_ERROR: str | None = None
except ImportError as _e:  # pragma: no cover - exercised where megatron-core is absent
    MEGATRON_IMPORT_ERROR = f"{type(_e).__name__}: {_e}"
    MegatronModule = torch.nn.Module  # type: ignore[misc,assignment]

TRAINER_STATE = "trainer_state.pt"


class MegatronUnavailableError(EngineError):
    """megatron-core is not importable here; the message says what failed and how to install it."""


def _require_megatron() -> None:
    if MEGATRON_IMPORT_ERROR is not None:
        raise MegatronUnavailableError(
            f"backend 'megatron' needs megatron-core==0.11.0 ({MEGATRON_IMPORT_ERROR}); install it with "
            "`pip install --no-deps megatron-core==0.11.0 einops` (see docs/engines-megatron.md)")


@dataclasses.dataclass
class MegatronConfig(TrainConfig):
    """TrainConfig (optimizer, schedule, clipping, device, seed) plus the parallel layout.

    The data-parallel size is world_size / (tensor_parallel * pipeline_parallel); expert_parallel splits each
    sparse layer's experts over that many ranks, and expert_tensor_parallel splits each expert's matrices (1: whole
    on each rank, the expert-parallel group folded over the attention's TP ranks; or tensor_parallel). The expert
    data-parallel size is world_size / (expert_tensor_parallel * expert_parallel * pipeline_parallel).
    """

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1                # MoE: each sparse layer's experts split over this many ranks
    # MoE: 1 or tensor_parallel; None: topology.schema.expert_tensor_parallel's default (1 when expert_parallel > 1)
    expert_tensor_parallel: int | None = None
    use_distributed_optimizer: bool = True
    vocab_pad_multiple: int = 128           # padded vocab = multiple of vocab_pad_multiple * tensor_parallel
    attention: str = "auto"                 # "auto": TE on a GPU when importable, else "torch"; or "te"/"torch"
    bf16: bool = False                      # bfloat16 model weights with float32 main params (GPU)
    dist_timeout_s: float = 600.0
    # Memory at long context (docs/engines-megatron.md, "Memory at 32k"):
    sequence_parallel: bool = False         # with tp > 1: norms and residuals hold 1/tp of the sequence
    recompute: str = "none"                 # "selective": core attention; "full": every layer's activations
    logprob_chunk_tokens: int = 0           # log-probs over the vocabulary this many tokens at a time (0: all)

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("tensor_parallel", "pipeline_parallel", "expert_parallel", "vocab_pad_multiple"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MegatronConfig.{key} must be an integer >= 1, got {value!r}")
        self.expert_tensor_parallel = expert_tensor_parallel(self.tensor_parallel, self.expert_parallel,
                                                             self.expert_tensor_parallel)
        if self.expert_tensor_parallel not in (1, self.tensor_parallel):
            raise ValueError(f"MegatronConfig.expert_tensor_parallel must be 1 or tensor_parallel "
                             f"({self.tensor_parallel}), got {self.expert_tensor_parallel!r}")
        if self.attention not in ("auto", "te", "torch"):
            raise ValueError(f"MegatronConfig.attention must be 'auto', 'te' or 'torch', got {self.attention!r}")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"MegatronConfig.recompute must be 'none', 'selective' or 'full', got {self.recompute!r}")
        if not isinstance(self.logprob_chunk_tokens, int) or self.logprob_chunk_tokens < 0:
            raise ValueError(f"MegatronConfig.logprob_chunk_tokens must be an integer >= 0, got "
                             f"{self.logprob_chunk_tokens!r}")

    @property
    def sequence_parallel_on(self) -> bool:
        """Sequence parallelism splits the sequence over the TP ranks: without TP there is nothing to split."""
        return self.sequence_parallel and self.tensor_parallel > 1


# --- model ---------------------------------------------------------------------------------------------
#: The families (model.FAMILIES model_type) this backend builds.
MEGATRON_FAMILIES = ("qwen2", "qwen3", "qwen3_moe")


def transformer_config(cfg: Qwen2Config, mc: MegatronConfig) -> TransformerConfig:
    """Megatron's TransformerConfig for a Hugging Face Qwen2, Qwen3 or Qwen3-MoE config.

    Qwen3: RMSNorm over each head's queries and keys (``qk_layernorm``), no q/k/v bias, ``head_dim`` its own
    key (``kv_channels``). Qwen3-MoE: the sparse layers' router takes the top-k of the logits and a softmax
    over those k (``moe_router_pre_softmax`` False), which is Hugging Face's softmax over all experts
    renormalised over the top k (``norm_topk_prob`` true); with ``norm_topk_prob`` false the softmax over all
    experts comes first and the top-k probabilities are used as they are (``moe_router_pre_softmax`` True):
    megatron-core's ``topk_softmax_with_capacity`` (transformer/moe/moe_utils.py). No token dropping (no
    capacity factor); the load-balancing loss only with ``moe_aux_loss_coef`` > 0, as the torch trainer.
    """
    _require_megatron()
    if cfg.MODEL_TYPE not in MEGATRON_FAMILIES:
        raise ValueError(f"the megatron backend builds {', '.join(MEGATRON_FAMILIES)}; got {cfg.MODEL_TYPE}")
    if cfg.num_key_value_heads % mc.tensor_parallel:
        raise ValueError(f"tensor_parallel ({mc.tensor_parallel}) must divide num_key_value_heads "
                         f"({cfg.num_key_value_heads}): each TP rank holds whole query groups")
    if cfg.num_hidden_layers % mc.pipeline_parallel:
        raise ValueError(f"pipeline_parallel ({mc.pipeline_parallel}) must divide num_hidden_layers "
                         f"({cfg.num_hidden_layers})")
    sparse = cfg.sparse_layers
    moe: dict[str, Any] = {}
    if sparse:
        experts = cfg.num_experts  # type: ignore[attr-defined]
        if experts % mc.expert_parallel:
            raise ValueError(f"expert_parallel ({mc.expert_parallel}) must divide num_experts ({experts}): each "
                             f"expert-parallel rank holds whole experts")
        etp = mc.expert_tensor_parallel
        if cfg.moe_intermediate_size % etp:  # type: ignore[attr-defined]
            raise ValueError(f"expert_tensor_parallel ({etp}) must divide moe_intermediate_size "
                             f"({cfg.moe_intermediate_size}): each expert's MLP is split like the dense one")
        if etp > 1 and mc.expert_parallel > 1:
            raise ValueError(f"expert_tensor_parallel {etp} together with expert_parallel > 1 is not supported: its "
                             f"only run (gloo, CPU) gave log-probs 2.5e-2 off the torch trainer's "
                             f"(docs/engines-megatron.md, Families); use expert_tensor_parallel 1")
        if mc.tensor_parallel > 1 and not mc.sequence_parallel:
            raise ValueError("a mixture-of-experts model with tensor_parallel > 1 needs sequence_parallel: true "
                             "(megatron-core's MoELayer refuses to train tensor-parallel experts without it)")
        coef = mc.moe_aux_loss_coef
        moe = dict(num_moe_experts=experts, moe_ffn_hidden_size=cfg.moe_intermediate_size,  # type: ignore[attr-defined]
                   moe_router_topk=cfg.num_experts_per_tok,  # type: ignore[attr-defined]
                   moe_router_pre_softmax=not cfg.norm_topk_prob,  # type: ignore[attr-defined]
                   moe_router_load_balancing_type="aux_loss" if coef > 0 else "none", moe_aux_loss_coeff=coef,
                   moe_layer_freq=[int(cfg.is_sparse_layer(i)) for i in range(cfg.num_hidden_layers)],
                   expert_model_parallel_size=mc.expert_parallel, expert_tensor_parallel_size=etp)
    elif mc.expert_parallel > 1:
        raise ValueError(f"expert_parallel ({mc.expert_parallel}) > 1 needs a mixture-of-experts model; "
                         f"{cfg.MODEL_TYPE} has no sparse layers")
    dtype = torch.bfloat16 if mc.bf16 else torch.float32
    return TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim, normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps,
        add_bias_linear=False, add_qkv_bias=cfg.qkv_bias, qk_layernorm=cfg.qk_norm,
        gated_linear_unit=True, activation_func=F.silu,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=mc.tensor_parallel, pipeline_model_parallel_size=mc.pipeline_parallel,
        params_dtype=dtype, bf16=mc.bf16, pipeline_dtype=dtype,
        use_cpu_initialization=True, perform_initialization=False,  # weights come from the HF checkpoint
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        calculate_per_token_loss=True,  # loss_fn's sum / our denominator; no division by micro-batch count
        variable_seq_lengths=True,      # packed micro-batches differ in length (pipeline shapes are sent)
        # the only dispatcher megatron-core allows with variable sequence lengths (its allgather default refuses
        # them in TransformerConfig's checks, dense models included); over gloo on CPU as over NCCL
        moe_token_dispatcher_type="alltoall",
        deallocate_pipeline_outputs=True,
        sequence_parallel=mc.sequence_parallel_on,
        **moe,
        **({"recompute_granularity": "selective"} if mc.recompute == "selective" else
           {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
           if mc.recompute == "full" else {}),
    )


#: Longest sequence trained on SDPA's math kernel on a GPU. That kernel materialises each head's [L, L]
#: float32 scores, and its backward holds about three such tensors: at 27.6k tokens with 7 heads per
#: tensor-parallel rank one score tensor is 21 GB. Longer sequences run on an O(L)-memory kernel or not at all.
MATH_KERNEL_MAX_TOKENS = 4096

try:  # flash-attn's variable-length kernel: one call per packed micro-batch, GQA native (optional, GPU only)
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None


class LongSequenceAttentionError(EngineError):
    """A sequence too long for the only attention kernel torch would run it on; the message names the fix."""


def math_kernel_refused(device: torch.device) -> bool:
    """Whether long sequences must not fall back to the math kernel here: on a GPU, where its L x L scores
    run out of memory hours into a run; on the CPU it is the reference every test compares against."""
    return device.type == "cuda"


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal attention of sequences of one length, 4-D [b, heads, L, d] (keys/values [b, groups, L, d]).

    4-D, because torch's flash and memory-efficient kernels take nothing else (3-D input always ran the
    math kernel). Grouped-query attention goes to the kernel as ``enable_gqa``, so keys and values are not
    repeated per query head where the kernel takes fewer key/value heads than query heads (torch's flash
    kernels). Torch's memory-efficient CUDA kernel refuses ``enable_gqa`` (measured with torch 2.11 on an
    H200: docs/measurements/gpu-probes-h200.json, ``attention``), so where flash cannot run (fp32, a head
    dimension past its limit, a GPU without it) a long sequence goes to the memory-efficient kernel with
    its keys and values repeated per query head: two [L, heads, d] copies, far below the math kernel's
    L x L scores.
    """
    gqa = q.shape[1] != k.shape[1]
    length = q.shape[-2]
    if not (math_kernel_refused(q.device) and length > MATH_KERNEL_MAX_TOKENS):
        return sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    try:
        try:
            return sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa,
                        backends=[SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
        except RuntimeError:
            if not gqa:
                raise
            groups = q.shape[1] // k.shape[1]
            k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
            return sdpa(q, k, v, is_causal=True, scale=scale, backends=[SDPBackend.EFFICIENT_ATTENTION])
    except RuntimeError as exc:
        raise LongSequenceAttentionError(
            f"a sequence of {length} tokens ({q.dtype}, head dim {q.shape[-1]}, {q.shape[1]} query / {k.shape[1]} "
            f"key-value heads) fits neither torch's flash nor its memory-efficient attention kernel here, and the "
            f"math kernel would hold {q.shape[1]} x {length} x {length} float32 scores "
            f"({q.shape[1] * length * length * 4 / 2**30:.1f} GiB, about three times that in the backward). "
            f"Fix: train in bf16 (trainer setting bf16: true), install flash-attn or Transformer Engine, or keep "
            f"sequences at most {MATH_KERNEL_MAX_TOKENS} tokens ({str(exc).splitlines()[0][:200]})") from exc


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float | None, varlen: bool = True) -> torch.Tensor:
    """Causal attention within each packed sequence of a THD stream: query [t, heads, d], key/value
    [t, groups, d], sequence boundaries ``cu_seqlens`` ([n + 1] int32); returns [t, heads, d].

    flash-attn's variable-length kernel where it is installed and can run (CUDA, fp16/bf16, head dim <= 256;
    ``varlen`` False leaves it out): one call for the whole stream, GQA native. Otherwise one
    :func:`sequence_attention` per sequence.
    """
    if (varlen and flash_attn_varlen_func is not None and query.is_cuda
            and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256):
        return flash_attn_varlen_func(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                      dropout_p=0.0, softmax_scale=scale, causal=True)
    bounds = cu_seqlens.tolist()
    outs = [sequence_attention(*(x[s:e].transpose(0, 1).unsqueeze(0) for x in (query, key, value)), scale)[0]
            .transpose(0, 1) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    return torch.cat(outs, dim=0) if outs else query.new_empty(query.shape)


class TorchPackedAttention(MegatronModule):
    """Core attention that accepts Megatron's THD packed sequences, on an O(L)-memory kernel.

    THD: query [t, heads, d], key/value [t, groups, d] and `packed_seq_params.cu_seqlens_q`; attention never
    crosses a sequence boundary (:func:`packed_causal_attention`). BSHD: [s, b, heads, d], causal over each
    row (right padding is never attended by real tokens). Returns [t, heads * d] or [s, b, heads * d].
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        # pg_collection: the process groups newer megatron-core (0.16.1 here) hands every core attention; this kernel
        # communicates nothing.
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("TorchPackedAttention does not support context parallelism (use Transformer Engine)")
        self.softmax_scale = softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None:
            out = packed_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                          int(packed_seq_params.max_seqlen_q), self.softmax_scale)
            return out.reshape(out.shape[0], -1)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
        o = sequence_attention(q, k, v, self.softmax_scale)
        s, b = query.shape[0], query.shape[1]
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)


def _use_te(mc: MegatronConfig, device: torch.device, lora: bool = False, moe: bool = False) -> bool:
    """Whether the layers are Transformer Engine's. Not with LoRA: TE's linear_qkv and linear_fc1 apply the
    norm inside the layer, and an adapter must see the normalised input (megatron_lora.py adapts the local
    spec's layers, whose norms are modules of their own). Not with experts: a mixture of experts runs on the
    local spec (SequentialMLP experts, whose names the converter maps; TE's grouped experts are not mapped)."""
    if mc.attention == "torch":
        return False
    if moe:
        if mc.attention == "te":
            raise MegatronUnavailableError("MegatronConfig.attention='te' with a mixture-of-experts model: its layers "
                                           "run on the local spec (attention 'auto' or 'torch'; "
                                           "docs/engines-megatron.md, Families)")
        return False
    if lora:
        if mc.attention == "te":
            raise MegatronUnavailableError("MegatronConfig.attention='te' with LoRA: the adapters train on the local "
                                           "layer spec (attention 'auto' or 'torch'; docs/engines-megatron.md, LoRA)")
        return False
    try:
        import transformer_engine  # noqa: F401
        has_te = True
    except ImportError:
        has_te = False
    if mc.attention == "te":
        if not has_te:
            raise MegatronUnavailableError("MegatronConfig.attention='te' but transformer_engine is not importable")
        return True
    return has_te and device.type == "cuda"


class LocalRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm for every norm of Megatron's local (non-Transformer-Engine) layers.

    Megatron's local spec picks its norm by what is installed: Apex's FusedLayerNorm when ``apex`` imports,
    which asserts ``normalization == "LayerNorm"`` and so cannot build Qwen2's RMSNorm (an install with Apex
    and without Transformer Engine crashed), else its torch wrapper, which refuses sequence parallelism. This
    one is neither: under sequence parallelism each TP rank normalises its share of the tokens, so the weight
    is marked ``sequence_parallel`` and Megatron's finalize_model_grads sums its gradient over the TP ranks.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


class QwenSequentialMLP(SequentialMLP if MEGATRON_IMPORT_ERROR is None else torch.nn.Module):  # type: ignore[misc]
    """megatron-core's SequentialMLP experts (one MLP per local expert, each on its slice of the tokens) built
    at the experts' own width. Its MLPs take ``config.ffn_hidden_size``, and megatron-core 0.11 asserts that
    equals ``moe_ffn_hidden_size``, while Qwen3-MoE's dense layers (mlp_only_layers) have intermediate_size and
    its experts moe_intermediate_size: the experts get a copy of the config with their width."""

    def __init__(self, num_local_experts: int, config: TransformerConfig, submodules: Any, **kwargs: Any) -> None:
        expert_config = copy.copy(config)
        expert_config.ffn_hidden_size = config.moe_ffn_hidden_size
        super().__init__(num_local_experts, expert_config, submodules, **kwargs)


def layer_spec(mc: MegatronConfig, device: torch.device, tc: TransformerConfig, lora: bool = False) -> ModuleSpec | Any:
    """This pipeline stage's layers: Transformer Engine's spec (dense families) or the local one, whose sparse
    layers (``tc.moe_layer_freq``) are a router and SequentialMLP experts behind the alltoall dispatcher."""
    moe = tc.num_moe_experts is not None
    if _use_te(mc, device, lora, moe):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=tc.qk_layernorm)

    def local(sparse: bool) -> ModuleSpec:
        spec = get_gpt_layer_local_spec(num_experts=tc.num_moe_experts if sparse else None, moe_grouped_gemm=False,
                                        qk_layernorm=tc.qk_layernorm)
        attention = spec.submodules.self_attention.submodules
        attention.core_attention = TorchPackedAttention
        if tc.qk_layernorm:
            attention.q_layernorm = attention.k_layernorm = LocalRMSNorm
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = LocalRMSNorm
        if sparse:
            spec.submodules.mlp.submodules.experts.module = QwenSequentialMLP
        return spec
    count = get_num_layers_to_build(tc)
    offset = mpu.get_pipeline_model_parallel_rank() * count   # uniform stages (transformer_config checks)
    pattern = tc.moe_layer_freq if moe else [0] * tc.num_layers
    return TransformerBlockSubmodules(layer_specs=[local(bool(pattern[offset + i])) for i in range(count)],
                                      layer_norm=LocalRMSNorm)


def padded_vocab_size(vocab: int, mc: MegatronConfig) -> int:
    multiple = mc.vocab_pad_multiple * mc.tensor_parallel
    return -(-vocab // multiple) * multiple


def build_gpt_model(cfg: Qwen2Config, mc: MegatronConfig, device: torch.device, lora: bool = False) -> GPTModel:
    """This rank's stage of the model (parallel_state must be initialised); ``lora``: on the local layer spec."""
    tc = transformer_config(cfg, mc)
    model = GPTModel(
        config=tc, transformer_layer_spec=layer_spec(mc, device, tc, lora), vocab_size=padded_vocab_size(cfg.vocab_size, mc),
        max_sequence_length=cfg.max_position_embeddings, pre_process=mpu.is_pipeline_first_stage(),
        post_process=mpu.is_pipeline_last_stage(), parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings, position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta) if float(cfg.rope_theta).is_integer() else cfg.rope_theta)
    return model.to(device)


def replayed_routing(logits: torch.Tensor, replay: torch.Tensor, native: tuple[torch.Tensor, torch.Tensor],
                     pre_softmax: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A TopKRouter's (probs [N, E], routing_map [N, E]) with each token routed to its replayed experts
    (``replay`` [N, k] expert ids; a row whose first id is ROUTE_NATIVE keeps its ``native`` routing). Only
    the choice is replayed: the weights are the current logits' softmax at those experts, as megatron-core
    computes them for its own top k (moe_utils.topk_softmax_with_capacity; over the k logits, or over all
    experts with ``pre_softmax``), so the router still gets gradients, as in the torch trainer (moe.py)."""
    native_probs, native_map = native
    replay = replay.to(device=logits.device, dtype=torch.long)
    keep = replay[:, :1] == ROUTE_NATIVE
    idx = replay.masked_fill(keep, 0)
    if pre_softmax:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits).gather(1, idx)
    else:
        probs = torch.softmax(logits.gather(1, idx), dim=-1, dtype=torch.float32).type_as(logits)
    routed_probs = torch.zeros_like(logits).scatter(1, idx, probs)
    routed_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    return torch.where(keep, native_probs, routed_probs), torch.where(keep, native_map, routed_map)


# --- HF <-> Megatron conversion -----------------------------------------------------------------------
# kind of a Megatron parameter: how its tensor-parallel shards relate to the full tensor(s)
#   rep   replicated on every TP rank          vocab  rows split (vocab padded)
#   row   columns split (RowParallelLinear)   fc1    per rank [gate shard; up shard]
#   col   rows split (a LoRA B of a ColumnParallelLinear)
#   qkv   fused per query group [q heads.., k, v], rank r holds groups r*G/tp .. (r+1)*G/tp - 1
@dataclasses.dataclass(frozen=True)
class ParamMap:
    mcore_name: str
    kind: str
    hf_names: tuple[str, ...]
    expert: bool = False    # a local expert's weight: this expert-parallel rank's own, the others hold others


EXPERT_PREFIX = "mlp.experts.local_experts."


def param_map(mcore_name: str, layer_offset: int, expert_offset: int = 0) -> ParamMap:
    """How a local Megatron parameter name maps to Hugging Face names (layer numbers made global; local expert
    j of expert-parallel rank r is Hugging Face expert ``expert_offset + j``, expert_offset = r * local experts)."""
    n = mcore_name
    if n == "embedding.word_embeddings.weight":
        return ParamMap(n, "vocab", ("model.embed_tokens.weight",))
    if n == "output_layer.weight":
        return ParamMap(n, "vocab", ("lm_head.weight",))
    if n == "decoder.final_layernorm.weight":
        return ParamMap(n, "rep", ("model.norm.weight",))
    parts = n.split(".")
    if len(parts) < 4 or parts[:2] != ["decoder", "layers"]:
        raise CheckpointError(f"no Hugging Face name for Megatron parameter {n!r}")
    hf = f"model.layers.{int(parts[2]) + layer_offset}."
    rest = ".".join(parts[3:])
    adapter = adapter_param_names(".".join(parts[3:5]), ".".join(parts[5:]))
    if adapter is not None:   # megatron_lora.py: A replicated and B split on a column-parallel layer, the reverse on a row one
        block, projection, matrix = adapter
        column = LORA_LINEARS[".".join(parts[3:5])][0] == "column"
        kind = ("col" if column else "row") if (matrix == "lora_B") == column else "rep"
        return ParamMap(n, kind, (f"{hf}{block}.{projection}.{matrix}.weight",))
    table: dict[str, tuple[str, tuple[str, ...]]] = {
        "input_layernorm.weight": ("rep", ("input_layernorm.weight",)),
        "self_attention.linear_qkv.layer_norm_weight": ("rep", ("input_layernorm.weight",)),  # TE spec
        "self_attention.linear_qkv.weight": ("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                     "self_attn.v_proj.weight")),
        "self_attention.linear_qkv.bias": ("qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                   "self_attn.v_proj.bias")),
        "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
        "self_attention.q_layernorm.weight": ("rep", ("self_attn.q_norm.weight",)),   # Qwen3
        "self_attention.k_layernorm.weight": ("rep", ("self_attn.k_norm.weight",)),
        "mlp.router.weight": ("rep", ("mlp.gate.weight",)),                          # Qwen3-MoE sparse layer
        "pre_mlp_layernorm.weight": ("rep", ("post_attention_layernorm.weight",)),
        "mlp.linear_fc1.layer_norm_weight": ("rep", ("post_attention_layernorm.weight",)),  # TE spec
        "mlp.linear_fc1.weight": ("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
        "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
    }
    if rest.startswith(EXPERT_PREFIX):
        local, linear = rest[len(EXPERT_PREFIX):].split(".", 1)
        expert = f"mlp.experts.{int(local) + expert_offset}."
        if linear == "linear_fc1.weight":
            return ParamMap(n, "fc1", (f"{hf}{expert}gate_proj.weight", f"{hf}{expert}up_proj.weight"), expert=True)
        if linear == "linear_fc2.weight":
            return ParamMap(n, "row", (f"{hf}{expert}down_proj.weight",), expert=True)
    if rest not in table:
        raise CheckpointError(f"no Hugging Face name for Megatron parameter {n!r}")
    kind, names = table[rest]
    return ParamMap(n, kind, tuple(hf + x for x in names))


def hf_to_megatron_shard(pm: ParamMap, hf: Sequence[torch.Tensor], cfg: Qwen2Config, tp_rank: int, tp_size: int,
                         padded_vocab: int) -> torch.Tensor:
    """TP rank `tp_rank`'s shard of one Megatron parameter from its full Hugging Face tensors."""
    if pm.kind == "rep":
        return hf[0]
    if pm.kind == "vocab":
        full = hf[0]
        if full.shape[0] < padded_vocab:
            full = torch.cat([full, full.new_zeros(padded_vocab - full.shape[0], *full.shape[1:])])
        return full.chunk(tp_size, dim=0)[tp_rank]
    if pm.kind == "row":
        return hf[0].chunk(tp_size, dim=1)[tp_rank]
    if pm.kind == "col":
        return hf[0].chunk(tp_size, dim=0)[tp_rank]
    if pm.kind == "fc1":
        gate, up = hf
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0)
    if pm.kind == "qkv":
        q, k, v = hf
        groups, per = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
        tail = tuple(q.shape[1:])
        fused = torch.cat([q.reshape(groups, per, cfg.head_dim, *tail), k.reshape(groups, 1, cfg.head_dim, *tail),
                           v.reshape(groups, 1, cfg.head_dim, *tail)], dim=1)
        return fused.chunk(tp_size, dim=0)[tp_rank].reshape(-1, *tail)
    raise AssertionError(pm.kind)


def megatron_shards_to_hf(pm: ParamMap, shards: Sequence[torch.Tensor], cfg: Qwen2Config,
                          ) -> list[tuple[str, torch.Tensor]]:
    """Full Hugging Face tensors of one Megatron parameter from all its TP shards (rank order)."""
    if pm.kind == "rep":
        return [(pm.hf_names[0], shards[0])]
    if pm.kind == "vocab":
        return [(pm.hf_names[0], torch.cat(list(shards), dim=0)[:cfg.vocab_size])]
    if pm.kind == "row":
        return [(pm.hf_names[0], torch.cat(list(shards), dim=1))]
    if pm.kind == "col":
        return [(pm.hf_names[0], torch.cat(list(shards), dim=0))]
    if pm.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [(pm.hf_names[0], torch.cat([h[0] for h in halves])), (pm.hf_names[1], torch.cat([h[1] for h in halves]))]
    if pm.kind == "qkv":
        groups, per = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
        full = torch.cat(list(shards), dim=0)
        tail = tuple(full.shape[1:])
        fused = full.reshape(groups, per + 2, cfg.head_dim, *tail)
        return [(pm.hf_names[0], fused[:, :per].reshape(-1, *tail)),
                (pm.hf_names[1], fused[:, per].reshape(-1, *tail)),
                (pm.hf_names[2], fused[:, per + 1].reshape(-1, *tail))]
    raise AssertionError(pm.kind)


# --- log-probs over vocabulary shards -----------------------------------------------------------------
def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int,
                            temperature: float = 1.0, with_entropy: bool = False,
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(logits / T)[target] (and the entropy) when each TP rank holds a slice of the vocabulary.

    logits [n, V_local] are this rank's columns vocab_start .. vocab_start + V_local - 1 (columns past the
    real `vocab_size` are padding and excluded). Three all-reduces of [n] vectors over the TP group (max,
    sum of exponentials, target logit; a fourth for the entropy); the full [n, V] logits never exist.
    Differentiable: reductions use Megatron's reduce_from_tensor_model_parallel_region (identity backward),
    since every TP rank computes the same loss from the reduced values.
    """
    z = logits.float()
    if temperature not in (0.0, 1.0):
        z = z / temperature
    local_v = z.shape[-1]
    pad = (torch.arange(local_v, device=z.device) + vocab_start) >= vocab_size
    has_pad = bool(pad.any())
    if has_pad:
        z = z.masked_fill(pad, float("-inf"))
    tp_group = mpu.get_tensor_model_parallel_group()
    tp_size = mpu.get_tensor_model_parallel_world_size()
    m = z.detach().max(dim=-1).values
    if tp_size > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    e = torch.exp(z - m.unsqueeze(-1))
    sum_exp = tensor_parallel.reduce_from_tensor_model_parallel_region(e.sum(dim=-1))
    logz = m + torch.log(sum_exp)
    in_range = (targets >= vocab_start) & (targets < vocab_start + local_v)
    local_t = (targets - vocab_start).clamp(0, local_v - 1)
    target_logit = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
    target_logit = tensor_parallel.reduce_from_tensor_model_parallel_region(target_logit)
    logp = target_logit - logz
    entropy = None
    if with_entropy:
        p = e / sum_exp.unsqueeze(-1)
        zf = z.masked_fill(pad, 0.0) if has_pad else z
        expected = tensor_parallel.reduce_from_tensor_model_parallel_region((p * zf).sum(dim=-1))
        entropy = logz - expected
    return logp, entropy


def chunked_vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int,
                                    temperature: float = 1.0, with_entropy: bool = False, chunk_tokens: int = 0,
                                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`vocab_parallel_logprobs` `chunk_tokens` rows at a time, each chunk recomputed in the backward
    pass: its float32 intermediates (the logits cast, their exponentials, the probabilities) then exist for
    one chunk at a time instead of for the whole micro-batch. Same values and gradients; every TP rank runs
    the same chunks, so the chunks' all-reduces pair up."""
    n = logits.shape[0]
    if chunk_tokens <= 0 or n <= chunk_tokens:
        return vocab_parallel_logprobs(logits, targets, vocab_start, vocab_size, temperature, with_entropy)

    def one(chunk: torch.Tensor, chunk_targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lp, ent = vocab_parallel_logprobs(chunk, chunk_targets, vocab_start, vocab_size, temperature, with_entropy)
        return (lp, ent) if ent is not None else (lp,)

    # split, not slicing: the gradient of a split is one cat of the chunks' gradients, while each slice's
    # backward would allocate a zero tensor the size of all the logits.
    parts = [torch.utils.checkpoint.checkpoint(one, chunk, chunk_targets, use_reentrant=False)
             for chunk, chunk_targets in zip(logits.split(chunk_tokens), targets.split(chunk_tokens))]
    logp = torch.cat([p[0] for p in parts])
    return logp, (torch.cat([p[1] for p in parts]) if with_entropy else None)


# --- distributed setup ---------------------------------------------------------------------------------
def init_distributed(mc: MegatronConfig, device: torch.device) -> None:
    """torch.distributed (env:// when launched by torchrun, else a world of one) and parallel_state."""
    timeout = datetime.timedelta(seconds=mc.dist_timeout_s)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        else:
            addr, port, rank, world = "127.0.0.1", free_port(), 0, 1
        # env:// would have rank 0's store listen on every interface; this one listens on MASTER_ADDR only
        store = rendezvous_store(addr, port, rank, world, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    world = dist.get_world_size()
    if world % (mc.tensor_parallel * mc.pipeline_parallel):
        raise ValueError(f"world size {world} is not a multiple of tensor_parallel x pipeline_parallel "
                         f"({mc.tensor_parallel} x {mc.pipeline_parallel})")
    expert_ranks = mc.expert_tensor_parallel * mc.expert_parallel * mc.pipeline_parallel
    if world % expert_ranks:
        raise ValueError(f"world size {world} is not a multiple of expert_tensor_parallel x expert_parallel x "
                         f"pipeline_parallel ({mc.expert_tensor_parallel} x {mc.expert_parallel} x "
                         f"{mc.pipeline_parallel}): the expert-parallel groups must tile the world")
    if mpu.model_parallel_is_initialized():
        if (mpu.get_tensor_model_parallel_world_size() != mc.tensor_parallel
                or mpu.get_pipeline_model_parallel_world_size() != mc.pipeline_parallel
                or mpu.get_expert_model_parallel_world_size() != mc.expert_parallel
                or mpu.get_expert_tensor_parallel_world_size() != mc.expert_tensor_parallel):
            raise ValueError("parallel_state is already initialised with other tensor/pipeline/expert sizes")
        return
    mpu.initialize_model_parallel(tensor_model_parallel_size=mc.tensor_parallel,
                                  pipeline_model_parallel_size=mc.pipeline_parallel,
                                  expert_model_parallel_size=mc.expert_parallel,
                                  expert_tensor_parallel_size=mc.expert_tensor_parallel,
                                  distributed_timeout_minutes=max(1, int(mc.dist_timeout_s // 60)))
    if device.type == "cuda":  # Megatron's CUDA RNG tracker (dropout regions, TE)
        tensor_parallel.model_parallel_cuda_manual_seed(mc.seed)


class _HFReader:
    """Reads named tensors from a Hugging Face model directory on demand (one open handle per file)."""

    def __init__(self, model_dir: str) -> None:
        self.where: dict[str, str] = {}
        for path in _weight_files(model_dir):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    self.where[name] = path
        self.source = model_dir

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise CheckpointError(f"{self.source}: missing tensor {name!r}")
        with safe_open(self.where[name], framework="pt") as f:
            return f.get_tensor(name)


# --- the engine -------------------------------------------------------------------------------------------
class MegatronTrainEngine(TrainEngine):
    """`TrainEngine` on Megatron-core; one instance per rank, all ranks call every method together.

    Every rank receives its data-parallel share of the micro-batches (TP and PP peers of one data-parallel
    rank receive the same ones). `export_weights` must be iterated to the end on every rank; buckets come
    out only on export senders (`is_export_sender`: data-parallel rank 0 and tensor-parallel rank 0 of each
    pipeline stage), each holding its own stage's layers.

    With ``lora`` the base is frozen and adapters train on it (megatron_lora.py): the optimizer holds the
    adapters alone, and weights, versions and checkpoints are the adapter's Hugging Face-named tensors, as the
    torch trainer's. ``model_dir`` is then the base model or a LoRA checkpoint (which names its base), and
    ``start_adapter`` an adapter directory a new run starts from.
    """

    def __init__(self, model_dir: str, config: MegatronConfig | None = None, *, version: int = 0,
                 lora: LoraSpec | None = None, start_adapter: str | None = None) -> None:
        _require_megatron()
        self.config = config or MegatronConfig()
        self.model_dir = model_dir
        self.lora = lora
        self.base_dir, adapter_dir = resolve_start(model_dir, start_adapter) if lora else (model_dir, None)
        self._tokenizer_files = read_tokenizer_files(model_dir)
        self.device = torch.device(self.config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            self.device = torch.device("cuda", torch.cuda.current_device())
        init_distributed(self.config, self.device)
        torch.manual_seed(self.config.seed)
        self.hf_config = load_config(self.base_dir)
        if self.hf_config.MODEL_TYPE not in MEGATRON_FAMILIES:
            raise CheckpointError(f"{model_dir}: the model is {self.hf_config.MODEL_TYPE} "
                                  f"({self.hf_config.ARCHITECTURE}); the megatron backend builds "
                                  f"{', '.join(MEGATRON_FAMILIES)}")
        if lora is not None and self.hf_config.sparse_layers:
            raise CheckpointError(f"{model_dir}: LoRA on the megatron backend adapts dense models only; "
                                  f"{self.hf_config.MODEL_TYPE} has experts")
        self.tp_rank, self.tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
        self.pp_rank, self.pp_size = mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size()
        self.dp_rank, self.dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
        self.ep_rank, self.ep_size = mpu.get_expert_model_parallel_rank(), mpu.get_expert_model_parallel_world_size()
        # the experts' own tensor parallelism: 1 (whole experts, the expert-parallel group folded over the TP ranks)
        # or the dense layers' tp
        self.etp_rank = mpu.get_expert_tensor_parallel_rank()
        self.etp_size = mpu.get_expert_tensor_parallel_world_size()
        # ranks whose experts the export senders gather: the expert-parallel group of a data-parallel rank 0
        self.joins_expert_export = bool(self.hf_config.sparse_layers) and mpu.get_expert_data_parallel_rank() == 0
        self.local_experts = getattr(self.hf_config, "num_experts", 0) // self.ep_size
        self.padded_vocab = padded_vocab_size(self.hf_config.vocab_size, self.config)
        self.model = build_gpt_model(self.hf_config, self.config, self.device, lora=lora is not None)
        self.layer_offset = self._layer_offset()
        if lora is not None:
            self._add_lora(lora)
        self.param_maps = {name: param_map(name, self.layer_offset, self.ep_rank * self.local_experts)
                           for name, _ in self.model.named_parameters()}
        self._mark_tensor_parallel_params()
        self._replay: torch.Tensor | None = None   # this forward's routing to replay ([tokens, sparse layers, k])
        self._install_routing_replay()
        self._load_hf_weights(self.base_dir)
        if lora is not None:
            self._load_adapter(adapter_dir)
        tc = self.model.config
        self.ddp = DistributedDataParallel(
            config=tc, module=self.model,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                     use_distributed_optimizer=self.config.use_distributed_optimizer,
                                                     check_for_nan_in_grad=False))
        tc.no_sync_func = self.ddp.no_sync
        tc.finalize_model_grads_func = self._finalize_grads
        c = self.config
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=c.lr, min_lr=c.lr * c.min_lr_ratio, weight_decay=c.weight_decay,
                            adam_beta1=c.betas[0], adam_beta2=c.betas[1], adam_eps=c.adam_eps,
                            clip_grad=c.grad_clip if c.grad_clip > 0 else 0.0, bf16=c.bf16, fp16=False,
                            params_dtype=torch.bfloat16 if c.bf16 else torch.float32,
                            use_distributed_optimizer=c.use_distributed_optimizer),
            [self.ddp])
        self.step = 0
        self._initial_version = version

    # --- setup helpers -----------------------------------------------------------------------------
    def _layer_offset(self) -> int:
        layers = getattr(self.model.decoder, "layers", [])
        if len(layers) == 0:
            return 0
        return int(layers[0].layer_number) - 1

    def _mark_tensor_parallel_params(self) -> None:
        """Megatron's linear layers set `tensor_model_parallel` only while initialising weights, and we build
        with perform_initialization=False (the weights come from the checkpoint); without the attribute the
        grad norm would drop split weights on TP ranks > 0. Set it from the conversion table."""
        for name, param in self.model.named_parameters():
            kind = self.param_maps[name].kind
            if kind == "rep":
                tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
            else:
                for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                    if hasattr(param, attr):
                        delattr(param, attr)
                tensor_parallel.set_tensor_model_parallel_attributes(param, True, 1 if kind == "row" else 0, 1)

    def _install_routing_replay(self) -> None:
        """Every router of this stage routes by ``self._replay`` when a forward's batch carries
        ``fields["routed_experts"]`` (algo.routing_replay r3), column = the layer's index among the model's
        sparse layers; under sequence parallelism a router sees this TP rank's slice of the tokens."""
        sparse = self.hf_config.sparse_layers
        pre_softmax = not getattr(self.hf_config, "norm_topk_prob", True)
        for layer in getattr(self.model.decoder, "layers", []):
            router = getattr(layer.mlp, "router", None)
            if router is None:
                continue
            slot = sparse.index(int(layer.layer_number) - 1)

            def routing(logits: torch.Tensor, native: Callable[..., Any] = router.routing, slot: int = slot,
                        **later: Any) -> Any:
                # later: what newer megatron-core passes on (0.16.1: padding_mask), handed to its own routing
                routed = native(logits, **later)
                if self._replay is None:
                    return routed
                rows = self._replay[:, slot]
                if self.config.sequence_parallel_on:
                    rows = rows.chunk(self.tp_size)[self.tp_rank]
                flat = logits.reshape(-1, logits.shape[-1])   # [s, b, E] as routing() flattens it
                if rows.shape[0] != flat.shape[0]:
                    raise RequestError(f"routing replay: {rows.shape[0]} token rows for a router of "
                                       f"{flat.shape[0]} tokens")
                return replayed_routing(flat, rows, routed, pre_softmax)
            router.routing = routing

    def _add_lora(self, spec: LoraSpec) -> None:
        try:
            add_parallel_lora(self.model, self.hf_config, spec, self.layer_offset, self.tp_size,
                              self.config.sequence_parallel_on)
        except LoraError as exc:
            raise CheckpointError(f"{self.base_dir}: {exc}") from None
        if self.config.recompute == "full" and mpu.is_pipeline_first_stage():
            # A recomputed layer's gradients flow only when its input asks for them: the frozen embedding's
            # output would not, and the first layers' adapters would get none.
            self.model.embedding.register_forward_hook(lambda _m, _a, out: out.requires_grad_(True))

    def _load_hf_weights(self, model_dir: str) -> None:
        """The base's parameters from a Hugging Face model directory (all of them without LoRA)."""
        reader = _HFReader(model_dir)
        tied = self.hf_config.tie_word_embeddings

        def full(pm: ParamMap) -> list[torch.Tensor]:
            names = ("model.embed_tokens.weight",) if tied and pm.mcore_name == "output_layer.weight" else pm.hf_names
            return [reader.get(n) for n in names]
        self._assign(full, adapters=False, source=model_dir)

    def _load_adapter(self, adapter_dir: str | None) -> None:
        """The adapter's parameters from a PEFT-layout directory, or the initial adapter (``lora.initial_adapter``,
        the torch trainer's) when None."""
        if adapter_dir is None:
            tensors = initial_adapter(self.hf_config, self.lora, self.config.seed)
        else:
            problem = adapter_problem(adapter_dir, self.hf_config, self.lora)
            if problem:
                raise CheckpointError(problem)
            tensors = read_adapter(adapter_dir)[1]

        self._assign(lambda pm: [tensors[n] for n in pm.hf_names], adapters=True,
                     source=adapter_dir or "the initial adapter")

    def _assign(self, full: Callable[[ParamMap], list[torch.Tensor]], *, adapters: bool, source: str) -> None:
        """Copy this rank's shard of each base (``adapters`` False) or adapter parameter from its full Hugging
        Face tensors, ``full(param_map)``."""
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                pm = self.param_maps[name]
                if is_adapter_name(pm.hf_names[0]) != adapters:
                    continue
                tp_rank, tp_size = (self.etp_rank, self.etp_size) if pm.expert else (self.tp_rank, self.tp_size)
                shard = hf_to_megatron_shard(pm, full(pm), self.hf_config, tp_rank, tp_size, self.padded_vocab)
                if tuple(shard.shape) != tuple(param.shape):
                    raise CheckpointError(f"{source}: {pm.hf_names} give shape {tuple(shard.shape)} for {name!r}, "
                                          f"the model expects {tuple(param.shape)}")
                param.copy_(shard)

    @property
    def version(self) -> int:
        return self._initial_version + self.step

    @property
    def is_export_sender(self) -> bool:
        return self.dp_rank == 0 and self.tp_rank == 0

    @property
    def data_parallel(self) -> tuple[int, int]:
        return self.dp_rank, self.dp_size

    @property
    def reports_stats(self) -> bool:
        return self.tp_rank == 0 and self.pp_rank == self.pp_size - 1   # loss_fn runs on the last stage only

    # --- forward -----------------------------------------------------------------------------------
    def _check(self, batch: PackedBatch) -> PackedBatch:
        vocab = self.hf_config.vocab_size
        if batch.num_tokens and (int(batch.input_ids.min()) < 0 or int(batch.input_ids.max()) >= vocab):
            raise RequestError(f"PackedBatch.input_ids has a token outside the vocabulary (size {vocab})")
        return batch.to(self.device)

    def _packed_params(self, batch: PackedBatch) -> PackedSeqParams:
        cu = batch.cu_seqlens.to(device=self.device, dtype=torch.int32)
        max_len = int((batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).max())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
                               max_seqlen_kv=max_len)

    def _replay_rows(self, batch: PackedBatch) -> torch.Tensor | None:
        """The batch's routing to replay, checked ([tokens, sparse layers, top-k]), or None."""
        routes = batch.fields.get("routed_experts")
        if routes is None or not self.hf_config.sparse_layers:
            return None
        want = (batch.num_tokens, len(self.hf_config.sparse_layers), self.hf_config.num_experts_per_tok)
        if tuple(routes.shape) != want:
            raise RequestError(f"routing replay: fields['routed_experts'] has shape {tuple(routes.shape)}, the model "
                               f"routes {want} (tokens, sparse layers, top-k)")
        if self.config.recompute == "full" and self.pp_size > 1:
            raise RequestError("routing replay with recompute 'full' and pipeline_parallel > 1: a layer recomputed "
                               "in the backward of an earlier micro-batch would route by a later one's replay")
        return routes.to(self.device, torch.long)

    def _forward(self, model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
        # Kept after the forward: a fully recomputed layer routes again in this micro-batch's backward.
        self._replay = self._replay_rows(batch)
        tokens = batch.num_tokens
        if self.config.sequence_parallel_on and tokens % self.tp_size:
            # Sequence parallelism splits the tokens evenly over the TP ranks: pad with a sequence of its
            # own (attention never crosses sequences), whose outputs are cut off again below.
            pad = self.tp_size - tokens % self.tp_size
            batch = PackedBatch(torch.cat([batch.input_ids, batch.input_ids.new_zeros(pad)]),
                                torch.cat([batch.cu_seqlens, batch.cu_seqlens.new_tensor([tokens + pad])]),
                                torch.cat([batch.position_ids, torch.arange(pad, dtype=batch.position_ids.dtype,
                                                                            device=batch.position_ids.device)]))
            if self._replay is not None:   # the padding routes natively
                self._replay = torch.cat([self._replay, self._replay.new_full((pad, *self._replay.shape[1:]),
                                                                              ROUTE_NATIVE)])
        out = model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], attention_mask=None,
                    packed_seq_params=self._packed_params(batch))
        if batch.num_tokens != tokens and mpu.is_pipeline_last_stage():
            out = out[:, :tokens]   # logits [b, s, V_local] on the last stage
        return out

    def _token_outputs(self, logits: torch.Tensor, batch: PackedBatch, temperature: float,
                       with_entropy: bool) -> TokenLogProbs:
        """Aligned with the input tokens: position t is predicted by position t-1's logits."""
        local = logits.reshape(-1, logits.shape[-1])[:-1]
        vocab_start = self.tp_rank * (self.padded_vocab // self.tp_size)
        lp, ent = chunked_vocab_parallel_logprobs(local, batch.input_ids[1:], vocab_start, self.hf_config.vocab_size,
                                                  temperature, with_entropy, self.config.logprob_chunk_tokens)
        zero = lp.new_zeros(1)
        starts = torch.zeros(batch.num_tokens, dtype=torch.bool, device=lp.device)
        starts[batch.cu_seqlens[:-1]] = True
        logprobs = torch.cat([zero, lp]).masked_fill(starts, 0.0)
        entropy = torch.cat([zero, ent]).masked_fill(starts, 0.0) if with_entropy else None
        return TokenLogProbs(logprobs, entropy)

    def _broadcast_from_last_stage(self, value: torch.Tensor | None, numel: int) -> torch.Tensor:
        if self.pp_size == 1:
            assert value is not None
            return value
        buf = value.contiguous() if value is not None else torch.empty(numel, device=self.device)
        dist.broadcast(buf, src=mpu.get_pipeline_model_parallel_last_rank(),
                       group=mpu.get_pipeline_model_parallel_group())
        return buf

    def compute_logprobs(self, batch: PackedBatch, temperature: float = 1.0,
                         with_entropy: bool = False) -> TokenLogProbs:
        batch = self._check(batch)
        store: dict[str, torch.Tensor] = {}

        def forward_step(data_iter: Iterator[PackedBatch], model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            mb = next(data_iter)
            out = self._forward(model, mb)

            def collect(logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
                res = self._token_outputs(logits, mb, temperature, with_entropy)
                store["logprobs"] = res.logprobs
                if res.entropy is not None:
                    store["entropy"] = res.entropy
                return logits.new_zeros(()), {}
            return out, collect

        self.ddp.eval()
        with torch.no_grad():
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch]), model=[self.ddp],
                                        num_microbatches=1, seq_length=batch.num_tokens, micro_batch_size=1,
                                        forward_only=True)
            logprobs = self._broadcast_from_last_stage(store.get("logprobs"), batch.num_tokens)
            entropy = self._broadcast_from_last_stage(store.get("entropy"), batch.num_tokens) if with_entropy else None
        self.ddp.train()
        return TokenLogProbs(logprobs, entropy)

    # --- optimisation ------------------------------------------------------------------------------
    def _finalize_grads(self, model: list[torch.nn.Module], num_tokens: torch.Tensor | None = None,
                        **later: Any) -> None:
        # The loss is already divided by the global denominator: reduce gradients (summed across DP ranks,
        # calculate_per_token_loss) without Megatron's division by the token count. `later`: what newer
        # megatron-core releases pass on (pg_collection, force_all_reduce), handed back unchanged.
        finalize_model_grads(model, None, **later)

    def data_parallel_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.dp_size > 1:
            dist.all_reduce(t, group=mpu.get_data_parallel_group())
        return t.tolist()

    def _set_lr(self) -> float:
        lr = self.config.lr * self.config.lr_factor(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.config.weight_decay * group.get("wd_mult", 1.0)
        return lr

    def _grad_norm(self) -> float:
        """The gradient norm over every parameter. A model with experts has two optimizers (dense parameters
        reduced over the model-parallel group, experts over the expert-parallel one: megatron-core's
        ChainedOptimizer, which computes the total only inside its own step): the root of their squares."""
        return float(np.sqrt(sum(float(opt.get_grad_norm() or 0.0) ** 2 for opt in self._megatron_optimizers())))

    def _clip_grads(self, total_norm: float) -> None:
        """Scale every gradient by grad_clip / total_norm when the total norm is larger (each optimizer's own)."""
        for opt in self._megatron_optimizers():
            clip_grad_by_total_norm_fp32(opt.get_parameters(), self.config.grad_clip, total_norm)

    def _megatron_optimizers(self) -> list[Any]:
        return list(getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer])

    def train_step(self, micro_batches: list[PackedBatch], loss_fn: LossFn, temperature: float = 1.0,
                   loss_denominator: float | None = None, with_entropy: bool = False) -> dict[str, float]:
        batches = [self._check(mb) for mb in micro_batches]
        weights, denominator = step_loss_weights(batches, loss_denominator, lambda n: self.data_parallel_sum([n])[0])
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self._set_lr()
        loss_total = [0.0]
        stat_sums: dict[str, float] = {}
        weight_iter = iter(weights)

        def forward_step(data_iter: Iterator[PackedBatch], model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            mb = next(data_iter)
            weight = next(weight_iter)
            out = self._forward(model, mb)

            def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
                outputs = self._token_outputs(logits, mb, temperature, with_entropy)
                loss_sum, stats = loss_fn(outputs, mb)
                if loss_sum.dim() != 0:
                    raise RequestError(f"loss_fn must return a scalar loss sum, got shape {tuple(loss_sum.shape)}")
                loss_total[0] += float(loss_sum.detach())
                for key, value in stats.items():
                    stat_sums[key] = stat_sums.get(key, 0.0) + float(value) * weight
                return loss_sum / denominator, torch.tensor(int(weight), dtype=torch.int), {}
            return out, loss_func

        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=[self.ddp],
                                    num_microbatches=len(batches), seq_length=max(mb.num_tokens for mb in batches),
                                    micro_batch_size=1, forward_only=False)
        found_inf = self.optimizer.prepare_grads()
        grad_norm = self._grad_norm()
        skipped = bool(found_inf) or not np.isfinite(grad_norm)
        if not skipped:
            if self.config.grad_clip > 0:
                self._clip_grads(grad_norm)
            self.optimizer.step_with_ready_grads()
            self.step += 1
        self.optimizer.zero_grad()
        self.ddp.zero_grad_buffer()
        # Report global figures: loss and stats summed over data-parallel ranks (the last stage computes them).
        keys = sorted(stat_sums)
        local = [loss_total[0], sum(weights), float(sum(mb.num_tokens for mb in batches)),
                 float(sum(mb.num_seqs for mb in batches))] + [stat_sums[k] for k in keys]
        if self.pp_size > 1:  # only the last stage ran loss_fn: take its figures (and stat names)
            box: list[Any] = [(local, keys)]
            dist.broadcast_object_list(box, src=mpu.get_pipeline_model_parallel_last_rank(),
                                       group=mpu.get_pipeline_model_parallel_group())
            local, keys = box[0]
        total = self.data_parallel_sum(local)
        out = {"loss": total[0] / denominator, "grad_norm": grad_norm, "lr": lr, "skipped": float(skipped),
               "tokens": total[2], "seqs": total[3], "step": float(self.step), "version": float(self.version)}
        for key, value in zip(keys, total[4:]):
            out.setdefault(key, value / total[1] if total[1] else 0.0)
        return out

    # --- weights -----------------------------------------------------------------------------------
    def _export_units(self) -> list[tuple[ParamMap, torch.nn.Parameter]]:
        tied = self.hf_config.tie_word_embeddings
        units = []
        for name, param in self.model.named_parameters():
            pm = self.param_maps[name]
            if tied and pm.mcore_name == "output_layer.weight":
                continue  # a copy of the embedding on the last stage; HF stores it once
            if self.lora is not None and not is_adapter_name(pm.hf_names[0]):
                continue  # with LoRA a version is the adapter alone (the rollouts hold the base)
            units.append((pm, param))
        return units

    def export_weights(self, bucket_bytes: int = 64 << 20, dtype: torch.dtype | None = None) -> Iterator[WeightBucket]:
        """Hugging Face-named buckets of this stage's weights; iterate to the end on every rank.

        Ranks of data-parallel rank 0 take part (one all-gather over the TP group per bucket, the next
        bucket's gather started before the current bucket is handed out); buckets are yielded on TP rank 0.
        With expert parallelism the expert-parallel peers of those ranks take part too: each bucket's expert
        weights are first all-gathered over the expert-parallel group, so every expert is published once,
        under its Hugging Face number (expert-parallel rank r's local expert j is expert r * local + j).
        """
        if self.dp_rank != 0 and not self.joins_expert_export:
            return
        units = self._export_units()
        buckets: list[list[tuple[ParamMap, torch.nn.Parameter]]] = [[]]
        size = 0
        for pm, param in units:
            factor = (self.tp_size if self._tp_split(pm) else 1) * (self.ep_size if pm.expert else 1)
            nbytes = param.numel() * factor * (dtype or param.dtype).itemsize
            if buckets[-1] and size + nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((pm, param))
            size += nbytes
        pending = self._start_gather(buckets[0]) if buckets[0] else None
        for i in range(len(buckets)):
            if pending is None:
                break
            current = pending
            pending = self._start_gather(buckets[i + 1]) if i + 1 < len(buckets) else None
            out = self._finish_gather(current, dtype)
            if self.is_export_sender:
                yield out

    def _tp_split(self, pm: ParamMap) -> bool:
        """Whether this parameter is split over the TP ranks (experts: only with expert tensor parallelism)."""
        return pm.kind != "rep" and (self.etp_size if pm.expert else self.tp_size) > 1

    def _start_gather(self, bucket: list[tuple[ParamMap, torch.nn.Parameter]],
                      ) -> tuple[Any, list[torch.Tensor], list[tuple[ParamMap, torch.Tensor]]]:
        """The bucket's pieces (a parameter map with this TP rank's tensor; with expert parallelism one piece per
        expert-parallel rank's copy of each expert weight, its map naming that rank's experts) and the started
        all-gather of their TP-split tensors."""
        pieces: list[tuple[ParamMap, torch.Tensor]] = [(pm, p.detach()) for pm, p in bucket if not pm.expert]
        experts = [(pm, p.detach()) for pm, p in bucket if pm.expert]
        if self.ep_size == 1:
            pieces += experts
        elif experts and self.joins_expert_export:   # synchronous: the TP gather below sends what this one receives
            flat = torch.cat([p.reshape(-1) for _, p in experts])
            parts = [torch.empty_like(flat) for _ in range(self.ep_size)]
            dist.all_gather(parts, flat, group=mpu.get_expert_model_parallel_group())
            for rank, part in enumerate(parts):
                offset = 0
                for pm, p in experts:
                    remapped = param_map(pm.mcore_name, self.layer_offset, rank * self.local_experts)
                    pieces.append((remapped, part[offset:offset + p.numel()].view(p.shape)))
                    offset += p.numel()
        # (otherwise: a TP peer of a data-parallel rank 0 outside the sender's expert-parallel group, whose experts
        # the sender gathers in its own group; folded experts are whole, so there is no TP gather of them to join)
        split = [t for pm, t in pieces if self._tp_split(pm)]
        if self.dp_rank != 0 or not split:
            return None, [], pieces
        flat = torch.cat([t.reshape(-1) for t in split])
        parts = [torch.empty_like(flat) for _ in range(self.tp_size)]
        handle = dist.all_gather(parts, flat, group=mpu.get_tensor_model_parallel_group(), async_op=True)
        return handle, parts, pieces

    def _finish_gather(self, pending: tuple[Any, list[torch.Tensor], list[tuple[ParamMap, torch.Tensor]]],
                       dtype: torch.dtype | None) -> WeightBucket:
        handle, parts, pieces = pending
        if handle is not None:
            handle.wait()
        out: WeightBucket = []
        if not self.is_export_sender:
            return out
        offset = 0
        for pm, tensor in pieces:
            if not self._tp_split(pm):
                shards = [tensor]
            else:
                n = tensor.numel()
                shards = [part[offset:offset + n].view(tensor.shape) for part in parts]
                offset += n
            for hf_name, full in megatron_shards_to_hf(pm, shards, self.hf_config):
                out.append((hf_name, full.to(dtype or full.dtype, copy=True).contiguous()))
        return out

    # --- checkpoints -------------------------------------------------------------------------------
    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        return [opt.optimizer for opt in self._megatron_optimizers()]

    def _layout(self) -> dict[str, int]:
        return {"tensor_parallel": self.tp_size, "pipeline_parallel": self.pp_size, "data_parallel": self.dp_size,
                "expert_parallel": self.ep_size, "expert_tensor_parallel": self.etp_size}

    def save(self, path: str) -> None:
        """HF layout (config.json + safetensors; one file per pipeline stage with an index when pp > 1),
        tokenizer files, each rank's optimizer shard, and trainer_state.pt written last by rank 0. With LoRA the
        weights are the adapter in PEFT's layout, written by rank 0 (lora.write_adapter, as the torch trainer),
        with the base's config.json; the base's weights stay at the base directory."""
        rank = dist.get_rank()
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        tensors: dict[str, torch.Tensor] = {}
        for bucket in self.export_weights(256 << 20):
            tensors.update({name: t.cpu() for name, t in bucket})
        fname = SINGLE_FILE if self.pp_size == 1 else shard_file_name(self.pp_rank, self.pp_size)
        if self.is_export_sender and self.lora is None:
            write_weights_file(tensors, os.path.join(path, fname))
        names: list[Any] = [None] * dist.get_world_size()
        # an adapter is small: its stages' tensors go to rank 0, which writes the one adapter file
        dist.all_gather_object(names, (fname, tensors if self.lora else sorted(tensors))
                               if self.is_export_sender else None)
        torch.save({"layout": self._layout(), "optimizers": [o.state_dict() for o in self._inner_optimizers()]},
                   os.path.join(path, f"optim_rank{rank:05d}.pt"))
        dist.barrier()
        if rank == 0 and self.lora is not None:
            adapter = {n: t for item in names if item is not None for n, t in item[1].items()}
            write_adapter(path, adapter, self.lora, self.base_dir, self.hf_config)
            copy_base_config(self.base_dir, path)
        elif rank == 0:
            if self.pp_size > 1:
                weight_map = {n: f for item in names if item is not None for f, ns in [item] for n in ns}
                write_weights_index(path, weight_map, {})
            config = self.hf_config.to_dict()
            config["torch_dtype"] = "bfloat16" if self.config.bf16 else "float32"
            with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2)
        if rank == 0:
            write_tokenizer_files(self._tokenizer_files, path)
            state = {"step": self.step, "initial_version": self._initial_version, "layout": self._layout(),
                     "config": dataclasses.asdict(self.config),
                     "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}}
            atomic_write(os.path.join(path, TRAINER_STATE), lambda f: torch.save(state, f))
        dist.barrier()

    def load(self, path: str) -> None:
        """Restore what `save` wrote, on the same parallel layout (weights on any layout: they are HF)."""
        state_path = os.path.join(path, TRAINER_STATE)
        if not os.path.exists(state_path):
            raise CheckpointError(f"{path}: no {TRAINER_STATE} (not a complete trainer checkpoint)")
        if load_config(path).to_dict() != self.hf_config.to_dict():
            raise CheckpointError(f"{path}: config.json describes a different model than this trainer's")
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        try:
            # saved before expert parallelism (ep 1) or before expert tensor parallelism had its own size (= tp)
            saved = {"expert_parallel": 1, "expert_tensor_parallel": state["layout"]["tensor_parallel"],
                     **state["layout"]}
            if saved != self._layout():
                raise CheckpointError(f"{path}: saved with layout {state['layout']}, this trainer runs "
                                      f"{self._layout()} (optimizer shards are per rank)")
            optim_path = os.path.join(path, f"optim_rank{dist.get_rank():05d}.pt")
            if not os.path.exists(optim_path):
                raise CheckpointError(f"{path}: missing {os.path.basename(optim_path)}")
            if self.lora is not None:
                self._load_adapter(path)
            else:
                self._load_hf_weights(path)
            optim = torch.load(optim_path, map_location=self.device, weights_only=False)
            for inner, sd in zip(self._inner_optimizers(), optim["optimizers"], strict=True):
                inner.load_state_dict(sd)
            self.step, self._initial_version = int(state["step"]), int(state["initial_version"])
            rng = state["rng"]
        except KeyError as e:
            raise CheckpointError(f"{state_path}: missing key {e.args[0]!r}") from None
        # The distributed optimizer's fp32 main params are views of (fp32) or copies of (bf16) the weights.
        if hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])


def is_available() -> bool:
    return MEGATRON_IMPORT_ERROR is None


__all__ = ["LocalRMSNorm", "LongSequenceAttentionError", "MEGATRON_FAMILIES", "MegatronConfig", "MegatronTrainEngine",
           "MegatronUnavailableError", "ParamMap", "QwenSequentialMLP", "TorchPackedAttention", "build_gpt_model",
           "hf_to_megatron_shard", "init_distributed", "is_available", "layer_spec", "megatron_shards_to_hf",
           "packed_causal_attention", "padded_vocab_size", "param_map", "replayed_routing", "transformer_config",
           "vocab_parallel_logprobs"]
