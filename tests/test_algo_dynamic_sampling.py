"""algo.dynamic_sampling: a group whose answers all got the same reward is uniform, against a reference."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from algo.dynamic_sampling import is_uniform


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rewards=st.lists(st.sampled_from([-5.0, 5.0, 0.0, 0.3]), max_size=12), atol=st.sampled_from([0.0, 0.5, 2.0]))
def test_is_uniform_matches_reference(rewards, atol):
    assert is_uniform(rewards, atol=atol) == (len(rewards) < 2 or max(rewards) - min(rewards) <= atol)
    assert is_uniform(torch.tensor(rewards), atol=atol) == is_uniform(rewards, atol=atol)


def test_all_correct_all_wrong_and_single_answer_groups_are_uniform():
    assert is_uniform([5.0, 5.0]) and is_uniform([-5.0, -5.0, -5.0]) and is_uniform([5.0]) and is_uniform([])
    assert not is_uniform([5.0, -5.0]) and not is_uniform([0.0, 0.0, 0.3])
    assert is_uniform([0.0, 0.0, 0.3], atol=0.5)


def test_bad_input_is_rejected_by_name():
    with pytest.raises(ValueError, match="rewards: contains non-finite"):
        is_uniform([1.0, float("nan")])
    with pytest.raises(ValueError, match="rewards: must be 1-D"):
        is_uniform(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="rewards: cannot be read"):
        is_uniform(["a", 1.0])
    with pytest.raises(ValueError, match="atol"):
        is_uniform([1.0], atol=-1.0)
