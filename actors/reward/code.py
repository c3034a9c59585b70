"""CodeReward: scores answers by running the program they contain against the task's unit tests.

The program is the last fenced code block of the answer (```python ... ``` preferred, then any fence), or
the whole answer when it has no fence. It runs in the bubblewrap sandbox (actors/reward/sandbox.py)
through :func:`actors.reward.code_grader.grade_code` in a pool worker. The sandbox bounds every run
(``sandbox`` settings: wall_time_s, cpu_time_s, memory_bytes, ...); the pool's deadline per item is the
backstop for a wedged worker: ``score_timeout_s`` if set, else (wall_time_s + 1) per test + 10 s.
Without a working sandbox, programs are refused (scored wrong, detail "blocked") unless the settings say
``allow_unsandboxed: true``.
"""
from __future__ import annotations

import re

from actors.reward.actor import RewardActor, Score, failure_detail
from actors.reward.pool import TaskFailure
from actors.reward.sandbox import Sandbox, SandboxLimits
from topology.settings import CodeRewardSettings
from transport.protocol import Task

__all__ = ["CodeReward", "extract_program"]

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_program(text: str) -> str:
    """The last ```python block, else the last fenced block, else the whole text."""
    blocks = _FENCE.findall(text)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return text


class CodeReward(RewardActor):
    task_kind = "code"
    default_grader = "actors.reward.code_grader:grade_code"
    preload = ("actors.reward.code_grader",)
    default_timeout_s = 60.0
    Settings = CodeRewardSettings
    cfg: CodeRewardSettings

    async def on_start(self) -> None:
        self.limits = SandboxLimits(**self.cfg.sandbox.model_dump(exclude_none=True))
        self.sandbox = Sandbox(self.limits, allow_unsandboxed=self.cfg.allow_unsandboxed)
        await super().on_start()

    async def score(self, text: str, task: Task) -> Score:
        if not task.tests:
            return Score(False, "task has no tests", failed=True)
        program = extract_program(text)
        timeout = (self.cfg.score_timeout_s if self.cfg.score_timeout_s is not None
                   else len(task.tests) * (self.limits.wall_time_s + 1.0) + 10.0)
        assert self.pool is not None
        result = await self.pool.run(self.grader, program, task.tests, task.mode or None, sandbox=self.sandbox,
                                     timeout=timeout)
        if isinstance(result, TaskFailure):
            return Score(False, failure_detail(result), failed=True)
        self.counters[f"verdict.{result.detail}"] += 1   # passed, wrong_answer, runtime_error, blocked, ...
        detail = f"{result.detail} ({result.tests_passed}/{result.tests_total})"
        if result.message:
            detail += f": {result.message}"
        return Score(bool(result.passed), detail[:300])
