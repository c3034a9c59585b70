"""Actor base in-process: spec validation, handler dispatch, readiness, logs, drain (finish or hand back)."""
from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

import pytest

from actors.runtime.base import Actor, ActorSpec, SpecError, handles, load_actor_class, ready_path
from testsupport.bounded import run_bounded
from transport.bus import Bus, RemoteError
from transport.messages import Message, message


@message("test.actor.ask")
class Ask(Message):
    text: str
    slow: bool = False


@message("test.actor.answer")
class Answer(Message):
    text: str


@message("test.actor.note")
class Note(Message):
    n: int


@message("test.actor.unhandled")
class Unhandled(Message):
    pass


class EchoActor(Actor):
    def __init__(self, spec: ActorSpec) -> None:
        super().__init__(spec)
        self.notes: list[int] = []
        self.release = asyncio.Event()
        self.slow_started = asyncio.Event()
        self.hooks: list[str] = []

    async def on_start(self) -> None:
        self.hooks.append("start")

    async def on_ready(self) -> None:
        self.hooks.append("ready")

    async def on_drain(self) -> None:
        self.hooks.append("drain")

    async def on_stop(self) -> None:
        self.hooks.append("stop")

    @handles(Ask)
    async def ask(self, msg: Ask, env: Any) -> Answer:
        if msg.slow:
            self.slow_started.set()
            await self.release.wait()
        return Answer(f"{env.sender}:{msg.text}")

    @handles(Note)
    def note(self, msg: Note) -> None:
        self.notes.append(msg.n)


run = functools.partial(run_bounded, timeout=30.0)


def make_spec(tmp_path: Any, **settings: Any) -> ActorSpec:
    return ActorSpec(name="echo", cls="tests.test_actors_runtime:EchoActor", endpoint=f"ipc://{tmp_path}/echo",
                     run_dir=str(tmp_path), settings={"log_console": False, **settings})


async def wait_ready(tmp_path: Any, actor_task: asyncio.Task) -> None:
    path = ready_path(tmp_path, "echo")
    while not path.exists():
        assert not actor_task.done(), actor_task.result()
        await asyncio.sleep(0.005)


async def busy_echo(tmp_path: Any, text: str, **settings: Any) -> tuple[EchoActor, asyncio.Task, Bus, asyncio.Task]:
    """An EchoActor running, a client, and one request the actor is holding (until ``actor.release``)."""
    actor = EchoActor(make_spec(tmp_path, **settings))
    task = asyncio.create_task(actor.run())
    await wait_ready(tmp_path, task)
    client = await Bus("client", "tcp://127.0.0.1:*", {"echo": f"ipc://{tmp_path}/echo"},
                       heartbeat_interval=None).start()
    slow = asyncio.create_task(client.request("echo", Ask(text, slow=True), timeout=10))
    await asyncio.wait_for(actor.slow_started.wait(), 5)
    return actor, task, client, slow


def test_spec_roundtrip_and_errors_name_the_key(tmp_path: Any) -> None:
    spec = ActorSpec("rollout.0", "actors.rollout:Rollout", "tcp://127.0.0.1:5555", {"buffer": "ipc:///x"},
                     {"group_size": 4}, "/runs/1", None, {"OMP_NUM_THREADS": "1"})
    assert ActorSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    spec.write(tmp_path / "s.json")
    assert ActorSpec.load(tmp_path / "s.json") == spec
    for bad, words in [({"cls": "a:B", "endpoint": "x"}, "spec.name: required"),
                       ({"name": "a", "cls": "nocolon", "endpoint": "x"}, "spec.cls: expected 'module:Class'"),
                       ({"name": "a", "cls": "a:B", "endpoint": "x", "peers": {"b": 1}}, "spec.peers"),
                       ({"name": "a", "cls": "a:B", "endpoint": "x", "colour": 1}, "spec.colour: unknown key")]:
        with pytest.raises(SpecError, match=words):
            ActorSpec.from_dict(bad)
    (tmp_path / "broken.json").write_text('{"name": "a",\n "cls": }')
    with pytest.raises(SpecError, match="line 2"):
        ActorSpec.load(tmp_path / "broken.json")
    with pytest.raises(SpecError, match="not a subclass of actors.runtime.base.Actor"):
        load_actor_class(f"{__name__}:Ask")


def test_handlers_readiness_logs_and_clean_stop(tmp_path: Any) -> None:
    async def main() -> None:
        actor = EchoActor(make_spec(tmp_path))
        task = asyncio.create_task(actor.run())
        await wait_ready(tmp_path, task)
        info = json.loads(ready_path(tmp_path, "echo").read_text())
        client = await Bus("client", "tcp://127.0.0.1:*", {"echo": info["endpoint"]},
                           heartbeat_interval=None).start()
        assert await client.request("echo", Ask("hi"), timeout=5) == Answer("client:hi")
        for i in range(5):
            await client.send("echo", Note(i))
        with pytest.raises(RemoteError) as err:
            await client.request("echo", Unhandled(), timeout=5)
        assert err.value.code == "no_handler" and "test.actor.unhandled" in str(err.value)
        assert actor.notes == list(range(5))     # one-way sends from one peer arrive in order, before the reply
        actor.request_stop("test over")
        assert await task == 0
        assert actor.hooks == ["start", "ready", "drain", "stop"]
        assert not ready_path(tmp_path, "echo").exists()
        events = [json.loads(line) for line in (tmp_path / "logs" / "echo.jsonl").read_text().splitlines()]
        assert all(e["actor"] == "echo" for e in events)
        names = [e["event"] for e in events]
        assert "ready" in names and "stopping" in names and names[-1] == "stopped"
        assert any(e["event"] == "message_rejected" and e["reason"] == "no_handler" for e in events)
        await client.close()

    run(main())


