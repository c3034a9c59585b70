"""Policy losses by name, and how a batch's per-token losses are aggregated into one number.

Every loss here is a per-token surrogate pg_t of the current policy's log-prob, taken around the PROXIMAL
policy (the decoupled objective of arXiv 2505.24298: the trust region is centred on the weights the
trainer holds before this step's updates), times the behaviour importance weight w_t that algo.corrections
computes (exp(logp_prox - logp_behav), capped, truncated or masked), times an aggregation weight:

    loss = sum_t pg_t * w_t * a_t * trained_t / denominator

With decoupled: false the proximal log-probs ARE the behaviour ones, w_t = 1, and each loss is its paper's
on-policy/old-policy form. The surrogates (r_t = exp(logp_t - logp_prox_t), A_t the advantage):

    clip   max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), dual clip c: for A < 0, min(that, -A c)
           (PPO, arXiv 1707.06347; GRPO, Dr.GRPO, DAPO, RLOO, REINFORCE++, LitePPO use it)
    gspo   the clip surrogate on the sequence ratio s_i = exp(mean_t (logp_t - logp_prox_t)) over the answer's
           trained tokens, with the answer's mean advantage (GSPO, arXiv 2507.18071 eq. 5-7)
    cispo  -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp: the clipped ratio is a constant weight and
           every token keeps its gradient (MiniMax-M1, arXiv 2506.13585 eq. 4)
    sapo   -A * (4 / tau) * sigmoid(tau * (r - 1)), tau = tau_pos for A > 0 and tau_neg otherwise: a soft
           gate in place of the hard clip (SAPO, arXiv 2511.20347 eq. 5-7); its gradient at r = 1 is PPO's

The losses that share a surrogate differ in their advantages and aggregation, which the experiment config
sets with the loss (topology/experiment.py, LOSS_SETTINGS; docs/algo.md has the table with sources).

Aggregation (`agg_mode`, verl's `loss_agg_mode`, verl/trainer/ppo/core_algos.py `agg_loss`), with
`aggregation_weights` giving a_t and `loss_denominator` the denominator over the global minibatch:

    token-mean               a_t = 1,        / trained tokens          (DAPO; AReaL's default)
    seq-mean-token-sum       a_t = 1,        / answers                 (RLOO's sequence-level REINFORCE)
    seq-mean-token-mean      a_t = 1 / |y|,  / answers                 (GRPO, GSPO, SAPO)
    seq-mean-token-sum-norm  a_t = 1,        / (answers * L)           (Dr.GRPO, L a constant: the length
                                                                        limit, gen.max_new_tokens)

|y| is the number of loss tokens of the answer.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Literal

import torch

from algo._validate import as_tensor, check_finite, check_mask, check_same_shape
from algo.corrections import per_sequence_sum, sequence_ids

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class LossConfig:
    name: str = "ppo"
    eps_low: float = 0.2
    eps_high: float | None = None     # None: eps_low (symmetric clip)
    dual_clip: float | None = None    # c > 1 bounds the loss of negative-advantage tokens at -A * c
    tau_pos: float = 1.0              # SAPO's gate temperatures
    tau_neg: float = 1.05

    def __post_init__(self) -> None:
        if self.name not in POLICY_LOSSES:
            raise ValueError(f"name: unknown loss {self.name!r}; choose one of {', '.join(POLICY_LOSSES)}")
        if not self.eps_low > 0:
            raise ValueError(f"eps_low: must be positive, got {self.eps_low}")
        if self.eps_high is not None and not self.eps_high > 0:
            raise ValueError(f"eps_high: must be positive, got {self.eps_high}")
        if self.dual_clip is not None:
            if not self.dual_clip > 1:
                raise ValueError(f"dual_clip: must be > 1, got {self.dual_clip}")
            if POLICY_LOSSES[self.name].surrogate is not clip_surrogate:
                raise ValueError(f"dual_clip: only the clip surrogate has one, not loss {self.name!r}")
        if not (self.tau_pos > 0 and self.tau_neg > 0):
            raise ValueError(f"tau_pos/tau_neg: must be positive, got {self.tau_pos}/{self.tau_neg}")


@dataclass
class PPOStats:
    """Sums and counts over one micro-batch; `merge` adds micro-batches, `summary` gives the means and
    maxima AReaL logs. Everything is a plain float so it travels in a message or a metrics line."""

    n_tokens: float = 0.0  # loss-mask tokens seen (before the corrections)
    n_trained: float = 0.0  # of those, not masked by a correction
    n_clipped: float = 0.0  # trained tokens where the clipped branch was active (cispo: ratio out of the band)
    n_dual_clipped: float = 0.0
    loss_sum: float = 0.0  # sum of pg_t * w_t over trained tokens (unnormalised, before aggregation weights)
    ratio_sum: float = 0.0
    ratio_max: float = 0.0
    behav_weight_sum: float = 0.0  # over all loss-mask tokens, masked or not
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


Surrogate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LossConfig],
                     tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def clip_surrogate(adv: torch.Tensor, ratio: torch.Tensor, logp: torch.Tensor, cfg: LossConfig
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate (with the dual clip when set): per-token loss, clipped, dual-clipped."""
    eps_high = cfg.eps_high if cfg.eps_high is not None else cfg.eps_low
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - cfg.eps_low, 1.0 + eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clipped = pg_clipped > pg_unclipped
    dual = torch.zeros_like(clipped)
    if cfg.dual_clip is not None:
        bound = -adv * cfg.dual_clip
        dual = (adv < 0) & (pg > bound)
        pg = torch.where(dual, bound, pg)
    return pg, clipped, dual


