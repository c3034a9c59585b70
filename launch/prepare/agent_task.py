"""Arithmetic with a calculator tool: the embedded agent task (`make_task --task agent`).

A problem of level L is a chain that starts with a product of two two-digit numbers and adds or subtracts
L-1 more two-digit numbers, e.g. level 2: ``37*48+56``. A 1M-parameter model cannot multiply two-digit
numbers in its head; with the calculator tool (actors/rollout/envs/calculator.py: one operation per call) the task
is copying: call ``[37*48]``, read ``=1776``, call ``[1776+56]``, read ``=1832``, box the last value::

    prompt       "Compute: 37*48+56\\n"
    transcript   model "[37*48]"   env "=1776\\n"   model "[1776+56]"   env "=1832\\n"   model "\\\\boxed{1832}"

The demonstrations are imperfect the way a real teacher's can be: by default (``--guess-fraction 0.8``)
most of them skip the tool and box a guess (the true value off by 1 to ``--guess-spread``, default 30),
which is always wrong. A student imitating that mix mostly guesses; RL, rewarded on the true answer, learns to use the tool,
which careful demonstrations (``--guess-fraction 0``) teach. Without the tool (an episode of one turn) the
task can only be guessed; ``--guess-fraction 1 --guess-spread 0`` (a teacher who always answers in its head,
correctly) measures how well the model could learn that.

Records follow AReaL's JSON-lines layout, plus what the episode needs: ``query_id``, ``prompt``, ``answer``,
``solutions`` (the transcript's text, observations included, ending in ``\\boxed{answer}``), ``level``,
``task`` ("math": the boxed answer is checked as any math answer), ``tool`` ("calculator": the environment,
actors/envs) and ``transcripts``: per solution, its segments ``{"role": "model" | "env", "text": ...}``, model first and last, alternating; the warm start
trains on the model's segments only (launch/prepare/sft.py). The output is a pure function of the arguments, and the
splits never share a product: a quarter of the pairs of two-digit factors (either order) is held out for
the test split, so no test problem's product appears in a training problem of any level.
"""
from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass
from typing import Iterable

from actors.rollout.envs.calculator import CALL_CLOSE, CALL_OPEN, calculate, observation

LEVELS = (1, 2, 3)
OPERANDS = range(10, 100)
PROMPT_TEMPLATE = "Compute: {expr}\n"
TOOL = "calculator"
TASK = "agent"
GUESS_SPREAD = 30
RECIPE_GUESS_FRACTION = 0.8
TEST_PAIR_FRACTION = 0.25
_EXPR = re.compile(r"(\d+)\*(\d+)((?:[-+]\d+)*)")


@dataclass(frozen=True)
class Chain:
    """``a*b`` followed by ``tail`` (each an operator "+"/"-" and an operand), evaluated left to right."""

    a: int
    b: int
    tail: tuple[tuple[str, int], ...] = ()

    @classmethod
    def parse(cls, expr: str) -> "Chain":
        """The chain a prompt's expression spells (``37*48+56``); ValueError if it spells none."""
        found = _EXPR.fullmatch(expr)
        if found is None:
            raise ValueError(f"not a product followed by +/- terms: {expr!r}")
        tail = tuple((m[0], int(m[1:])) for m in re.findall(r"[-+]\d+", found.group(3)))
        return cls(int(found.group(1)), int(found.group(2)), tail)

    @property
    def level(self) -> int:
        return 1 + len(self.tail)

    @property
    def expr(self) -> str:
        return f"{self.a}*{self.b}" + "".join(f"{op}{x}" for op, x in self.tail)

    def calls(self) -> list[tuple[str, int]]:
        """The calculator calls that solve it, one operation each, with their values."""
        call = f"{self.a}*{self.b}"
        value = calculate(call)
        out = [(call, value)]
        for op, x in self.tail:
            call = f"{value}{op}{x}"
            value = calculate(call)
            out.append((call, value))
        return out

    @property
    def value(self) -> int:
        return self.calls()[-1][1]


def tool_transcript(chain: Chain) -> list[dict[str, str]]:
    """The careful teacher: one call per operation, then the boxed value. Observations are exactly what the
    calculator environment answers."""
    segments: list[dict[str, str]] = []
    for call, value in chain.calls():
        segments.append({"role": "model", "text": f"{CALL_OPEN}{call}{CALL_CLOSE}"})
        segments.append({"role": "env", "text": observation(value)})
    segments.append({"role": "model", "text": f"\\boxed{{{chain.value}}}"})
    return segments


