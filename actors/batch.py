"""The training batch's layout: its list form (`Batch`, as the buffer assembles it and tests build it), its
columns (`transport.protocol.BatchTensors`, as it travels), the tensor frames its token columns are split
into, each trainer rank's share of it, and its packed form (`TrainBatch`, as the trainer works on it: every
sequence's tokens and per-token fields in one stream, micro-batches gathered from it).

A group's token-level data travels as plain lists (a few MB at most). A training batch does not: at the 7B
recipe's shape (512 prompts x 16 answers of up to 31,744 tokens) its token ids, log-probs and versions are
over 1 GB each, so its token columns are tensors split into frames of at most `BATCH_FRAME_BYTES`, and a
trainer rank gets only the sequences it trains on (`shares`). Pure functions of the batch: no I/O.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from actors.engines.base import PackedBatch
from actors.engines.moe import ROUTE_NATIVE
from transport.protocol import BatchTensors, BufferStats, Sample

# Each tensor frame of a BatchTensors holds at most this many bytes: well under the bus's 256 MiB frame
# limit (transport/bus.py), and large enough that the per-frame cost is nothing next to the copy.
BATCH_FRAME_BYTES = 64 << 20

TOKEN_COLUMNS = ("prompt_ids", "output_ids", "logprobs", "versions")

# The `versions` entry of a token no weights sampled (an episode's observation tokens, actors/rollout/episode.py),
# as prompts have in training: such tokens are never trained or graded.
ENV_VERSION = -1


def generated_ids(output_ids: Sequence[int], versions: Sequence[int]) -> list[int]:
    """The tokens a model generated among an answer's: those whose version is not `ENV_VERSION` (what a
    grader reads). Lists that do not line up are taken whole (an answer from before episodes)."""
    if len(versions) != len(output_ids):
        return list(output_ids)
    return [t for t, v in zip(output_ids, versions) if v != ENV_VERSION]


@dataclass
class BatchGroup:
    """One prompt of a Batch: its tokens and difficulty level (-1: none), which the buffer holds, and its
    scored answers."""

    prompt_ids: list[int]
    level: int
    samples: list[Sample]


@dataclass
class Batch:
    """B scored groups, each started no more than eta versions ago, as the buffer assembles them (and tests
    build them). It travels as `BatchTensors` (`from_batch`)."""

    step: int
    groups: list[BatchGroup]
    stats: BufferStats


def _chunks(flat_tensor: torch.Tensor, frame_bytes: int) -> list[torch.Tensor]:
    """`flat_tensor` (1-D) as views of at most `frame_bytes` bytes each: one tensor frame per view, no copy."""
    per = max(1, frame_bytes // flat_tensor.element_size())
    return list(flat_tensor.split(per)) if flat_tensor.numel() else [flat_tensor]


def _joined(chunks: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if not chunks:
        return torch.empty(0, dtype=dtype)
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def _gather_ranges(chunks: list[torch.Tensor], ranges: list[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
    """The elements [a, b) of each range of the column that `chunks` split, concatenated in order."""
    starts = [0]
    for c in chunks:
        starts.append(starts[-1] + c.numel())
    pieces = []
    for a, b in ranges:
        k = bisect.bisect_right(starts, a) - 1
        while a < b:
            end = min(b, starts[k + 1])
            pieces.append(chunks[k][a - starts[k]:end - starts[k]])
            a, k = end, k + 1
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype)


def from_columns(*, step: int, stats: BufferStats, levels: list[int], group_sizes: list[int],
                 prompt_ids: torch.Tensor, prompt_lens: list[int], output_ids: torch.Tensor,
                 output_lens: list[int], logprobs: torch.Tensor, versions: torch.Tensor, rewards: list[float],
                 correct: list[bool], finish_reasons: list[str], score_details: list[str] | None = None,
                 carried: list[int] | None = None, routed_experts: list[torch.Tensor] | None = None,
                 frame_bytes: int = BATCH_FRAME_BYTES) -> BatchTensors:
    """A batch from flat 1-D token tensors (converted to the wire dtypes), split into frames. Columns
    that disagree raise TypeError naming the column (BatchTensors.__post_init__)."""
    n = len(output_lens)
    return BatchTensors(step=step, stats=stats, levels=list(levels), group_sizes=list(group_sizes),
                        prompt_lens=list(prompt_lens), output_lens=list(output_lens),
                        rewards=[float(r) for r in rewards], correct=[bool(c) for c in correct],
                        finish_reasons=list(finish_reasons),
                        score_details=list(score_details) if score_details is not None else [""] * n,
                        prompt_ids=_chunks(prompt_ids.reshape(-1).to(torch.int32), frame_bytes),
                        output_ids=_chunks(output_ids.reshape(-1).to(torch.int32), frame_bytes),
                        logprobs=_chunks(logprobs.reshape(-1).to(torch.float32), frame_bytes),
                        versions=_chunks(versions.reshape(-1).to(torch.int32), frame_bytes),
                        carried=None if carried is None else list(carried), routed_experts=routed_experts or [])


def from_batch(batch: Batch, frame_bytes: int = BATCH_FRAME_BYTES) -> BatchTensors:
    """The columns of a list-form batch (every sample carried)."""
    samples = [s for g in batch.groups for s in g.samples]

    def cat(rows: list[list[Any]], dtype: type) -> torch.Tensor:
        # One array per row, then one concatenation: numpy reads a list of numbers 2-4x faster than
        # torch.tensor does, and far faster than flattening the lists in Python.
        return torch.from_numpy(np.concatenate([np.asarray(r, dtype=dtype) for r in rows] or [np.empty(0, dtype)]))

    return from_columns(
        step=batch.step, stats=batch.stats, levels=[g.level for g in batch.groups],
        group_sizes=[len(g.samples) for g in batch.groups],
        prompt_ids=cat([g.prompt_ids for g in batch.groups], np.int32),
        prompt_lens=[len(g.prompt_ids) for g in batch.groups],
        output_ids=cat([s.output_ids for s in samples], np.int32), output_lens=[len(s.output_ids) for s in samples],
        logprobs=cat([s.logprobs for s in samples], np.float32),
        versions=cat([s.versions for s in samples], np.int32), rewards=[s.reward for s in samples],
        correct=[s.correct for s in samples], finish_reasons=[s.finish_reason for s in samples],
        score_details=[s.score_detail for s in samples], routed_experts=routed_column(samples), frame_bytes=frame_bytes)


def routed_column(samples: list[Sample]) -> list[torch.Tensor]:
    """The routed_experts column of these samples: empty when none has any, else an empty tensor where one lacks it."""
    if all(s.routed_experts is None for s in samples):
        return []
    none = torch.empty(0, dtype=torch.uint8)
    return [none if s.routed_experts is None else s.routed_experts for s in samples]


def as_columns(batch: Batch | BatchTensors) -> BatchTensors:
    """The batch in the trainer's working form (what the buffer sends); a list-form Batch is converted."""
    return batch if isinstance(batch, BatchTensors) else from_batch(batch)


