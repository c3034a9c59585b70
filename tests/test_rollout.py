"""RolloutActor in-process on a tiny random model: trajectories out round-robin, bad groups handed back,
drain hands unfinished groups back, configuration errors name the key."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
from pathlib import Path
from typing import Any

import pytest

from actors.rollout.actor import RolloutActor
from actors.weight_sync import WeightSyncConfigError, link_config
from testsupport.bounded import run_bounded
from testsupport.local_actors import actor_spec, ipc_endpoints
from topology.settings import SettingsError, read_settings
from transport.bulk import LinkConfig
from transport.bus import Bus, RemoteError
from transport.protocol import (EvalGenerate, EvalGenerated, GenerateGroup, GroupReturned, Task, Trajectories,
                                WeightsReady, WorkerHello)


run = functools.partial(run_bounded, timeout=60.0)


def group(group_id: str, max_new_tokens: int = 8, prompt: list[int] | None = None, n: int = 3) -> GenerateGroup:
    return GenerateGroup(group_id=group_id, prompt_ids=prompt or [3, 4, 5, 6], n=n,
                         task=Task(kind="math", answer="1"), temperature=1.0, max_new_tokens=max_new_tokens, seed=5)


def test_rollout_generates_returns_and_drains(tmp_path: Path, random_model_dir: Path) -> None:
    model_dir = random_model_dir
    eps = ipc_endpoints(tmp_path, ["rollout.0", "reward.0", "reward.1", "buffer", "param_server"])
    spec = actor_spec("rollout.0", "actors.rollout:RolloutActor", eps, run_dir=tmp_path, env={},
                      settings={"model": {"path": str(model_dir)}, "run": {"recover": "off"}, "log_console": False,
                                "groups": {"reward": ["reward.0", "reward.1"], "buffer": ["buffer"],
                                           "param_server": ["param_server"]},
                                "bus": {"heartbeat_interval": None}, "stats_every_s": 0})

    async def main() -> None:
        got: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        hellos: list[tuple[str, Any]] = []

        def sink(name: str) -> Any:
            def put(env: Any) -> None:
                (hellos.append if isinstance(env.msg, WorkerHello) else got.put_nowait)((name, env.msg))
            return put

        buses = [await Bus(n, eps[n], {"rollout.0": eps["rollout.0"]}, handler=sink(n),
                           heartbeat_interval=None).start() for n in ("reward.0", "reward.1", "buffer", "param_server")]
        actor = RolloutActor(spec)
        task = asyncio.create_task(actor.run())
        buffer = buses[2]
        # Handlers wait for the engine, so these may be sent before the actor is ready.
        await buffer.send("rollout.0", group("g1"))
        first = await got.get()
        await buffer.send("rollout.0", group("g2"))
        second = await got.get()
        assert [first[0], second[0]] == ["reward.0", "reward.1"]          # round-robin over reward actors
        for _, traj in (first, second):
            assert isinstance(traj, Trajectories) and traj.answers.rollout == "rollout.0"
            assert traj.task == Task(kind="math", answer="1") and len(traj.answers.samples) == 3
            for s in traj.answers.samples:
                assert len(s.output_ids) == len(s.logprobs) == len(s.versions) == 8 and s.finish_reason == "length"
                assert s.versions == [0] * 8 and all(math.isfinite(x) and x <= 0 for x in s.logprobs)
        # A token outside the vocabulary cannot be generated from: handed back as invalid, not retried forever.
        await buffer.send("rollout.0", group("bad", prompt=[1, 100000]))
        name, msg = await got.get()
        assert name == "buffer" and isinstance(msg, GroupReturned) and msg.reason.startswith("invalid:")
        # Sent on ready, before anything else to the buffer: a restarted rollout's old groups get re-issued.
        assert hellos == [("buffer", WorkerHello(role="rollout"))]
        # Only the parameter server announces weights; and weights without a link are refused with a reason.
        ready = WeightsReady(version=1, n_buckets=1, weights_hash="x", epoch=0)
        with pytest.raises(RemoteError, match=r"\[sender_not_allowed\] rl.weights_ready is sent by param_server"):
            await buffer.request("rollout.0", ready, timeout=10)
        with pytest.raises(RemoteError, match="no weights link"):
            await buses[3].request("rollout.0", ready, timeout=10)
        # Stopping mid-generation hands the group back to the buffer.
        decoding = asyncio.Event()
        loop = asyncio.get_running_loop()
        actor.engine.on_step = lambda step: loop.call_soon_threadsafe(decoding.set)  # decode-thread hook
        await buffer.send("rollout.0", group("long", max_new_tokens=3000, n=2))
        await decoding.wait()          # the only request in the engine is being decoded
        actor.request_stop("test over")
        name, msg = await got.get()
        assert name == "buffer" and msg == GroupReturned(group_id="long", reason="draining")
        assert await task == 0
        assert actor.counters["groups_generated"] == 2 and actor.counters["groups_returned"] == 2
        for bus in buses:
            await bus.close(linger=0)

    run(main())


def test_rollout_answers_the_evaluator_greedily_and_only_the_evaluator(tmp_path: Path, random_model_dir: Path) -> None:
    eps = ipc_endpoints(tmp_path, ["rollout.0", "reward.0", "buffer", "evaluator"])
    spec = actor_spec("rollout.0", "actors.rollout:RolloutActor", eps, run_dir=tmp_path, env={},
                      settings={"model": {"path": str(random_model_dir)}, "run": {"recover": "off"},
                                "log_console": False, "groups": {"reward": ["reward.0"], "buffer": ["buffer"],
                                                                         "evaluator": ["evaluator"]},
                                "bus": {"heartbeat_interval": None}, "stats_every_s": 0})

    async def main() -> None:
        buses = {n: await Bus(n, eps[n], {"rollout.0": eps["rollout.0"]}, handler=lambda env: None,
                              heartbeat_interval=None).start() for n in ("reward.0", "buffer", "evaluator")}
        actor = RolloutActor(spec)
        task = asyncio.create_task(actor.run())
        evaluator = buses["evaluator"]
        # no prompt: the engine's version only (how the evaluator follows the run)
        assert await evaluator.request("rollout.0", EvalGenerate(), timeout=30) == EvalGenerated(version=0)
        ask = EvalGenerate(prompt_ids=[3, 4, 5, 6], max_new_tokens=6)
        first, second = [await evaluator.request("rollout.0", ask, timeout=30) for _ in range(2)]
        assert isinstance(first, EvalGenerated) and not first.error and first.finish_reason == "length"
        assert len(first.output_ids) == len(first.logprobs) == len(first.versions) == 6 and first.versions == [0] * 6
        assert second.output_ids == first.output_ids   # greedy: the same answer twice
        bad = await evaluator.request("rollout.0", EvalGenerate(prompt_ids=[1, 100000]), timeout=30)
        assert bad.error.startswith("invalid:") and not bad.output_ids
        # another actor of the run cannot have the rollout generate for it
        with pytest.raises(RemoteError, match=r"\[sender_not_allowed\] rl.eval_generate is sent by evaluator only"):
            await buses["buffer"].request("rollout.0", ask, timeout=10)
        assert actor.counters["eval_prompts_answered"] == 2 and actor.counters["groups_generated"] == 0
        actor.request_stop("test over")
        assert await task == 0
        for bus in buses.values():
            await bus.close(linger=0)

    run(main())


def test_configuration_errors_name_the_key() -> None:
    with pytest.raises(SettingsError, match=r"rollout.0: settings.engine: input should be 'torch' or 'sglang' "
                                            r"\(value: 'vllm'\)"):
        read_settings(RolloutActor, {"engine": "vllm"}, "rollout.0")
    with pytest.raises(WeightSyncConfigError, match="link: link 'weights' is not in settings.links"):
        link_config({}, "weights", "ps_to_rollout")
    assert link_config({}, None, "ps_to_rollout") is None


def test_a_malformed_link_is_refused_with_its_key_before_the_actor_starts() -> None:
    # links are typed like every other section: the launcher's settings check names the key and the value
    link = {"name": "weights", "backend": "nccl", "master_addr": "127.0.0.1", "master_port": 29500, "rank": 0,
            "world_size": 2, "members": ["ps", "rollout.0"]}
    cfg = read_settings(RolloutActor, {"links": {"weights": link}}, "rollout.0")
    assert link_config(cfg.links, None, "ps_to_rollout") == LinkConfig.from_dict(link)
    for change, problem in [({"backend": "mpi"}, "links.weights.backend: input should be 'gloo' or 'nccl'"),
                            ({"rank": 2}, "links.weights: value error, rank 2 outside world size 2"),
                            ({"master_port": 70000}, "links.weights.master_port: input should be less than or equal to 65535"),
                            ({"timeout": 5}, "links.weights.timeout: unknown key (did you mean 'timeout_s'?)")]:
        with pytest.raises(SettingsError) as err:
            read_settings(RolloutActor, {"links": {"weights": {**link, **change}}}, "rollout.0")
        assert problem in str(err.value), str(err.value)


def test_the_link_settings_declare_the_fields_of_the_link_config() -> None:
    # one declaration read twice: the typed settings the launcher checks, and the dataclass transport builds
    from topology.settings import LinkSettings
    assert list(LinkSettings.model_fields) == [f.name for f in dataclasses.fields(LinkConfig)]
