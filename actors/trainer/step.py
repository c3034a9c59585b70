"""One training step's math on a batch, for one trainer rank: the packed layout of the sequences, the
proximal log-probs, the advantages, the corrected behaviour weights and the updates of the loss `algo.loss`
names (algo/), split across
data-parallel replicas. Pure functions of the engine and the batch; the trainer actor (actors/trainer/actor.py)
and its rank followers (actors/trainer/followers.py) call them."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from actors.batch import Batch, TrainBatch, as_columns, sequence_lengths
from actors.engines.base import PackedBatch, TokenLogProbs, TrainEngine
from actors.engines.moe import ROUTE_NATIVE
from actors.trainer.metrics import ShareResult, step_metrics
from algo.advantages import AdvNorm, Baseline, KLEstimator, StdLevel, compute_advantages, kl_penalty, overlong_penalty
from algo.corrections import CorrectionConfig, CorrectionStats, MismatchStats, correct, mismatch_stats
from algo.losses import AggMode, LossConfig, PPOStats, aggregation_weights, loss_denominator, policy_loss
from algo.packing import allocate_micro_batches, split_by_rank
from topology.experiment import ExperimentConfig
from transport.protocol import BatchTensors


class TrainerConfigError(ValueError):
    """The trainer's settings or placement cannot work; the message says why."""


def batch_to_sequences(batch: Batch) -> dict[str, Any]:
    """Flatten a Batch into per-sequence token lists and per-token fields aligned with the tokens.

    loss_mask marks the answer tokens a model generated (an episode's environment tokens, version -1, are not
    among them); `behav` holds their behaviour log-probs (aligned: position t holds
    log p(x_t | x_<t)); `versions` the weight version that sampled each answer token (-1 on prompts).
    """
    seqs, mask, behav, versions, rewards, correct, group_ids, no_eos, out_lens = [], [], [], [], [], [], [], [], []
    for g_idx, group in enumerate(batch.groups):
        p = list(group.prompt_ids)
        for s in group.samples:
            seqs.append(p + list(s.output_ids))
            mask.append([0.0] * len(p) + [float(v >= 0) for v in s.versions])
            behav.append([0.0] * len(p) + [float(x) for x in s.logprobs])
            versions.append([-1.0] * len(p) + [float(v) for v in s.versions])
            rewards.append(float(s.reward))
            correct.append(bool(s.correct))
            group_ids.append(g_idx)
            no_eos.append(s.finish_reason != "stop")
            out_lens.append(len(s.output_ids))
    return {"seqs": seqs, "loss_mask": mask, "behav": behav, "versions": versions, "rewards": rewards,
            "correct": correct, "group_ids": group_ids, "no_eos": no_eos, "out_lens": out_lens}