def sample_groups(batch: BatchTensors) -> list[int]:
    """Each sample's group index."""
    return [g for g, size in enumerate(batch.group_sizes) for _ in range(size)]


def sequence_lengths(batch: BatchTensors) -> tuple[list[int], list[int]]:
    """Each sequence's (prompt + answer) length and group index, in sample order."""
    group_ids = sample_groups(batch)
    return [batch.prompt_lens[g] + n for g, n in zip(group_ids, batch.output_lens)], group_ids


def carried_samples(batch: BatchTensors) -> list[int]:
    """The samples whose tokens `batch` carries, ascending (every sample unless it is a rank's share)."""
    return list(range(len(batch.output_lens))) if batch.carried is None else list(batch.carried)


def carries_every_sample(batch: BatchTensors) -> bool:
    return batch.carried is None or batch.carried == list(range(len(batch.output_lens)))


def flat(batch: BatchTensors, column: str) -> torch.Tensor:
    """One token column (prompt_ids, output_ids, logprobs or versions) as a single 1-D tensor."""
    if column not in TOKEN_COLUMNS:
        raise ValueError(f"{column!r} is not a token column of a batch")
    return _joined(getattr(batch, column), torch.float32 if column == "logprobs" else torch.int32)


def share(batch: BatchTensors, samples: list[int], frame_bytes: int = BATCH_FRAME_BYTES) -> BatchTensors:
    """The same batch carrying the tokens of `samples` only (every scalar column stays whole)."""
    return shares(batch, [samples], frame_bytes)[0]


