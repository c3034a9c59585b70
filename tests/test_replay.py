"""tools.replay: printing with filters, a deterministic actor replays identically, a changed one is caught
at the right message."""
from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import uvloop

from actors.runtime.base import Actor, ActorSpec, handles, ready_path
from actors.runtime.threads import in_thread
from testsupport.bounded import until
from tools import replay
from transport.bus import Bus
from transport.messages import Message, message


@message("test.replay.add")
class Add(Message):
    n: int


@message("test.replay.total")
class Total(Message):
    total: int
    t: torch.Tensor


@message("test.replay.query")
class Query(Message):
    pass


@message("test.replay.double")
class Double(Message):
    n: int


class Accumulator(Actor):
    """Deterministic: keeps a sum, reports it to 'sink', asks 'oracle' to double every 5th number."""

    async def on_start(self) -> None:
        self.total = 0

    @handles(Add)
    async def add(self, msg: Add) -> None:
        n = msg.n
        if n % 5 == 0:
            n = (await self.bus.request("oracle", Double(n), timeout=10)).n
        self.total += self.bump(n)
        await self.bus.send("sink", Total(self.total, torch.full((3,), float(self.total))))

    def bump(self, n: int) -> int:
        return n

    @handles(Query)
    async def query(self, msg: Query) -> Add:
        # async like add(): with max_inflight=1 the two run strictly in arrival order (a plain def
        # handler runs inline and could overtake an add() still waiting for the oracle)
        return Add(self.total)


class ChangedAccumulator(Accumulator):
    """Differs from Accumulator once the total passes 40."""

    def bump(self, n: int) -> int:
        return n + 1 if self.total > 40 else n


@message("test.replay.push")
class Push(Message):
    pass


@message("test.replay.seen")
class Seen(Message):
    adds: int     # how many Adds the actor had taken when a transfer on its link ended


class Linked(Actor):
    """Forms its bulk link "w", and later sends a bucket on it, in threads of the background, as the parameter
    server does; it tells the sink how many Adds it had taken when the formation ended, when the send began
    (once a Push asked for it) and when it ended."""

    async def on_start(self) -> None:
        from transport.bulk import LinkConfig

        self.adds = 0
        self.asked = asyncio.Event()
        self.link = self.make_link(LinkConfig.from_dict(self.cfg.links["w"].model_dump()))

    async def on_ready(self) -> None:
        self.spawn(self.transfers(), name="transfers")

    async def transfers(self) -> None:
        await in_thread(self.link.open, 0)
        await self.bus.send("sink", Seen(self.adds))
        await self.asked.wait()
        sending = in_thread(self.link.send, [("x", torch.arange(1 << 20, dtype=torch.float32))], 1)
        await self.bus.send("sink", Seen(self.adds))
        await sending
        await self.bus.send("sink", Seen(self.adds))

    @handles(Add)
    def add(self, msg: Add) -> None:
        self.adds += 1

    @handles(Query)
    async def query(self, msg: Query) -> Add:
        return Add(self.adds)

    @handles(Push)
    def push(self, msg: Push) -> None:
        self.asked.set()


class HangingAccumulator(Accumulator):
    """Leaves a mark in its run directory, then never finishes starting."""

    async def on_start(self) -> None:
        (Path(self.run_dir) / "started").write_text("")
        await asyncio.sleep(3600)