def test_drain_finishes_inflight_work(tmp_path: Any) -> None:
    async def main() -> None:
        actor, task, client, slow = await busy_echo(tmp_path, "slow", drain_timeout=10)
        actor.request_stop("test")
        # while draining, new requests are refused (the requester can send them elsewhere) ...
        with pytest.raises(RemoteError) as err:
            await client.request("echo", Ask("new"), timeout=5)
        assert err.value.code == "draining"
        # ... but the in-flight one completes
        actor.release.set()
        assert await slow == Answer("client:slow")
        assert await task == 0
        await client.close()

    run(main())


def test_stack_dump_shows_where_each_task_waits(tmp_path: Any) -> None:
    # What `kill -USR1 <pid>` writes for a stuck actor: every asyncio task's stack and every thread's.
    async def main() -> str:
        actor, task, client, slow = await busy_echo(tmp_path, "slow")
        path = actor.dump_stacks()
        actor.release.set()
        await slow
        actor.request_stop("test over")
        assert await task == 0
        await client.close()
        return path.read_text()

    text = run(main())
    assert text.startswith("echo pid ")
    assert "bus-echo-inbound" in text and "await asock.poll" in text          # the bus reading its socket
    assert "in ask" in text and "await self.release.wait()" in text          # the handler, at its await
    assert "--- threads" in text and "Current thread" in text


def test_drain_timeout_hands_work_back(tmp_path: Any) -> None:
    async def main() -> None:
        actor, task, client, slow = await busy_echo(tmp_path, "stuck", drain_timeout=0.2)
        actor.request_stop("test")
        with pytest.raises(RemoteError) as err:
            await slow
        assert err.value.code == "draining"       # handed back to the requester, not lost
        assert await task == 0
        await client.close()

    run(main())


def test_failed_critical_background_task_stops_with_exit_1(tmp_path: Any) -> None:
    async def main() -> None:
        actor = EchoActor(make_spec(tmp_path))
        task = asyncio.create_task(actor.run())
        await wait_ready(tmp_path, task)

        async def broken() -> None:
            raise ValueError("disk full")

        actor.spawn(broken(), "writer")
        assert await task == 1
        log = (tmp_path / "logs" / "echo.jsonl").read_text()
        assert "background task 'writer' failed" in log

    run(main())


class SlowStartActor(Actor):
    """on_start holds until the test releases it; handlers read state that on_start creates."""

    gate: asyncio.Event

    async def on_start(self) -> None:
        await self.gate.wait()
        self.seen: list[int] = []

    @handles(Note)
    def note(self, msg: Note) -> None:
        self.seen.append(msg.n)

    @handles(Ask)
    async def ask(self, msg: Ask) -> Answer:
        return Answer(f"{len(self.seen)}:{msg.text}")


def test_messages_before_on_start_finishes_wait_for_it_in_order(tmp_path: Any) -> None:
    async def main() -> None:
        actor = SlowStartActor(ActorSpec(name="slow", cls="tests.test_actors_runtime:SlowStartActor",
                                         endpoint=f"ipc://{tmp_path}/slow", run_dir=str(tmp_path),
                                         settings={"log_console": False}))
        actor.gate = asyncio.Event()
        task = asyncio.create_task(actor.run())
        client = await Bus("client", "tcp://127.0.0.1:*", {"slow": f"ipc://{tmp_path}/slow"},
                           heartbeat_interval=None).start()
        for i in range(3):
            await client.send("slow", Note(i))
        asking = asyncio.ensure_future(client.request("slow", Ask("q"), timeout=10))
        while actor.counters["early_messages"] < 4:  # all four reached the actor while on_start blocks
            await asyncio.sleep(0.01)                   # (bounded by run()'s timeout)
        assert not hasattr(actor, "seen") and not asking.done()
        actor.gate.set()
        assert await asking == Answer("3:q")  # every early note was handled, in order, before the request
        assert actor.seen == [0, 1, 2]
        actor.request_stop("test over")
        assert await task == 0
        await client.close()
    run(main())


def test_every_kind_a_shipped_actor_handles_names_the_roles_that_send_it() -> None:
    # A bus refuses a kind from any role but its senders (and binds each connection to one actor): a kind
    # declared with no senders would be accepted from any actor of the run.
    import importlib

    shipped = ["actors.buffer:BufferActor", "actors.rollout:RolloutActor", "actors.reward.math:MathReward",
               "actors.reward.code:CodeReward", "actors.trainer:TrainerActor", "actors.param_server:ParamServerActor",
               "actors.evaluator:EvalActor"]
    handled = {}
    for path in shipped:
        module, _, name = path.partition(":")
        for kind in getattr(importlib.import_module(module), name)._handlers:
            handled[kind.KIND] = kind.SENDERS
    assert not [k for k, senders in handled.items() if not senders], handled
    # what a probe from another uid spoofed before connections were bound to actors
    assert {k: sorted(handled[k]) for k in ("ps.eval_weights_request", "ps.weights_status_request",
                                             "rl.checkpoint_request", "rl.run_finished", "rl.version_update",
                                             "rl.batch_request", "rl.weights_published", "rl.eval_generate")} == {
        "ps.eval_weights_request": ["evaluator"], "ps.weights_status_request": ["trainer"],
        "rl.checkpoint_request": ["trainer"], "rl.run_finished": ["trainer"], "rl.version_update": ["trainer"],
        "rl.batch_request": ["trainer"], "rl.weights_published": ["trainer"], "rl.eval_generate": ["evaluator"]}
