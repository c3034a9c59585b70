"""Padding-free sequence packing and micro-batch allocation under a token budget.

Training on variable-length answers (a few hundred to 31k tokens) with padded [B, T] tensors wastes most
of the compute on padding. Instead sequences are concatenated into one 1-D token stream described by
`cu_seqlens` (cumulative lengths, the layout flash-attention's varlen kernels take) and `position_ids`
that restart at 0 for every sequence.

A training batch then has to be cut into micro-batches that each fit a token budget (GPU memory), using
as few forward/backward passes as possible, with the work of the passes balanced so that data-parallel
ranks wait on each other as little as possible. `allocate_micro_batches` does that:

1. the number of micro-batches k starts at the lower bound ceil(total tokens / budget), rounded up to a
   multiple of the number of data-parallel ranks, and grows only when no feasible partition is found
   (first-fit-decreasing gives a feasible upper bound, so the search is short);
2. for each k a balanced partition is built (Karmarkar-Karp largest differencing, or greedy
   longest-processing-time), repaired to fit the budget and refined by moves and swaps between the
   heaviest and lightest micro-batches;
3. micro-batches are dealt to ranks so that every rank gets the same number and rank loads are balanced.

Balancing can be on tokens or on estimated FLOPs (linear plus an attention term quadratic in length).
The default method per cost was chosen by measurement: see docs/algo.md and `python -m tools.bench packing`.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
import torch

from algo._validate import as_tensor, check_cu_seqlens

Cost = Literal["tokens", "flops"]
Method = Literal["kk", "lpt", "ffd"]

#: Sequence length at which the attention term of the FLOPs estimate equals the linear term. For a
#: Qwen2-7B-like model (28 layers, hidden 3584, ~7e9 parameters) attention costs 4*layers*hidden*L per
#: token against 2*params for the matmuls, which crosses over near 35k tokens.
DEFAULT_ATTN_CROSSOVER_TOKENS = 32768

#: Chosen by `python -m tools.bench packing` (docs/algo.md): balancing tokens, greedy LPT reaches the
#: same micro-batch count and balance as Karmarkar-Karp about 9x faster; balancing FLOPs, Karmarkar-Karp
#: balances better (max/min 1.53 against 1.70 on the long-tailed batches) and sometimes needs fewer passes.
DEFAULT_METHOD: dict[str, Method] = {"tokens": "lpt", "flops": "kk"}


# ----------------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedSequences:
    """Sequences concatenated into one stream: data[cu_seqlens[i]:cu_seqlens[i+1]] is sequence i."""

    data: torch.Tensor  # [total, ...]
    cu_seqlens: torch.Tensor  # int32 [n + 1]
    position_ids: torch.Tensor  # int64 [total], restarting at 0 per sequence
    max_seqlen: int

    @property
    def lengths(self) -> torch.Tensor:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(torch.int64)


def cu_seqlens_from_lengths(lengths: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Cumulative lengths [0, l0, l0+l1, ...] as int32 (the dtype varlen attention kernels take)."""
    lens = as_tensor("lengths", lengths).to(torch.int64).reshape(-1)
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError(f"lengths: negative length {int(lens.min())} at index {int(lens.argmin())}")
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=cu[1:])
    if int(cu[-1]) >= 2**31:
        raise ValueError(f"lengths: {int(cu[-1])} tokens in total do not fit int32 cu_seqlens")
    return cu.to(torch.int32)


