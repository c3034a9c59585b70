"""The feed-forward blocks of the decoder (model.py): the SwiGLU MLP, and Qwen3-MoE's routed mixture of experts.

A sparse block scores each token's hidden state against every expert (`gate`, a bias-free linear layer),
takes the softmax over all experts, keeps the top `k` (renormalised over those k when `norm_topk_prob`), and
sums those experts' SwiGLU outputs weighted by their probabilities: transformers' Qwen3MoeTopKRouter and
Qwen3MoeExperts, step by step. The experts are a `ModuleList` of MLPs so their parameters carry the names of
Hugging Face checkpoints (`mlp.experts.3.gate_proj.weight`) and travel through weight sync unchanged; the
tokens are sorted by expert once and each expert runs on its slice (one matmul per expert hit, no padding).

Routing replay (`RoutingTrace`): a forward can record the experts every sparse layer chose for each token, and
a later forward over the same tokens can replay them. Only the discrete choice is replayed: the weights are
the current router's probabilities at the replayed experts, so the router still gets gradients (verl's
`RouterReplay.get_replay_topk`, verl/utils/megatron/router_replay_patch.py; Megatron-LM's
`moe_enable_routing_replay`).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

# The expert id of a replayed token row that has no recorded routing: it is routed by its own router.
ROUTE_NATIVE = -1


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclasses.dataclass
class RoutingTrace:
    """What the sparse layers of one forward pass record and replay. Token rows are the forward's tokens in
    order ([B, T] flattened; a packed stream's tokens as packed).

    record: keep each sparse layer's chosen experts (`chosen`, in layer order)
    replay: [tokens, sparse layers, k] expert ids to route by instead of the router's top-k; a row whose
        first id is ROUTE_NATIVE is routed natively
    keep_router_logits: keep each sparse layer's router logits (`router_logits`), for the load-balancing loss
    """

    record: bool = False
    replay: torch.Tensor | None = None
    keep_router_logits: bool = False
    chosen: list[torch.Tensor] = dataclasses.field(default_factory=list)
    router_logits: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def experts(self) -> torch.Tensor:
        """The recorded choices as one [tokens, sparse layers, k] tensor."""
        return torch.stack(self.chosen, dim=1)


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(hidden_size, intermediate_size) for _ in range(num_experts))

    def forward(self, x: torch.Tensor, trace: RoutingTrace | None = None, slot: int = 0) -> torch.Tensor:
        """x [..., H]; ``slot``: this layer's index among the model's sparse layers (its column in a trace)."""
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        chosen = torch.topk(probs, self.top_k, dim=-1).indices
        if trace is not None and trace.replay is not None:
            replay = trace.replay[:, slot].to(chosen.device, torch.long)
            if replay.shape != chosen.shape:
                raise ValueError(f"routing replay: {tuple(replay.shape)} expert ids for a layer that routes "
                                 f"{tuple(chosen.shape)} (tokens, top-k)")
            chosen = torch.where(replay[:, :1] == ROUTE_NATIVE, chosen, replay)
        weights = probs.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        if trace is not None:
            if trace.record:
                trace.chosen.append(chosen)
            if trace.keep_router_logits:
                trace.router_logits.append(logits)
        return self._mix(flat, chosen, weights).reshape(x.shape)

    def _mix(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts of weight * expert(token)."""
        out = torch.zeros_like(flat)
        assignments = chosen.reshape(-1)
        order = assignments.argsort(stable=True)  # (token, slot) pairs grouped by expert, tokens ascending
        counts = torch.bincount(assignments, minlength=len(self.experts)).tolist()
        flat_weights = weights.reshape(-1)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                pairs = order[start:start + count]
                tokens = pairs // self.top_k
                out.index_add_(0, tokens, (expert(flat[tokens]) * flat_weights[pairs, None]).to(out.dtype))
                start += count
        return out


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss over all sparse layers, as transformers' Qwen3-MoE computes it
    (``load_balancing_loss_func`` without a mask): num_experts * sum_e f_e * P_e, where f_e is the share of
    (token, top-k) assignments expert e got and P_e its mean router probability, over all layers' tokens."""
    probs = torch.softmax(torch.cat(router_logits).float(), dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    counts = torch.zeros(num_experts, dtype=torch.float32, device=probs.device)
    counts.scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device))
    rows = probs.shape[0]
    return num_experts * torch.sum((counts / rows) * (probs.sum(0) / rows))


def compact_routes(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Expert ids in the smallest integer type that holds them: uint8 up to 256 experts, else int16."""
    return experts.to(torch.uint8 if num_experts <= 256 else torch.int16)
