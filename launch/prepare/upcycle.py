"""Sparse upcycling: the first weights of a mixture-of-experts model taken from a trained dense model.

A warm-start recipe may start its MoE from a dense model of the same shape (`prepare.warm_start.upcycle`)
instead of from random weights: the embeddings, norms and attention are copied, and every expert of a sparse
layer is a slice of that layer's dense MLP (Komatsuzaki et al., "Sparse Upcycling", 2022, copy the whole MLP
into each expert; Qwen1.5-MoE-A2.7B partitions it into finer experts, as here when the experts are narrower).
With a dense MLP of `parts` x moe_intermediate_size units, expert e takes the units of part e mod parts and its
down projection is scaled by `parts`, so a token routed to one expert of each part with equal weights computes
the dense MLP exactly. The routers start small and random (normal(0, initializer_range), the model's own
initialisation), so routing spreads over the copies and the experts drift apart as the model trains.

Families may differ where the MoE's has no counterpart: Qwen2's q/k/v biases are left out (Qwen3 has none) and
Qwen3's q/k RMSNorms start at one (Qwen2 has none). Neither keeps the dense model's function, so an upcycled
model is trained further before use; `upcycle` returns what it left out and what it initialised.
"""
from __future__ import annotations

from typing import Any

import torch

from actors.engines.checkpoint import (assign_weights, iter_checkpoint_tensors, load_config, read_tokenizer_files,
                                       save_model, write_tokenizer_files)
from actors.engines.model import Qwen2ForCausalLM, Qwen3MoeConfig

# Keys whose values the dense model and the mixture of experts must share, for every non-MLP tensor to fit.
SHARED_SHAPE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "tie_word_embeddings")
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


class UpcycleError(ValueError):
    """The dense model cannot seed the mixture of experts; the message names the key that differs."""


def upcycle(dense_dir: str, moe_dir: str, out: str, seed: int = 0) -> dict[str, Any]:
    """Write to ``out`` the model of ``moe_dir``'s config.json and tokenizer with its weights upcycled from the
    dense checkpoint ``dense_dir``; returns {"parts", "left_out", "initialised"} (tensor names)."""
    dense, moe = load_config(dense_dir), load_config(moe_dir)
    if not isinstance(moe, Qwen3MoeConfig):
        raise UpcycleError(f"upcycle: {moe_dir} is {moe.MODEL_TYPE!r}, not a mixture of experts (qwen3_moe)")
    if isinstance(dense, Qwen3MoeConfig):
        raise UpcycleError(f"upcycle: {dense_dir} is a mixture of experts already; the source must be dense")
    for key in SHARED_SHAPE:
        if getattr(dense, key) != getattr(moe, key):
            raise UpcycleError(f"upcycle: key {key!r} is {getattr(dense, key)} in {dense_dir} and "
                               f"{getattr(moe, key)} in {moe_dir}; they must match")
    parts, rest = divmod(dense.intermediate_size, moe.moe_intermediate_size)
    if rest or not parts:
        raise UpcycleError(f"upcycle: the dense intermediate_size {dense.intermediate_size} is not a multiple of "
                           f"moe_intermediate_size {moe.moe_intermediate_size}")
    model = Qwen2ForCausalLM(moe).init_weights(seed)
    params = dict(model.named_parameters())
    given, left_out = {}, []
    for name, tensor in iter_checkpoint_tensors(dense_dir):
        layer_mlp = _layer_mlp(name)
        if layer_mlp is None:
            if name in params:
                given[name] = tensor
            elif name != "lm_head.weight":      # a tied head is the embedding, copied as such
                left_out.append(name)
            continue
        layer, proj = layer_mlp
        if not moe.is_sparse_layer(layer):
            given[name] = tensor
            continue
        for expert in range(moe.num_experts):
            units = slice((expert % parts) * moe.moe_intermediate_size, (expert % parts + 1) * moe.moe_intermediate_size)
            piece = tensor[:, units] * parts if proj == "down_proj" else tensor[units]
            given[f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"] = piece
    assign_weights(model, given.items(), strict=False, source=dense_dir)
    initialised = sorted(set(params) - set(given) - ({"lm_head.weight"} if moe.tie_word_embeddings else set()))
    save_model(model, out)
    write_tokenizer_files(read_tokenizer_files(moe_dir), out)
    return {"parts": parts, "left_out": sorted(left_out), "initialised": initialised}


def _layer_mlp(name: str) -> tuple[int, str] | None:
    """(layer, projection) of a dense MLP weight `model.layers.L.mlp.P.weight`; None for any other tensor."""
    fields = name.split(".")
    if len(fields) == 6 and fields[:2] == ["model", "layers"] and fields[3] == "mlp" and fields[4] in _MLP_NAMES:
        return int(fields[2]), fields[4]
    return None

