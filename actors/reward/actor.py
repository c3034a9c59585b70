"""RewardActor: the shared body of the reward actors (math.py: MathReward, code.py: CodeReward).

A :class:`Trajectories` message is decoded with the model's tokenizer (``model.path``), every sample is
scored by the subclass's :meth:`RewardActor.score` (which runs its checker in a :class:`RewardPool` of
``settings["instance"]["cpu_workers"]`` worker processes with a hard per-item timeout, so CPU work never
runs on the event loop), and the answers go on to the buffer (``settings["groups"]["buffer"][0]``) in
:class:`ScoredGroup`. Each sample gets ``reward`` (``algo.reward_correct`` if correct, else
``algo.reward_wrong``; +5 / -5 by default), ``correct`` and ``score_detail``; a sample whose agent returned
its own reward (``Sample.agent_reward``) keeps that reward, correct when it is positive. An item whose check fails
(timeout after the pool's retry, a crash, a checker error, an unusable task) scores as wrong and is
counted in ``score_failures``; the group itself is always sent on, never lost.

Counters (logged with the actor's ``stopped`` event): ``score_seconds``, the sum of every group's scoring
time (decode and checks, queueing in the pool included), and ``busy_seconds``, the time during which at least
one group was being scored: ``busy_seconds`` over a run's wall time is the reward's share of it.

Settings (all optional): ``score_timeout_s`` (per-item hard limit), ``grader`` ("module:function", the
checker the pool runs; for experiments and tests), ``instance.cpu_workers`` (pool size, default 1).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import ClassVar

from actors.runtime.base import Actor, ActorSpec, handles
from actors.engines.tokenizer import LoadedTokenizer, load_tokenizer
from actors.batch import generated_ids
from actors.reward.pool import RewardPool, TaskFailure
from topology.settings import RewardSettings
from transport.protocol import HelloRequest, RunFinished, Sample, ScoredGroup, Task, Trajectories, WorkerHello

__all__ = ["RewardActor", "RewardConfigError", "Score", "failure_detail"]


class RewardConfigError(ValueError):
    """The reward actor's settings are unusable; the message names the key."""


@dataclasses.dataclass
class Score:
    correct: bool
    detail: str
    failed: bool = False   # the check itself did not complete (timeout, crash, error, bad task)


def failure_detail(result: TaskFailure) -> str:
    first = result.detail.splitlines()[0] if result.detail else ""
    return f"checker {result.kind} after {result.attempts} attempt(s): {first}"[:300]


