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

from dataclasses import dataclass, fields

import torch

from algo._validate import as_tensor, check_finite, check_mask, check_same_shape


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


@dataclass
class PPOStats:
    """Sums and counts over one micro-batch; `merge` adds micro-batches, `summary` gives the means and
    maxima AReaL logs. Everything is a plain float so it travels in a message or a metrics line."""

    n_tokens: float = 0.0  # loss-mask tokens seen (before the behaviour cap)
    n_trained: float = 0.0  # of those, not masked by the behaviour cap
    n_clipped: float = 0.0  # trained tokens where the clipped branch was active
    n_dual_clipped: float = 0.0
    loss_sum: float = 0.0  # sum of pg_t * w_t over trained tokens (unnormalised)
    ratio_sum: float = 0.0
    ratio_max: float = 0.0
    behav_weight_sum: float = 0.0  # over all loss-mask tokens, capped or not
    behav_weight_max: float = 0.0
    approx_kl_sum: float = 0.0  # k1 estimate of KL(prox || current): logp_prox - logp
    entropy_sum: float = 0.0
    n_entropy: float = 0.0

    def merge(self, other: "PPOStats") -> "PPOStats":
        out = PPOStats()
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(out, f.name, max(a, b) if f.name.endswith("_max") else a + b)
        return out

    def summary(self) -> dict[str, float]:
        n, t = max(self.n_tokens, 1.0), max(self.n_trained, 1.0)
        out = {
            "n_tokens": self.n_tokens,
            "clip_ratio": self.n_clipped / t,
            "dual_clip_ratio": self.n_dual_clipped / t,
            "behav_masked_frac": (self.n_tokens - self.n_trained) / n,
            "importance_weight_mean": self.behav_weight_sum / n,
            "importance_weight_max": self.behav_weight_max,
            "ratio_mean": self.ratio_sum / t,
            "ratio_max": self.ratio_max,
            "approx_kl": self.approx_kl_sum / t,
            "loss_token_mean": self.loss_sum / t,
        }
        if self.n_entropy:
            out["entropy"] = self.entropy_sum / self.n_entropy
        return out


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
        mask = mask & ~_over_cap(logp_prox, logp_behav, behav_cap)
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
    logp, logp_prox, logp_behav, advantages, _ = tensors
    mask = check_mask("loss_mask", tensors[4])
    if not float(n_tokens) > 0 or n_tokens != n_tokens:
        raise ValueError(f"n_tokens: must be a positive token count, got {n_tokens}")

    logp_prox = logp_prox.detach()
    logp_behav = logp_behav.detach()
    adv = advantages.detach()
    eps_high = config.eps_high if config.eps_high is not None else config.eps_low

    # zero the log-ratio off the mask before exp(): padding with arbitrary log-probs must not overflow
    # into inf, whose gradient would turn into NaN even behind a where()
    ratio = torch.exp(torch.where(mask, logp - logp_prox, torch.zeros_like(logp)))
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - config.eps_low, 1.0 + eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clipped = pg_clipped > pg_unclipped
    dual = torch.zeros_like(clipped)
    if config.dual_clip is not None:
        bound = -adv * config.dual_clip
        dual = (adv < 0) & (pg > bound)
        pg = torch.where(dual, bound, pg)

    behav_weight = torch.exp(torch.where(mask, logp_prox - logp_behav, torch.zeros_like(logp_prox)))
    trained = mask
    if config.behav_cap is not None:
        trained = mask & ~_over_cap(logp_prox, logp_behav, config.behav_cap)
    per_token = pg * torch.where(trained, behav_weight, torch.zeros_like(behav_weight))
    loss = torch.where(trained, per_token, torch.zeros_like(per_token)).sum() / float(n_tokens)

    with torch.no_grad():
        stats = PPOStats(
            n_tokens=float(mask.sum()),
            n_trained=float(trained.sum()),
            n_clipped=float((clipped & trained).sum()),
            n_dual_clipped=float((dual & trained).sum()),
            loss_sum=float(per_token[trained].sum()),
            ratio_sum=float(ratio[trained].sum()),
            ratio_max=float(ratio[trained].max()) if bool(trained.any()) else 0.0,
            behav_weight_sum=float(behav_weight[mask].sum()),
            behav_weight_max=float(behav_weight[mask].max()) if bool(mask.any()) else 0.0,
            approx_kl_sum=float((logp_prox - logp)[trained].sum()),
        )
        if logits is not None or entropy is not None:
            ent = token_entropy(logits) if entropy is None else as_tensor("entropy", entropy)
            check_finite("entropy", ent)
            check_same_shape(("logp", "entropy"), (logp, ent))
            stats.entropy_sum = float(ent[trained].sum())
            stats.n_entropy = float(trained.sum())
    return loss, stats


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dimension, per token (no gradient)."""
    check_finite("logits", logits)
    with torch.no_grad():
        logz = torch.log_softmax(logits.float(), dim=-1)
        return -(logz.exp() * logz).sum(-1)


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


def _over_cap(logp_prox: torch.Tensor, logp_behav: torch.Tensor, cap: float) -> torch.Tensor:
    # compare in log space: exp() of a large gap overflows float32 long before the comparison matters
    check_finite("logp_prox", as_tensor("logp_prox", logp_prox))
    check_finite("logp_behav", as_tensor("logp_behav", logp_behav))
    return (logp_prox.detach() - logp_behav.detach()) > torch.log(torch.tensor(float(cap))).to(logp_prox.dtype)