def sequence_index(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-token index of the sequence each token of a packed stream belongs to (int64 [total])."""
    cu = check_cu_seqlens("cu_seqlens", cu_seqlens)
    lens = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(lens.numel()), lens)


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Positions 0..len-1 within each sequence of a packed stream (int64 [total])."""
    cu = check_cu_seqlens("cu_seqlens", cu_seqlens)
    total = int(cu[-1])
    seq = sequence_index(cu)
    return torch.arange(total, dtype=torch.int64) - cu[:-1][seq]


def pack_sequences(sequences: Sequence[torch.Tensor]) -> PackedSequences:
    """Concatenate sequences (each [len, ...], same trailing shape and dtype) into a packed stream."""
    if len(sequences) == 0:
        raise ValueError("sequences: nothing to pack")
    tails = {tuple(s.shape[1:]) for s in sequences}
    if len(tails) != 1:
        raise ValueError(f"sequences: trailing shapes differ: {sorted(tails)}")
    dtypes = {s.dtype for s in sequences}
    if len(dtypes) != 1:
        raise ValueError(f"sequences: dtypes differ: {sorted(map(str, dtypes))}")
    lengths = [int(s.shape[0]) for s in sequences]
    cu = cu_seqlens_from_lengths(lengths)
    data = torch.cat(list(sequences), dim=0)
    return PackedSequences(
        data=data,
        cu_seqlens=cu,
        position_ids=position_ids_from_cu_seqlens(cu),
        max_seqlen=max(lengths),
    )


def unpack_sequences(data: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Split a packed stream back into its sequences (views, no copy)."""
    cu = check_cu_seqlens("cu_seqlens", cu_seqlens, total=int(data.shape[0]))
    return [data[int(a):int(b)] for a, b in zip(cu[:-1], cu[1:])]


def pad_packed(
    data: torch.Tensor, cu_seqlens: torch.Tensor, pad_value: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed [total, ...] -> padded [n, max_len, ...] (left-aligned) and its bool mask [n, max_len]."""
    cu = check_cu_seqlens("cu_seqlens", cu_seqlens, total=int(data.shape[0]))
    lens = cu[1:] - cu[:-1]
    n = lens.numel()
    max_len = int(lens.max()) if n else 0
    mask = torch.arange(max_len).unsqueeze(0) < lens.unsqueeze(1)
    out = torch.full((n, max_len, *data.shape[1:]), pad_value, dtype=data.dtype)
    out[mask] = data
    return out, mask


def unpad(padded: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Inverse of `pad_packed`: the entries of `padded` where `mask` is set, row by row, as one stream."""
    if padded.shape[: mask.dim()] != mask.shape:
        raise ValueError(f"mask: shape {tuple(mask.shape)} does not lead padded shape {tuple(padded.shape)}")
    return padded[mask.bool()]


# ----------------------------------------------------------------------------------------------------
# Micro-batch allocation
# ----------------------------------------------------------------------------------------------------


def sequence_cost(
    lengths: Sequence[int] | np.ndarray,
    cost: Cost = "tokens",
    attn_crossover_tokens: int = DEFAULT_ATTN_CROSSOVER_TOKENS,
) -> np.ndarray:
    """Work of one forward/backward pass over each sequence, in token-equivalents.

    "tokens": the length. "flops": length * (1 + length / attn_crossover_tokens), i.e. the matmul
    FLOPs that grow linearly plus causal attention that grows quadratically.
    """
    lens = np.asarray(lengths, dtype=np.float64)
    if cost == "tokens":
        return lens.copy()
    if cost == "flops":
        if attn_crossover_tokens <= 0:
            raise ValueError(f"attn_crossover_tokens: must be positive, got {attn_crossover_tokens}")
        return lens * (1.0 + lens / float(attn_crossover_tokens))
    raise ValueError(f"cost: must be 'tokens' or 'flops', got {cost!r}")


def micro_batch_lower_bound(lengths: Sequence[int], max_tokens: int, n_groups: int = 1) -> int:
    """ceil(total tokens / budget), rounded up to a multiple of n_groups (at least n_groups)."""
    total = int(np.sum(np.asarray(lengths, dtype=np.int64)))
    k = max(1, math.ceil(total / max_tokens))
    return math.ceil(k / n_groups) * n_groups


def allocate_micro_batches(
    lengths: Sequence[int] | np.ndarray | torch.Tensor,
    max_tokens: int,
    n_groups: int = 1,
    cost: Cost = "tokens",
    method: Method | None = None,
    attn_crossover_tokens: int = DEFAULT_ATTN_CROSSOVER_TOKENS,
) -> list[list[int]]:
    """Partition sequence indices into micro-batches of at most `max_tokens` tokens each.

    Returns n_groups * m micro-batches (lists of indices into `lengths`, each sorted ascending):
    data-parallel rank r owns micro-batches [r*m, (r+1)*m) (`split_by_rank` does the slicing). Every
    index appears exactly once. The count is the smallest the method finds at or above
    `micro_batch_lower_bound`; work (tokens or FLOPs, see `sequence_cost`) is balanced across
    micro-batches and across ranks. "ffd" is plain first-fit-decreasing without balancing, kept as
    the baseline the benchmark compares against. `method=None` takes DEFAULT_METHOD[cost].
    """
    lens = _check_lengths(lengths, max_tokens, n_groups)
    n = lens.size
    if method is None:
        method = DEFAULT_METHOD.get(cost, "lpt")
    if method not in ("kk", "lpt", "ffd"):
        raise ValueError(f"method: must be 'kk', 'lpt' or 'ffd', got {method!r}")
    work = sequence_cost(lens, cost, attn_crossover_tokens)

    ffd_bins = _first_fit_decreasing(lens, max_tokens)
    k_ffd = math.ceil(len(ffd_bins) / n_groups) * n_groups
    if k_ffd > n:
        raise ValueError(
            f"n_groups: {n} sequences cannot give each of {n_groups} ranks the same number of micro-batches"
        )
    if method == "ffd":
        bins = _split_to_count(ffd_bins, k_ffd, lens)
    else:
        bins = None
        k = micro_batch_lower_bound(lens, max_tokens, n_groups)
        while k <= k_ffd:
            candidate = _karmarkar_karp(work, k) if method == "kk" else _greedy_lpt(work, lens, k, max_tokens)
            if _repair(candidate, lens, max_tokens):
                bins = candidate
                break
            k += n_groups
        if bins is None:  # the balanced partitions never fit below FFD's count: start from FFD's bins
            bins = _split_to_count(ffd_bins, k_ffd, lens)
        _refine(bins, work, lens, max_tokens)
    bins = [sorted(b) for b in bins]
    return _deal_to_ranks(bins, work, n_groups)


def split_by_rank(micro_batches: list[list[int]], n_groups: int) -> list[list[list[int]]]:
    """The micro-batches of each rank, as laid out by `allocate_micro_batches`."""
    if n_groups < 1 or len(micro_batches) % n_groups:
        raise ValueError(f"n_groups: {len(micro_batches)} micro-batches do not split evenly over {n_groups} ranks")
    m = len(micro_batches) // n_groups
    return [micro_batches[r * m:(r + 1) * m] for r in range(n_groups)]


def _check_lengths(lengths: object, max_tokens: int, n_groups: int) -> np.ndarray:
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.detach().cpu().numpy()
    lens = np.asarray(lengths)
    if lens.ndim != 1 or lens.size == 0:
        raise ValueError("lengths: must be a non-empty 1-D sequence of sequence lengths")
    if lens.dtype.kind == "f":
        if not np.isfinite(lens).all():
            raise ValueError("lengths: contains non-finite values")
        if not (lens == np.round(lens)).all():
            raise ValueError("lengths: must be whole numbers")
    elif lens.dtype.kind not in "iu":
        raise ValueError(f"lengths: must be integers, got dtype {lens.dtype}")
    lens = lens.astype(np.int64)
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be positive, got {max_tokens}")
    if n_groups < 1:
        raise ValueError(f"n_groups: must be positive, got {n_groups}")
    if (lens < 0).any():
        i = int(np.argmin(lens))
        raise ValueError(f"lengths: negative length {int(lens[i])} at index {i}")
    if (lens > max_tokens).any():
        i = int(np.argmax(lens))
        raise ValueError(f"lengths: sequence {i} has {int(lens[i])} tokens, more than max_tokens={max_tokens}")
    return lens


def _first_fit_decreasing(lens: np.ndarray, cap: int) -> list[list[int]]:
    """Classic FFD bin packing; a segment tree over bin room makes "first bin with room" O(log n)."""
    order = np.argsort(-lens, kind="stable")
    size = 1
    while size < lens.size:
        size *= 2
    tree = np.full(2 * size, -1, dtype=np.int64)  # max room in subtree; -1 marks bins not opened
    bins: list[list[int]] = []
    for i in order:
        need = int(lens[i])
        if tree[1] >= need:
            node = 1
            while node < size:
                node = 2 * node if tree[2 * node] >= need else 2 * node + 1
            b = node - size
        else:
            b = len(bins)
            bins.append([])
            node = size + b
            tree[node] = cap
        bins[b].append(int(i))
        tree[node] -= need
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return bins


def _split_to_count(bins: list[list[int]], k: int, lens: np.ndarray) -> list[list[int]]:
    """Grow a feasible packing to exactly k non-empty bins by moving single items into new bins."""
    bins = [list(b) for b in bins]
    while len(bins) < k:
        donor = max((b for b in bins if len(b) > 1), key=lambda b: sum(int(lens[i]) for i in b))
        smallest = min(donor, key=lambda i: int(lens[i]))
        donor.remove(smallest)
        bins.append([smallest])
    return bins


def _karmarkar_karp(work: np.ndarray, k: int) -> list[list[int]]:
    """k-way largest differencing: merge the two partial partitions whose spread is largest,
    pairing the heaviest part of one with the lightest of the other, until one partition is left."""
    heap: list[tuple[float, int, np.ndarray, list[list[int]]]] = []
    for i, w in enumerate(work):
        sums = np.zeros(k)
        sums[0] = w
        parts: list[list[int]] = [[] for _ in range(k)]
        parts[0].append(i)
        heap.append((-float(w), i, sums, parts))
    heapq.heapify(heap)
    tiebreak = len(work)
    while len(heap) > 1:
        _, _, sums_a, parts_a = heapq.heappop(heap)
        _, _, sums_b, parts_b = heapq.heappop(heap)
        # both are kept sorted heaviest first: reverse b so its lightest joins a's heaviest
        sums = sums_a + sums_b[::-1]
        parts = [pa + pb for pa, pb in zip(parts_a, reversed(parts_b))]
        order = np.argsort(-sums, kind="stable")
        sums = sums[order] - sums[order[-1]]
        parts = [parts[j] for j in order]
        heapq.heappush(heap, (-float(sums[0] - sums[-1]), tiebreak, sums, parts))
        tiebreak += 1
    return heap[0][3]


def _greedy_lpt(work: np.ndarray, lens: np.ndarray, k: int, cap: int) -> list[list[int]]:
    """Longest processing time first: each sequence goes to the lightest bin it fits in."""
    bins: list[list[int]] = [[] for _ in range(k)]
    load = np.zeros(k)
    tokens = np.zeros(k, dtype=np.int64)
    for i in np.argsort(-work, kind="stable"):
        fits = tokens + lens[i] <= cap
        b = int(np.argmin(np.where(fits, load, np.inf))) if fits.any() else int(np.argmin(tokens))
        bins[b].append(int(i))
        load[b] += work[i]
        tokens[b] += lens[i]
    return bins


class _Assignment:
    """Bins as arrays (bin of each item, per-bin load, tokens, count) so that the local search can
    score every candidate move or swap at once with numpy instead of looping over item pairs."""

    def __init__(self, bins: list[list[int]], work: np.ndarray, lens: np.ndarray) -> None:
        self.k = len(bins)
        self.work, self.lens = work, lens
        self.bin_of = np.empty(work.size, dtype=np.int64)
        for b, items in enumerate(bins):
            self.bin_of[items] = b
        self.count = np.bincount(self.bin_of, minlength=self.k)
        self.load = np.bincount(self.bin_of, weights=work, minlength=self.k)
        self.tokens = np.bincount(self.bin_of, weights=lens, minlength=self.k).astype(np.int64)

    def move(self, i: int, to: int) -> None:
        frm = int(self.bin_of[i])
        self.bin_of[i] = to
        self.count[frm] -= 1
        self.count[to] += 1
        self.load[frm] -= self.work[i]
        self.load[to] += self.work[i]
        self.tokens[frm] -= self.lens[i]
        self.tokens[to] += self.lens[i]

    def swap(self, i: int, j: int) -> None:
        bi, bj = int(self.bin_of[i]), int(self.bin_of[j])
        self.move(i, bj)
        self.move(j, bi)

    def bins(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(self.k)]
        for i, b in enumerate(self.bin_of):
            out[int(b)].append(i)
        return out

    def exchange_candidates(self, b: int, use_work: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every move out of bin b and every swap of an item of b with one outside b, as parallel
        arrays (item leaving b, item entering b or -1 for a plain move, change of b's measure)."""
        size = self.work if use_work else self.lens
        inside = np.flatnonzero(self.bin_of == b)
        outside = np.flatnonzero(self.bin_of != b)
        leave = np.concatenate([inside, np.repeat(inside, outside.size)])
        enter = np.concatenate([np.full(inside.size, -1), np.tile(outside, inside.size)])
        delta = -size[leave] + np.where(enter >= 0, size[np.maximum(enter, 0)], 0)
        return leave, enter, delta


def _repair(bins: list[list[int]], lens: np.ndarray, cap: int) -> bool:
    """Move or swap items out of over-budget bins in place; True when every bin fits. Bounded."""
    a = _Assignment(bins, lens.astype(np.float64), lens)
    for _ in range(4 * a.k + 16):
        over = int(np.argmax(a.tokens))
        excess = int(a.tokens[over]) - cap
        if excess <= 0:
            bins[:] = a.bins()
            return True
        leave, enter, delta = a.exchange_candidates(over, use_work=False)
        # the bin the leaving item goes to: the emptiest for a plain move, the partner's bin for a swap
        emptiest = int(np.argmax(np.where(np.arange(a.k) == over, np.iinfo(np.int64).min, cap - a.tokens)))
        target = np.where(enter >= 0, a.bin_of[np.maximum(enter, 0)], emptiest)
        ok = (delta < 0) & (a.tokens[target] - delta <= cap) & (target != over)
        if not ok.any():
            return False
        score = np.where(ok, np.minimum(-delta, excess), -1)
        c = int(np.argmax(score))
        if enter[c] >= 0:
            a.swap(int(leave[c]), int(enter[c]))
        else:
            a.move(int(leave[c]), emptiest)
    bins[:] = a.bins()
    return bool(a.tokens.max() <= cap)


def _refine(bins: list[list[int]], work: np.ndarray, lens: np.ndarray, cap: int) -> None:
    """Narrow the spread of work across bins in place: alternately raise the lightest bin and lower
    the heaviest by the best single move or swap with any other bin, never breaking the budget and
    never emptying a bin. Each accepted step strictly improves the pair it touches; steps are bounded."""
    a = _Assignment(bins, work, lens)
    if a.k < 2:
        return
    for _ in range(8 * a.k):
        hi, lo = int(np.argmax(a.load)), int(np.argmin(a.load))
        spread = a.load[hi] - a.load[lo]
        if spread <= 1e-12 * a.load[hi]:
            break
        improved = False
        for b, sign in ((lo, 1.0), (hi, -1.0)):
            leave, enter, delta = a.exchange_candidates(b, use_work=True)
            other = np.where(enter >= 0, a.bin_of[np.maximum(enter, 0)], -1)
            # a plain move out of b: into the lightest other bin when lowering hi; moves cannot raise lo
            if sign < 0:
                dest = int(np.argmin(np.where(np.arange(a.k) == b, np.inf, a.load)))
                other = np.where(enter >= 0, other, dest)
                ok_shape = (enter >= 0) | (a.count[b] > 1)
            else:
                ok_shape = enter >= 0
            safe_other = np.maximum(other, 0)
            dtok = -lens[leave] + np.where(enter >= 0, lens[np.maximum(enter, 0)], 0)
            new_b = a.load[b] + delta
            new_o = a.load[safe_other] - delta
            fits = (a.tokens[b] + dtok <= cap) & (a.tokens[safe_other] - dtok <= cap)
            if sign > 0:  # raise the lightest: both end above its old load, neither above the max
                ok = ok_shape & fits & (delta > 0) & (new_b <= a.load[hi]) & (new_o > a.load[lo])
                score = np.minimum(new_b, new_o)
                gain = score - a.load[lo]
            else:  # lower the heaviest: both end below its old load, neither below the min
                ok = ok_shape & fits & (delta < 0) & (new_b >= a.load[lo]) & (new_o < a.load[hi])
                score = np.maximum(new_b, new_o)
                gain = a.load[hi] - score
            gain = np.where(ok & (other >= 0), gain, 0.0)
            c = int(np.argmax(gain)) if gain.size else 0
            if gain.size and gain[c] > 1e-9 * spread:
                if enter[c] >= 0:
                    a.swap(int(leave[c]), int(enter[c]))
                else:
                    a.move(int(leave[c]), int(other[c]))
                improved = True
                break
        if not improved:
            break
    bins[:] = a.bins()


def _deal_to_ranks(bins: list[list[int]], work: np.ndarray, n_groups: int) -> list[list[int]]:
    """Give each rank len(bins)/n_groups micro-batches, heaviest first to the lightest rank."""
    if n_groups == 1:
        return bins
    m = len(bins) // n_groups
    loads = [float(work[b].sum()) for b in bins]
    ranks: list[list[list[int]]] = [[] for _ in range(n_groups)]
    rank_load = [0.0] * n_groups
    for b in sorted(range(len(bins)), key=lambda b: -loads[b]):
        r = min((r for r in range(n_groups) if len(ranks[r]) < m), key=lambda r: rank_load[r])
        ranks[r].append(bins[b])
        rank_load[r] += loads[b]
    return [b for rank in ranks for b in rank]
