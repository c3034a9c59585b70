"""Episodes through the real rollout actor, the buffer's staleness, the reward actor's grading and the trainer's
loss: a group whose task names a tool is answered in several turns (environment tokens marked with version -1,
never trained, never graded; staleness from the first generated token); a group without one is exactly one
engine request; a weight update between turns keeps every token's version."""
from __future__ import annotations

import asyncio
import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from actors.engines.tokenizer import load_tokenizer
from actors.engines.torch_train import TorchTrainEngine, TrainConfig
from actors.batch import ENV_VERSION, generated_ids
from actors.buffer.state import group_start_version
from actors.trainer.step import StepConfig, batch_to_sequences, train_on_batch
from testsupport.bounded import run_bounded, until
from testsupport.local_actors import actor_spec, ipc_endpoints
from testsupport.scripted_engine import ScriptedEngine
from testsupport.tiny_models import ARITH_TOKENIZER_DIR, sampled_batch, tiny_model
from transport.bus import Bus
from transport.protocol import (AbortGroup, Answers, GenerateGroup, GroupAborted, GroupReturned, Sample, Task,
                                Trajectories, WorkerHello)

run = functools.partial(run_bounded, timeout=60.0)
ARITH = load_tokenizer(str(ARITH_TOKENIZER_DIR))
EOS = ARITH.eos_token_id


def agent_group(group_id: str, expr: str, tool: str = "calculator", n: int = 2) -> GenerateGroup:
    return GenerateGroup(group_id=group_id, prompt_ids=ARITH.encode(f"Compute: {expr}\n"), n=n,
                         task=Task(kind="math", answer="", tool=tool), temperature=1.0, max_new_tokens=20,
                         stop_token_ids=[EOS], seed=5)