@dataclass
class StepConfig:
    """How one training step uses a batch: the `algo` and `gen` settings it needs, in the step's terms. Its
    values come only from the experiment's settings (topology/experiment.py declares their defaults)."""

    loss: LossConfig
    correction: CorrectionConfig
    agg_mode: AggMode
    minibatches: int
    max_tokens_per_mb: int
    temperature: float
    decoupled: bool           # False: proximal = behaviour log-probs, i.e. standard PPO
    group_norm: bool          # True: the group form (rewards minus the group mean); False: AReaL's
    group_std: bool
    adv_norm: AdvNorm
    kl_coef: float            # > 0: a KL penalty to the frozen starting weights, in the token rewards
    kl_estimator: KLEstimator
    routing_replay: Literal["none", "r2", "r3"] = "none"   # MoE: whose routing the training forwards replay
    baseline: Baseline = "mean"
    std_level: StdLevel = "group"
    max_new_tokens: int = 64          # the length limit: Dr.GRPO's constant normaliser, DAPO's overlong limit
    overlong_buffer: int | None = None   # tokens before the limit where DAPO's penalty ramps up
    overlong_penalty: float = 1.0

    @classmethod
    def from_settings(cls, cfg: ExperimentConfig) -> "StepConfig":
        a = cfg.algo
        lower, upper = a.rejection_bounds
        rejection = "token" if a.rejection == "icepop" else a.rejection
        correction = CorrectionConfig(
            behav_cap=a.behav_imp_weight_cap or None, tis_cap=a.tis_cap, tis_level=a.tis_level, rejection=rejection,
            rejection_lower=lower if rejection != "none" else None,
            rejection_upper=upper if rejection != "none" else None, m2po_tau=a.m2po_tau)
        buffer = (max(1, round(a.overlong_buffer * cfg.gen.max_new_tokens)) if a.overlong_buffer is not None
                  else None)
        return cls(loss=LossConfig(a.loss, a.eps_clip, a.eps_clip_high, a.dual_clip, a.sapo_tau_pos, a.sapo_tau_neg),
                   correction=correction, agg_mode=a.loss_agg_mode,
                   minibatches=a.ppo_minibatches, max_tokens_per_mb=a.max_tokens_per_mb,
                   temperature=cfg.gen.temperature or 1.0, decoupled=a.decoupled, group_norm=a.group_norm,
                   group_std=a.group_std, adv_norm=a.adv_norm, kl_coef=a.kl_coef, kl_estimator=a.kl_estimator,
                   routing_replay=a.routing_replay,
                   baseline=a.baseline, std_level=a.std_level, max_new_tokens=cfg.gen.max_new_tokens,
                   overlong_buffer=buffer, overlong_penalty=a.overlong_penalty)

    @classmethod
    def defaults(cls, **changes: Any) -> "StepConfig":
        """The step of an experiment with default settings, with `changes` (field=value) applied."""
        return replace(cls.from_settings(ExperimentConfig()), **changes)


def train_on_batch(engine: TrainEngine, batch: Batch | BatchTensors, cfg: StepConfig, version: int,
                   ref_engine: TrainEngine | None = None) -> dict[str, Any]:
    """One training step on `batch` with a single-rank engine at `version` (steps completed); the metrics."""
    cols = as_columns(batch)
    return step_metrics(cols, version, [train_share(engine, cols, cfg, version, ref_engine)])


def packed_logprobs(engine: TrainEngine, batch: TrainBatch, micro_batches: Any, out: torch.Tensor,
                    temperature: float, routes: torch.Tensor | None = None,
                    record_routes: bool = False) -> torch.Tensor | None:
    """Log-probs of `batch`'s sequences under `engine`, computed micro-batch by micro-batch (lists of sequence
    indices) and written into `out` (the batch's layout). A mixture-of-experts model replays `routes` (the
    layout's [tokens, sparse layers, top-k] expert ids) when given, and with `record_routes` returns the
    routing it took, in the layout (ROUTE_NATIVE where no sequence was computed)."""
    recorded = None
    for ids in micro_batches:
        where = batch.token_index(ids)
        mb = batch.micro_batch(ids, routes=routes)
        result = engine.compute_logprobs(mb, temperature=temperature, **({"record_routing": True} if record_routes else {}))
        if record_routes and result.routed_experts is not None and recorded is None:
            recorded = torch.full((out.numel(), *result.routed_experts.shape[1:]), ROUTE_NATIVE, dtype=torch.int64)
        out[where] = result.logprobs.to(device=out.device, dtype=out.dtype)
        if recorded is not None:
            recorded[where] = result.routed_experts.to(device=recorded.device, dtype=recorded.dtype)
    return recorded


def minibatch_plan(lengths: list[int], group_ids: list[int], cfg: StepConfig, dp_size: int) -> list[list[list[list[int]]]]:
    """Per data-parallel rank, its micro-batches (sequence indices) of every PPO minibatch. PPO minibatches
    are contiguous slices of whole groups, so a group never straddles two updates; each is split into the
    same number of micro-batches per replica, balanced by tokens (algo.packing). A pure function of the
    lengths: trainer.0 computes it to send each rank its share, and each rank computes it again to train."""
    budget = max(cfg.max_tokens_per_mb, max(lengths))
    groups = sorted(set(group_ids))
    plan: list[list[list[list[int]]]] = [[] for _ in range(dp_size)]
    for m in range(cfg.minibatches):
        gsel = set(groups[m::cfg.minibatches])
        seq_ids = [i for i in range(len(lengths)) if group_ids[i] in gsel]
        if not seq_ids:
            continue
        if len(seq_ids) < dp_size:
            raise TrainerConfigError(f"PPO minibatch {m} has {len(seq_ids)} sequences for {dp_size} data-parallel "
                                     f"ranks: use fewer algo.ppo_minibatches or a larger batch")
        ranks = split_by_rank(allocate_micro_batches([lengths[i] for i in seq_ids], budget, n_groups=dp_size), dp_size)
        for r in range(dp_size):
            plan[r].append([[seq_ids[i] for i in idx] for idx in ranks[r]])
    return plan


