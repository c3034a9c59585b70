"""The embedded tasks: synthetic multi-step integer arithmetic (``--task math``, the default),
programming problems with hidden unit tests (``--task code``, code_task.py) and arithmetic with a
calculator tool, solved in several turns (``--task agent``, agent_task.py).

A problem of level L is a chain of L additions/subtractions of integers 1..19, e.g. level 3:
``7+2-5+3``. The worked solution rewrites the expression one operation at a time, left to right,
then boxes the result::

    prompt:    "Compute: 7+2-5+3\\n"
    solution:  "9-5+3=4+3=7 \\boxed{7}"

Worked solutions are written only for the "solved" levels (by default all three); levels outside
them carry a prompt and a final answer only. By default (``--direct-fraction 0.8``) most worked solutions only
state the answer (``\\boxed{7}``), as a teacher that usually skips its working would: a student
imitating that mix answers "in its head" most of the time and is often wrong, and RL, rewarded on the
boxed answer, learns to work step by step. docs/task.md has the measurements behind these defaults.

Records follow AReaL's JSON-lines layout: ``query_id``, ``prompt``, ``answer`` and, where a worked
solution exists, ``solutions`` (a list of strings ending in ``\\boxed{answer}``), plus ``level``.
Output is a pure function of the arguments (seeded ``random.Random``), and the train and test splits
never share an expression.

    python -m tools.make_task --out data/arith --seed 0
    python -m tools.make_task --task code --out data/code --seed 0
    python -m tools.make_task --task agent --out data/agent --seed 0

`make_task(argv)` is that command: its flags are also what a prepare recipe's `args` name
(`launch.prepare.stage.prepare_data`), so they are parsed here, and tools/make_task.py calls it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from launch.prepare import agent_task, code_task

PROMPT_TEMPLATE = "Compute: {expr}\n"
DEFAULT_LEVELS = (1, 2, 3)
DEFAULT_SOLVED_LEVELS = (1, 2, 3)
# The research recipe (docs/task.md), the CLI defaults: operands 1..19 make sums hard to do "in
# the head" while each worked step stays easy; 80% of the demonstrations only state the answer.
RECIPE_DIRECT_FRACTION = 0.8
RECIPE_DIRECT_WRONG = 1.0
RECIPE_MAX_OPERAND = 19
SOLUTION_STYLES = ("rewrite", "accumulate")


@dataclass(frozen=True)
class Problem:
    """One chain ``operands[0] ops[0] operands[1] ...`` evaluated left to right."""

    operands: tuple[int, ...]
    ops: tuple[str, ...]

    @property
    def level(self) -> int:
        return len(self.ops)

    @property
    def expr(self) -> str:
        return render(self.operands, self.ops)


def render(operands: Iterable[int], ops: Iterable[str]) -> str:
    """Writes a chain without spaces; a negative leading value keeps its minus sign (``-4+2``)."""
    operands, ops = list(operands), list(ops)
    parts = [str(operands[0])]
    for op, value in zip(ops, operands[1:]):
        parts.append(f"{op}{value}")
    return "".join(parts)


def apply(op: str, left: int, right: int) -> int:
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    raise ValueError(f"unknown operator {op!r}")


def solve(problem: Problem) -> tuple[list[str], int]:
    """The rewrite steps (each the remaining chain after one operation) and the final value."""
    values, ops = list(problem.operands), list(problem.ops)
    steps = []
    while ops:
        values = [apply(ops[0], values[0], values[1])] + values[2:]
        ops = ops[1:]
        steps.append(render(values, ops))
    return steps, values[0]


def worked_solution(problem: Problem, style: str = "rewrite") -> str:
    """``rewrite``: each step is the remaining chain (``9-5+3=4+3=7``); ``accumulate``: each step
    is one operation on the running value (``7+2=9;9-5=4;4+3=7``)."""
    steps, answer = solve(problem)
    if style == "rewrite":
        body = "=".join(steps)
    elif style == "accumulate":
        value, parts = problem.operands[0], []
        for op, operand in zip(problem.ops, problem.operands[1:]):
            new = apply(op, value, operand)
            parts.append(f"{value}{op}{operand}={new}")
            value = new
        body = ";".join(parts)
    else:
        raise ValueError(f"unknown solution style {style!r}: expected one of {SOLUTION_STYLES}")
    return f"{body} \\boxed{{{answer}}}"


def random_problem(rng: random.Random, level: int, max_operand: int) -> Problem:
    operands = tuple(rng.randint(1, max_operand) for _ in range(level + 1))
    ops = tuple(rng.choice("+-") for _ in range(level))
    return Problem(operands, ops)


def n_distinct(level: int, max_operand: int) -> int:
    return max_operand ** (level + 1) * 2**level


def sample_level(rng: random.Random, level: int, max_operand: int, count: int,
                 exclude: set[str]) -> list[Problem]:
    """``count`` distinct problems of one level whose expressions are not in ``exclude``.

    Bounded: asking for more than the level holds is an error, not an endless loop.
    """
    available = n_distinct(level, max_operand) - len(exclude)
    if count > available:
        raise ValueError(f"level {level} with operands 1..{max_operand} has only {available} unused "
                         f"distinct problems; asked for {count}")
    chosen: dict[str, Problem] = {}
    # Rejection sampling stays cheap while count is well under the level's size; past half of it,
    # enumerate instead so the loop is bounded.
    if count * 2 > available:
        pool = [p for p in _enumerate_level(level, max_operand) if p.expr not in exclude]
        rng.shuffle(pool)
        return pool[:count]
    while len(chosen) < count:
        problem = random_problem(rng, level, max_operand)
        if problem.expr not in exclude and problem.expr not in chosen:
            chosen[problem.expr] = problem
    return list(chosen.values())


def _enumerate_level(level: int, max_operand: int) -> Iterator[Problem]:
    for operands in itertools.product(range(1, max_operand + 1), repeat=level + 1):
        for ops in itertools.product("+-", repeat=level):
            yield Problem(tuple(operands), tuple(ops))


def record(problem: Problem, split: str, index: int, solved: bool, style: str = "rewrite") -> dict:
    _, answer = solve(problem)
    rec = {
        "query_id": f"arith-{split}-L{problem.level}-{index:06d}",
        "prompt": PROMPT_TEMPLATE.format(expr=problem.expr),
        "answer": str(answer),
        "level": problem.level,
    }
    if solved:
        rec["solutions"] = [worked_solution(problem, style)]
    return rec


def make_splits(seed: int = 0, levels: Iterable[int] = DEFAULT_LEVELS,
                solved_levels: Iterable[int] = DEFAULT_SOLVED_LEVELS, train_per_level: int = 6000,
                test_per_level: int = 200, max_operand: int = 9,
                style: str = "rewrite", partial: str = "none",
                direct_fraction: float = 0.0, direct_wrong: float = 0.0) -> dict[str, list[dict]]:
    """Builds the train and test splits; the test split is drawn first so it never shrinks.

    ``partial`` says which problems of the levels outside ``solved_levels`` still get a worked
    solution: "none", "additions" (only chains of "+", as if the teacher solved only those) or
    "sample:P" (a seeded fraction P of them). ``direct_fraction`` of the worked solutions only
    state the answer (``\\boxed{7}``), as a teacher that often skips its working would; of those,
    ``direct_wrong`` box a guess near the answer instead (off by 1 to 3): a teacher that guesses when
    it skips its working. ``answer`` always stays right, so RL's reward is.
    """
    for name, value in (("direct_fraction", direct_fraction), ("direct_wrong", direct_wrong)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be within [0, 1], got {value}")
    levels, solved = sorted(set(levels)), set(solved_levels)
    has_solution = partial_rule(partial)
    if not levels or min(levels) < 1:
        raise ValueError(f"levels must be positive integers, got {levels}")
    if style not in SOLUTION_STYLES:
        raise ValueError(f"unknown solution style {style!r}: expected one of {SOLUTION_STYLES}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    rng = random.Random(seed)
    splits: dict[str, list[dict]] = {"train": [], "test": []}
    for level in levels:
        # A small level keeps three quarters of its problems for training.
        n_test = min(test_per_level, n_distinct(level, max_operand) // 4)
        test = sample_level(rng, level, max_operand, n_test, exclude=set())
        # Tiny levels (level 1 has 2 * max_operand**2 problems) get what is left after the test split.
        room = n_distinct(level, max_operand) - len(test)
        train = sample_level(rng, level, max_operand, min(train_per_level, room),
                             exclude={p.expr for p in test})
        # A separate stream per level, so the choice of partial solutions never shifts the splits.
        pick = random.Random(f"{seed}/{level}/partial")
        direct = random.Random(f"{seed}/{level}/direct")
        guess = random.Random(f"{seed}/{level}/guess")
        for split, problems in (("test", test), ("train", train)):
            for i, p in enumerate(problems):
                solved_here = level in solved or has_solution(p, pick)
                rec = record(p, split, i, solved_here, style)
                if solved_here and direct.random() < direct_fraction:
                    shown = int(rec["answer"])
                    if guess.random() < direct_wrong:
                        shown += guess.choice((-3, -2, -1, 1, 2, 3))
                    rec["solutions"] = [f"\\boxed{{{shown}}}"]
                splits[split].append(rec)
    for split in splits.values():
        rng.shuffle(split)
    return splits


def partial_rule(spec: str) -> Callable[[Problem, random.Random], bool]:
    """Parses ``--partial``: which unsolved-level problems get a worked solution anyway."""
    if spec == "none":
        return lambda problem, rng: False
    if spec == "additions":
        return lambda problem, rng: set(problem.ops) == {"+"}
    if spec.startswith("sample:"):
        try:
            fraction = float(spec.removeprefix("sample:"))
        except ValueError:
            fraction = -1.0
        if 0.0 <= fraction <= 1.0:
            return lambda problem, rng: rng.random() < fraction
    raise ValueError(f"bad partial rule {spec!r}: expected 'none', 'additions' or 'sample:P' with 0<=P<=1")


def write_jsonl(records: Iterable[dict], path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n += 1
    return n


def parse_levels(text: str) -> list[int]:
    """``"1-3,5"`` -> ``[1, 2, 3, 5]``."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        try:
            out.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ValueError(f"bad level list {text!r}: expected e.g. '1-3,5'") from None
    return out