def shares(batch: BatchTensors, per_rank: list[list[int]], frame_bytes: int = BATCH_FRAME_BYTES) -> list[BatchTensors]:
    """`share` of each list of samples. Each sample's tokens are one contiguous range of the carried
    columns, so a share is a concatenation of slices of the chunks (one copy of the share, no index)."""
    have = carried_samples(batch)
    position = {s: k for k, s in enumerate(have)}
    offsets = [0]
    for s in have:
        offsets.append(offsets[-1] + batch.output_lens[s])
    prompts = flat(batch, "prompt_ids")
    out = []
    for samples in per_rank:
        wanted = sorted(set(samples))
        missing = [s for s in wanted if s not in position]
        if missing:
            raise ValueError(f"samples {missing[:8]} are not carried by this batch")
        if wanted == have:   # every sample (a KL penalty's shares): the batch itself, no copy
            out.append(batch)
            continue
        ranges = [(offsets[position[s]], offsets[position[s] + 1]) for s in wanted]
        out.append(from_columns(
            step=batch.step, stats=batch.stats, levels=batch.levels, group_sizes=batch.group_sizes,
            prompt_ids=prompts, prompt_lens=batch.prompt_lens,
            output_ids=_gather_ranges(batch.output_ids, ranges, torch.int32), output_lens=batch.output_lens,
            logprobs=_gather_ranges(batch.logprobs, ranges, torch.float32),
            versions=_gather_ranges(batch.versions, ranges, torch.int32), rewards=batch.rewards,
            correct=batch.correct, finish_reasons=batch.finish_reasons, score_details=batch.score_details,
            carried=wanted, frame_bytes=frame_bytes,
            routed_experts=[batch.routed_experts[position[s]] for s in wanted] if batch.routed_experts else []))
    return out


def to_batch(batch: BatchTensors) -> Batch:
    """The list form (every sample must be carried)."""
    if not carries_every_sample(batch):
        raise ValueError("to_batch: this batch carries the tokens of only some samples (a rank's share)")
    prompts = flat(batch, "prompt_ids").tolist()
    out, lp = flat(batch, "output_ids").tolist(), flat(batch, "logprobs").tolist()
    ver = flat(batch, "versions").tolist()
    routed = batch.routed_experts
    groups, p, o, i = [], 0, 0, 0
    for level, size, plen in zip(batch.levels, batch.group_sizes, batch.prompt_lens):
        samples = []
        for _ in range(size):
            n = batch.output_lens[i]
            samples.append(Sample(output_ids=out[o:o + n], logprobs=lp[o:o + n], versions=ver[o:o + n],
                                  finish_reason=batch.finish_reasons[i], reward=batch.rewards[i],
                                  correct=batch.correct[i], score_detail=batch.score_details[i],
                                  routed_experts=routed[i] if routed and routed[i].numel() else None))
            o, i = o + n, i + 1
        groups.append(BatchGroup(prompt_ids=prompts[p:p + plen], level=level, samples=samples))
        p += plen
    return Batch(step=batch.step, groups=groups, stats=batch.stats)


