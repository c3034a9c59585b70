"""The weights paths' coordination runs one way: the parameter server asks its fanout to take a version,
form a group or push, and gets a result back; the fanout never calls the server (it gets no server object,
and nothing of actors/param_server). Every sender (the pipeline stages' too) is a `WeightSender`."""
from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", sorted(p.name for p in (ROOT / "actors" / "weight_sync").glob("*.py")))
def test_a_weights_path_never_reaches_the_parameter_server(module: str) -> None:
    tree = ast.parse((ROOT / "actors" / "weight_sync" / module).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not {m for m in imported if m.startswith("actors.param_server")}
    # no attribute named like the server the fanouts used to call back through
    assert not {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "server"
                and isinstance(n.value, ast.Name) and n.value.id == "self"}


def test_a_fanout_is_built_from_parts_and_answers_with_results() -> None:
    from actors.weight_sync import (Accepted, Fanout, Formation, RelayFanout, Transfer, TrainerFanout,
                                    make_fanout)

    for cls in (RelayFanout, TrainerFanout):
        params = set(inspect.signature(cls).parameters)
        assert {"bus", "log", "counters"} <= params and "server" not in params, cls.__name__
    assert "server" not in inspect.signature(make_fanout).parameters
    hints = {name: inspect.signature(getattr(Fanout, name)).return_annotation for name in ("accept", "form", "push")}
    assert hints == {"accept": "Accepted", "form": "Formation", "push": "Transfer"}
    assert Accepted and Formation and Transfer


def test_a_lost_member_abandons_the_running_formation_at_once() -> None:
    from collections import Counter

    from actors.weight_sync.base import Abandoned, LossWatch

    async def scenario() -> tuple[str, int]:
        counters: Counter = Counter()
        watch = LossWatch(counters)
        watch.begin(["rollout.0", "rollout.1"])
        never = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(watch.unless_lost(never, "forming epoch 3"))
        await asyncio.sleep(0)
        watch.lost("rollout.2")   # not a member: nothing happens
        await asyncio.sleep(0)
        assert not waiting.done()
        watch.lost("rollout.1")
        with pytest.raises(Abandoned) as caught:
            await waiting
        assert never.cancelled()
        return str(caught.value), counters["transfers_abandoned"]

    message, abandoned = asyncio.run(scenario())
    assert message == "forming epoch 3 abandoned: rollout.1 was lost while it ran" and abandoned == 1


def test_a_server_lost_while_its_group_is_formed_fails_the_formation() -> None:
    # Forming with SGLang servers: the trainer is asked to host the group first. A member whose server dies
    # meanwhile fails the formation (no member is told to join a group it cannot complete).
    import types
    from collections import Counter

    import structlog

    from actors.weight_sync.direct import TrainerFanout

    class Bus:
        def __init__(self) -> None:
            self.sent: list[str] = []
            self.answer: asyncio.Future = asyncio.get_running_loop().create_future()

        async def request(self, to: str, msg: object, timeout: float) -> object:
            return await self.answer

        async def send(self, to: str, msg: object) -> None:
            self.sent.append(to)

    async def scenario() -> tuple[str, list[str], bool]:
        bus = Bus()
        fanout = TrainerFanout(bus, structlog.get_logger(), Counter(), ack_timeout=30, late_s=1, trainer="trainer",
                               rollouts=["rollout.0", "rollout.1"], start_version=0)
        forming = asyncio.ensure_future(fanout.form(1, ["rollout.0", "rollout.1"], {"rollout.0": 1, "rollout.1": 1}))
        await asyncio.sleep(0)
        fanout.lost("rollout.1", "its server died")
        for _ in range(10):   # a few turns of the loop: the formation sees the loss
            await asyncio.sleep(0)
        if not bus.answer.done():   # the trainer answers: a formation that did not stop goes on to tell members
            bus.answer.set_result(types.SimpleNamespace(master_addrs=["127.0.0.1"], master_ports=[1]))
        formation = await forming
        return formation.error, bus.sent, bus.answer.cancelled()

    error, told, abandoned = asyncio.run(scenario())
    assert error == "forming epoch 1 abandoned: rollout.1 was lost while it ran" and told == [] and abandoned


def test_the_factories_take_settings_and_parts_not_an_actor() -> None:
    from actors.weight_sync import make_fanout, make_receiver, make_sender, make_stage_sender

    for factory in (make_sender, make_fanout, make_receiver, make_stage_sender):
        first = next(iter(inspect.signature(factory).parameters.values()))
        assert first.name == "cfg", factory.__name__


def test_a_stage_sender_is_a_weight_sender() -> None:
    import structlog

    from actors.weight_sync import StageSender, WeightSender, WeightSyncError

    log = structlog.get_logger()
    follower = StageSender(1, False, "127.0.0.1", log)
    assert isinstance(follower, WeightSender)
    exported = []
    assert follower.take(3, (exported.append(i) or [] for i in range(2))) == [] and exported == [0, 1]
    assert follower.keep(3, iter([])) is None
    with pytest.raises(WeightSyncError, match="announced by trainer rank 0"):
        asyncio.run(follower.publish(3, [], []))
    follower.close()


def test_the_evaluator_takes_its_message_kinds_from_the_protocol() -> None:
    tree = ast.parse((ROOT / "actors" / "evaluator" / "actor.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "actors.param_server.actor" not in imported and "transport.protocol" in imported