def cispo_surrogate(adv: torch.Tensor, ratio: torch.Tensor, logp: torch.Tensor, cfg: LossConfig
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO: the clipped ratio as a constant weight on -A * logp; 'clipped' is the ratio out of the band."""
    eps_high = cfg.eps_high if cfg.eps_high is not None else cfg.eps_low
    r = ratio.detach()
    bounded = r.clamp(1.0 - cfg.eps_low, 1.0 + eps_high)
    return -bounded * adv * logp, bounded != r, torch.zeros_like(r, dtype=torch.bool)


def sapo_surrogate(adv: torch.Tensor, ratio: torch.Tensor, logp: torch.Tensor, cfg: LossConfig
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SAPO's soft gate; nothing is clipped."""
    tau = torch.where(adv > 0, torch.full_like(ratio, cfg.tau_pos), torch.full_like(ratio, cfg.tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return -adv * gate, none, none


@dataclass(frozen=True)
class PolicyLoss:
    surrogate: Surrogate
    sequence_ratio: bool = False   # GSPO: one ratio (and advantage) per answer


# The registry: a loss name and its surrogate. What else each name fixes (advantages, aggregation, clip
# range) is in topology/experiment.py's LOSS_SETTINGS; tests/test_algo_losses.py checks the two agree.
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": PolicyLoss(clip_surrogate),
    "grpo": PolicyLoss(clip_surrogate),
    "dr_grpo": PolicyLoss(clip_surrogate),
    "dapo": PolicyLoss(clip_surrogate),
    "rloo": PolicyLoss(clip_surrogate),
    "reinforce_pp": PolicyLoss(clip_surrogate),
    "reinforce_pp_baseline": PolicyLoss(clip_surrogate),
    "lite_ppo": PolicyLoss(clip_surrogate),
    "gspo": PolicyLoss(clip_surrogate, sequence_ratio=True),
    "cispo": PolicyLoss(cispo_surrogate),
    "sapo": PolicyLoss(sapo_surrogate),
}


def policy_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    denominator: int | float,
    config: LossConfig = LossConfig(),
    *,
    weight: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    agg_weight: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PPOStats]:
    """One micro-batch's loss under `config.name`, divided by `denominator` (the global one: summing
    micro-batches then gives the whole minibatch's loss).

    `weight` is the behaviour importance weight per token and `keep` the tokens trained (algo.corrections;
    default: 1 and the whole mask), `agg_weight` the aggregation weight a_t (`aggregation_weights`; default 1).
    `cu_seqlens` delimits the answers of a 1-D packed stream (GSPO's sequence ratio). `logits` or a
    per-token `entropy` add the mean entropy to the statistics. Gradients flow through `logp` only.
    """
    names = ("logp", "logp_prox", "advantages", "loss_mask")
    tensors = [as_tensor(n, t) for n, t in zip(names, (logp, logp_prox, advantages, loss_mask))]
    check_same_shape(names, tensors)
    for n, t in zip(names[:3], tensors[:3]):
        check_finite(n, t)
    logp, logp_prox, adv, _ = tensors
    mask = check_mask("loss_mask", tensors[3])
    if not float(denominator) > 0 or denominator != denominator:
        raise ValueError(f"denominator: must be positive, got {denominator}")
    trained = mask if keep is None else mask & check_mask("keep", as_tensor("keep", keep))
    if weight is None:
        weight = torch.ones_like(logp_prox)
    for name, t in (("weight", weight), ("agg_weight", agg_weight)):
        if t is not None:
            check_same_shape(("logp", name), (logp, as_tensor(name, t)))
            check_finite(name, t)
    logp_prox = logp_prox.detach()
    adv = adv.detach()
    spec = POLICY_LOSSES[config.name]

    # zero the log-ratio off the mask before exp(): padding with arbitrary log-probs must not overflow
    # into inf, whose gradient would turn into NaN even behind a where()
    log_ratio = torch.where(mask, logp - logp_prox, torch.zeros_like(logp))
    if spec.sequence_ratio:
        seq, n_seqs = sequence_ids(mask.shape, cu_seqlens)
        zero = torch.zeros_like(log_ratio)
        count = torch.zeros(n_seqs, dtype=logp.dtype).index_add_(0, seq.reshape(-1), trained.reshape(-1).to(logp.dtype))
        mean_log = torch.zeros(n_seqs, dtype=logp.dtype).index_add_(
            0, seq.reshape(-1), torch.where(trained, log_ratio, zero).reshape(-1)) / count.clamp(min=1.0)
        ratio = torch.exp(mean_log)[seq]
        adv = (per_sequence_sum(torch.where(trained, adv, torch.zeros_like(adv)), seq, n_seqs)
               / count.clamp(min=1.0).to(torch.float64)).to(adv.dtype)[seq]
    else:
        ratio = torch.exp(log_ratio)
    pg, clipped, dual = spec.surrogate(adv, ratio, logp, config)
    per_token = pg * torch.where(trained, weight.detach(), torch.zeros_like(weight))
    if agg_weight is not None:
        per_token = per_token * agg_weight.detach()
    loss = torch.where(trained, per_token, torch.zeros_like(per_token)).sum() / float(denominator)

    with torch.no_grad():
        unaggregated = pg * weight
        stats = PPOStats(
            n_tokens=float(mask.sum()),
            n_trained=float(trained.sum()),
            n_clipped=float((clipped & trained).sum()),
            n_dual_clipped=float((dual & trained).sum()),
            loss_sum=float(unaggregated[trained].sum()),
            ratio_sum=float(ratio[trained].sum()),
            ratio_max=float(ratio[trained].max()) if bool(trained.any()) else 0.0,
            behav_weight_sum=float(weight[mask].sum()),
            behav_weight_max=float(weight[mask].max()) if bool(mask.any()) else 0.0,
            approx_kl_sum=float((logp_prox - logp)[trained].sum()),
        )
        if logits is not None or entropy is not None:
            ent = token_entropy(logits) if entropy is None else as_tensor("entropy", entropy)
            check_finite("entropy", ent)
            check_same_shape(("logp", "entropy"), (logp, ent))
            stats.entropy_sum = float(ent[trained].sum())
            stats.n_entropy = float(trained.sum())
    return loss, stats


def aggregation_weights(loss_mask: torch.Tensor, mode: AggMode, cu_seqlens: torch.Tensor | None = None
                        ) -> torch.Tensor | None:
    """a_t of `mode`: 1 / |y| on each loss token of an answer for seq-mean-token-mean, else None (all 1)."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"mode: must be one of {', '.join(LOSS_AGG_MODES)}, got {mode!r}")
    if mode != "seq-mean-token-mean":
        return None
    mask = check_mask("loss_mask", as_tensor("loss_mask", loss_mask))
    seq, n_seqs = sequence_ids(mask.shape, cu_seqlens)
    lengths = per_sequence_sum(mask.to(torch.float64), seq, n_seqs).clamp(min=1.0)
    return torch.where(mask, (1.0 / lengths)[seq].to(torch.float32), torch.zeros(mask.shape))


def loss_denominator(mode: AggMode, n_trained_tokens: float, n_answers: float, norm_length: int | None = None) -> float:
    """The global denominator of `mode`: trained tokens (token-mean), answers (the seq-mean modes), or
    answers times the constant `norm_length` (seq-mean-token-sum-norm)."""
    if mode == "token-mean":
        return float(n_trained_tokens)
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return float(n_answers)
    if mode == "seq-mean-token-sum-norm":
        if norm_length is None or norm_length < 1:
            raise ValueError(f"norm_length: seq-mean-token-sum-norm needs a positive constant length, got {norm_length}")
        return float(n_answers) * float(norm_length)
    raise ValueError(f"mode: must be one of {', '.join(LOSS_AGG_MODES)}, got {mode!r}")


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dimension, per token (no gradient)."""
    check_finite("logits", logits)
    with torch.no_grad():
        logz = torch.log_softmax(logits.float(), dim=-1)
        return -(logz.exp() * logz).sum(-1)
