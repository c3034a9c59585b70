"""`python -m tools.bench reward`: reward-check throughput, parallel in the worker pool vs serial in one process.

Math: varied answers (numbers, fractions, radicals, polynomials, tuples, sets, intervals, equations,
percents, units, choices, and wrong or unboxed answers), checked with `grade_math`. Code: varied programs
(stdio and function-call, right, wrong and crashing) graded with `grade_code` through the bubblewrap
sandbox, on both sandbox runners: the zygote (the default) and one bwrap start per program (the runner
before it). Each workload runs serially in this process and through a warmed-up `RewardPool`, so the
ratios are measured side by side. `--json` prints one object with `math_per_s` (serial checks per second
on one core), `code_per_s` (tasks per second through the zygote sandbox, pool), `code_bwrap_per_s` (the
same with one bwrap per program), `sandbox_speedup` (their ratio), `code_cpu_ms_per_run` and
`code_bwrap_cpu_ms_per_run` (CPU per run of a one-line program, all processes), `parallel_speedup` (the whole
workload, serial time / pool time) and the detailed figures; `*_runs_per_s` count sandboxed program runs
(one per stdio test up to the first failure, one per function-call task) instead of tasks.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from actors.reward import zygote
from actors.reward.code_grader import grade_code
from actors.reward.math_grader import POOL_PRELOAD, grade_math, grade_math_fast
from actors.reward.pool import RewardPool, TaskFailure
from actors.reward.sandbox import RUNNERS, Sandbox, SandboxLimits, probe_sandbox

MATH_GRADER = "actors.reward.math_grader:grade_math"
CODE_GRADER = "actors.reward.code_grader:grade_code"


def math_items(count: int, seed: int) -> list[tuple[str, str]]:
    """(response, answer) pairs drawn from templates covering the checker's kinds of answers."""
    rng = random.Random(seed)

    def one() -> tuple[str, str]:
        a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(1, 9)
        kind = rng.randrange(14)
        if kind == 0:
            return rf"\boxed{{{a * b}}}", str(a * b)
        if kind == 1:
            return rf"\boxed{{\frac{{{a}}}{{{b}}}}}", f"{a / b:.8f}"
        if kind == 2:
            return rf"\boxed{{\sqrt{{{4 * c}}}}}", rf"2\sqrt{{{c}}}"
        if kind == 3:
            return rf"\boxed{{x^2+{2 * c}x+{c * c}}}", f"(x+{c})^2"
        if kind == 4:
            return rf"\boxed{{({a}, {b})}}", f"({a},{b})"
        if kind == 5:
            return rf"\boxed{{\{{{a}, {b}, {c}\}}}}", rf"\{{{c},{b},{a}\}}"
        if kind == 6:
            return rf"\boxed{{[{c}, {a + 10})}}", rf"[{c},{a + 10})"
        if kind == 7:
            return rf"\boxed{{y = {a}x + {b}}}", f"{a}x - y + {b} = 0"
        if kind == 8:
            return rf"\boxed{{{a}\%}}", f"{a / 100}"
        if kind == 9:
            return rf"\boxed{{{a}\text{{ cm}}}}", str(a)
        if kind == 10:
            return rf"\boxed{{\text{{(B)}}}}", "B"
        if kind == 11:
            return rf"\boxed{{{a + 1}}}", str(a)  # wrong
        if kind == 12:
            return f"the answer is {a}", str(a)  # no box
        return rf"\boxed{{\frac{{{a}}}{{{b}}} + \frac{{1}}{{{c}}}}}", rf"\frac{{{a * c + b}}}{{{b * c}}}"

    return [one() for _ in range(count)]


