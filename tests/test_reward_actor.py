"""Reward actors as real processes: Trajectories in, ScoredGroup out, with the right rewards.

Three actors run under the Supervisor: a MathReward with the real grader, a MathReward whose grader
(configured through settings, run in the pool like any other) hangs on one marked answer and has a tiny
timeout, and a CodeReward that runs programs in the sandbox. This test plays the rollout (sends
Trajectories) and the buffer (a Bus bound at the buffer's endpoint).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvloop

from actors.runtime.base import ActorSpec
from actors.engines.tokenizer import load_tokenizer
from actors.reward.code import extract_program
from actors.reward.math_grader import MathVerdict, grade_math
from actors.reward.sandbox import probe_sandbox
from actors.runtime.supervisor import Supervisor
from testsupport.bounded import run_bounded
from testsupport.local_actors import actor_spec, ipc_endpoints
from transport.bus import Bus, Envelope
from transport.protocol import Answers, Sample, ScoredGroup, Task, Trajectories

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "configs" / "models" / "arith-tiny"   # only its tokenizer is used
WAIT_S = 60.0
HANG_MARK = "HANG-FOREVER"


def hanging_grade(response: str, answer: str) -> MathVerdict:
    """A checker that never returns for a marked answer: stands in for sympy stuck on hostile input."""
    if HANG_MARK in response:
        time.sleep(3600)
    return grade_math(response, answer)


def test_extract_program() -> None:
    text = "think\n```\nprint(0)\n```\nfinal:\n```python\nprint(1)\n```\n"
    assert extract_program(text) == "print(1)\n"
    assert extract_program("```\nprint(2)\n```") == "print(2)\n"
    assert extract_program("print(3)") == "print(3)"


class Rig:
    def __init__(self, root: Path) -> None:
        self.loop = uvloop.new_event_loop()
        self.run_dir = root / "run"
        sock = root / "s"
        sock.mkdir()
        self.names = ["reward.math", "reward.hang", "reward.code"]
        self.endpoints = ipc_endpoints(sock, [*self.names, "buffer", "rollout.0"])
        self.tok = load_tokenizer(str(MODEL_DIR))
        self.scored: asyncio.Queue[ScoredGroup] = asyncio.Queue()

    def spec(self, name: str, cls: str, **extra: Any) -> ActorSpec:
        settings: dict[str, Any] = {
            "model": {"path": str(MODEL_DIR)}, "algo": {"reward_correct": 5.0, "reward_wrong": -5.0},
            "groups": {"reward": self.names, "buffer": ["buffer"], "rollout": ["rollout.0"]},
            "instance": {"index": 0, "cpu_workers": 1}, "log_console": False,
            "bus": {"heartbeat_interval": 0.5, "heartbeat_timeout": 3.0},
        }
        settings.update(extra)
        return actor_spec(name, cls, self.endpoints, settings, self.run_dir)

    def run(self, coro: Any, timeout: float = WAIT_S) -> Any:
        return run_bounded(coro, timeout, self.loop)

    async def start(self) -> None:
        specs = [self.spec("reward.math", "actors.reward.math:MathReward"),
                 self.spec("reward.hang", "actors.reward.math:MathReward",
                           grader="tests.test_reward_actor:hanging_grade", score_timeout_s=0.5),
                 self.spec("reward.code", "actors.reward.code:CodeReward",
                           sandbox={"wall_time_s": 2.0, "cpu_time_s": 2.0},
                           allow_unsandboxed=not probe_sandbox().available)]
        self.sup = Supervisor(specs, self.run_dir, ready_timeout=WAIT_S, stop_timeout=20)
        self.buffer = await Bus("buffer", self.endpoints["buffer"], {}, handler=self.on_buffer,
                                heartbeat_interval=None).start()
        self.rollout = await Bus("rollout.0", self.endpoints["rollout.0"],
                                 {n: self.endpoints[n] for n in self.names}, heartbeat_interval=None).start()
        await self.sup.start()

    def on_buffer(self, env: Envelope) -> None:
        if isinstance(env.msg, ScoredGroup):
            self.scored.put_nowait(env.msg)

    def sample(self, text: str) -> Sample:
        ids = self.tok.encode(text)
        return Sample(output_ids=ids, logprobs=[-0.5] * len(ids), versions=[3] * len(ids), finish_reason="stop")

    async def score(self, actor: str, group_id: str, task: Task, texts: list[str],
                    agent_rewards: list[float | None] | None = None) -> ScoredGroup:
        """``agent_rewards``: what each sample's agent returned (None: graded by the actor)."""
        samples = [dataclasses.replace(self.sample(t), agent_reward=r)
                   for t, r in zip(texts, agent_rewards or [None] * len(texts))]
        await self.rollout.send(actor, Trajectories(group_id=group_id, task=task, answers=Answers(
            samples=samples, rollout="rollout.0", gen_seconds=1.25, busy_seconds=2.0, up_seconds=3.0)))
        while True:
            group = await self.scored.get()
            if group.group_id == group_id:
                return group

    async def close(self) -> None:
        if getattr(self, "sup", None) is not None:
            await self.sup.stop()
        for bus in (getattr(self, "buffer", None), getattr(self, "rollout", None)):
            if bus is not None:
                await bus.close(linger=0)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    r = Rig(tmp_path_factory.mktemp("reward"))
    try:
        r.run(r.start())
        yield r
    finally:
        r.run(r.close())
        r.loop.close()


