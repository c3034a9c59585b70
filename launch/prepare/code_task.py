"""Synthetic programming problems with hidden unit tests: the embedded code task (`make_task --task code`).

A problem asks for a one-line integer function, stated in math notation with two worked examples, in one
of the two styles code datasets store (docs/reward-code.md)::

    functional  prompt "Write f(x) returning 3x+2. f(1)=5, f(4)=14\\n"
                answer "def f(x):return 3*x+2"
                tests  [{"fn_name": "f", "args": [23], "expected": 71}, ...]
    stdio       prompt "Read x, print 3x+2. 1->5, 4->14\\n"
                answer "x=int(input());print(3*x+2)"
                tests  [{"input": "23\\n", "output": "71\\n"}, ...]

Levels: 1 is one operation (``3x``, ``x+4``, ``x-4``), 2 is ``ax+b`` / ``ax-b``, 3 is ``a(x+b)`` /
``a(x-b)``, with a in 2..9 and b in 1..9. The hidden tests call x values the prompt does not show
(10..49 and -9..-1) first, then the first shown example, so a program that only reproduces the examples fails.

The demonstrations are imperfect as a real teacher's can be: by default (``--hardcode-fraction 0.8``)
most of them hard-code the two shown examples (``def f(x):return {1:5,4:14}[x]``), which passes the
examples and fails the hidden tests. A student imitating that mix mostly hard-codes; RL, rewarded by the
hidden tests in the sandbox, learns to write the general program, which careful demonstrations
(``--hardcode-fraction 0``) teach. ``answer`` always holds a correct program.

Records: ``query_id``, ``prompt``, ``answer``, ``solutions`` (one program), ``level``, ``task`` ("code"),
``mode`` ("functional" or "stdio") and ``tests``. The output is a pure function of the arguments, and the
test split's formulas never occur in the train split (whatever the style or examples).
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Iterable

LEVELS = (1, 2, 3)
STYLES = ("functional", "stdio")
EXAMPLE_XS = range(0, 10)
HIDDEN_XS = tuple(range(10, 50)) + tuple(range(-9, 0))
N_HIDDEN = 2
RECIPE_HARDCODE_FRACTION = 0.8


@dataclass(frozen=True)
class Formula:
    """``kind`` is one of "mul", "add", "sub" (level 1), "lin+", "lin-" (level 2), "aff+", "aff-" (level 3)."""

    kind: str
    a: int
    b: int

    @property
    def level(self) -> int:
        return {"mul": 1, "add": 1, "sub": 1, "lin+": 2, "lin-": 2, "aff+": 3, "aff-": 3}[self.kind]

    @property
    def spec(self) -> str:
        """Math notation, as the prompt states it (``3x+2``, ``3(x-8)``)."""
        return self._render(times="")

    @property
    def python(self) -> str:
        """The same formula as a Python expression of x (``3*x+2``, ``3*(x-8)``)."""
        return self._render(times="*")

    def _render(self, times: str) -> str:
        sign = "+" if self.kind.endswith(("+", "add")) else "-"
        if self.kind == "mul":
            return f"{self.a}{times}x"
        if self.kind in ("add", "sub"):
            return f"x{sign}{self.b}"
        if self.kind.startswith("lin"):
            return f"{self.a}{times}x{sign}{self.b}"
        return f"{self.a}{times}(x{sign}{self.b})"

    def __call__(self, x: int) -> int:
        return eval(self.python, {"__builtins__": {}}, {"x": x})  # noqa: S307 - digits, x and + - * ( ) only


def formulas(level: int) -> list[Formula]:
    """Every formula of a level, in a fixed order."""
    if level == 1:
        return ([Formula("mul", a, 0) for a in range(2, 10)] + [Formula("add", 1, b) for b in range(1, 10)]
                + [Formula("sub", 1, b) for b in range(1, 10)])
    kinds = {2: ("lin+", "lin-"), 3: ("aff+", "aff-")}.get(level)
    if kinds is None:
        raise ValueError(f"unknown code level {level}: expected one of {list(LEVELS)}")
    return [Formula(k, a, b) for k in kinds for a in range(2, 10) for b in range(1, 10)]


def prompt(formula: Formula, style: str, xs: tuple[int, int]) -> str:
    if style == "functional":
        shown = ", ".join(f"f({x})={formula(x)}" for x in xs)
        return f"Write f(x) returning {formula.spec}. {shown}\n"
    shown = ", ".join(f"{x}->{formula(x)}" for x in xs)
    return f"Read x, print {formula.spec}. {shown}\n"


def program(formula: Formula, style: str) -> str:
    """The correct program."""
    if style == "functional":
        return f"def f(x):return {formula.python}"
    return f"x=int(input());print({formula.python})"


def hardcoded_program(formula: Formula, style: str, xs: tuple[int, int]) -> str:
    """A program that reproduces the shown examples only (KeyError on any other x)."""
    table = "{" + ",".join(f"{x}:{formula(x)}" for x in xs) + "}"
    if style == "functional":
        return f"def f(x):return {table}[x]"
    return f"print({table}[int(input())])"


def tests(formula: Formula, style: str, xs: tuple[int, int], rng: random.Random) -> list[dict]:
    """Hidden unseen inputs first (so a hard-coded program fails on its first run), then the first shown
    example. Three tests: a stdio program runs once per test in the sandbox, so each costs a start."""
    inputs = [*rng.sample(HIDDEN_XS, N_HIDDEN), xs[0]]
    if style == "functional":
        return [{"fn_name": "f", "args": [x], "expected": formula(x)} for x in inputs]
    return [{"input": f"{x}\n", "output": f"{formula(x)}\n"} for x in inputs]


def _problems(pool: list[Formula]) -> list[tuple[Formula, str, tuple[int, int]]]:
    return [(f, style, xs) for f in pool for style in STYLES for xs in itertools.combinations(EXAMPLE_XS, 2)]


def make_splits(seed: int = 0, levels: Iterable[int] = LEVELS, train_per_level: int = 3000,
                test_per_level: int = 40, hardcode_fraction: float = RECIPE_HARDCODE_FRACTION,
                test_formula_fraction: float = 0.25) -> dict[str, list[dict]]:
    """Train and test records; a quarter of each level's formulas (``test_formula_fraction``) are held out."""
    if not 0.0 <= hardcode_fraction <= 1.0:
        raise ValueError(f"hardcode_fraction must be within [0, 1], got {hardcode_fraction}")
    if not 0.0 < test_formula_fraction < 1.0:
        raise ValueError(f"test_formula_fraction must be within (0, 1), got {test_formula_fraction}")
    levels = sorted(set(levels))
    if not levels or any(level not in LEVELS for level in levels):
        raise ValueError(f"code levels must be among {list(LEVELS)}, got {levels}")
    if train_per_level < 0 or test_per_level < 0:
        raise ValueError("train_per_level and test_per_level must be >= 0")
    rng = random.Random(f"code/{seed}")
    splits: dict[str, list[dict]] = {"train": [], "test": []}
    for level in levels:
        pool = formulas(level)
        rng.shuffle(pool)
        n_test = max(1, round(len(pool) * test_formula_fraction))
        held_out, seen = pool[:n_test], pool[n_test:]
        demo = random.Random(f"code/{seed}/{level}/hardcode")
        for split, chosen, count in (("test", held_out, test_per_level), ("train", seen, train_per_level)):
            problems = _problems(chosen)
            rng.shuffle(problems)
            for i, (formula, style, xs) in enumerate(problems[:count]):
                good = program(formula, style)
                shown = hardcoded_program(formula, style, xs) if demo.random() < hardcode_fraction else good
                splits[split].append({
                    "query_id": f"code-{split}-L{level}-{i:06d}", "prompt": prompt(formula, style, xs),
                    "answer": good, "solutions": [shown], "level": level, "task": "code", "mode": style,
                    "tests": tests(formula, style, xs, rng)})
    for records in splits.values():
        rng.shuffle(records)
    return splits