def rank_samples(batch: BatchTensors, cfg: StepConfig, dp_size: int) -> list[list[int]]:
    """Per data-parallel rank, the samples whose tokens it needs: those it trains on, or with a KL penalty
    every one (the reference log-probs of the whole batch enter every rank's advantages)."""
    if cfg.kl_coef > 0:
        return [list(range(len(batch.output_lens)))] * dp_size
    lengths, group_ids = sequence_lengths(batch)
    return [sorted(i for mbs in minibatches for ids in mbs for i in ids)
            for minibatches in minibatch_plan(lengths, group_ids, cfg, dp_size)]


def train_share(engine: TrainEngine, batch: Batch | BatchTensors, cfg: StepConfig, version: int,
                ref_engine: TrainEngine | None = None) -> ShareResult:
    """This rank's part of one training step. Every rank of a multi-rank trainer calls it on the same batch,
    or on its share of it (`actors.batch.share` of `rank_samples`: the same scalar columns, the tokens of
    its own sequences): each data-parallel replica takes the same number of micro-batches of every PPO
    minibatch (`minibatch_plan`), computes their proximal log-probs and trains on them; the gradients and
    the loss denominator (the minibatch's global token count) are summed across replicas."""
    lay = TrainBatch.of(batch)
    batch = lay.columns
    dp_rank, dp_size = engine.data_parallel
    lengths, group_ids = lay.lengths, lay.group_ids
    minibatches = minibatch_plan(lengths, group_ids, cfg, dp_size)[dp_rank]
    mine_ids = [i for mbs in minibatches for ids in mbs for i in ids]
    missing = [i for i in (range(len(lengths)) if cfg.kl_coef > 0 else mine_ids) if not lay.carried[i]]
    if missing:
        raise ValueError(f"train_share: data-parallel rank {dp_rank} was not sent the tokens of sequences "
                         f"{missing[:8]} (of {len(missing)}) it needs")
    mask = lay.loss_mask.bool()
    behav = lay.behav
    # Loss tokens per sequence: the running count of the mask at each sequence's end less at its start.
    running = torch.zeros(mask.numel() + 1, dtype=torch.int64)
    running[1:] = torch.cumsum(mask, 0)
    mask_tokens = (running[lay.cu_seqlens[1:]] - running[lay.cu_seqlens[:-1]]).tolist()
    rewards = torch.tensor(batch.rewards, dtype=torch.float32)
    if cfg.overlong_buffer is not None:
        rewards = rewards + overlong_penalty(torch.tensor(batch.output_lens), cfg.max_new_tokens, cfg.overlong_buffer,
                                             cfg.overlong_penalty)
    budget = max(cfg.max_tokens_per_mb, max(lengths))
    t_logprobs = time.perf_counter()
    kl_reward = None
    ref = None
    if cfg.kl_coef > 0:
        # KL(behaviour || reference) on the sampled tokens, for the whole batch on every rank: the penalty
        # enters the token rewards before the batch-wide advantage normalisation.
        if ref_engine is None:
            raise TrainerConfigError("algo.kl_coef > 0 needs the reference engine (the frozen starting weights)")
        ref = torch.zeros_like(behav)
        packed_logprobs(ref_engine, lay, allocate_micro_batches(lengths, budget), ref, cfg.temperature)
        kl_reward = -cfg.kl_coef * float(kl_penalty(behav[mask], ref[mask], cfg.kl_estimator).mean())
    adv = compute_advantages(rewards, torch.tensor(group_ids), mask, cu_seqlens=lay.cu_seqlens,
                             group_norm=cfg.group_norm, group_std=cfg.group_std, adv_norm=cfg.adv_norm,
                             baseline=cfg.baseline, std_level=cfg.std_level,
                             logp=behav, logp_ref=ref,
                             kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator).advantages

    # Proximal log-probs: the current weights before this step's updates, for this rank's sequences. Routing
    # replay (mixture-of-experts models; verl's and slime's R2/R3): r3 replays the rollout's routing in this
    # forward and in training, r2 records this forward's routing and replays it in training.
    prox = behav.clone()
    replay = lay.routes if cfg.routing_replay == "r3" else None
    if cfg.decoupled or cfg.routing_replay == "r2":
        computed = prox if cfg.decoupled else prox.clone()  # plain PPO keeps prox = behav; r2 still records
        recorded = packed_logprobs(engine, lay, [ids for mbs in minibatches for ids in mbs], computed,
                                   cfg.temperature, routes=replay, record_routes=cfg.routing_replay == "r2")
        if cfg.routing_replay == "r2":
            replay = recorded
    logprobs_seconds = time.perf_counter() - t_logprobs
    mine = lay.token_mask(mine_ids)
    current = (lay.versions == float(version)) & mask & mine  # sampled by exactly these weights
    gaps = (prox - behav).abs()[current]
    gap = float(gaps.max()) if gaps.numel() else 0.0
    mismatch = mismatch_stats(prox, behav, current)
    # The corrections depend on the proximal and behaviour log-probs only: once for this rank's tokens.
    corrected = correct(prox, behav, mask & mine, cfg.correction, lay.cu_seqlens)
    agg = aggregation_weights(mask, cfg.agg_mode, lay.cu_seqlens)

    per_token = {"loss_mask": lay.loss_mask, "prox": prox, "adv": adv, "weight": corrected.weight,
                 "keep": corrected.keep.to(torch.float32), **({"agg": agg} if agg is not None else {})}
    stats_all = PPOStats()
    updates: list[dict[str, float]] = []
    loss_shares: dict[int, float] = {}
    for mbs_ids in minibatches:
        ids_here = [i for ids in mbs_ids for i in ids]
        sel = lay.token_mask(ids_here)
        answers = sum(1 for i in ids_here if mask_tokens[i] > 0)
        local_tokens, n_answers = engine.data_parallel_sum([float(corrected.keep[sel].sum()), float(answers)])
        if local_tokens == 0:   # the same decision on every rank
            continue
        for i in ids_here:
            loss_shares[i] = float(mask_tokens[i]) / local_tokens
        denominator = loss_denominator(cfg.agg_mode, local_tokens, n_answers, cfg.max_new_tokens)
        mbs = [lay.micro_batch(ids, per_token, routes=replay) for ids in mbs_ids]
        collected: list[PPOStats] = []

        def loss_fn(outputs: TokenLogProbs, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
            f = mb.fields
            loss, st = policy_loss(outputs.logprobs, f["prox"], f["adv"], f["loss_mask"], 1.0, cfg.loss,
                                   weight=f["weight"], keep=f["keep"], agg_weight=f.get("agg"),
                                   cu_seqlens=mb.cu_seqlens, entropy=outputs.entropy)
            collected.append(st)
            return loss, {}

        updates.append(engine.train_step(mbs, loss_fn, temperature=cfg.temperature,
                                         loss_denominator=denominator, with_entropy=True))
        for st in collected:
            stats_all = stats_all.merge(st)
    reports = engine.reports_stats
    return ShareResult(ppo=stats_all if reports else PPOStats(), logprob_gap=gap, updates=updates,
                       kl_reward=kl_reward, logprobs_seconds=logprobs_seconds, loss_shares=loss_shares,
                       logprob_gap_sum=float(gaps.sum()), logprob_gap_tokens=gaps.numel(),
                       correction=corrected.stats if reports else CorrectionStats(),
                       mismatch=mismatch if reports else MismatchStats())
