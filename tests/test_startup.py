"""What a process loads at start. Every actor is a fresh process and every launch checks each actor class's
settings, so a library a process imports without using it costs its import in each of them: sympy (about 1 s
of CPU on a 2-core machine) is loaded by the math checks that need it and by the pools that run them, not by
the launcher's checks, the math reward actor or the evaluator, which grade on the sympy-free fast path."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from actors.reward.math_grader import POOL_PRELOAD, grade_math
from actors.reward.pool import RewardPool

ROOT = Path(__file__).resolve().parents[1]

LAUNCH_CHECKS = """
import sys
from launch.readiness import settings_problems
from topology import load
plan = load("topology/local.yaml")
assert settings_problems(plan) == []
import actors.reward.math, actors.evaluator.actor
from actors.reward.math_grader import grade_math_fast
assert grade_math_fast(r"the answer is \\boxed{3/4}", "0.75").correct
print(sorted(m for m in ("sympy", "actors.reward.math", "actors.evaluator.actor") if m in sys.modules))
"""


def test_the_launch_checks_and_the_grading_actors_start_without_sympy() -> None:
    out = subprocess.run([sys.executable, "-c", LAUNCH_CHECKS], cwd=ROOT, capture_output=True, text=True,
                         timeout=240, check=True).stdout
    assert out.split("\n")[-2] == str(["actors.evaluator.actor", "actors.reward.math"])


def test_a_math_pool_has_sympy_loaded_before_its_first_check() -> None:
    with RewardPool(1, timeout=60.0, preload=POOL_PRELOAD) as pool:
        assert pool.submit("sys:modules.__contains__", "sympy").result() is True
        # and a check that needs sympy (an expression, not a plain number) decides in the worker
        verdict = pool.submit(grade_math, r"\boxed{\frac{x^2-1}{x-1}}", "x+1").result()
    assert verdict.correct, verdict


def test_the_startup_benchmark_reads_the_topologys_actor_classes_and_times_a_process() -> None:
    from tools.bench.startup import actor_classes, process_cpu

    assert actor_classes("topology/local.yaml") == {
        "buffer": ("actors.buffer", "BufferActor"), "rollout": ("actors.rollout", "RolloutActor"),
        "reward": ("actors.reward.math", "MathReward"), "trainer": ("actors.trainer", "TrainerActor"),
        "param_server": ("actors.param_server", "ParamServerActor"), "evaluator": ("actors.evaluator", "EvalActor")}
    assert process_cpu([sys.executable, "-c", "sum(range(10**6))"], repeats=1) > 0