def make_task(argv: list[str] | None = None) -> int:
    """`python -m tools.make_task ARGS`: write the task's train.jsonl and test.jsonl; the exit status."""
    ap = argparse.ArgumentParser(prog="python -m tools.make_task", description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=("math", "code", "agent"), default="math",
                    help="math: +/- chains (default); code: programs with hidden unit tests (launch/prepare/code_task.py); "
                         "agent: products and sums with a calculator tool (launch/prepare/agent_task.py)")
    ap.add_argument("--out", type=Path, default=None, help="directory for train/test.jsonl "
                    "(default data/arith, data/code with --task code, data/agent with --task agent)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--levels", default="1-3", help="levels to generate, e.g. 1-5 (code, agent: within 1-3)")
    ap.add_argument("--train-per-level", type=int, default=None, help="default 6000 (code: 3000, agent: 4000)")
    ap.add_argument("--test-per-level", type=int, default=None, help="default 200 (code: 40)")
    math_args = ap.add_argument_group("math only")
    math_args.add_argument("--solved-levels", default=None, help="levels that get worked solutions (default 1-3)")
    math_args.add_argument("--max-operand", type=int, default=None, help=f"default {RECIPE_MAX_OPERAND}")
    math_args.add_argument("--partial", default=None,
                           help="worked solutions on the other levels: none (default), additions, sample:P")
    math_args.add_argument("--direct-fraction", type=float, default=None,
                           help=f"fraction of worked solutions that only state the boxed answer "
                                f"(default {RECIPE_DIRECT_FRACTION})")
    math_args.add_argument("--direct-wrong", type=float, default=None,
                           help="fraction of the answer-only demonstrations that box a wrong guess (off by 1-3; "
                                f"default {RECIPE_DIRECT_WRONG})")
    math_args.add_argument("--style", choices=SOLUTION_STYLES, default=None,
                           help="worked-solution format (default rewrite)")
    code_args = ap.add_argument_group("code only")
    code_args.add_argument("--hardcode-fraction", type=float, default=None,
                           help="fraction of demonstrations that hard-code the shown examples "
                                f"(default {code_task.RECIPE_HARDCODE_FRACTION})")
    agent_args = ap.add_argument_group("agent only")
    agent_args.add_argument("--guess-fraction", type=float, default=None,
                            help="fraction of demonstrations that skip the tool and box a wrong guess "
                                 f"(default {agent_task.RECIPE_GUESS_FRACTION})")
    agent_args.add_argument("--guess-spread", type=int, default=None,
                            help="a guess is off by 1 to this much; 0: guesses are right, as if worked out in the "
                                 f"head (default {agent_task.GUESS_SPREAD})")
    args = ap.parse_args(argv)
    own = {"math": ("solved_levels", "max_operand", "partial", "direct_fraction", "direct_wrong", "style"),
           "code": ("hardcode_fraction",), "agent": ("guess_fraction", "guess_spread")}
    wrong = [name for task, names in own.items() if task != args.task for name in names
             if getattr(args, name) is not None]
    if wrong:
        flags = ", ".join("--" + name.replace("_", "-") for name in wrong)
        print(f"make_task: {flags} do(es) not apply to --task {args.task}", file=sys.stderr)
        return 2
    out = args.out or Path({"math": "data/arith", "code": "data/code", "agent": "data/agent"}[args.task])
    default_train, default_test = {"math": (6000, 200), "code": (3000, 40), "agent": (4000, 200)}[args.task]
    train = default_train if args.train_per_level is None else args.train_per_level
    test = default_test if args.test_per_level is None else args.test_per_level
    try:
        if args.task == "agent":
            splits = agent_task.make_splits(
                args.seed, parse_levels(args.levels), train, test,
                agent_task.RECIPE_GUESS_FRACTION if args.guess_fraction is None else args.guess_fraction,
                agent_task.GUESS_SPREAD if args.guess_spread is None else args.guess_spread)
        elif args.task == "code":
            splits = code_task.make_splits(
                args.seed, parse_levels(args.levels), train, test,
                code_task.RECIPE_HARDCODE_FRACTION if args.hardcode_fraction is None else args.hardcode_fraction)
        else:
            splits = make_splits(
                args.seed, parse_levels(args.levels), parse_levels(args.solved_levels or "1-3"), train, test,
                RECIPE_MAX_OPERAND if args.max_operand is None else args.max_operand,
                args.style or "rewrite", args.partial or "none",
                RECIPE_DIRECT_FRACTION if args.direct_fraction is None else args.direct_fraction,
                RECIPE_DIRECT_WRONG if args.direct_wrong is None else args.direct_wrong)
    except ValueError as e:
        print(f"make_task: {e}", file=sys.stderr)
        return 2
    for name, records in splits.items():
        n = write_jsonl(records, out / f"{name}.jsonl")
        print(f"wrote {n} records to {out / f'{name}.jsonl'}")
    return 0

