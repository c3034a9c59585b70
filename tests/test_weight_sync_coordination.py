"""The weights paths' coordination is one typed interface in one direction: the parameter server calls its
fanout, and the fanout reports back only through `actors.weight_sync.Coordinator`, which the server
implements. Every sender (the pipeline stages' too) is a `WeightSender`."""
from __future__ import annotations

import ast
import asyncio
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _coordinator_members() -> set[str]:
    from actors.weight_sync import Coordinator

    return set(typing.get_type_hints(Coordinator)) | {
        n for n, v in vars(Coordinator).items() if callable(v) and not n.startswith("_")}


def _used_on_the_server(path: Path) -> set[str]:
    """The attributes a module uses on its fanouts' server (``ps = self.server`` and ``self.server``)."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            value = node.value
            if isinstance(value, ast.Name) and value.id == "ps":
                used.add(node.attr)
            elif (isinstance(value, ast.Attribute) and value.attr == "server" and isinstance(value.value, ast.Name)
                  and value.value.id == "self"):
                used.add(node.attr)
    return used


@pytest.mark.parametrize("module", ["relay.py", "direct.py"])
def test_a_fanout_reaches_its_server_only_through_the_coordinator(module: str) -> None:
    used = _used_on_the_server(ROOT / "actors" / "weight_sync" / module)
    assert used, "the scan found no use of the server: it no longer matches how the fanouts are written"
    assert used <= _coordinator_members(), f"used beyond Coordinator: {sorted(used - _coordinator_members())}"


def test_the_parameter_server_implements_the_coordinator() -> None:
    from actors.param_server.actor import ParamServerActor
    from actors.weight_sync import Coordinator

    methods = {n for n, v in vars(Coordinator).items() if callable(v) and not n.startswith("_")}
    missing = [n for n in methods if not callable(getattr(ParamServerActor, n, None))]
    assert not missing
    # the attributes: set by Actor or in on_start
    source = (ROOT / "actors" / "param_server" / "actor.py").read_text() + (ROOT / "actors" / "runtime" / "base.py").read_text()
    for name in typing.get_type_hints(Coordinator):
        assert f"self.{name} =" in source or f"self.{name}:" in source, name


def test_the_factories_take_settings_and_parts_not_an_actor() -> None:
    import inspect

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
