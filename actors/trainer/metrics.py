"""What a training step reports: the step's metrics from the batch and every rank's share, and where they
are written (metrics.jsonl in the run directory, and TensorBoard)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from actors.trainer.trackers import Trackers
from actors.batch import Batch, as_columns, carries_every_sample, flat, sample_groups
from algo.corrections import CorrectionStats, MismatchStats
from algo.losses import PPOStats
from algo.staleness import sample_staleness
from transport.protocol import BatchTensors


#: The step metric holding each sample's share of the loss's weight (a list in batch order, None where no rank
#: reported it): the trainer writes it to its trace records, not to metrics.jsonl.
LOSS_SHARES = "loss_shares"


def _loss_shares(shares: list["ShareResult"], n: int) -> list[float | None]:
    out: list[float | None] = [None] * n
    for share in shares:
        for i, value in (share.loss_shares or {}).items():
            out[i] = round(value, 6)
    return out


@dataclass
class ShareResult:
    """What one trainer rank did with its share of a step; rank 0 merges every rank's into the metrics."""

    ppo: PPOStats                       # empty on ranks whose loss statistics duplicate another's
    logprob_gap: float                  # max |proximal - behaviour| on tokens sampled by these very weights
    updates: list[dict[str, float]]     # engine.train_step reports (already global: summed over replicas)
    kl_reward: float | None = None      # mean over answer tokens of -kl_coef * KL to the reference (kl_coef > 0)
    logprob_gap_sum: float = 0.0        # sum of |proximal - behaviour| over those tokens ...
    logprob_gap_tokens: int = 0         # ... and their count
    logprobs_seconds: float = 0.0       # the proximal (and reference) log-probs before the updates
    # per sample of this rank's share (index in the batch): its loss tokens over its minibatch's, the weight
    # the token-normalised loss gives it (tools.trace sample)
    loss_shares: dict[int, float] | None = None
    correction: CorrectionStats = field(default_factory=CorrectionStats)   # tokens each correction masked or truncated
    mismatch: MismatchStats = field(default_factory=MismatchStats)         # engine vs trainer on current-weight tokens


def step_metrics(batch: Batch | BatchTensors, version: int, shares: list[ShareResult]) -> dict[str, Any]:
    """The step's metrics from the batch's answers (every sample carried: rank 0's batch) and every rank's
    share (rank 0's first)."""
    batch = as_columns(batch)
    ppo, correction, mismatch = PPOStats(), CorrectionStats(), MismatchStats()
    for share in shares:
        ppo = ppo.merge(share.ppo)
        correction = correction.merge(share.correction)
        mismatch = mismatch.merge(share.mismatch)
    summary = ppo.summary()
    updates = shares[0].updates
    kl_reward = {} if shares[0].kl_reward is None else {"kl_reward": shares[0].kl_reward}
    rewards = torch.tensor(batch.rewards, dtype=torch.float32)
    if not carries_every_sample(batch):
        raise ValueError("step_metrics: needs every sample's versions (the whole batch), got a rank's share")
    versions = flat(batch, "versions")
    # Each sample's oldest weight version (prompt and unknown tokens are -1 and do not count).
    starts_v, o = [], 0
    for n in batch.output_lens:
        mine = versions[o:o + n]
        mine = mine[mine >= 0]
        starts_v.append(int(mine.min()) if mine.numel() else version)
        o += n
    staleness = sample_staleness(torch.tensor(starts_v), version).float()
    out_lens = torch.tensor(batch.output_lens, dtype=torch.float32)
    return {
        "task_reward": float(rewards.mean()), "accuracy": float(torch.tensor(batch.correct).float().mean()),
        # the loss mask: every generated answer token (an episode's environment tokens, version -1, are not trained)
        "n_tokens": float((versions >= 0).sum()), "env_tokens": float((versions < 0).sum()),
        "n_seqs": float(len(batch.output_lens)),
        "avg_seq_len": float(out_lens.mean()),
        "no_eos_ratio": float(torch.tensor([r != "stop" for r in batch.finish_reasons]).float().mean()),
        "importance_weight": summary["importance_weight_mean"],
        "importance_weight_max": summary["importance_weight_max"],
        "actor_clip_ratio": summary["clip_ratio"], "ppo_approx_kl": summary["approx_kl"],
        "behav_masked_frac": summary["behav_masked_frac"], "entropy": summary.get("entropy", 0.0),
        "staleness_mean": float(staleness.mean()), "staleness_max": float(staleness.max()),
        "logprob_gap_max": max(share.logprob_gap for share in shares),
        "logprob_gap_mean": (sum(share.logprob_gap_sum for share in shares)
                             / max(1, sum(share.logprob_gap_tokens for share in shares))),
        "loss": sum(x["loss"] for x in updates), "grad_norm": max((x["grad_norm"] for x in updates), default=0.0),
        "lr": updates[-1]["lr"] if updates else 0.0,
        "accuracy_by_level": _accuracy_by_level(batch), **kl_reward,
        **({"moe_aux_loss": sum(x["moe_aux_loss"] for x in updates) / len(updates)}
           if updates and "moe_aux_loss" in updates[0] else {}),
        # rank 0's phases of the step (the timeline's spans; the wait and export are the trainer actor's)
        "logprobs_seconds": shares[0].logprobs_seconds,
        "forward_backward_seconds": sum(x.get("forward_backward_seconds", 0.0) for x in updates),
        "optimizer_seconds": sum(x.get("optimizer_seconds", 0.0) for x in updates),
        LOSS_SHARES: _loss_shares(shares, len(batch.output_lens)),
        "answer_len_max": float(out_lens.max()), "ratio_max": summary["ratio_max"],
        "dual_clip_ratio": summary["dual_clip_ratio"], **correction.summary(), **mismatch.summary(),
    }


