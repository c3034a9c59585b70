"""algo/advantages.py's baselines of the loss menu on cases worked by hand: RLOO's leave-one-out mean, LitePPO's
batch-level std, Dr.GRPO's missing std, and DAPO's soft overlong penalty."""
from __future__ import annotations

import pytest
import torch

from algo.advantages import compute_advantages, group_normalize, overlong_penalty


def test_leave_one_out_baseline_by_hand() -> None:
    # group [1, 0, 0, 1]: each answer minus the mean of the other three: 1 - 1/3, 0 - 2/3
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    out = group_normalize(r, torch.zeros(4, dtype=torch.int64), use_std=False, baseline="leave_one_out")
    assert out.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # a group of one answer has no other answers: 0
    single = group_normalize(torch.tensor([3.0]), torch.tensor([5]), use_std=False, baseline="leave_one_out")
    assert single.tolist() == [0.0]


def test_batch_level_std_by_hand() -> None:
    # groups [1, 0] and [1, 1]: minus group means 0.5 and 1 -> [0.5, -0.5, 0, 0]; the batch's rewards [1, 0, 1, 1]
    # have mean 0.75 and population std sqrt(0.1875) = 0.4330
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    out = group_normalize(r, torch.tensor([0, 0, 1, 1]), std_level="batch", eps=0.0)
    assert out.tolist() == pytest.approx([0.5 / 0.1875 ** 0.5, -0.5 / 0.1875 ** 0.5, 0.0, 0.0])


def test_no_std_division_is_dr_grpo() -> None:
    r = torch.tensor([5.0, -5.0, -5.0, -5.0])
    assert group_normalize(r, torch.zeros(4, dtype=torch.int64), use_std=False).tolist() == [7.5, -2.5, -2.5, -2.5]


def test_overlong_penalty_by_hand() -> None:
    # limit 10, buffer 4: no penalty up to 6 tokens, then -1/4 a token, -1 at 10 and beyond
    out = overlong_penalty(torch.tensor([5, 6, 8, 10, 12]), max_length=10, buffer=4, factor=1.0)
    assert out.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="buffer: must be in 1..max_length"):
        overlong_penalty(torch.tensor([1]), max_length=10, buffer=0, factor=1.0)


def test_rloo_advantages_through_the_pipeline() -> None:
    # one token per answer, no token normalisation: the advantage is the leave-one-out reward
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    mask = torch.ones(4, 1)
    adv = compute_advantages(r, torch.zeros(4, dtype=torch.int64), mask, group_norm=True, group_std=False,
                             baseline="leave_one_out", adv_norm="none").advantages
    assert adv.flatten().tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