def _ranges(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The positions [starts[k], starts[k] + lens[k]) of every k, concatenated in order (int64)."""
    within = torch.zeros_like(lens)
    within[1:] = torch.cumsum(lens, 0)[:-1]
    return torch.repeat_interleave(starts - within, lens) + torch.arange(int(lens.sum()), dtype=torch.int64)


@dataclass
class TrainBatch:
    """A batch as the trainer works on it: the columns it arrived as (the buffer's BatchTensors, or a rank's
    share of them) and the packed layout of every sequence (prompt + answer, in sample order), with the
    tokens and per-token fields of the carried ones filled in (the others are zero: a rank reads only its own
    sequences' tokens). A micro-batch is a gather of some sequences' slices of these tensors (`micro_batch`),
    never a detour through Python lists."""

    columns: BatchTensors
    lengths: list[int]             # tokens per sequence
    group_ids: list[int]
    starts: list[int]              # where each sequence begins in the layout
    cu_seqlens: torch.Tensor       # int64 [sequences + 1]
    carried: torch.Tensor          # bool [sequences]: whose tokens this batch holds
    tokens: torch.Tensor           # int64 token ids
    loss_mask: torch.Tensor        # float32, 1 on answer tokens a model generated
    behav: torch.Tensor            # float32 behaviour log-probs on answer tokens
    versions: torch.Tensor         # float32 weight version on answer tokens, -1 on prompts
    routes: torch.Tensor | None    # the rollout's routing, [tokens, sparse layers, top-k] int64 (ROUTE_NATIVE: none)

    @classmethod
    def of(cls, batch: Batch | BatchTensors) -> "TrainBatch":
        """The packed layout of `batch`."""
        cols = as_columns(batch)
        lengths, group_ids = sequence_lengths(cols)
        n = len(lengths)
        lens = torch.tensor(lengths, dtype=torch.int64)
        cu = torch.zeros(n + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lens, 0)
        total = int(cu[-1])
        prompt_of = torch.tensor([cols.prompt_lens[g] for g in group_ids], dtype=torch.int64)
        pos = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(cu[:-1], lens)
        on_answer = pos >= torch.repeat_interleave(prompt_of, lens)
        carried = carried_samples(cols)
        c = torch.tensor(carried, dtype=torch.int64)
        out_lens = torch.tensor([cols.output_lens[i] for i in carried], dtype=torch.int64)
        # Where each carried answer token sits in the layout: its sequence's start + prompt length + offset.
        answer_pos = _ranges(cu[:-1][c] + prompt_of[c], out_lens)
        behav = torch.zeros(total, dtype=torch.float32)
        behav[answer_pos] = flat(cols, "logprobs")
        versions = torch.full((total,), -1.0, dtype=torch.float32)
        versions[answer_pos] = flat(cols, "versions").to(torch.float32)
        tokens = torch.zeros(total, dtype=torch.int64)
        tokens[answer_pos] = flat(cols, "output_ids").to(torch.int64)
        # Each carried sequence's prompt: its group's slice of the prompt column.
        group_prompt_lens = torch.tensor(cols.prompt_lens, dtype=torch.int64)
        prompt_start = torch.zeros_like(group_prompt_lens)
        prompt_start[1:] = torch.cumsum(group_prompt_lens, 0)[:-1]
        g = torch.tensor(group_ids, dtype=torch.int64)[c]
        tokens[_ranges(cu[:-1][c], prompt_of[c])] = flat(cols, "prompt_ids").to(torch.int64)[
            _ranges(prompt_start[g], group_prompt_lens[g])]
        loss_mask = on_answer.to(torch.float32)
        # An episode's environment tokens (version -1, actors/rollout/episode.py) are context, never trained. A
        # rank knows this only for the sequences it carries; the others keep every answer token in the mask.
        loss_mask[answer_pos] = (versions[answer_pos] >= 0).to(torch.float32)
        has = torch.zeros(n, dtype=torch.bool)
        has[c] = True
        starts = cu[:-1].tolist()
        return cls(cols, lengths, group_ids, starts, cu, has, tokens, loss_mask, behav, versions,
                   _rollout_routes(cols, carried, starts, total))

    def token_index(self, ids: list[int]) -> torch.Tensor:
        """The layout positions of the tokens of sequences `ids`, in that order (int64)."""
        i = torch.tensor(ids, dtype=torch.int64)
        return _ranges(self.cu_seqlens[:-1][i], self.cu_seqlens[1:][i] - self.cu_seqlens[:-1][i])

    def token_mask(self, ids: list[int]) -> torch.Tensor:
        """True on the tokens of sequences `ids` (bool, the layout's length)."""
        sel = torch.zeros(self.tokens.numel(), dtype=torch.bool)
        sel[self.token_index(ids)] = True
        return sel

    def micro_batch(self, ids: list[int], fields: dict[str, torch.Tensor] | None = None,
                    routes: torch.Tensor | None = None) -> PackedBatch:
        """Sequences `ids`, packed in that order, with their slices of the per-token `fields` (float32, as a
        loss reads them) and, for replay, of `routes` (the layout's routing, as "routed_experts")."""
        idx = self.token_index(ids)
        lens = torch.tensor([self.lengths[i] for i in ids], dtype=torch.int64)
        cu = torch.zeros(len(ids) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lens, 0)
        position_ids = torch.arange(idx.numel(), dtype=torch.int64) - torch.repeat_interleave(cu[:-1], lens)
        packed = {k: v[idx].to(torch.float32) for k, v in (fields or {}).items()}
        if routes is not None:
            packed["routed_experts"] = routes[idx]
        return PackedBatch(self.tokens[idx], cu, position_ids, packed)


def _rollout_routes(batch: BatchTensors, carried: list[int], starts: list[int], total: int) -> torch.Tensor | None:
    """The routing the rollout engines recorded, in the layout: each carried sequence's routed tokens from its
    start, ROUTE_NATIVE on the tokens nobody routed (the last token, an answer without routing)."""
    shaped = [r for r in batch.routed_experts if r.dim() == 3]
    if not shaped:
        return None
    routes = torch.full((total, *shaped[0].shape[1:]), ROUTE_NATIVE, dtype=torch.int64)
    for i, recorded in zip(carried, batch.routed_experts):
        if recorded.dim() == 3:
            routes[starts[i]:starts[i] + recorded.shape[0]] = recorded.to(torch.int64)
    return routes