def mismatch_warning(stats: dict[str, Any], threshold: float) -> str | None:
    """The warning line when the engine/trainer KL on tokens sampled by the current weights passes `threshold`
    (0: never), else None."""
    kl = stats.get("mismatch_kl_k3", 0.0)
    if threshold <= 0 or not kl > threshold:
        return None
    return (f"engine/trainer mismatch: KL (k3) {kl:.3g} > algo.mismatch_warn_kl {threshold:g} on "
            f"{stats.get('mismatch_tokens', 0):.0f} tokens of the current weights (mean |logp diff| "
            f"{stats.get('mismatch_logprob_diff_mean', 0.0):.3g}); consider algo.tis_cap or algo.rejection: icepop")


def _accuracy_by_level(batch: BatchTensors) -> dict[str, float]:
    by: dict[str, list[bool]] = {}
    for g, correct in zip(sample_groups(batch), batch.correct):
        by.setdefault(str(batch.levels[g]), []).append(correct)
    return {k: sum(v) / len(v) for k, v in sorted(by.items())}


def trained_history(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps' records of the history that was trained, in step order, from metrics.jsonl's lines in the
    order written. A restarted or resumed trainer writes the steps it trains again: a step at or below the one
    before it means the history was rolled back there, so the records it replaces are left out (what a
    summary counts is what was trained, once)."""
    kept: list[dict[str, Any]] = []
    for record in records:
        while kept and kept[-1]["step"] >= record["step"]:
            kept.pop()
        kept.append(record)
    return kept


class MetricsWriter:
    """A step's metrics appended to ``metrics.jsonl`` and given to the run's trackers (actors/trainer/trackers.py:
    TensorBoard by default, Weights & Biases, SwanLab)."""

    def __init__(self, run_dir: Path, log: Any, trackers: Trackers | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.trackers = trackers if trackers is not None else Trackers(["tensorboard"], run_dir, "", "offline", {},
                                                                       log)

    def write(self, stats: dict[str, Any], step: int) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(stats) + "\n")
        self.trackers.log_step(stats, step)

    def close(self) -> None:
        self.trackers.close()