def guess_transcript(chain: Chain, rng: random.Random, spread: int = GUESS_SPREAD) -> list[dict[str, str]]:
    """The teacher who skips the tool: a boxed guess off by 1 to ``spread`` (never right); ``spread`` 0: the
    right value, as if worked out in the head."""
    guess = chain.value + (rng.choice((-1, 1)) * rng.randint(1, spread) if spread else 0)
    return [{"role": "model", "text": f"\\boxed{{{guess}}}"}]


def factor_pairs(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(test pairs, train pairs): unordered two-digit factor pairs, a seeded TEST_PAIR_FRACTION held out."""
    pairs = list(itertools.combinations_with_replacement(OPERANDS, 2))
    random.Random(f"agent/{seed}/pairs").shuffle(pairs)
    n_test = round(len(pairs) * TEST_PAIR_FRACTION)
    return pairs[:n_test], pairs[n_test:]


def sample_chains(rng: random.Random, level: int, pairs: list[tuple[int, int]], count: int) -> list[Chain]:
    """``count`` distinct chains of ``level`` on the given factor pairs (either order). Bounded: level 1 is
    enumerated (asking for more than exist is an error); longer chains have over 16,000 tails per product."""
    if level == 1:
        pool = sorted({Chain(a, b) for x, y in pairs for a, b in ((x, y), (y, x))}, key=lambda c: (c.a, c.b))
        if count > len(pool):
            raise ValueError(f"level 1 has only {len(pool)} problems on these factor pairs; asked for {count}")
        rng.shuffle(pool)
        return pool[:count]
    chosen: dict[str, Chain] = {}
    room = 2 * len(pairs) * (2 * len(OPERANDS)) ** (level - 1)
    if count * 2 > room:
        raise ValueError(f"level {level} has about {room} problems on these factor pairs; asked for {count}")
    while len(chosen) < count:   # under half of the space: rejection ends quickly
        x, y = rng.choice(pairs)
        a, b = (x, y) if rng.random() < 0.5 else (y, x)
        chain = Chain(a, b, tuple((rng.choice("+-"), rng.choice(OPERANDS)) for _ in range(level - 1)))
        chosen.setdefault(chain.expr, chain)
    return list(chosen.values())


def record(chain: Chain, split: str, index: int, transcript: list[dict[str, str]]) -> dict:
    return {
        "query_id": f"{TASK}-{split}-L{chain.level}-{index:06d}",
        "prompt": PROMPT_TEMPLATE.format(expr=chain.expr),
        "answer": str(chain.value),
        "solutions": ["".join(s["text"] for s in transcript)],
        "level": chain.level,
        "task": "math",   # the checker of the boxed answer; "tool" names the environment
        "tool": TOOL,
        "transcripts": [transcript],
    }


def make_splits(seed: int = 0, levels: Iterable[int] = LEVELS, train_per_level: int = 4000,
                test_per_level: int = 200, guess_fraction: float = RECIPE_GUESS_FRACTION,
                guess_spread: int = GUESS_SPREAD) -> dict[str, list[dict]]:
    """Train and test records. The test split's factor pairs never occur in the train split."""
    if not 0.0 <= guess_fraction <= 1.0:
        raise ValueError(f"guess_fraction must be within [0, 1], got {guess_fraction}")
    if guess_spread < 0:
        raise ValueError(f"guess_spread must be >= 0, got {guess_spread}")
    levels = sorted(set(levels))
    if not levels or any(level not in LEVELS for level in levels):
        raise ValueError(f"agent levels must be among {list(LEVELS)}, got {levels}")
    if train_per_level < 0 or test_per_level < 0:
        raise ValueError("train_per_level and test_per_level must be >= 0")
    test_pairs, train_pairs = factor_pairs(seed)
    splits: dict[str, list[dict]] = {"train": [], "test": []}
    for level in levels:
        # Separate streams per level and purpose: the teacher's choices never move the splits.
        pick = random.Random(f"agent/{seed}/{level}/problems")
        teacher = random.Random(f"agent/{seed}/{level}/teacher")
        for split, pairs, count in (("test", test_pairs, test_per_level), ("train", train_pairs, train_per_level)):
            for i, chain in enumerate(sample_chains(pick, level, pairs, count)):
                guesses = teacher.random() < guess_fraction
                transcript = guess_transcript(chain, teacher, guess_spread) if guesses else tool_transcript(chain)
                splits[split].append(record(chain, split, i, transcript))
    shuffle = random.Random(f"agent/{seed}/order")
    for records in splits.values():
        shuffle.shuffle(records)
    return splits