MODULE = __name__
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def record_log(tmp_path: Any) -> tuple[str, list[int]]:
    """Run Accumulator against real buses, recording in and out; returns the log path and the totals."""
    async def main() -> list[int]:
        totals: list[int] = []

        def oracle(env: Any) -> Any:
            return Double(env.msg.n * 2)

        def sink(env: Any) -> None:
            totals.append(env.msg.total)

        oracle_bus = await Bus("oracle", "tcp://127.0.0.1:*", handler=oracle, heartbeat_interval=None).start()
        sink_bus = await Bus("sink", "tcp://127.0.0.1:*", handler=sink, heartbeat_interval=None).start()
        spec = ActorSpec("acc", f"{MODULE}:Accumulator", f"ipc://{tmp_path}/acc",
                         {"oracle": oracle_bus.endpoint, "sink": sink_bus.endpoint},
                         {"log_console": False, "message_log": {"outbound": True}, "bus": {"max_inflight": 1}},
                         str(tmp_path))
        actor = Accumulator(spec)
        task = asyncio.create_task(actor.run())
        async with asyncio.timeout(10):
            while not ready_path(tmp_path, "acc").exists():
                await asyncio.sleep(0.005)
        client = await Bus("client", "tcp://127.0.0.1:*", {"acc": spec.endpoint}, heartbeat_interval=None).start()
        for i in range(1, 13):
            await client.send("acc", Add(i))
        assert (await client.request("acc", Query(), timeout=10)).n == actor.total
        actor.request_stop()
        assert await task == 0
        for b in (client, oracle_bus, sink_bus):
            await b.close()
        return totals

    async def bounded() -> list[int]:
        async with asyncio.timeout(60):
            return await main()

    totals = uvloop.run(bounded())
    return str(tmp_path / "msglog" / "acc.msglog"), totals


def test_replay_identical_and_divergence_at_the_right_message(tmp_path: Any, capsys: Any) -> None:
    path, totals = record_log(tmp_path)
    # 1..12 with 5 and 10 doubled by the oracle
    assert totals[-1] == sum(range(1, 13)) + 5 + 10

    same = replay.replay_into(path, f"{MODULE}:Accumulator")
    assert same.compared and same.divergence is None and same.fed == 13
    assert same.sent == 12 + 2 + 1       # totals, oracle requests, the query's reply

    changed = replay.replay_into(path, f"{MODULE}:ChangedAccumulator")
    d = changed.divergence
    # totals: 1,3,6,10,20,26,33,41,50 ... the first Add after total 41 is Add(9), inbound position 8
    first_over = next(i for i, t in enumerate(totals) if t > 40) + 1
    assert d is not None and d.inbound_position == first_over == 8
    assert d.cause_kind == "test.replay.add" and d.outbound_position == 0
    # named by message and field, with the two values
    assert d.message == "test.replay.total" and d.field == "total" and (d.expected, d.actual) == ("50", "51")

    assert replay.main([path, "--into", f"{MODULE}:Accumulator"]) == 0
    assert "identical" in capsys.readouterr().out
    assert replay.main([path, "--into", f"{MODULE}:ChangedAccumulator"]) == 1
    out = capsys.readouterr().out
    assert "first divergence at inbound message #8" in out and "message test.replay.total, field total" in out


def test_print_filters_and_json(tmp_path: Any, capsys: Any) -> None:
    path, _ = record_log(tmp_path)
    assert replay.main([path, "--type", "test.replay.add", "--sender", "client"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 12 and all("test.replay.add" in ln and "client ->" in ln for ln in lines)
    assert replay.main([path, "--dir", "out", "--type", "test.replay.total", "--json", "--limit", "2"]) == 0
    objs = [json.loads(ln) for ln in capsys.readouterr().out.strip().splitlines()]
    assert [o["fields"]["total"] for o in objs] == [1, 3]
    assert objs[0]["fields"]["t"] == {"tensor": "float32", "shape": [3]} and objs[0]["peer"] == "sink"


def test_torn_log_still_prints_and_bad_path_is_a_clear_error(tmp_path: Any, capsys: Any) -> None:
    path, _ = record_log(tmp_path)
    with open(path, "r+b") as fh:
        fh.seek(0, 2)
        fh.truncate(fh.tell() - 3)
    assert replay.main([path, "--type", "test.replay.query"]) == 0
    captured = capsys.readouterr()
    assert "torn record" in captured.err and "test.replay.query" in captured.out
    assert replay.main([str(tmp_path / "missing.msglog")]) == 2


def test_a_replay_stopped_with_sigterm_removes_its_temporary_directory(tmp_path: Any) -> None:
    # A replay that hung and was stopped once left /tmp/replay-* behind.
    path, _ = record_log(tmp_path / "rec")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "tools.replay", path, "--into", f"tests.test_replay:HangingAccumulator"],
                            cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp.glob("replay-*/started")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.05)   # polling the child's file
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert list(tmp.iterdir()) == []


