"""Off-policy and trainer/engine mismatch corrections, and the mismatch monitors.

Every answer token has a behaviour log-prob (what the rollout engine sampled it with, logp_behav) and a
proximal one (the trainer's recomputation before this step's updates, logp_prox). Their ratio

    w_t = exp(logp_prox_t - logp_behav_t)

is the importance weight the decoupled objective multiplies each token's loss by. It mixes two gaps: the
staleness of the weights that sampled the token, and the numerical mismatch between the engine's and the
trainer's computation of the same weights (kernels, precision, batch order). Both can blow up on a few
tokens; these corrections bound their effect. They depend only on logp_prox and logp_behav (neither
carries a gradient), so they are computed once per step, before the micro-batches, and combine with any
loss of algo.losses. Applied in this order:

1. behaviour cap (AReaL, `behav_imp_weight_cap`): tokens with w_t > cap are masked out.
2. rejection (verl's rollout correction "rejection sampling", `rollout_rs`): out of [lower, upper] by
   * token:     w_t                                   -> that token is masked (IcePop, arXiv 2510.18855,
                                                         masks tokens with w_t outside [0.5, 5])
   * sequence:  prod_t w_t = exp(sum_t log w_t)       -> the whole answer is masked
   * geometric: exp(mean_t log w_t)                   -> the whole answer is masked
   lower defaults to 1 / upper (verl's convention).
3. M2PO (arXiv 2510.01161, section 3): the tokens with the largest (log w_t)^2 are masked, the fewest
   that bring the mean of (log w_t)^2 over the remaining tokens to at most tau.
4. TIS, truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
   off-policy RL training"; verl's `rollout_is`): w_t <- min(w_t, cap) per token, or per answer
   min(prod_t w_t, cap) on each of its tokens; the token stays trained with the truncated weight.

Tensors are [B, T] padded (rows are sequences) or 1-D packed streams with `cu_seqlens`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

import torch

from algo._validate import as_tensor, check_cu_seqlens, check_finite, check_mask, check_same_shape

RejectionLevel = Literal["none", "token", "sequence", "geometric"]
TisLevel = Literal["token", "sequence"]
REJECTION_LEVELS: tuple[str, ...] = ("none", "token", "sequence", "geometric")


@dataclass(frozen=True)
class CorrectionConfig:
    behav_cap: float | None = None       # mask tokens whose w_t exceeds this (AReaL)
    tis_cap: float | None = None         # truncate the weight at this value (TIS)
    tis_level: TisLevel = "token"
    rejection: RejectionLevel = "none"
    rejection_lower: float | None = None  # None: 1 / rejection_upper
    rejection_upper: float | None = None
    m2po_tau: float | None = None        # M2PO's bound on the mean squared log weight

    def __post_init__(self) -> None:
        for name in ("behav_cap", "tis_cap"):
            v = getattr(self, name)
            if v is not None and not v > 1:
                raise ValueError(f"{name}: must be > 1, got {v}")
        if self.tis_level not in ("token", "sequence"):
            raise ValueError(f"tis_level: must be 'token' or 'sequence', got {self.tis_level!r}")
        if self.rejection not in REJECTION_LEVELS:
            raise ValueError(f"rejection: must be one of {', '.join(REJECTION_LEVELS)}, got {self.rejection!r}")
        if self.rejection != "none":
            if self.rejection_upper is None or not self.rejection_upper > 0:
                raise ValueError(f"rejection_upper: rejection {self.rejection!r} needs a positive upper bound")
            if not 0 < self.lower < self.rejection_upper:
                raise ValueError(f"rejection_lower: must be in (0, rejection_upper={self.rejection_upper}), "
                                 f"got {self.lower}")
        if self.m2po_tau is not None and not self.m2po_tau > 0:
            raise ValueError(f"m2po_tau: must be positive, got {self.m2po_tau}")

    @property
    def lower(self) -> float:
        if self.rejection_lower is not None:
            return self.rejection_lower
        return 1.0 / self.rejection_upper if self.rejection_upper else 0.0


@dataclass
class CorrectionStats:
    """Token counts of one share of a step; `merge` adds shares, `summary` gives the fractions."""

    n_tokens: float = 0.0          # loss-mask tokens
    n_behav_capped: float = 0.0    # masked by the behaviour cap
    n_rejected: float = 0.0        # masked by rejection (token, sequence or geometric level)
    n_m2po_masked: float = 0.0     # masked by M2PO
    n_tis_truncated: float = 0.0   # kept, with their weight truncated by TIS

    def merge(self, other: "CorrectionStats") -> "CorrectionStats":
        return CorrectionStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def summary(self) -> dict[str, float]:
        n = max(self.n_tokens, 1.0)
        return {"behav_capped_frac": self.n_behav_capped / n, "rejected_frac": self.n_rejected / n,
                "m2po_masked_frac": self.n_m2po_masked / n, "tis_truncated_frac": self.n_tis_truncated / n}


@dataclass
class Corrected:
    weight: torch.Tensor   # float32 per token: w_t, truncated where TIS applies (1 off the mask)
    keep: torch.Tensor     # bool per token: loss tokens that stay trained
    stats: CorrectionStats


def sequence_ids(shape: torch.Size, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Per-token sequence index and the number of sequences: rows of a [B, T] tensor, or the sequences of a
    1-D packed stream given by `cu_seqlens`."""
    if len(shape) == 2:
        return torch.arange(shape[0]).repeat_interleave(shape[1]).reshape(shape), shape[0]
    if len(shape) != 1 or cu_seqlens is None:
        raise ValueError(f"cu_seqlens: needed for a 1-D packed stream (shape {tuple(shape)}); [B, T] needs none")
    cu = check_cu_seqlens("cu_seqlens", cu_seqlens, total=shape[0])
    lens = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(lens.numel()), lens), int(lens.numel())


