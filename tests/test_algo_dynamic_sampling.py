"""algo.dynamic_sampling: uniform-reward groups are dropped, against a loop reference."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from algo.dynamic_sampling import filter_uniform_groups


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data(), n=st.integers(0, 30), atol=st.sampled_from([0.0, 0.5, 2.0]))
def test_filter_matches_reference(data, n, atol):
    rewards = data.draw(st.lists(st.sampled_from([-5.0, 5.0, 0.0, 0.3]), min_size=n, max_size=n))
    gids = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    got = filter_uniform_groups(torch.tensor(rewards), torch.tensor(gids, dtype=torch.long), atol=atol)
    informative = {g for g in set(gids) if max(r for r, h in zip(rewards, gids) if h == g)
                   - min(r for r, h in zip(rewards, gids) if h == g) > atol}
    assert got.keep.tolist() == [g in informative for g in gids]
    assert got.kept_groups.tolist() == sorted(informative)
    assert got.dropped_groups.tolist() == sorted(set(gids) - informative)
    assert got.n_kept_groups + got.n_dropped_groups == len(set(gids))


def test_all_correct_all_wrong_and_single_answer_groups_are_dropped():
    rewards = torch.tensor([5.0, 5.0, -5.0, -5.0, 5.0, -5.0, 5.0])
    gids = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    got = filter_uniform_groups(rewards, gids)
    assert got.kept_groups.tolist() == [2] and got.dropped_groups.tolist() == [0, 1, 3]
    assert got.keep.tolist() == [False, False, False, False, True, True, False]


def test_bad_input_is_rejected_by_name():
    with pytest.raises(ValueError, match="rewards"):
        filter_uniform_groups(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="group_ids"):
        filter_uniform_groups(torch.tensor([1.0, 2.0]), torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="atol"):
        filter_uniform_groups(torch.tensor([1.0]), torch.tensor([0]), atol=-1.0)

