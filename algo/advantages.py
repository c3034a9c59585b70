"""Rewards and advantages: from per-answer scores to per-token advantages.

Two forms, chosen by `compute_advantages(group_norm=...)` (`algo.group_norm` in the experiment config):

* AReaL's (group_norm False; its v0.1/v0.2 recipes: GAE with gamma = lambda = 1 and no critic, then "normalize
  them across all generated tokens", `group_adv_norm: false` in its v0.2 configs): the raw sequence reward on
  every token of its answer, standardised over all valid tokens of the batch. Rewards [5, 5 | -5, 5], one
  token each: [0.58, 0.58, -1.73, 0.58].
* the group form (group_norm True; GRPO's baseline): each reward minus its group's mean (divided by the group's
  std with `group_std`) first, then the same. The same rewards: [0, 0, -1.41, 1.41].

Each step is a function of its own:

1. `sequence_rewards`: a checker score in [0, 1] (1 = correct; a fraction of unit tests passed also
   works) becomes a sequence reward, +5 correct / -5 wrong by default, then (r + bias) * scale, clipped.
2. `group_normalize` (the group form only): subtract the mean (and optionally divide by the std) of the
   rewards of the answers to the same prompt (GRPO-style baseline, no critic needed).
3. `token_rewards`: the sequence reward sits on the last valid token of the answer; an optional KL
   penalty against a reference policy (`kl_penalty`, estimators k1/k2/k3) is subtracted on every token.
4. `gae`: generalised advantage estimation over the valid tokens of each sequence; gamma = lambda = 1
   and no critic by default (then every token of an answer gets its reward), a value baseline works too.
5. `normalize_advantages`: mean/std normalisation over all valid tokens of the (global) batch; the
   moments can be computed per rank with `masked_moments`, summed across ranks, and passed in.
   `group_normalize_tokens` does the same within each group (the answers to one prompt) instead, and
   `apply_adv_norm` picks one by name (`algo.adv_norm`: batch, group or none).

`compute_advantages` chains them. Tensors are [B, T] padded with a loss mask, or 1-D packed streams
with `cu_seqlens` (see algo.packing). The mask may have gaps (multi-turn): the GAE recursion runs over
the valid tokens of a sequence in order, skipping masked ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from algo._validate import as_tensor, check_finite, check_grouped_rewards, check_mask, check_same_shape
from algo.packing import pad_packed, unpad

KLEstimator = Literal["k1", "k2", "k3"]
AdvNorm = Literal["batch", "group", "none"]
Baseline = Literal["mean", "leave_one_out"]
StdLevel = Literal["group", "batch"]
ADV_NORMS: tuple[str, ...] = ("batch", "group", "none")


def sequence_rewards(
    scores: torch.Tensor,
    *,
    correct_reward: float = 5.0,
    wrong_reward: float = -5.0,
    scale: float = 1.0,
    bias: float = 0.0,
    clip: float | None = None,
) -> torch.Tensor:
    """Map checker scores in [0, 1] to rewards: ((wrong + (correct - wrong) * score) + bias) * scale,
    then clipped to [-clip, clip] when `clip` is given. Bool scores are accepted. Returns float32 [B]."""
    s = as_tensor("scores", scores)
    s = s.to(torch.float64)
    check_finite("scores", s)
    if s.numel() and (bool((s < 0).any()) or bool((s > 1).any())):
        raise ValueError("scores: must lie in [0, 1] (1 = correct)")
    for name, v in (("correct_reward", correct_reward), ("wrong_reward", wrong_reward), ("scale", scale), ("bias", bias)):
        if not torch.isfinite(torch.tensor(float(v))):
            raise ValueError(f"{name}: must be finite, got {v}")
    r = (wrong_reward + (correct_reward - wrong_reward) * s + bias) * scale
    if clip is not None:
        if not clip > 0:
            raise ValueError(f"clip: must be positive, got {clip}")
        r = r.clamp(-clip, clip)
    return r.to(torch.float32)


def group_normalize(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, use_std: bool = True, eps: float = 1e-5,
    baseline: Baseline = "mean", std_level: StdLevel = "group",
) -> torch.Tensor:
    """Subtract each group's mean reward (and divide by its population std + eps when `use_std`).

    `group_ids[i]` names the prompt answer i belongs to (any integers, any order). A group of one answer,
    or one whose answers all got the same reward, gets zero advantage: it carries no learning signal.

    `baseline="leave_one_out"` (RLOO, arXiv 2402.14740 eq. 6) subtracts the mean of the OTHER answers of
    the group instead: r_i - (sum_j r_j - r_i) / (G - 1) = G / (G - 1) * (r_i - mean); a group of one
    gets 0. `std_level="batch"` (LitePPO, arXiv 2508.08221 section 4.1: "group-level mean, batch-level
    std") divides by the population std of all rewards of the batch instead of each group's.
    """
    r, gid = check_grouped_rewards(rewards, group_ids)
    if r.numel() == 0:
        return r.clone()
    x = r.to(torch.float64)
    _, inverse = torch.unique(gid, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    count = torch.bincount(inverse, minlength=n_groups).to(torch.float64)
    mean = torch.bincount(inverse, weights=x, minlength=n_groups) / count
    centred = x - mean[inverse]
    dev = centred
    if baseline == "leave_one_out":
        others = (count - 1.0)[inverse]
        dev = torch.where(others > 0, dev * count[inverse] / others.clamp(min=1.0), torch.zeros_like(dev))
    elif baseline != "mean":
        raise ValueError(f"baseline: must be 'mean' or 'leave_one_out', got {baseline!r}")
    if use_std:
        if std_level == "group":
            std = torch.sqrt(torch.bincount(inverse, weights=centred * centred, minlength=n_groups) / count)
            dev = dev / (std[inverse] + eps)
        elif std_level == "batch":
            dev = dev / (torch.sqrt(((x - x.mean()) ** 2).mean()) + eps)
        else:
            raise ValueError(f"std_level: must be 'group' or 'batch', got {std_level!r}")
    return dev.to(r.dtype if r.is_floating_point() else torch.float32)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476 eq. 13), per answer: 0 up to max_length - buffer
    tokens, then falling linearly to -factor at max_length (and -factor beyond). Added to the reward."""
    n = as_tensor("lengths", lengths).to(torch.float64)
    if not 0 < buffer <= max_length:
        raise ValueError(f"buffer: must be in 1..max_length ({max_length}), got {buffer}")
    if not factor >= 0:
        raise ValueError(f"factor: must be >= 0, got {factor}")
    over = (n - (max_length - buffer)).clamp(min=0.0, max=float(buffer))
    return (-factor * over / buffer).to(torch.float32)


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: KLEstimator = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from log-probs of the sampled tokens.

    k1 = log p - log p_ref (unbiased, high variance, can be negative); k2 = (log p - log p_ref)^2 / 2;
    k3 = exp(log p_ref - log p) - (log p_ref - log p) - 1 (unbiased, always >= 0; Schulman's estimator).
    """
    check_finite("logp", logp)
    check_finite("logp_ref", logp_ref)
    check_same_shape(("logp", "logp_ref"), (logp, logp_ref))
    log_ratio = logp - logp_ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio * log_ratio
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"estimator: must be 'k1', 'k2' or 'k3', got {estimator!r}")


def token_rewards(
    seq_rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token rewards: `seq_rewards[b]` on the last valid token of sequence b, minus kl_coef * kl on
    every valid token; zero on masked tokens. A sequence with no valid token gets nothing."""
    view = _PaddedView(cu_seqlens, loss_mask)
    mask = view.mask
    r = as_tensor("seq_rewards", seq_rewards)
    check_finite("seq_rewards", r)
    if r.shape != (mask.shape[0],):
        raise ValueError(f"seq_rewards: shape {tuple(r.shape)} does not match {mask.shape[0]} sequences")
    out = torch.zeros(mask.shape, dtype=torch.float64)
    has_token = mask.any(dim=1)
    last = mask.shape[1] - 1 - mask.flip(1).int().argmax(dim=1)
    rows = torch.nonzero(has_token).squeeze(1)
    out[rows, last[rows]] = r.to(torch.float64)[rows]
    if kl is not None and kl_coef != 0.0:
        kl_p = view.pad("kl", kl).to(torch.float64)
        out = out - kl_coef * kl_p * mask
    return view.unpad(out.to(torch.float32))


def gae(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the valid tokens of each sequence.

    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1}, where t+1 is the
    next valid token of the same sequence and V after the last one is 0 (the answer ended). Without
    `values` V = 0. Returns (advantages, returns = advantages + values), zero on masked tokens.
    """
    if not (0.0 <= gamma <= 1.0) or not (0.0 <= lam <= 1.0):
        raise ValueError(f"gamma/lam: must lie in [0, 1], got gamma={gamma}, lam={lam}")
    view = _PaddedView(cu_seqlens, loss_mask)
    mask = view.mask
    r = view.pad("rewards", rewards).to(torch.float64)
    v = view.pad("values", values).to(torch.float64) if values is not None else None
    if gamma == 1.0 and lam == 1.0:
        # the sum telescopes: A_t = (sum of rewards from t on) - V_t; no compaction needed
        future = (r * mask).flip(1).cumsum(1).flip(1)
        adv = (future - v if v is not None else future) * mask
        ret = adv + (v * mask if v is not None else 0.0)
        return view.unpad(adv.to(torch.float32)), view.unpad(ret.to(torch.float32))
    # compact each row's valid tokens to the left so the recursion runs over them without gaps
    pos = torch.cumsum(mask.long(), dim=1) - 1
    counts = mask.sum(dim=1)
    width = int(counts.max()) if counts.numel() else 0
    rows = torch.arange(mask.shape[0]).unsqueeze(1).expand_as(mask)[mask]
    cols = pos[mask]
    rc = torch.zeros(mask.shape[0], width, dtype=torch.float64)
    rc[rows, cols] = r[mask]
    vc = torch.zeros_like(rc)
    if v is not None:
        vc[rows, cols] = v[mask]
    v_next = torch.zeros_like(vc)
    v_next[:, :-1] = vc[:, 1:]  # past each row's last valid token vc is 0: terminal value
    delta = rc + gamma * v_next - vc
    adv_c = torch.zeros_like(delta)
    running = torch.zeros(mask.shape[0], dtype=torch.float64)
    for t in range(width - 1, -1, -1):
        running = delta[:, t] + gamma * lam * running
        adv_c[:, t] = running
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    adv[mask] = adv_c[rows, cols]
    ret = adv + (v * mask if v is not None else 0.0)
    return view.unpad(adv.to(torch.float32)), view.unpad(ret.to(torch.float32))


def masked_moments(x: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """float64 [sum, sum of squares, count] of `x` over valid tokens: sum these across data-parallel
    ranks (all-reduce) and pass the result to `normalize_advantages` to normalise over the global batch."""
    check_finite("x", x)
    mask = check_mask("loss_mask", as_tensor("loss_mask", loss_mask))
    check_same_shape(("x", "loss_mask"), (x, mask))
    xm = x.to(torch.float64)[mask]
    return torch.stack([xm.sum(), (xm * xm).sum(), torch.tensor(float(xm.numel()), dtype=torch.float64)])


def normalize_advantages(
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    moments: torch.Tensor | None = None,
    use_std: bool = True,
    eps: float = 1e-5,
) -> torch.Tensor:
    """(A - mean) / (std + eps) with mean and population std over all valid tokens; zero elsewhere.

    `moments` (from `masked_moments`, possibly summed over ranks) overrides the local statistics.
    """
    if moments is None:
        moments = masked_moments(advantages, loss_mask)
    else:
        check_finite("advantages", advantages)
        moments = as_tensor("moments", moments).to(torch.float64)
        check_finite("moments", moments)
        if moments.shape != (3,):
            raise ValueError(f"moments: must be [sum, sum_sq, count], got shape {tuple(moments.shape)}")
    mask = check_mask("loss_mask", as_tensor("loss_mask", loss_mask))
    total, total_sq, count = (float(m) for m in moments)
    if count <= 0:
        return torch.zeros_like(advantages)
    mean = total / count
    x = advantages.to(torch.float64) - mean
    if use_std:
        var = max(total_sq / count - mean * mean, 0.0)
        x = x / (var**0.5 + eps)
    return (x * mask).to(advantages.dtype)


def group_normalize_tokens(
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    use_std: bool = True,
    eps: float = 1e-5,
) -> torch.Tensor:
    """(A - mean_g) / (std_g + eps) with the mean and population std over the valid tokens of each group g
    (`group_ids[b]` names the prompt sequence b answers); zero on masked tokens. A group whose tokens all
    hold one value gets zero advantage."""
    view = _PaddedView(cu_seqlens, loss_mask)
    mask = view.mask
    gid = as_tensor("group_ids", group_ids)
    if gid.shape != (mask.shape[0],) or gid.is_floating_point() or gid.dtype == torch.bool:
        raise ValueError(f"group_ids: must be {mask.shape[0]} integers (one per sequence), got "
                         f"{gid.dtype} of shape {tuple(gid.shape)}")
    a = view.pad("advantages", advantages).to(torch.float64)
    if mask.shape[0] == 0:
        return advantages.clone()
    _, inverse = torch.unique(gid, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    m = mask.to(torch.float64)
    count = torch.bincount(inverse, weights=m.sum(1), minlength=n_groups).clamp(min=1.0)
    mean = torch.bincount(inverse, weights=(a * m).sum(1), minlength=n_groups) / count
    dev = (a - mean[inverse].unsqueeze(1)) * m
    if use_std:
        var = torch.bincount(inverse, weights=(dev * dev).sum(1), minlength=n_groups) / count
        dev = dev / (var.sqrt()[inverse].unsqueeze(1) + eps)
    return view.unpad(dev.to(advantages.dtype))


def apply_adv_norm(
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: AdvNorm,
    *,
    group_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    moments: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """The advantage normalisation `algo.adv_norm` names: "batch" over all valid tokens of the batch
    (`moments` from `masked_moments`, summed over ranks, make it global), "group" over the valid tokens of
    each group (`group_ids` per sequence), "none" leaves the advantages as they are."""
    if mode == "batch":
        return normalize_advantages(advantages, loss_mask, moments=moments, eps=eps)
    if mode == "group":
        if group_ids is None:
            raise ValueError("group_ids: needed to normalise advantages per group")
        return group_normalize_tokens(advantages, loss_mask, group_ids, cu_seqlens=cu_seqlens, eps=eps)
    if mode == "none":
        return advantages
    raise ValueError(f"adv_norm: must be one of {list(ADV_NORMS)}, got {mode!r}")


@dataclass(frozen=True)
class Advantages:
    advantages: torch.Tensor  # per token, zero on masked tokens
    returns: torch.Tensor  # advantages + values: the critic's regression target
    token_rewards: torch.Tensor  # per token, sequence reward on the last valid token, KL folded in
    seq_rewards: torch.Tensor  # [B] after group normalisation (the group form), else as given


def compute_advantages(
    seq_rewards: torch.Tensor,
    group_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    logp: torch.Tensor | None = None,
    logp_ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k1",
    gamma: float = 1.0,
    lam: float = 1.0,
    group_norm: bool = False,
    group_std: bool = True,
    baseline: Baseline = "mean",
    std_level: StdLevel = "group",
    adv_norm: AdvNorm = "batch",
    token_norm_moments: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> Advantages:
    """AReaL's recipe in one call: sequence rewards (group-normalised first with `group_norm`: the group
    form), KL folded into token rewards (when kl_coef != 0 and logp/logp_ref are given), GAE, then
    `apply_adv_norm` (by default over all valid tokens of the batch, as AReaL's v0.2 does).

    Per-token tensors are [B, T] (with `loss_mask` [B, T]) or 1-D packed with `cu_seqlens` [B + 1].
    """
    r = (group_normalize(seq_rewards, group_ids, use_std=group_std, eps=eps, baseline=baseline, std_level=std_level)
         if group_norm else seq_rewards)
    kl = None
    if kl_coef != 0.0:
        if logp is None or logp_ref is None:
            raise ValueError("logp/logp_ref: both are needed when kl_coef != 0")
        kl = kl_penalty(logp, logp_ref, kl_estimator)
    tok_r = token_rewards(r, loss_mask, kl=kl, kl_coef=kl_coef, cu_seqlens=cu_seqlens)
    adv, ret = gae(tok_r, loss_mask, values=values, gamma=gamma, lam=lam, cu_seqlens=cu_seqlens)
    adv = apply_adv_norm(adv, loss_mask, adv_norm, group_ids=group_ids, cu_seqlens=cu_seqlens,
                         moments=token_norm_moments, eps=eps)
    return Advantages(advantages=adv, returns=ret, token_rewards=tok_r, seq_rewards=as_tensor("seq_rewards", r))


class _PaddedView:
    """Presents per-token inputs as [B, T] padded tensors whatever their layout, and results back in
    the caller's layout: identity for padded inputs, pad/unpad through cu_seqlens for packed ones."""

    def __init__(self, cu_seqlens: torch.Tensor | None, loss_mask: torch.Tensor) -> None:
        m = check_mask("loss_mask", as_tensor("loss_mask", loss_mask))
        self.cu_seqlens = cu_seqlens
        self.shape = m.shape
        if cu_seqlens is None:
            if m.dim() != 2:
                raise ValueError(f"loss_mask: must be [B, T] (or 1-D with cu_seqlens), got shape {tuple(m.shape)}")
            self.mask = m
            self.layout = None
        else:
            if m.dim() != 1:
                raise ValueError(f"loss_mask: must be 1-D when cu_seqlens is given, got shape {tuple(m.shape)}")
            padded, self.layout = pad_packed(m, cu_seqlens, pad_value=False)
            self.mask = padded & self.layout

    def pad(self, name: str, x: torch.Tensor | None) -> torch.Tensor:
        t = as_tensor(name, x)
        check_finite(name, t)
        if t.shape != self.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} does not match loss_mask shape {tuple(self.shape)}")
        return t if self.layout is None else pad_packed(t, self.cu_seqlens)[0]

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.layout is None else unpad(x, self.layout)