def rollout_with(tmp_path: Path, model_dir: Path, engine: ScriptedEngine, gen: dict[str, Any],
                 groups: list[GenerateGroup], monkeypatch: pytest.MonkeyPatch, drive: Any = None,
                 settings: dict[str, Any] | None = None) -> list[Any]:
    """Run the rollout actor in-process on ``engine``; send ``groups``; the messages it sends back, in order,
    and its stats. ``drive(buffer_bus, next_message, actor)``, if given, runs instead of sending ``groups`` and
    returns what the test wants back. ``settings``: more of the actor's settings."""
    monkeypatch.setattr("actors.rollout.actor.make_engine", lambda *a, **k: engine)
    eps = ipc_endpoints(tmp_path, ["rollout.0", "reward.0", "buffer"])
    spec = actor_spec("rollout.0", "actors.rollout:RolloutActor", eps, run_dir=tmp_path, env={},
                      settings={"model": {"path": str(model_dir)}, "run": {"recover": "off"}, "log_console": False,
                                "gen": gen, "groups": {"reward": ["reward.0"], "buffer": ["buffer"]},
                                "bus": {"heartbeat_interval": None}, "stats_every_s": 0, **(settings or {})})
    from actors.rollout.actor import RolloutActor

    async def main() -> list[Any]:
        got: asyncio.Queue[Any] = asyncio.Queue()

        def sink(env: Any) -> None:
            if not isinstance(env.msg, WorkerHello):
                got.put_nowait(env.msg)

        buses = [await Bus(n, eps[n], {"rollout.0": eps["rollout.0"]}, handler=sink,
                           heartbeat_interval=None).start() for n in ("reward.0", "buffer")]
        actor = RolloutActor(spec)
        task = asyncio.create_task(actor.run())
        async def next_message() -> Any:
            getting = asyncio.ensure_future(got.get())
            await asyncio.wait({getting, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getting.done():   # the actor stopped: its error, not a timeout
                getting.cancel()
                raise AssertionError(f"the rollout stopped: {task.result()!r}")
            return getting.result()

        out = []
        if drive is not None:
            out = await drive(buses[1], next_message, actor)
        for g in groups:
            await buses[1].send("rollout.0", g)
            out.append(await next_message())
        stats = actor.stats()
        actor.request_stop("test over")
        await task
        for b in buses:
            await b.close()
        return out + [stats]
    return run(main())


def test_rollout_runs_agent_episodes_and_single_turn_groups_on_one_path(tmp_path, random_model_dir, careful_agent,
                                                                         monkeypatch):
    engine = ScriptedEngine(careful_agent, vocab_size=ARITH.vocab_size)

    def script(context, sample):
        text = ARITH.decode(context)
        if text == "Compute: 11*11\n":   # the single-turn group: a model that answers in its head
            return ARITH.encode("\\boxed{121}") + [EOS]
        if text.count("=") == 1:         # a weight update lands between the first and second turn
            engine.set_version(3)
        return careful_agent(context, sample)
    engine.script = script
    single = agent_group("single", "11*11", tool="")
    traj, one, stats = rollout_with(tmp_path, random_model_dir, engine, {"max_turns": 5},
                                    [agent_group("g", "37*48+56"), single], monkeypatch)
    assert isinstance(traj, Trajectories) and traj.task.tool == "calculator"
    for s in traj.answers.samples:
        text = ARITH.decode(s.output_ids)
        assert text == "[37*48]=1776\n[1776+56]=1832\n\\boxed{1832}" + ARITH.decode([EOS])
        env = [i for i, v in enumerate(s.versions) if v == ENV_VERSION]
        assert ARITH.decode([s.output_ids[i] for i in env]) == "=1776\n=1832\n"   # only observation tokens
        assert all(s.logprobs[i] == 0.0 for i in env) and s.finish_reason == "stop"
        first_turn = len(ARITH.encode("[37*48]"))
        assert set(s.versions[:first_turn]) == {0} and set(v for v in s.versions[first_turn:] if v >= 0) == {3}
        assert ARITH.decode(generated_ids(s.output_ids, s.versions)).startswith("[37*48][1776+56]\\boxed{1832}")
    # Staleness counts from the episode's first generated token, not from an observation's -1.
    assert group_start_version(traj.answers) == 0
    # A group without a tool is exactly the one request the buffer asked for (the one-turn case).
    assert isinstance(one, Trajectories) and [r.rid for r in engine.requests].count("single") == 1
    assert [r for r in engine.requests if r.rid.startswith("single")] == [engine.requests[-1]]
    assert engine.requests[-1].sampling.stop_token_ids == (EOS,)
    assert all(v >= 0 for s in one.answers.samples for v in s.versions)
    assert stats["turns_per_episode"] == pytest.approx((3 * 2 + 1 * 2) / 4)
    assert stats["tool_calls_per_episode"] == pytest.approx(2 * 2 / 4)


def test_one_turn_restriction_and_unknown_tool(tmp_path, random_model_dir, careful_agent, monkeypatch):
    engine = ScriptedEngine(careful_agent, vocab_size=ARITH.vocab_size)
    traj, bad, _ = rollout_with(tmp_path, random_model_dir, engine, {"max_turns": 1},
                                [agent_group("g", "37*48"), agent_group("b", "37*48", tool="abacus")], monkeypatch)
    # One turn: the call is cut at its closing bracket, no observation, no answer ("length": no eos).
    for s in traj.answers.samples:
        assert ARITH.decode(s.output_ids) == "[37*48]" and s.finish_reason == "length" and min(s.versions) >= 0
    assert len(engine.requests) == 1
    assert isinstance(bad, GroupReturned) and bad.reason.startswith("invalid:") and "abacus" in bad.reason


def test_abort_group_reaches_an_episodes_later_turn(tmp_path, random_model_dir, careful_agent, monkeypatch):
    [hold] = ARITH.encode("C")   # a token the careful model never writes

    def script(context, sample):   # turn 2 is a decode still running when the buffer gives up on the group
        return [hold] if ARITH.decode(context).count("=") == 1 else careful_agent(context, sample)
    engine = ScriptedEngine(script, vocab_size=ARITH.vocab_size, hold_token=hold)

    async def drive(buffer, next_message, actor):
        await buffer.send("rollout.0", agent_group("g", "37*48+56", n=1))
        await until(lambda: any("#" in r.rid for r in engine.requests), 30, "the episode's second turn")
        reply = await buffer.request("rollout.0", AbortGroup(group_id="g", reason="test"), timeout=30)
        return [reply, await next_message()]
    reply, returned, _ = rollout_with(tmp_path, random_model_dir, engine, {"max_turns": 5}, [], monkeypatch, drive)
    assert reply == GroupAborted(group_id="g", held=True, stopped=True)
    assert returned == GroupReturned(group_id="g", reason="aborted")


def test_group_start_version_skips_environment_tokens():
    answers = Answers(samples=[Sample([1, 2, 3], [0.0] * 3, [4, ENV_VERSION, 5], "stop"),
                               Sample([1], [0.0], [6], "stop")], rollout="r")
    assert group_start_version(answers) == 4
    assert group_start_version(Answers(samples=[Sample([1], [0.0], [ENV_VERSION], "stop")], rollout="r")) == -1


def episode_batch(model, env_logprob: float):
    """A sampled batch whose answers' middle tokens are made environment tokens (version -1, log-prob
    ``env_logprob``): what the trainer gets from an episode."""
    batch = sampled_batch(model, groups=2, n=2)
    for g in batch.groups:
        for s in g.samples:
            for i in range(1, min(4, len(s.output_ids) - 1)):
                s.versions[i], s.logprobs[i] = ENV_VERSION, env_logprob
    return batch


def test_environment_tokens_are_never_trained():
    model = tiny_model(4)
    results = []
    for env_logprob in (0.0, -7.0):
        engine = TorchTrainEngine(model=copy.deepcopy(model), config=TrainConfig(lr=1e-3))
        batch = episode_batch(model, env_logprob)
        stats = train_on_batch(engine, batch, StepConfig.defaults(minibatches=1), version=0)
        results.append((stats, engine.model.state_dict()))
    (a, wa), (b, wb) = results
    # What an environment token carries cannot move the step: it is outside the loss.
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    env = sum(v < 0 for g in batch.groups for s in g.samples for v in s.versions)
    assert env > 0 and a["env_tokens"] == env
    assert a["n_tokens"] == sum(len(s.output_ids) for g in batch.groups for s in g.samples) - env
    flat = batch_to_sequences(batch)
    for mask, ver in zip(flat["loss_mask"], flat["versions"]):
        assert [m for m, v in zip(mask, ver)] == [float(v >= 0) for v in ver]


def test_reward_grades_only_generated_tokens():
    call, obs, answer = ARITH.encode("[2*3]"), ARITH.encode("=6\n"), ARITH.encode("\\boxed{6}")
    versions = [0] * len(call) + [ENV_VERSION] * len(obs) + [1] * len(answer)
    assert ARITH.decode(generated_ids(call + obs + answer, versions)) == "[2*3]\\boxed{6}"
    assert generated_ids([1, 2], []) == [1, 2]   # lists that do not line up: taken whole


def test_final_evaluation_answers_tool_records_as_episodes(tmp_path, random_model_dir):
    import subprocess
    import sys

    from actors.evaluator.harness import evaluate_held_out
    from topology.experiment import ExperimentConfig

    subprocess.run([sys.executable, "-m", "tools.make_task", "--task", "agent", "--out", str(tmp_path / "data"),
                    "--levels", "1-1", "--train-per-level", "4", "--test-per-level", "3"], check=True, timeout=300)
    test = str(tmp_path / "data" / "test.jsonl")
    config = ExperimentConfig.model_validate({"model": {"path": str(random_model_dir)}, "data": {"test": test},
                                              "gen": {"max_turns": 2, "max_new_tokens": 6}})
    report = evaluate_held_out(str(random_model_dir), config)
    # the episode evaluation's report: the run's turn budget and turns per episode, on every held-out record
    assert report["max_turns"] == 2 and report["overall"]["n"] == 3 and "greedy_turns" in report["overall"]