STDIO_PROGRAMS = (
    ("n = int(input())\nprint(sum(range(n + 1)))", lambda n: str(n * (n + 1) // 2)),
    ("n = int(input())\nprint(sum(range(n)))", lambda n: str(n * (n + 1) // 2)),  # wrong
    ("import sys\nxs = sys.stdin.read().split()\nprint(max(map(int, xs)))", lambda n: str(n)),
    ("n = int(input())\nprint(10 // (n - n))", lambda n: "0"),  # crashes
)
FUNCTION_PROGRAMS = (
    ("def solve(n):\n    return [i * i for i in range(n)]", lambda n: [i * i for i in range(n)]),
    ("class Solution:\n    def solve(self, n):\n        return {'n': n, 'even': n % 2 == 0}",
     lambda n: {"n": n, "even": n % 2 == 0}),
    ("def solve(n):\n    return n % 2 == 0", lambda n: int(n % 2 == 0)),  # wrong: bool is not int
)


def code_items(count: int, seed: int) -> list[tuple[str, list[dict], None]]:
    rng = random.Random(seed)
    items = []
    for index in range(count):
        tests_per_item = rng.randint(1, 3)
        values = [rng.randint(1, 50) for _ in range(tests_per_item)]
        if index % 2 == 0:
            program, answer = STDIO_PROGRAMS[rng.randrange(len(STDIO_PROGRAMS))]
            tests = [{"input": f"{v}\n", "output": answer(v)} for v in values]
        else:
            program, answer = FUNCTION_PROGRAMS[rng.randrange(len(FUNCTION_PROGRAMS))]
            tests = [{"fn_name": "solve", "args": [v], "expected": answer(v)} for v in values]
        items.append((program, tests, None))
    return items


def _serial(fn: Callable[..., Any], items: Sequence[tuple], **kwargs: Any) -> tuple[float, list[Any]]:
    started = time.perf_counter()
    results = [fn(*item, **kwargs) for item in items]
    return time.perf_counter() - started, results


def _parallel(pool: RewardPool, ref: str, items: Sequence[tuple], timeout: float, **kwargs: Any
              ) -> tuple[float, list[Any]]:
    started = time.perf_counter()
    futures = [pool.submit(ref, *item, timeout=timeout, **kwargs) for item in items]
    results = [future.result() for future in futures]
    return time.perf_counter() - started, results


def _verdict_key(result: Any) -> Any:
    if isinstance(result, TaskFailure):
        return ("failure", result.kind)
    return getattr(result, "correct", getattr(result, "passed", None))


def _program_runs(items: Sequence[tuple], verdicts: Sequence[Any]) -> int:
    """Sandboxed runs behind the verdicts: one per stdio test up to the first failing one, one per
    function-call task."""
    runs = 0
    for (_, tests, _), verdict in zip(items, verdicts):
        if "fn_name" in tests[0]:
            runs += 1
        else:
            runs += verdict.tests_passed + (0 if verdict.passed else 1)
    return runs


def cpu_ms_per_run(box: Sandbox, runs: int) -> float:
    """CPU milliseconds per sandboxed run of a one-line program, serially: this process, bwrap and what it
    reaped (one bwrap per program), and the zygote's server with the programs it reaped."""

    def used() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return (own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
                + sum(z.cpu_s() for z in zygote.idle_zygotes()))

    def one() -> None:
        box.run(["{python}", "-I", "-B", "{files}/prog.py"], files={"prog.py": b"print(1)"})

    one()  # a zygote starts here, outside the count
    before = used()
    for _ in range(runs):
        one()
    return (used() - before) / runs * 1000


def run(math_count: int, code_count: int, workers: int, seed: int) -> dict[str, Any]:
    maths = math_items(math_count, seed)
    codes = code_items(code_count, seed)
    limits = SandboxLimits(wall_time_s=2.0, cpu_time_s=2.0)
    sandboxes = {runner: Sandbox(limits, runner=runner) for runner in RUNNERS}
    sandbox = sandboxes["zygote"]
    load_before = os.getloadavg()[0]
    # Warm-ups outside the clock: sympy's first use, the sandbox probe, the pool's worker start (and each
    # worker's zygote: started once per process, it is not part of the steady state).
    for response, answer in maths[:20]:
        grade_math(response, answer)
    for box in sandboxes.values():
        grade_code(*codes[0], sandbox=box)
    code_pool: dict[str, tuple[float, list[Any]]] = {}
    with RewardPool(workers, timeout=30.0, preload=[*POOL_PRELOAD, "actors.reward.code_grader"]) as pool:
        _parallel(pool, MATH_GRADER, maths[: 20 * workers], 30.0)
        for box in sandboxes.values():
            _parallel(pool, CODE_GRADER, codes[:2 * workers], 30.0, sandbox=box)
        math_parallel_s, math_parallel = _parallel(pool, MATH_GRADER, maths, 30.0)
        for runner, box in sandboxes.items():
            code_pool[runner] = _parallel(pool, CODE_GRADER, codes, 60.0, sandbox=box)
        code_parallel_s, code_parallel = code_pool["zygote"]
        # What tools.score does: the bounded sympy-free path in the caller, the undecided rest in the pool.
        started = time.perf_counter()
        fast = [grade_math_fast(*item) for item in maths]
        undecided = [i for i, verdict in enumerate(fast) if verdict is None]
        _parallel(pool, MATH_GRADER, [maths[i] for i in undecided], 30.0)
        math_hybrid_s = time.perf_counter() - started
        pool_stats = pool.stats()
    math_serial_s, math_serial = _serial(grade_math, maths)
    code_serial = {runner: _serial(grade_code, codes, sandbox=box) for runner, box in sandboxes.items()}
    cpu_ms = {runner: cpu_ms_per_run(box, 100) for runner, box in sandboxes.items()}
    code_serial_s = code_serial["zygote"][0]
    # All runs must agree, or the timing compares different work.
    math_agree = [_verdict_key(r) for r in math_serial] == [_verdict_key(r) for r in math_parallel]
    code_keys = [[_verdict_key(r) for r in results] for _, results in [*code_pool.values(), *code_serial.values()]]
    code_agree = all(keys == code_keys[0] for keys in code_keys)
    code_runs = _program_runs(codes, code_serial["bwrap"][1])
    return {
        "workers": workers,
        "cpu_count": os.cpu_count(),
        "sandbox": probe_sandbox().reason,
        "math_items": math_count,
        "math_correct": sum(1 for r in math_serial if r.correct),
        "math_per_s": math_count / math_serial_s,
        "math_parallel_per_s": math_count / math_parallel_s,
        "math_parallel_speedup": math_serial_s / math_parallel_s,
        "math_fast_path_share": 1 - len(undecided) / math_count,
        "math_fast_path_plus_pool_per_s": math_count / math_hybrid_s,
        "code_items": code_count,
        "code_passed": sum(1 for r in code_serial["zygote"][1] if r.passed),
        "code_tests_run": sum(len(item[1]) for item in codes),
        "code_runs": code_runs,
        "code_per_s": code_count / code_parallel_s,
        "code_serial_per_s": code_count / code_serial_s,
        "code_parallel_speedup": code_serial_s / code_parallel_s,
        "code_runs_per_s": code_runs / code_parallel_s,
        "code_serial_runs_per_s": code_runs / code_serial_s,
        "code_bwrap_per_s": code_count / code_pool["bwrap"][0],
        "code_bwrap_serial_per_s": code_count / code_serial["bwrap"][0],
        "code_bwrap_runs_per_s": code_runs / code_pool["bwrap"][0],
        "code_bwrap_serial_runs_per_s": code_runs / code_serial["bwrap"][0],
        "sandbox_speedup": code_pool["bwrap"][0] / code_parallel_s,
        "sandbox_serial_speedup": code_serial["bwrap"][0] / code_serial_s,
        "code_cpu_ms_per_run": cpu_ms["zygote"],
        "code_bwrap_cpu_ms_per_run": cpu_ms["bwrap"],
        "parallel_speedup": (math_serial_s + code_serial_s) / (math_parallel_s + code_parallel_s),
        "results_agree": math_agree and code_agree,
        "load_average": [load_before, os.getloadavg()[0]],
        "pool": pool_stats,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench reward", description=__doc__.splitlines()[0])
    parser.add_argument("--math-items", type=int, default=600)
    parser.add_argument("--code-items", type=int, default=60)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.math_items < 1 or args.code_items < 1 or args.workers < 1:
        parser.error("--math-items, --code-items and --workers must be at least 1")
    if not probe_sandbox().available:
        print(f"error: no bubblewrap sandbox ({probe_sandbox().reason}); the code benchmark needs one",
              file=sys.stderr)
        return 2
    result = run(args.math_items, args.code_items, args.workers, args.seed)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"reward checks, {result['workers']} workers on {result['cpu_count']} CPUs, sandbox: {result['sandbox']}")
    print(f"{'workload':<10}{'items':>7}{'serial/s':>11}{'pool/s':>10}{'speedup':>9}")
    print(f"{'math':<10}{args.math_items:>7}{result['math_per_s']:>11.1f}{result['math_parallel_per_s']:>10.1f}"
          f"{result['math_parallel_speedup']:>8.2f}x")
    print(f"{'math*':<10}{args.math_items:>7}{result['math_per_s']:>11.1f}"
          f"{result['math_fast_path_plus_pool_per_s']:>10.1f}"
          f"{result['math_fast_path_plus_pool_per_s'] / result['math_per_s']:>8.2f}x")
    print(f"{'code':<10}{args.code_items:>7}{result['code_serial_per_s']:>11.1f}{result['code_per_s']:>10.1f}"
          f"{result['code_parallel_speedup']:>8.2f}x")
    print(f"{'code bwrap':<10}{args.code_items:>7}{result['code_bwrap_serial_per_s']:>11.1f}"
          f"{result['code_bwrap_per_s']:>10.1f}{result['code_bwrap_per_s'] / result['code_bwrap_serial_per_s']:>8.2f}x")
    print(f"sandbox: zygote / one bwrap per program {result['sandbox_speedup']:.2f}x in the pool, "
          f"{result['sandbox_serial_speedup']:.2f}x serial; {result['code_runs']} program runs: "
          f"{result['code_runs_per_s']:.1f} vs {result['code_bwrap_runs_per_s']:.1f} runs/s in the pool, "
          f"{result['code_serial_runs_per_s']:.1f} vs {result['code_bwrap_serial_runs_per_s']:.1f} serial; "
          f"CPU per run of print(1) {result['code_cpu_ms_per_run']:.1f} vs "
          f"{result['code_bwrap_cpu_ms_per_run']:.1f} ms")
    print(f"whole workload speedup {result['parallel_speedup']:.2f}x; serial and pool verdicts agree: "
          f"{result['results_agree']}; math correct {result['math_correct']}/{args.math_items}, "
          f"code passed {result['code_passed']}/{args.code_items} ({result['code_tests_run']} tests)")
    print(f"math*: sympy-free grade_math_fast in the caller ({100 * result['math_fast_path_share']:.0f}% settled), "
          "the rest in the pool, as tools.score does")
    return 0 if result["results_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