def per_sequence_sum(x: torch.Tensor, seq: torch.Tensor, n_seqs: int) -> torch.Tensor:
    """Sum of `x` over each sequence's tokens (x already zero off the mask), float64 [n_seqs]."""
    return torch.zeros(n_seqs, dtype=torch.float64).index_add_(0, seq.reshape(-1), x.reshape(-1).to(torch.float64))


def correct(
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    loss_mask: torch.Tensor,
    config: CorrectionConfig = CorrectionConfig(),
    cu_seqlens: torch.Tensor | None = None,
) -> Corrected:
    """The per-token importance weights and the tokens kept, after the corrections `config` enables."""
    prox, behav, mask = _checked(logp_prox, logp_behav, loss_mask, "loss_mask")
    # zero off the mask before exp(): padding with arbitrary log-probs must not overflow (as in algo.losses)
    log_w = torch.where(mask, prox - behav, torch.zeros_like(prox))
    weight = torch.exp(log_w)
    keep = mask
    stats = CorrectionStats(n_tokens=float(mask.sum()))
    if config.behav_cap is not None:
        keep = mask & ~over_cap(prox, behav, config.behav_cap)
        stats.n_behav_capped = float((mask & ~keep).sum())
    seq = n_seqs = None
    if config.rejection in ("sequence", "geometric") or (config.tis_level == "sequence" and config.tis_cap is not None):
        seq, n_seqs = sequence_ids(mask.shape, cu_seqlens)
    if config.rejection != "none":
        lo, hi = math.log(config.lower), math.log(config.rejection_upper)
        if config.rejection == "token":
            out = (log_w < lo) | (log_w > hi)
        else:
            total = per_sequence_sum(torch.where(keep, log_w, torch.zeros_like(log_w)), seq, n_seqs)
            if config.rejection == "geometric":
                total = total / per_sequence_sum(keep.to(torch.float64), seq, n_seqs).clamp(min=1.0)
            out = ((total < lo) | (total > hi))[seq]
        rejected = keep & out
        stats.n_rejected = float(rejected.sum())
        keep = keep & ~rejected
    if config.m2po_tau is not None:
        masked = m2po_mask(log_w, keep, config.m2po_tau)
        stats.n_m2po_masked = float(masked.sum())
        keep = keep & ~masked
    if config.tis_cap is not None:
        if config.tis_level == "token":
            truncated = keep & (weight > config.tis_cap)
            weight = weight.clamp(max=config.tis_cap)
        else:
            seq_w = torch.exp(per_sequence_sum(torch.where(keep, log_w, torch.zeros_like(log_w)), seq, n_seqs))
            truncated = keep & (seq_w > config.tis_cap)[seq]
            weight = torch.where(mask, seq_w.clamp(max=config.tis_cap)[seq].to(weight.dtype), weight)
        stats.n_tis_truncated = float(truncated.sum())
    return Corrected(weight=weight, keep=keep, stats=stats)


