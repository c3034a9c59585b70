"""algo.packing: packed streams round-trip; micro-batch allocation never exceeds the budget, loses no
sequence, uses no more micro-batches than first-fit-decreasing and balances work."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from algo.packing import (
    allocate_micro_batches,
    cu_seqlens_from_lengths,
    micro_batch_lower_bound,
    pack_sequences,
    pad_packed,
    position_ids_from_cu_seqlens,
    sequence_cost,
    sequence_index,
    split_by_rank,
    unpack_sequences,
    unpad,
)

HYP = settings(max_examples=60, deadline=None, derandomize=True)


def test_pack_unpack_round_trip_and_positions():
    seqs = [torch.arange(3), torch.arange(10, 15), torch.zeros(0, dtype=torch.long), torch.tensor([7])]
    packed = pack_sequences(seqs)
    assert packed.cu_seqlens.tolist() == [0, 3, 8, 8, 9] and packed.cu_seqlens.dtype == torch.int32
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0]
    assert packed.max_seqlen == 5 and packed.lengths.tolist() == [3, 5, 0, 1]
    assert sequence_index(packed.cu_seqlens).tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 3]
    for a, b in zip(unpack_sequences(packed.data, packed.cu_seqlens), seqs):
        assert torch.equal(a, b)
    padded, mask = pad_packed(packed.data, packed.cu_seqlens, pad_value=-1)
    assert padded.shape == (4, 5) and padded[0].tolist() == [0, 1, 2, -1, -1]
    assert torch.equal(unpad(padded, mask), packed.data)


def test_pack_rejects_mismatched_sequences_and_bad_cu_seqlens():
    with pytest.raises(ValueError, match="trailing shapes"):
        pack_sequences([torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(ValueError, match="dtypes"):
        pack_sequences([torch.zeros(2), torch.zeros(2, dtype=torch.long)])
    with pytest.raises(ValueError, match="cu_seqlens"):
        position_ids_from_cu_seqlens(torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        unpack_sequences(torch.zeros(4), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="lengths"):
        cu_seqlens_from_lengths([3, -1])


def check_allocation(lengths, max_tokens, n_groups, mbs):
    lens = np.asarray(lengths)
    flat = sorted(i for mb in mbs for i in mb)
    assert flat == list(range(len(lens))), "every sequence exactly once"
    assert all(mb for mb in mbs), "no empty micro-batch"
    assert all(int(lens[mb].sum()) <= max_tokens for mb in mbs), "budget respected"
    assert len(mbs) % n_groups == 0
    assert len(mbs) >= micro_batch_lower_bound(lens, max_tokens, n_groups)
    ranks = split_by_rank(mbs, n_groups)
    assert len({len(r) for r in ranks}) == 1


@HYP
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=80),   # a packed sequence has a token at least
    budget_extra=st.integers(0, 400),
    n_groups=st.integers(1, 4),
    method=st.sampled_from(["kk", "lpt", "ffd"]),
    cost=st.sampled_from(["tokens", "flops"]),
)
def test_allocation_never_exceeds_budget_and_loses_nothing(lengths, budget_extra, n_groups, method, cost):
    max_tokens = max(max(lengths), 1) + budget_extra
    # Every rank gets the same number of micro-batches, none empty: impossible when that takes more
    # micro-batches than there are sequences (3 sequences of a full budget each, 2 ranks).
    needed = -(-len(allocate_micro_batches(lengths, max_tokens, method="ffd")) // n_groups) * n_groups
    if needed > len(lengths):
        with pytest.raises(ValueError, match="n_groups"):
            allocate_micro_batches(lengths, max_tokens, n_groups=n_groups, method=method, cost=cost)
        return
    mbs = allocate_micro_batches(lengths, max_tokens, n_groups=n_groups, method=method, cost=cost)
    check_allocation(lengths, max_tokens, n_groups, mbs)
    # never more micro-batches than first-fit-decreasing (rounded to the rank count)
    ffd = allocate_micro_batches(lengths, max_tokens, n_groups=n_groups, method="ffd")
    assert len(mbs) <= len(ffd)


def long_tailed(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(6000), 0.8, n), 64, 31000).astype(np.int64)


@pytest.mark.parametrize("n_groups", [1, 4])
@pytest.mark.parametrize("method", ["kk", "lpt"])
def test_balanced_methods_beat_ffd_balance_at_no_more_micro_batches(n_groups, method):
    lengths = long_tailed(512, seed=3)
    budget = 32768
    ffd = allocate_micro_batches(lengths, budget, n_groups=n_groups, method="ffd")
    bal = allocate_micro_batches(lengths, budget, n_groups=n_groups, method=method)
    check_allocation(lengths, budget, n_groups, bal)
    loads = lambda mbs: [int(lengths[mb].sum()) for mb in mbs]
    assert len(bal) <= len(ffd)
    assert max(loads(bal)) / min(loads(bal)) < max(loads(ffd)) / min(loads(ffd))
    assert max(loads(bal)) / min(loads(bal)) <= 1.10
    rank_loads = [sum(loads(r)) for r in split_by_rank(bal, n_groups)]
    assert max(rank_loads) / min(rank_loads) <= 1.02


def test_flops_cost_balances_flops():
    lengths = long_tailed(256, seed=5)
    budget = 40000
    work = sequence_cost(lengths, "flops")
    by_flops = allocate_micro_batches(lengths, budget, cost="flops")
    by_tokens = allocate_micro_batches(lengths, budget, cost="tokens")
    spread = lambda mbs: max(work[mb].sum() for mb in mbs) / min(work[mb].sum() for mb in mbs)
    check_allocation(lengths, budget, 1, by_flops)
    assert spread(by_flops) < spread(by_tokens)


def test_allocation_errors_name_the_cause():
    with pytest.raises(ValueError, match="sequence 1 has 50 tokens"):
        allocate_micro_batches([10, 50, 20], max_tokens=40)
    with pytest.raises(ValueError, match="negative"):
        allocate_micro_batches([10, -5], max_tokens=40)
    with pytest.raises(ValueError, match="max_tokens"):
        allocate_micro_batches([10], max_tokens=0)
    with pytest.raises(ValueError, match="method"):
        allocate_micro_batches([10], max_tokens=40, method="best")
    with pytest.raises(ValueError, match="cost"):
        allocate_micro_batches([10], max_tokens=40, cost="time")
    with pytest.raises(ValueError, match="lengths"):
        allocate_micro_batches([1.5, 2.0], max_tokens=40)
    with pytest.raises(ValueError, match="lengths"):
        allocate_micro_batches([], max_tokens=40)


def test_torch_lengths_and_single_sequence():
    assert allocate_micro_batches(torch.tensor([5]), 5) == [[0]]
    mbs = allocate_micro_batches(torch.tensor([5, 5, 5, 5]), 10, n_groups=2)
    check_allocation([5, 5, 5, 5], 10, 2, mbs)
    assert len(mbs) == 2
