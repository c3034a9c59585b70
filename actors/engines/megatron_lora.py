"""LoRA on the Megatron-core trainer: adapters on Megatron's tensor-parallel linear layers, named as Hugging Face.

megatron-core (0.11 to 0.16) ships no LoRA layer; Megatron-Bridge's PEFT (``megatron/bridge/peft``) needs a newer
megatron-core and Python than we pin, and NeMo's is another package. This is our own thin layer, built to give the
same adapter as the torch trainer (``lora.py``): one (A, B) pair per Hugging Face projection, also where Megatron
fuses projections into one linear layer (``linear_qkv``: q, k, v; ``linear_fc1``: gate, up), as Megatron-Bridge's
``canonical_lora.py`` does, so an adapter version, a checkpoint and an export hold the tensors the torch trainer's do
(``model.layers.N.self_attn.q_proj.lora_A.weight``, ...).

Tensor parallelism splits each adapter the way its linear layer is split (PEFT's ``tuners/lora/tp_layer.py`` does the
same):

* column-parallel (``linear_qkv``, ``linear_fc1``; output rows split): A replicated, B split on its output rows as
  the layer's weight is (whole query groups per rank for q, k and v; the rank's gate and up rows). ``h = A x`` is the
  same on every rank; its gradient is summed over the TP ranks (each rank's B shard sees only its rows).
* row-parallel (``linear_proj``, ``linear_fc2``; input columns split): A split on its input columns, B replicated.
  The partial ``A_r x_r`` are summed over the TP ranks (an all-reduce of a rank-wide vector), then B applies.

With sequence parallelism each rank holds 1/tp of the tokens: a column-parallel adapter applies A to its own tokens
and all-gathers the rank-wide ``h``; a row-parallel one applies B to its own tokens of ``h``. The replicated matrix
then has a gradient from its rank's tokens only: it is marked ``sequence_parallel``, so Megatron's
``finalize_model_grads`` sums it over the TP ranks (as for the norms).

The adapter is a child ``lora`` of the linear layer, and a forward hook adds its output to the layer's: every base
parameter keeps its Megatron name, and the adapters are ``<linear>.lora.<projection>.lora_A.weight``.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .lora import LoraError, LoraSpec, _targeted, lora_problem, target_linears
from .model import Qwen2Config, Qwen2ForCausalLM


def _tensor_parallel() -> Any:
    """megatron-core's tensor_parallel, imported when an adapter first runs: the launcher's checks import this
    module for :func:`megatron_lora_problem`, and megatron-core takes seconds to import."""
    from megatron.core import tensor_parallel
    return tensor_parallel


#: Megatron's linear layers of a Qwen2 layer: (how tensor parallelism splits it, the Hugging Face block holding
#: its projections, the projections it holds in the order of its output rows).
LORA_LINEARS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "self_attention.linear_qkv": ("column", "self_attn", ("q_proj", "k_proj", "v_proj")),
    "self_attention.linear_proj": ("row", "self_attn", ("o_proj",)),
    "mlp.linear_fc1": ("column", "mlp", ("gate_proj", "up_proj")),
    "mlp.linear_fc2": ("row", "mlp", ("down_proj",)),
}
ADAPTER_CHILD = "lora"


def megatron_lora_problem(config: Qwen2Config, spec: LoraSpec) -> str | None:
    """Why ``spec`` cannot train on the Megatron trainer (None when it can): what :func:`lora.lora_problem` says,
    or a target outside the decoder layers' projections (``lm_head``: Megatron's output layer is split over the
    padded vocabulary and tied to the embedding on some models; the adapters here live in the decoder layers)."""
    problem = lora_problem(config, spec)
    if problem:
        return problem
    model = Qwen2ForCausalLM.on_meta(config)
    projections = {p for _, _, parts in LORA_LINEARS.values() for p in parts}
    outside = sorted({name for name, _ in target_linears(model, spec)
                      if not (name.startswith("model.layers.") and name.rsplit(".", 1)[-1] in projections)})
    if outside:
        return (f"model.lora.target_modules: {outside[:3]} are not adapted on the megatron trainer (it adapts the "
                f"decoder layers' {', '.join(sorted(projections))}); adapt those, or train on backend: torch")
    return None


def hf_module(linear_name: str, projection: str, layer_offset: int) -> str:
    """The Hugging Face module name of ``projection`` in the Megatron linear layer ``linear_name``
    (``decoder.layers.0.self_attention.linear_qkv``), layer number made global."""
    parts = linear_name.split(".")
    _, block, _ = LORA_LINEARS[".".join(parts[3:])]
    return f"model.layers.{int(parts[2]) + layer_offset}.{block}.{projection}"


def _output_blocks(config: Qwen2Config, suffix: str, tp_size: int) -> tuple[int, dict[str, int]]:
    """(blocks, rows per projection on this rank) of a column-parallel layer's output: each block is the
    projections' rows one after the other. linear_qkv: a block per query group (its query heads, key, value);
    linear_fc1: one block [gate; up]."""
    if suffix == "self_attention.linear_qkv":
        groups, d = config.num_key_value_heads // tp_size, config.head_dim
        per = config.num_attention_heads // config.num_key_value_heads
        return groups, {"q_proj": groups * per * d, "k_proj": groups * d, "v_proj": groups * d}
    rows = config.intermediate_size // tp_size
    return 1, {"gate_proj": rows, "up_proj": rows}


class _Adapter(nn.Module):
    """One projection's pair: lora_A (in -> rank) and lora_B (rank -> out), float32 as the torch trainer's."""

    def __init__(self, in_features: int, out_features: int, rank: int, device: torch.device) -> None:
        super().__init__()
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=device, dtype=torch.float32)


class ParallelLora(nn.Module):
    """The adapters of one Megatron linear layer (the module docstring): ``forward(x)`` is what they add to the
    layer's output for its input ``x``, in the layer's output layout on this rank."""

    def __init__(self, style: str, sizes: dict[str, tuple[int, int]], targeted: list[str], blocks: int,
                 spec: LoraSpec, sequence_parallel: bool, device: torch.device) -> None:
        super().__init__()
        self.style, self.blocks, self.scaling = style, blocks, spec.scaling
        self.order = list(sizes)                     # every projection of the layer, in its output order
        self.out_rows = {p: sizes[p][1] for p in sizes}
        self.sequence_parallel = sequence_parallel
        self.dropout = spec.dropout
        self.adapters = nn.ModuleDict({p: _Adapter(*sizes[p], spec.rank, device) for p in targeted})
        for adapter in self.adapters.values():
            # the replicated matrix sees only this rank's tokens under sequence parallelism (module docstring)
            replicated = adapter.lora_A if style == "column" else adapter.lora_B
            replicated.weight.sequence_parallel = sequence_parallel

    def _dropout_rng(self) -> Any:
        """Where the adapter's input differs between TP ranks (a row-parallel layer's input columns, or this rank's
        tokens under sequence parallelism) each rank draws its own mask (Megatron's model-parallel RNG); where
        it is the same on every rank, the same mask (the default RNG, seeded alike)."""
        if self.style == "row" or self.sequence_parallel:
            return _tensor_parallel().get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tensor_parallel = _tensor_parallel()
        x = x.float()
        if self.dropout > 0 and self.training:
            with self._dropout_rng():
                x = F.dropout(x, self.dropout)
        if self.style == "row":
            (name, adapter), = self.adapters.items()
            h = tensor_parallel.reduce_from_tensor_model_parallel_region(adapter.lora_A(x))
            if self.sequence_parallel:
                h = tensor_parallel.scatter_to_sequence_parallel_region(h)
            return adapter.lora_B(h) * self.scaling
        outs = []
        for name in self.order:
            if name not in self.adapters:
                outs.append(None)
                continue
            adapter = self.adapters[name]
            h = adapter.lora_A(x)
            h = (tensor_parallel.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)
                 if self.sequence_parallel else tensor_parallel.copy_to_tensor_model_parallel_region(h))
            outs.append(adapter.lora_B(h) * self.scaling)
        like = next(o for o in outs if o is not None)
        lead = like.shape[:-1]
        parts = [(o if o is not None else like.new_zeros(*lead, self.out_rows[n])).reshape(*lead, self.blocks, -1)
                 for n, o in zip(self.order, outs)]
        return torch.cat(parts, dim=-1).reshape(*lead, -1)


def _add_adapter_output(linear: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    """Forward hook of an adapted linear layer: its output plus its adapter's, its bias output unchanged."""
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + getattr(linear, ADAPTER_CHILD)(x).to(out.dtype), bias


def add_parallel_lora(model: nn.Module, config: Qwen2Config, spec: LoraSpec, layer_offset: int, tp_size: int,
                      sequence_parallel: bool) -> list[str]:
    """Freeze ``model`` (this rank's stage of the GPTModel) and put adapters on the projections ``spec`` targets;
    the Hugging Face names of the adapted projections. The adapters' values are set by the caller (an initial
    or saved adapter, converted to this rank's shards)."""
    problem = megatron_lora_problem(config, spec)
    if problem:
        raise LoraError(problem)
    model.requires_grad_(False)
    adapted = []
    for name, linear in list(model.named_modules()):
        suffix = ".".join(name.split(".")[3:])
        if not name.startswith("decoder.layers.") or suffix not in LORA_LINEARS:
            continue
        style, _, projections = LORA_LINEARS[suffix]
        targeted = [p for p in projections if _targeted(hf_module(name, p, layer_offset), spec.target_modules)]
        if not targeted:
            continue
        weight = linear.weight
        if style == "column":
            blocks, rows = _output_blocks(config, suffix, tp_size)
            sizes = {p: (weight.shape[1], rows[p]) for p in projections}
        else:
            blocks, sizes = 1, {projections[0]: (weight.shape[1], weight.shape[0])}
        linear.add_module(ADAPTER_CHILD, ParallelLora(style, sizes, targeted, blocks, spec, sequence_parallel,
                                                      weight.device))
        linear.register_forward_hook(_add_adapter_output, with_kwargs=True)
        adapted += [hf_module(name, p, layer_offset) for p in targeted]
    return adapted


def adapter_param_names(linear_suffix: str, rest: str) -> tuple[str, str, str] | None:
    """(HF block, projection, matrix) of an adapter parameter ``<linear_suffix>.lora.adapters.<proj>.<matrix>.weight``
    (``rest`` is what follows the linear layer's name), None for a base parameter."""
    prefix = f"{ADAPTER_CHILD}.adapters."
    if not rest.startswith(prefix) or linear_suffix not in LORA_LINEARS:
        return None
    projection, matrix, _ = rest[len(prefix):].split(".")
    return LORA_LINEARS[linear_suffix][1], projection, matrix
