"""algo.eval_stats: pass@k against brute-force enumeration, maj@k and greedy accuracy."""
from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings, strategies as st

from algo.eval_stats import greedy_accuracy, maj_at_k, pass_at_k, pass_at_k_one


@settings(max_examples=80, deadline=None, derandomize=True)
@given(n=st.integers(1, 10), data=st.data())
def test_pass_at_k_equals_enumeration_of_all_k_subsets(n, data):
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    want = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k_one(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_closed_forms_and_large_n():
    assert pass_at_k_one(32, 8, 1) == pytest.approx(8 / 32)
    assert pass_at_k_one(1000, 1, 10) == pytest.approx(1 - math.comb(999, 10) / math.comb(1000, 10))
    assert pass_at_k_one(100_000, 3, 50_000) == pytest.approx(1 - math.comb(99_997, 50_000) / math.comb(100_000, 50_000))
    assert pass_at_k([4, 4], [0, 4], 2) == pytest.approx(0.5)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="c"):
        pass_at_k_one(4, 5, 1)
    with pytest.raises(ValueError, match="k"):
        pass_at_k_one(4, 1, 5)
    with pytest.raises(ValueError, match="num_correct"):
        pass_at_k([4, 4], [1], 1)


def test_maj_at_k_votes_ties_and_missing_answers():
    answers = [["3", "4", "3", "5"], ["1", "2", "2", "1"], [None, None, "7", None], [None, None, None, None]]
    correct = [[True, False, True, False], [True, False, False, True], [False, False, False, False], [False] * 4]
    assert maj_at_k(answers, correct, 4) == pytest.approx(1 / 4 + 1 / 4)  # "3" wins; tie 1/2 goes to "1"
    assert maj_at_k(answers, correct, 1) == pytest.approx(2 / 4)
    with pytest.raises(ValueError, match="answers"):
        maj_at_k(answers, correct, 5)
    with pytest.raises(ValueError, match="correct"):
        maj_at_k(answers, correct[:2], 1)


def test_greedy_accuracy():
    assert greedy_accuracy([True, False, True, True]) == 0.75
    with pytest.raises(ValueError, match="correct"):
        greedy_accuracy([])
