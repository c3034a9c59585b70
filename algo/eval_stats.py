"""Evaluation statistics: unbiased pass@k, majority-vote maj@k, greedy accuracy.

pass@k (Chen et al. 2021, the Codex paper): with n samples per problem of which c are correct, the
probability that k samples drawn without replacement contain a correct one is
1 - C(n - c, k) / C(n, k), computed as a running product so that large n neither overflows nor loses
precision. Averaged over problems. pass@1 with n samples is the mean accuracy AReaL reports
("pass@1 averaged over 32 samples").
"""
from __future__ import annotations

from collections import Counter
from typing import Hashable, Sequence


def pass_at_k_one(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with n samples, c of them correct."""
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name}: must be an integer, got {v!r}")
    if n < 1 or k < 1:
        raise ValueError(f"n/k: must be positive, got n={n}, k={k}")
    if not 0 <= c <= n:
        raise ValueError(f"c: must lie in [0, n={n}], got {c}")
    if k > n:
        raise ValueError(f"k: {k} is more than the {n} samples drawn")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_at_k(num_samples: Sequence[int], num_correct: Sequence[int], k: int) -> float:
    """Mean unbiased pass@k over problems (per-problem sample counts may differ)."""
    if len(num_samples) != len(num_correct):
        raise ValueError(f"num_correct: {len(num_correct)} entries for {len(num_samples)} problems")
    if not num_samples:
        raise ValueError("num_samples: no problems")
    return sum(pass_at_k_one(int(n), int(c), k) for n, c in zip(num_samples, num_correct)) / len(num_samples)


def maj_at_k(answers: Sequence[Sequence[Hashable | None]], correct: Sequence[Sequence[bool]], k: int) -> float:
    """Fraction of problems whose majority answer among the first k samples is correct.

    `answers[p][j]` is the normalised final answer of sample j (None when none could be extracted: it
    does not vote); `correct[p][j]` whether it is correct. Ties go to the answer seen first. A problem
    where no sample produced an answer counts as wrong.
    """
    if len(answers) != len(correct):
        raise ValueError(f"correct: {len(correct)} entries for {len(answers)} problems")
    if not answers:
        raise ValueError("answers: no problems")
    if k < 1:
        raise ValueError(f"k: must be positive, got {k}")
    hits = 0
    for p, (ans, ok) in enumerate(zip(answers, correct)):
        if len(ans) != len(ok):
            raise ValueError(f"correct[{p}]: {len(ok)} flags for {len(ans)} answers")
        if len(ans) < k:
            raise ValueError(f"answers[{p}]: {len(ans)} samples, fewer than k={k}")
        votes = Counter(a for a in ans[:k] if a is not None)
        if not votes:
            continue
        top = max(votes.values())
        winner = next(j for j, a in enumerate(ans[:k]) if a is not None and votes[a] == top)
        hits += bool(ok[winner])
    return hits / len(answers)


def greedy_accuracy(correct: Sequence[bool]) -> float:
    """Fraction of problems whose single greedy (temperature 0) answer is correct."""
    if not correct:
        raise ValueError("correct: no problems")
    return sum(bool(c) for c in correct) / len(correct)