def m2po_mask(log_w: torch.Tensor, candidates: torch.Tensor, tau: float) -> torch.Tensor:
    """M2PO's mask: the fewest candidate tokens, largest (log w)^2 first, whose removal brings the mean of
    (log w)^2 over the remaining candidates to <= tau (none when it already is)."""
    q = (log_w.detach().to(torch.float64) ** 2)[candidates]
    n = q.numel()
    out = torch.zeros_like(candidates)
    if n == 0:
        return out
    order = torch.argsort(q, descending=True, stable=True)
    # remaining[k]: sum of q without its k largest values; the mean over n - k tokens must reach tau
    remaining = torch.flip(torch.cumsum(torch.flip(q[order], [0]), 0), [0])
    k_range = torch.arange(n, dtype=torch.float64)
    ok = remaining / (n - k_range) <= tau
    k = int(torch.nonzero(ok)[0]) if bool(ok.any()) else n
    drop = torch.zeros(n, dtype=torch.bool)
    drop[order[:k]] = True
    out[candidates] = drop
    return out


def over_cap(logp_prox: torch.Tensor, logp_behav: torch.Tensor, cap: float) -> torch.Tensor:
    """Tokens whose exp(logp_prox - logp_behav) exceeds `cap`, compared in log space: exp() of a large gap
    overflows float32 long before the comparison matters."""
    check_finite("logp_prox", as_tensor("logp_prox", logp_prox))
    check_finite("logp_behav", as_tensor("logp_behav", logp_behav))
    return (logp_prox.detach() - logp_behav.detach()) > torch.log(torch.tensor(float(cap))).to(logp_prox.dtype)


@dataclass
class MismatchStats:
    """The engine/trainer mismatch on tokens sampled by the very weights the trainer holds (so the gap is
    numerical, not staleness): sums over tokens, mergeable across ranks."""

    n_tokens: float = 0.0
    abs_diff_sum: float = 0.0    # |logp_prox - logp_behav|
    abs_diff_max: float = 0.0
    k3_sum: float = 0.0          # k3 estimate of KL(engine || trainer)

    def merge(self, other: "MismatchStats") -> "MismatchStats":
        return MismatchStats(self.n_tokens + other.n_tokens, self.abs_diff_sum + other.abs_diff_sum,
                             max(self.abs_diff_max, other.abs_diff_max), self.k3_sum + other.k3_sum)

    def summary(self) -> dict[str, float]:
        n = max(self.n_tokens, 1.0)
        return {"mismatch_tokens": self.n_tokens, "mismatch_logprob_diff_mean": self.abs_diff_sum / n,
                "mismatch_kl_k3": self.k3_sum / n}


def mismatch_stats(logp_prox: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor) -> MismatchStats:
    """Sums over the `mask` tokens: |logp_prox - logp_behav| and the k3 estimator of KL(behav || prox),
    (r - 1) - log r with r = p_prox / p_behav on tokens sampled from the behaviour policy (Schulman, "Approximating
    KL divergence"; always >= 0)."""
    prox, behav, sel = _checked(logp_prox, logp_behav, mask, "mask")
    d = (prox - behav).to(torch.float64)[sel]
    if d.numel() == 0:
        return MismatchStats()
    return MismatchStats(n_tokens=float(d.numel()), abs_diff_sum=float(d.abs().sum()),
                         abs_diff_max=float(d.abs().max()), k3_sum=float((torch.expm1(d) - d).sum()))


def _checked(logp_prox: object, logp_behav: object, mask: object, mask_name: str
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two log-prob tensors (finite, detached) and the bool mask, all of one shape."""
    names = ("logp_prox", "logp_behav", mask_name)
    prox, behav, m = (as_tensor(n, t) for n, t in zip(names, (logp_prox, logp_behav, mask)))
    check_same_shape(names, (prox, behav, m))
    check_finite("logp_prox", prox)
    check_finite("logp_behav", behav)
    return prox.detach(), behav.detach(), check_mask(mask_name, m)