def test_a_response_matching_any_listed_answer_is_right(rig: Rig) -> None:
    # AReaL's problems list several solutions (the first may box a choice letter, the next the value); its reward
    # accepts a response that matches any of them. The sympy path decides the last one (2/3 against 4/6).
    task = Task(kind="math", answer="A", answers=["A", "-\\frac{2}{3}"])
    texts = ["\\boxed{-\\frac{2}{3}}", "\\boxed{A}", "\\boxed{5}", "\\boxed{-\\frac{4}{6}}"]
    group = rig.run(rig.score("reward.math", "any1", task, texts))
    assert [s.correct for s in group.answers.samples] == [True, True, False, True]
    assert group.score_failures == 0


def test_math_rewards_right_wrong_garbage(rig: Rig) -> None:
    texts = ["7+5 is \\boxed{12}.", "so \\boxed{13}", "}{\\boxed{", "", "\\boxed{\\frac{24}{2}}"]
    group = rig.run(rig.score("reward.math", "m1", Task(kind="math", answer="12"), texts))
    assert [s.correct for s in group.answers.samples] == [True, False, False, False, True]
    assert [s.reward for s in group.answers.samples] == [5.0, -5.0, -5.0, -5.0, 5.0]
    answers = group.answers                               # passed on as generated, with the scores filled in
    assert group.score_failures == 0 and answers.rollout == "rollout.0"
    assert (answers.gen_seconds, answers.busy_seconds, answers.up_seconds) == (1.25, 2.0, 3.0)
    assert answers.samples[0].versions == [3] * len(answers.samples[0].output_ids)
    assert all(s.score_detail for s in group.answers.samples)


def test_an_agents_reward_passes_through_and_only_the_others_are_graded(rig: Rig) -> None:
    # The agent's verdict stands against the text (a wrong boxed answer it rewards, a right one it does not); a
    # sample without one is graded as any answer. On the hanging grader's actor, an agent's sample that reached
    # the grader would come back a counted failure scored wrong.
    texts = ["\\boxed{13}", "\\boxed{12}", "\\boxed{12}"]
    group = rig.run(rig.score("reward.math", "a1", Task(kind="math", answer="12"), texts, [2.5, -1.0, None]))
    assert [s.reward for s in group.answers.samples] == [2.5, -1.0, 5.0]
    assert [s.correct for s in group.answers.samples] == [True, False, True]
    assert [s.score_detail for s in group.answers.samples][:2] == ["agent reward 2.5", "agent reward -1"]
    assert group.score_failures == 0
    hang = rig.run(rig.score("reward.hang", "a2", Task(kind="math", answer="12"), [f"{HANG_MARK} \\boxed{{12}}"], [1.0]))
    assert hang.answers.samples[0].reward == 1.0 and hang.score_failures == 0


def test_hung_check_scores_wrong_and_is_counted_not_lost(rig: Rig) -> None:
    texts = ["\\boxed{12}", f"{HANG_MARK} \\boxed{{12}}", "\\boxed{11}"]
    # The grader sleeps an hour; rig.run's bound (WAIT_S) and the detail below say the pool killed it.
    group = rig.run(rig.score("reward.hang", "h1", Task(kind="math", answer="12"), texts))
    assert [s.correct for s in group.answers.samples] == [True, False, False]
    assert [s.reward for s in group.answers.samples] == [5.0, -5.0, -5.0]
    assert group.score_failures == 1
    assert group.answers.samples[1].score_detail.startswith("checker timeout after 2 attempt(s)")
    # The pool replaced its killed worker: the actor keeps scoring.
    again = rig.run(rig.score("reward.hang", "h2", Task(kind="math", answer="12"), ["\\boxed{12}"]))
    assert again.answers.samples[0].correct and again.score_failures == 0


def test_wrong_task_kind_is_a_counted_failure(rig: Rig) -> None:
    group = rig.run(rig.score("reward.math", "k1", Task(kind="code", tests=[{"input": "", "output": ""}]),
                              ["\\boxed{1}"]))
    first = group.answers.samples[0]
    assert not first.correct and first.reward == -5.0 and group.score_failures == 1


def test_code_rewards_in_the_sandbox(rig: Rig) -> None:
    tests = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6\n"}]
    texts = ["Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```",
             "```python\na, b = map(int, input().split())\nprint(a - b)\n```",
             "I cannot solve this )(*&",
             "```python\nwhile True:\n    pass\n```"]
    group = rig.run(rig.score("reward.code", "c1", Task(kind="code", tests=tests, mode="stdio"), texts))
    assert [s.correct for s in group.answers.samples] == [True, False, False, False]
    assert [s.reward for s in group.answers.samples] == [5.0, -5.0, -5.0, -5.0]
    details = [s.score_detail for s in group.answers.samples]
    assert details[0].startswith("passed (2/2)") and details[1].startswith("wrong_answer")
    assert details[2].startswith("runtime_error") and details[3].startswith("timeout"), details
    assert group.score_failures == 0
