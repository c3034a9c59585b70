"""The decoupled PPO loss of AReaL's paper (arXiv 2505.24298), with token-level normalisation.

Asynchronous RL trains on tokens that older weights generated. Three log-probs per token:
behaviour (logp_behav: what the rollout engine sampled with, possibly several versions within one
answer), proximal (logp_prox: recomputed by the trainer with the weights it holds before this step's
updates) and current (logp: differentiable). The trust region is taken around the proximal policy and the
behaviour gap is corrected by an importance weight:

    r_t   = exp(logp_t - logp_prox_t)
    pg_t  = max(-A_t * r_t, -A_t * clip(r_t, 1 - eps_low, 1 + eps_high))
            (dual clip c > 1: for A_t < 0, pg_t = min(pg_t, -A_t * c))
    w_t   = exp(logp_prox_t - logp_behav_t), tokens with w_t > behav_cap are masked out
    loss  = sum_t pg_t * w_t * mask_t / n_tokens

With logp_prox == logp_behav, w = 1 and this is standard PPO-clip. `n_tokens` is the number of loss
tokens in the GLOBAL batch (all micro-batches, minibatch, all data-parallel ranks): summing the losses of
micro-batches then gives exactly the full-batch loss, and so does summing (all-reducing) gradients
across ranks. `count_loss_tokens` computes the count with the behaviour cap applied, which is the
denominator AReaL uses (the mean over tokens actually trained on).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from algo._validate import as_tensor, check_finite, check_mask, check_same_shape
from algo.corrections import CorrectionConfig, correct, over_cap
from algo.losses import LossConfig, PPOStats, policy_loss, token_entropy

__all__ = ["PPOConfig", "PPOStats", "count_loss_tokens", "ppo_loss", "token_entropy", "value_loss"]


@dataclass(frozen=True)
class PPOConfig:
    eps_low: float = 0.2
    eps_high: float | None = None  # None: same as eps_low (symmetric clip); DAPO's clip-higher uses 0.28
    dual_clip: float | None = None  # c > 1 bounds the loss of negative-advantage tokens at -A * c
    behav_cap: float | None = None  # mask tokens whose exp(logp_prox - logp_behav) exceeds this

    def __post_init__(self) -> None:
        if not self.eps_low > 0:
            raise ValueError(f"eps_low: must be positive, got {self.eps_low}")
        if self.eps_high is not None and not self.eps_high > 0:
            raise ValueError(f"eps_high: must be positive, got {self.eps_high}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip: must be > 1, got {self.dual_clip}")
        if self.behav_cap is not None and not self.behav_cap > 1:
            raise ValueError(f"behav_cap: must be > 1, got {self.behav_cap}")


def count_loss_tokens(
    loss_mask: torch.Tensor,
    logp_prox: torch.Tensor | None = None,
    logp_behav: torch.Tensor | None = None,
    behav_cap: float | None = None,
) -> int:
    """Loss tokens that `ppo_loss` trains on: the mask, minus tokens over the behaviour cap.
    Sum this over every micro-batch of the minibatch and every rank to get `n_tokens`."""
    mask = check_mask("loss_mask", as_tensor("loss_mask", loss_mask))
    if behav_cap is not None:
        if logp_prox is None or logp_behav is None:
            raise ValueError("logp_prox/logp_behav: both are needed to apply behav_cap")
        mask = mask & ~over_cap(logp_prox, logp_behav, behav_cap)
    return int(mask.sum())


def ppo_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    n_tokens: int | float,
    config: PPOConfig = PPOConfig(),
    *,
    logits: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PPOStats]:
    """Decoupled PPO loss of one micro-batch, normalised by the global token count `n_tokens`.

    All per-token tensors share one shape: [B, T] padded or a 1-D packed stream. `logits` ([..., V],
    aligned with logp) or a precomputed per-token `entropy` add the mean entropy to the statistics.
    Gradients flow through `logp` only.
    """
    names = ("logp", "logp_prox", "logp_behav", "advantages", "loss_mask")
    tensors = [as_tensor(n, t) for n, t in zip(names, (logp, logp_prox, logp_behav, advantages, loss_mask))]
    check_same_shape(names, tensors)
    for n, t in zip(names[:4], tensors[:4]):
        check_finite(n, t)
    if not float(n_tokens) > 0 or n_tokens != n_tokens:
        raise ValueError(f"n_tokens: must be a positive token count, got {n_tokens}")
    corrected = correct(tensors[1], tensors[2], tensors[4], CorrectionConfig(behav_cap=config.behav_cap))
    return policy_loss(tensors[0], tensors[1], tensors[3], tensors[4], n_tokens,
                       LossConfig("ppo", config.eps_low, config.eps_high, config.dual_clip),
                       weight=corrected.weight, keep=corrected.keep, logits=logits, entropy=entropy)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    n_tokens: int | float,
    clip: float | None = 0.2,
) -> torch.Tensor:
    """Clipped squared-error critic loss, 0.5 * max((V - R)^2, (V_clipped - R)^2), token-normalised by
    the global `n_tokens` like the policy loss. For the critic research direction; unused by default."""
    names = ("values", "old_values", "returns", "loss_mask")
    tensors = [as_tensor(n, t) for n, t in zip(names, (values, old_values, returns, loss_mask))]
    check_same_shape(names, tensors)
    for n, t in zip(names[:3], tensors[:3]):
        check_finite(n, t)
    values, old_values, returns = tensors[0], tensors[1].detach(), tensors[2].detach()
    mask = check_mask("loss_mask", tensors[3])
    if not float(n_tokens) > 0:
        raise ValueError(f"n_tokens: must be a positive token count, got {n_tokens}")
    err = (values - returns) ** 2
    if clip is not None:
        v_clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (v_clipped - returns) ** 2)
    return 0.5 * torch.where(mask, err, torch.zeros_like(err)).sum() / float(n_tokens)