class RewardActor(Actor):
    # Subclasses set these: the Task.kind they score, the checker the pool runs and the modules its
    # workers import up front.
    task_kind: ClassVar[str] = ""
    default_grader: ClassVar[str] = ""
    preload: ClassVar[tuple[str, ...]] = ()
    default_timeout_s: ClassVar[float] = 10.0
    Settings = RewardSettings
    cfg: RewardSettings

    def __init__(self, spec: ActorSpec) -> None:
        super().__init__(spec)
        self.pool: RewardPool | None = None
        self.tokenizer: LoadedTokenizer | None = None
        self._ready = asyncio.Event()
        self._scoring = 0            # groups being scored now
        self._busy_since = 0.0       # when _scoring last went from 0 to 1

    @classmethod
    def check_settings(cls, cfg: RewardSettings) -> list[str]:
        out = []
        if not cfg.model.path:
            out.append("model.path: not set (the tokenizer to decode answers comes from it)")
        if not cfg.groups.get("buffer"):
            out.append("groups.buffer: no buffer to send scored groups to")
        return out

    async def on_start(self) -> None:
        cfg = self.cfg
        if problems := self.check_settings(cfg):
            raise RewardConfigError("; ".join(problems))
        self.tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model.path)
        self.buffer = cfg.groups["buffer"][0]
        self.reward_correct = cfg.algo.reward_correct
        self.reward_wrong = cfg.algo.reward_wrong
        self.grader = cfg.grader or self.default_grader
        self.custom_grader = cfg.grader is not None
        self.timeout_s = cfg.score_timeout_s or self.default_timeout_s
        workers = cfg.instance.cpu_workers or 1
        if workers < 1:
            raise RewardConfigError(f"instance.cpu_workers: must be >= 1, got {workers}")
        self.pool = await asyncio.to_thread(RewardPool, workers, timeout=self.timeout_s, preload=self.preload)
        self._ready.set()
        self.log.info("reward_ready", grader=self.grader, workers=workers, timeout_s=self.timeout_s)

    async def on_ready(self) -> None:
        await self.bus.send(self.buffer, WorkerHello(role="reward"))

    @handles(HelloRequest)
    async def on_hello_request(self, msg: HelloRequest) -> None:
        """A restarted buffer asks: it has no work of ours and may give some."""
        await self.bus.send(self.buffer, WorkerHello(role="reward"))

    async def on_stop(self) -> None:
        if self.pool is not None:
            stats = self.pool.stats()
            await asyncio.to_thread(self.pool.close)
            self.log.info("reward_stats", pool=stats, counters=dict(self.counters))

    async def score(self, text: str, task: Task) -> Score:
        """Score one decoded answer to a task of ``task_kind``; subclasses run their checker through
        ``self.pool``."""
        raise NotImplementedError

    async def _score_safely(self, text: str, task: Task) -> Score:
        if task.kind != self.task_kind:  # a routing mistake: scored as a failure, not as a wrong answer
            self.counters["wrong_task_kind"] += 1
            return Score(False, f"task kind {task.kind!r} is not {self.task_kind}", failed=True)
        try:
            return await self.score(text, task)
        except Exception as exc:  # a checker bug or a malformed task must not lose the group
            self.log.error("score_failed", error=repr(exc))
            return Score(False, f"score error: {type(exc).__name__}: {exc}"[:300], failed=True)

    @handles(Trajectories)
    async def on_trajectories(self, msg: Trajectories) -> None:
        await self._ready.wait()
        assert self.tokenizer is not None
        t0 = time.monotonic()
        if self._scoring == 0:
            self._busy_since = t0
        self._scoring += 1
        tok = self.tokenizer
        try:
            # An episode's answer is graded on the model's own tokens: never on what a tool appended.
            # A sample whose agent returned its reward is not graded again.
            graded = [s for s in msg.answers.samples if s.agent_reward is None]
            texts = await asyncio.to_thread(lambda: [tok.decode(generated_ids(s.output_ids, s.versions)) for s in graded])
            scores = iter(await asyncio.gather(*(self._score_safely(text, msg.task) for text in texts)))
        finally:
            self._scoring -= 1
            if self._scoring == 0:
                self.counters["busy_seconds"] += time.monotonic() - self._busy_since
        failures = 0
        samples: list[Sample] = []
        for sample in msg.answers.samples:
            if sample.agent_reward is not None:   # the agent graded its own episode: its reward passes through
                samples.append(dataclasses.replace(sample, reward=sample.agent_reward, correct=sample.agent_reward > 0,
                                                   score_detail=f"agent reward {sample.agent_reward:g}"))
                continue
            score = next(scores)
            failures += int(score.failed)
            samples.append(dataclasses.replace(sample, correct=score.correct, score_detail=score.detail,
                                               reward=self.reward_correct if score.correct else self.reward_wrong))
        seconds = time.monotonic() - t0
        self.counters["groups_scored"] += 1
        self.counters["score_seconds"] += seconds
        self.counters["samples_scored"] += len(samples)
        self.counters["samples_correct"] += sum(s.correct for s in samples)
        self.counters["score_failures"] += failures
        if failures:
            self.log.warning("score_failures", group_id=msg.group_id, failures=failures, samples=len(samples))
        await self.bus.send(self.buffer, ScoredGroup(
            group_id=msg.group_id, answers=dataclasses.replace(msg.answers, samples=samples), score_seconds=seconds,
            score_failures=failures))

    @handles(RunFinished)
    def on_run_finished(self, msg: RunFinished) -> None:
        self.request_stop(f"run finished at step {msg.step}: {msg.reason}")
