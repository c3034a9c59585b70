"""MathReward: scores answers by their last boxed answer against the task's references (math_grader): a
response matching any of them is correct (AReaL's data list several solutions per problem).

Most answers are settled by the grader's sympy-free fast path, which is bounded in time (regular
expressions and fractions); it runs in a thread, off the event loop. The undecided rest goes to the
worker pool with the hard timeout. A configured ``grader`` (settings) skips the fast path: every item goes
through the pool, so an experimental checker is always the one that decides.
"""
from __future__ import annotations

import asyncio

from actors.reward.actor import RewardActor, Score, failure_detail
from actors.reward.math_grader import POOL_PRELOAD, MathGradeInputError, grade_math_fast
from actors.reward.pool import TaskFailure
from transport.protocol import Task

__all__ = ["MathReward"]


class MathReward(RewardActor):
    task_kind = "math"
    default_grader = "actors.reward.math_grader:grade_math"
    preload = POOL_PRELOAD
    default_timeout_s = 10.0

    async def score(self, text: str, task: Task) -> Score:
        references = task.references
        if not references:
            return Score(False, "task has no reference answer", failed=True)
        # one reference as a string, several as a list: the checker's (text, answer) signature takes either
        reference: str | list[str] = references[0] if len(references) == 1 else references
        if not self.custom_grader:
            try:
                verdict = await asyncio.to_thread(grade_math_fast, text, reference)
            except MathGradeInputError as exc:
                return Score(False, f"bad input: {exc}"[:300], failed=True)
            if verdict is not None:
                self.counters["fast_path"] += 1
                return Score(bool(verdict.correct), verdict.reason)
        assert self.pool is not None
        result = await self.pool.run(self.grader, text, reference, timeout=self.timeout_s)
        if isinstance(result, TaskFailure):
            return Score(False, failure_detail(result), failed=True)
        return Score(bool(result.correct), str(getattr(result, "reason", "")))