def _rl_log(path: Any, n: int = 100) -> str:
    """A log of ``n`` rl.* records, written the way an actor writes them."""
    from transport.messages import encode
    from transport.msglog import MessageLogWriter
    from transport.protocol import BatchRequest, GroupReturned

    with MessageLogWriter(path, meta={"actor": "buffer"}) as log:
        for i in range(n):
            msg = GroupReturned(f"g{i}", "drain") if i % 2 else BatchRequest(i)
            log.record("in", encode(msg, "rollout0" if i % 2 else "trainer"), peer="x")
    return str(path)


def _run_replay(*args: str) -> subprocess.CompletedProcess:
    """tools.replay in a fresh interpreter: nothing imported by the test process helps it decode."""
    return subprocess.run([sys.executable, "-m", "tools.replay", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


def test_read_mode_decodes_rl_messages(tmp_path: Any) -> None:
    path = _rl_log(tmp_path / "buffer.msglog", n=6)
    out = _run_replay(path)
    assert out.returncode == 0 and "unknown message kind" not in out.stdout, out.stdout
    assert out.stdout.count("rl.batch_request") == 3 and out.stdout.count("rl.group_returned") == 3
    only = _run_replay(path, "--type", "rl.group_returned")
    lines = only.stdout.strip().splitlines()
    assert len(lines) == 3 and all('"reason":"drain"' in ln for ln in lines), only.stdout


def test_corrupt_length_mid_log_is_an_error_not_a_torn_tail(tmp_path: Any, capsys: Any) -> None:
    from transport.msglog import MAGIC, MessageLogError, MessageLogReader

    path = _rl_log(tmp_path / "buffer.msglog")
    data = bytearray(open(path, "rb").read())
    # record 0 is the meta record; walk to record 2 and claim it is 2 GiB long
    pos = len(MAGIC)
    for _ in range(2):
        pos += 8 + int.from_bytes(data[pos:pos + 4], "little")
    data[pos:pos + 4] = (1 << 31).to_bytes(4, "little")
    open(path, "wb").write(bytes(data))
    with pytest.raises(MessageLogError, match=f"record 2 at offset {pos} has a corrupt length"):
        list(MessageLogReader(path))
    assert replay.main([path]) == 2
    assert f"record 2 at offset {pos}" in capsys.readouterr().err
    assert replay.main([path, "--into", "actors.buffer:BufferActor"]) == 2
    captured = capsys.readouterr()
    assert "corrupt length" in captured.err and "identical" not in captured.out


class Watcher(Accumulator):
    """Tells the oracle when the sink is gone: work done on a heartbeat verdict, not on a message."""

    def on_peer_dead(self, peer: str) -> None:
        if peer == "sink":
            self.spawn(self.bus.send("oracle", Add(-1)), name="report")


def test_heartbeat_verdicts_are_logged_and_replayed(tmp_path: Any) -> None:
    async def main() -> None:
        told = asyncio.Event()

        def oracle(env: Any) -> None:
            if type(env.msg) is Add and env.msg.n == -1:
                told.set()

        oracle_bus = await Bus("oracle", "tcp://127.0.0.1:*", handler=oracle, heartbeat_interval=None).start()
        sink_bus = await Bus("sink", "tcp://127.0.0.1:*", handler=lambda env: None, heartbeat_interval=None).start()
        spec = ActorSpec("watch", f"{MODULE}:Watcher", f"ipc://{tmp_path}/watch",
                         {"oracle": oracle_bus.endpoint, "sink": sink_bus.endpoint},
                         {"log_console": False, "message_log": {"outbound": True},
                          "bus": {"heartbeat_interval": 0.05, "heartbeat_timeout": 0.5}}, str(tmp_path))
        actor = Watcher(spec)
        task = asyncio.create_task(actor.run())
        async with asyncio.timeout(10):
            while not ready_path(tmp_path, "watch").exists():
                await asyncio.sleep(0.005)
        await sink_bus.close()          # the sink goes silent: the watcher's heartbeats declare it dead
        async with asyncio.timeout(30):
            await told.wait()
        actor.request_stop()
        assert await task == 0
        await oracle_bus.close()

    uvloop.run(main())
    path = str(tmp_path / "msglog" / "watch.msglog")
    from transport.msglog import read_log
    events = [(r.event, r.peer) for r in read_log(path)[0] if r.kind == "event"]
    assert ("peer_dead", "sink") in events, events
    same = replay.replay_into(path, f"{MODULE}:Watcher", idle_timeout=10)
    assert same.compared and same.divergence is None and same.sent >= 1, same
    # an actor that does nothing on the verdict: the report to the oracle is missing
    d = replay.replay_into(path, f"{MODULE}:Accumulator", idle_timeout=5).divergence
    assert d is not None and d.peer == "oracle" and d.actual == "nothing" and d.message == "test.replay.add", d


class RestartWatcher(Accumulator):
    """Tells the oracle when the sink came back as a new process: work done on a verdict, not on a message."""

    def on_peer_restarted(self, peer: str) -> None:
        if peer == "sink":
            self.spawn(self.bus.send("oracle", Add(-2)), name="report")


def test_a_peer_restart_is_logged_and_replayed_where_it_happened(tmp_path: Any) -> None:
    async def main() -> None:
        told = asyncio.Event()

        def oracle(env: Any) -> None:
            if type(env.msg) is Add and env.msg.n == -2:
                told.set()

        watch_ep, sink_ep = f"ipc://{tmp_path}/watch", f"ipc://{tmp_path}/sink"
        oracle_bus = await Bus("oracle", "tcp://127.0.0.1:*", handler=oracle, heartbeat_interval=None).start()

        def sink() -> Bus:   # pings the watcher: its pings say which process it is
            return Bus("sink", sink_ep, {"watch": watch_ep}, handler=lambda env: None, heartbeat_interval=0.05)

        sink_bus = await sink().start()
        spec = ActorSpec("watch", f"{MODULE}:RestartWatcher", watch_ep, {"oracle": oracle_bus.endpoint, "sink": sink_ep},
                         {"log_console": False, "message_log": {"outbound": True},
                          "bus": {"heartbeat_interval": 0.05, "heartbeat_timeout": 30.0}}, str(tmp_path))
        actor = RestartWatcher(spec)
        task = asyncio.create_task(actor.run())
        async with asyncio.timeout(10):
            while not ready_path(tmp_path, "watch").exists():
                await asyncio.sleep(0.005)
        first = sink_bus.incarnation
        await until(lambda: actor.bus.liveness.peers["sink"].incarnation == first, timeout=10, what="the sink's first ping")
        await sink_bus.close()
        sink_bus = await sink().start()          # a new process of the sink, long before any heartbeat timeout
        async with asyncio.timeout(30):
            await told.wait()
        actor.request_stop()
        assert await task == 0
        for bus in (sink_bus, oracle_bus):
            await bus.close()

    uvloop.run(main())
    path = str(tmp_path / "msglog" / "watch.msglog")
    from transport.msglog import read_log
    events = [(r.event, r.peer) for r in read_log(path)[0] if r.kind == "event"]
    assert ("peer_restarted", "sink") in events and ("peer_dead", "sink") not in events, events
    same = replay.replay_into(path, f"{MODULE}:RestartWatcher", idle_timeout=10)
    assert same.compared and same.divergence is None and same.sent >= 1, same
    # an actor that does nothing on the verdict: the report to the oracle is missing
    d = replay.replay_into(path, f"{MODULE}:Accumulator", idle_timeout=5).divergence
    assert d is not None and d.peer == "oracle" and d.actual == "nothing" and d.message == "test.replay.add", d


def test_link_transfers_end_in_the_replay_where_they_ended_in_the_original(tmp_path: Any) -> None:
    # The original's link formation ends only after it took three Adds (its peer joins late), and a bucket it
    # then sends is not received before it stops. A stand-in link that formed at once would report 0 Adds, and
    # one that sent at once would send a bucket the original never finished sending (both seen from the
    # parameter server: it pushed a version fewer, or a bucket more).
    from testsupport.bounded import run_bounded, until
    from testsupport.local_actors import gloo_link
    from transport.bulk import BulkLink, LinkConfig
    from transport.msglog import read_log
    from transport.ports import free_port

    members, port = ["linked", "peer"], free_port()

    async def main() -> None:
        seen: list[int] = []
        sink_bus = await Bus("sink", "tcp://127.0.0.1:*", handler=lambda env: seen.append(env.msg.adds),
                             heartbeat_interval=None).start()
        spec = ActorSpec("linked", f"{MODULE}:Linked", f"ipc://{tmp_path}/linked", {"sink": sink_bus.endpoint},
                         {"log_console": False, "message_log": {"outbound": True},
                          "links": {"w": gloo_link("w", port, members, "linked")}}, str(tmp_path))
        actor = Linked(spec)
        task = asyncio.create_task(actor.run())
        await until(lambda: ready_path(tmp_path, "linked").exists(), 10, "the actor to be ready", 0.005)
        client = await Bus("client", "tcp://127.0.0.1:*", {"linked": spec.endpoint}, heartbeat_interval=None).start()
        # answered in a task: the replay waits for the answer before the Adds (and the actor's threads run)
        assert (await client.request("linked", Query(), timeout=10)).n == 0
        for i in range(3):
            await client.send("linked", Add(i))
        assert (await client.request("linked", Query(), timeout=10)).n == 3
        peer = BulkLink(LinkConfig.from_dict(gloo_link("w", port, members, "peer")))
        await asyncio.to_thread(peer.open, 0)
        await until(lambda: seen == [3], 10, "the report of the formation")
        await client.send("linked", Push())
        await until(lambda: seen == [3, 3], 10, "the report that the send began")
        actor.request_stop()
        assert await task == 0
        await asyncio.to_thread(peer.recv, 0)   # the bucket moves only now: the original had stopped
        peer.close()
        for b in (client, sink_bus):
            await b.close()

    run_bounded(main(), 60)
    path = str(tmp_path / "msglog" / "linked.msglog")
    kinds = [r.kind for r in read_log(path)[0]]
    assert kinds.index("bulk_formed") > kinds.index("in") and "bulk_out" not in kinds, kinds
    same = replay.replay_into(path, f"{MODULE}:Linked", idle_timeout=10)
    assert same.compared and same.divergence is None and not same.notes, (same.divergence, same.notes)
    assert same.sent == 4     # the queries' answers and two reports: no bucket, no report that the send ended


def test_a_field_added_with_a_default_compares_equal_to_a_log_written_before_it() -> None:
    # A log recorded before Task.tool existed has no "tool" in its tasks; the replay sends tool="" (the default
    # decode fills in): the same message. A different value is still a divergence.
    import msgpack

    from tools.replay.compare import wire_key
    from transport.messages import encode
    from transport.protocol import GenerateGroup, Task

    sent = encode(GenerateGroup(group_id="g", prompt_ids=[1, 2], n=2, task=Task("math", "4")), sender="buffer")
    head = msgpack.unpackb(sent[0], raw=False)
    assert head[7]["task"]["tool"] == ""
    old = [msgpack.packb([*head[:7], {**head[7], "task": {k: v for k, v in head[7]["task"].items() if k != "tool"}}])]
    assert wire_key(old, "rollout.0") == wire_key(sent, "rollout.0")
    other = encode(GenerateGroup(group_id="g", prompt_ids=[1, 2], n=2, task=Task("math", "4", tool="calculator")),
                   sender="buffer")
    assert wire_key(other, "rollout.0") != wire_key(old, "rollout.0")
