"""The bus: request/reply, one-way, tensors, each bad input, CURVE, backpressure, heartbeats, draining."""
from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import msgpack
import pytest
import torch
import uvloop
import zmq
import zmq.asyncio

from testsupport.bounded import run_bounded, until as poll_until
from transport.auth import CurveConfig, TokenConfig, generate_run_keys, generate_run_tokens
from transport.bus import Bus, MessageTooLarge, RemoteError, RequestTimeout, UnknownPeer
from transport.messages import SCHEMA_VERSION, Error, Message, decode, encode, message


@message("test.bus.echo")
class Echo(Message):
    text: str
    n: int = 0
    t: torch.Tensor | None = None


@message("test.bus.count")
class Count(Message):
    n: int


class ListLog:
    """Stands in for a structlog logger; keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict]] = []

    def bind(self, **_: Any) -> "ListLog":
        return self

    def _add(self, level: str, event: str, **kw: Any) -> None:
        self.events.append((level, event, kw))

    def info(self, event: str, **kw: Any) -> None:
        self._add("info", event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._add("warning", event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._add("error", event, **kw)


run = functools.partial(run_bounded, timeout=30.0)
# Effects with no event to await (a ZAP denial, a counter) are polled often: they come within milliseconds.
until = functools.partial(poll_until, timeout=5.0, poll_s=0.005)


def echo_handler(env: Any) -> Any:
    if isinstance(env.msg, Echo):
        if env.msg.text == "boom":
            raise RuntimeError("handler exploded")
        return Echo(env.msg.text.upper(), env.msg.n + 1, env.msg.t)
    return None


async def pair(endpoint: str = "tcp://127.0.0.1:*", **server_kw: Any) -> tuple[Bus, Bus]:
    server = await Bus("server", endpoint, handler=server_kw.pop("handler", echo_handler), **server_kw).start()
    client = await Bus("client", "tcp://127.0.0.1:*", {"server": server.endpoint}).start()
    return server, client


def test_request_reply_oneway_and_tensors(tmp_path: Any) -> None:
    async def main() -> None:
        received: list[Any] = []
        done = asyncio.Event()

        def handler(env: Any) -> Any:
            if isinstance(env.msg, Count):
                received.append(env.msg.n)
                if len(received) == 100:
                    done.set()
                return None
            return echo_handler(env)

        for endpoint in ("tcp://127.0.0.1:*", f"ipc://{tmp_path}/sock/server"):
            received.clear()
            done.clear()
            server, client = await pair(endpoint, handler=handler)
            reply = await client.request("server", Echo("hi", 1), timeout=5)
            assert reply == Echo("HI", 2)
            t = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
            reply = await client.request("server", Echo("tensor", 0, t), timeout=5)
            assert torch.equal(reply.t, t) and reply.t.dtype == torch.bfloat16
            for i in range(100):
                await client.send("server", Count(i))
            await asyncio.wait_for(done.wait(), 5)
            assert received == list(range(100))   # one peer's messages arrive in order
            assert server.stats["received"] == 102 and client.stats["sent"] == 102
            await client.close()
            await server.close()

    run(main())


def test_error_replies_raise_typed_exceptions() -> None:
    async def main() -> None:
        server, client = await pair(handler=echo_handler)
        with pytest.raises(RemoteError) as info:
            await client.request("server", Echo("boom"), timeout=5)
        assert info.value.code == "handler_error" and "handler exploded" in str(info.value)
        # the server is still serving
        assert (await client.request("server", Echo("ok"), timeout=5)).text == "OK"
        with pytest.raises(UnknownPeer, match="no endpoint for peer 'nobody'"):
            await client.send("nobody", Echo("x"))
        small = await Bus("small", "tcp://127.0.0.1:*", {"server": server.endpoint},
                          max_frame_bytes=1000, heartbeat_interval=None).start()
        with pytest.raises(MessageTooLarge, match="frame 1 is 4000 bytes"):
            await small.send("server", Echo("big", 0, torch.zeros(1000)))
        await small.close()
        server.draining = True
        with pytest.raises(RemoteError) as info:
            await client.request("server", Echo("late"), timeout=5)
        assert info.value.code == "draining"
        await client.close()
        await server.close()

    run(main())


def test_request_timeout() -> None:
    async def main() -> None:
        never = asyncio.Event()

        async def slow(env: Any) -> Any:
            await never.wait()

        server, client = await pair(handler=slow)
        with pytest.raises(RequestTimeout, match="did not answer 'test.bus.echo' within 0.2s"):
            await client.request("server", Echo("x"), timeout=0.2)
        assert client.stats["request_timeouts"] == 1
        await client.close()
        await server.close()

    run(main())


def test_each_bad_input_is_counted_logged_and_answered() -> None:
    async def main() -> None:
        log = ListLog()
        server = await Bus("server", "tcp://127.0.0.1:*", handler=echo_handler, max_frame_bytes=4096,
                           log=log, heartbeat_interval=None).start()
        ctx = zmq.asyncio.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.connect(server.endpoint)

        def head(tag: str, body: Any, mid: str, version: int = SCHEMA_VERSION) -> bytes:
            return msgpack.packb([tag, version, "evil", mid, 1.0, None, True, body])

        ok_body = {"text": "x", "n": 1, "t": {"$t": 1, "dtype": "float32", "shape": [4]}}
        cases = {
            "unknown_kind": [head("no.such.kind", {}, "m1")],
            "bad_field": [head("test.bus.echo", {"text": 5}, "m2")],
            "schema_version": [head("test.bus.echo", {"text": "x"}, "m3", version=99)],
            "frame_too_large": [head("test.bus.echo", {**ok_body, "t": {**ok_body["t"], "shape": [2048]}}, "m4"),
                                b"\0" * 8192],
            "tensor_size": [head("test.bus.echo", ok_body, "m5"), b"\0" * 15],
        }
        for reason, frames in cases.items():
            await raw.send_multipart(frames)
            reply_frames = await asyncio.wait_for(raw.recv_multipart(), 5)
            header, err = decode(reply_frames)
            assert isinstance(err, Error) and err.code == reason, (reason, err)
            assert header.reply_to == msgpack.unpackb(frames[0])[3]
        # malformed frames carry no usable header: counted and logged, no reply possible
        await raw.send_multipart([b"\xc1not msgpack"])
        await raw.send_multipart([msgpack.packb(["too", "short"])])
        await until(lambda: server.rejected["malformed"] == 2)
        for reason in cases:
            assert server.rejected[reason] == 1, reason
        logged = [(kw["reason"], kw["sender"]) for lvl, ev, kw in log.events if ev == "message_rejected"]
        assert ("bad_field", "evil") in logged and ("malformed", None) in logged
        assert any("field 'text': expected str, got int" in kw["error"] for _, _, kw in log.events)
        # and the actor still works for a well-behaved client
        client = await Bus("client", "tcp://127.0.0.1:*", {"server": server.endpoint}).start()
        assert (await client.request("server", Echo("fine"), timeout=5)).text == "FINE"
        raw.close(0)
        ctx.term()
        await client.close()
        await server.close()

    run(main())


def test_without_curve_each_connection_is_bound_to_its_actor_by_the_runs_tokens(tmp_path: Any) -> None:
    # Without CURVE the header's name was trusted: from another uid, a message saying it came from the evaluator
    # fetched the model's weights. Now a connection must log in as an actor of the run with that actor's token.
    async def main() -> None:
        tokens_dir = generate_run_tokens(str(tmp_path), ["server", "boss", "worker"])
        assert {oct(os.stat(os.path.join(tokens_dir, f)).st_mode & 0o777) for f in os.listdir(tokens_dir)} == {"0o600"}
        assert oct(os.stat(tokens_dir).st_mode & 0o777) == "0o700"
        roles = {"server": "server", "boss": "boss", "worker": "worker"}
        calls: list[str] = []

        def handler(env: Any) -> Any:
            calls.append(env.msg.text)
            return Echo(env.msg.text.upper())

        def tokens(name: str) -> TokenConfig:
            return TokenConfig.from_spec({"tokens_dir": tokens_dir}, name)

        server = await Bus("server", "tcp://127.0.0.1:*", handler=handler, roles=roles, heartbeat_interval=None,
                           tokens=tokens("server")).start()
        peers = {"server": server.endpoint}

        def client(name: str, creds: TokenConfig | None) -> Bus:
            return Bus(name, "tcp://127.0.0.1:*", peers, heartbeat_interval=None, tokens=creds)

        boss = await client("boss", tokens("boss")).start()
        worker = await client("worker", tokens("worker")).start()
        assert (await boss.request("server", Order("go"), timeout=5)).text == "GO"
        with pytest.raises(RemoteError, match=r"\[sender_not_allowed\] test.bus.order is sent by boss only"):
            await worker.request("server", Order("go"), timeout=5)
        # worker's token, boss's name in the header
        impostor = await client("boss", tokens("worker")).start()
        with pytest.raises(RemoteError, match=r"\[spoofed_sender\] the message says it is from 'boss', but its "
                                              r"token is worker's"):
            await impostor.request("server", Order("go"), timeout=5)
        # a guessed token, and no credentials at all: never processed, nor answered
        guesser = await client("boss", TokenConfig("boss", "0" * 64)).start()
        anonymous = await client("boss", None).start()
        for bus in (guesser, anonymous):
            with pytest.raises(RequestTimeout):
                await bus.request("server", Order("go"), timeout=0.5)
        await until(lambda: server.rejected["auth_denied"] >= 1)
        assert calls == ["go"]
        assert server.rejected["sender_not_allowed"] == 1 and server.rejected["spoofed_sender"] == 1
        for bus in (anonymous, guesser, impostor, worker, boss, server):
            await bus.close()

    run(main())
    with pytest.raises(ValueError, match=r"token file .*/nobody.token: No such file or directory"):
        TokenConfig.from_spec({"tokens_dir": str(tmp_path / "tokens")}, "nobody")
    with pytest.raises(ValueError, match=r"tokens: expected a map with tokens_dir"):
        TokenConfig.from_spec({"keys_dir": str(tmp_path)}, "boss")


def test_an_ipc_socket_is_only_its_users(tmp_path: Any) -> None:
    async def main() -> None:
        path = tmp_path / "sockets" / "server"
        server = await Bus("server", f"ipc://{path}", handler=echo_handler, heartbeat_interval=None).start()
        assert oct(path.stat().st_mode & 0o777) == "0o600"          # connecting needs write permission
        assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
        client = await Bus("client", "tcp://127.0.0.1:*", {"server": server.endpoint}, heartbeat_interval=None).start()
        assert (await client.request("server", Echo("mine"), timeout=5)).text == "MINE"
        for bus in (client, server):
            await bus.close()

    run(main())


def test_curve_accepts_authorised_and_rejects_others(tmp_path: Any) -> None:
    async def main() -> None:
        keys = generate_run_keys(str(tmp_path), ["server", "client"])
        assert oct(os.stat(os.path.join(keys, "server.key_secret")).st_mode & 0o777) == "0o600"
        calls: list[str] = []

        def handler(env: Any) -> Any:
            calls.append(env.msg.text)
            return echo_handler(env)

        server_cfg = CurveConfig.from_spec({"keys_dir": keys}, "server")
        server = await Bus("server", "tcp://127.0.0.1:*", handler=handler, curve=server_cfg,
                           heartbeat_interval=None).start()
        peers = {"server": server.endpoint}
        client = await Bus("client", "tcp://127.0.0.1:*", peers, heartbeat_interval=None,
                           curve=CurveConfig.from_keys_dir(keys, "client", ["server"])).start()
        assert (await client.request("server", Echo("trusted"), timeout=5)).text == "TRUSTED"

        # a client whose key is not in the run's key set: the ZAP handler denies it
        pub, sec = zmq.curve_keypair()
        rogue_cfg = CurveConfig(pub.decode(), sec.decode(), {"server": server_cfg.public}, [])
        rogue = await Bus("rogue", "tcp://127.0.0.1:*", peers, curve=rogue_cfg, heartbeat_interval=None).start()
        with pytest.raises(RequestTimeout):
            await rogue.request("server", Echo("intruder"), timeout=0.5)
        await until(lambda: server.rejected["auth_denied"] >= 1)
        # a client without CURVE at all cannot even complete the handshake
        plain = await Bus("plain", "tcp://127.0.0.1:*", peers, heartbeat_interval=None).start()
        with pytest.raises(RequestTimeout):
            await plain.request("server", Echo("plaintext"), timeout=0.5)
        assert calls == ["trusted"]
        for bus in (plain, rogue, client, server):
            await bus.close()

    run(main())


@message("test.bus.order", senders=("boss",))
class Order(Message):
    text: str


def test_a_kind_is_accepted_only_from_its_roles_and_a_curve_key_cannot_claim_another_name(tmp_path: Any) -> None:
    # Once any holder of a run key (or, without CURVE, anyone) could send any kind under any name: a
    # spoofed BatchRequest stole a batch, a spoofed VersionUpdate made the buffer drop every group.
    async def main() -> None:
        keys = generate_run_keys(str(tmp_path), ["server", "boss", "worker"])
        roles = {"server": "server", "boss": "boss", "worker": "worker"}

        def handler(env: Any) -> Any:
            return Echo(env.msg.text.upper())

        server = await Bus("server", "tcp://127.0.0.1:*", handler=handler, roles=roles, heartbeat_interval=None,
                           curve=CurveConfig.from_keys_dir(keys, "server")).start()
        peers = {"server": server.endpoint}

        def client(name: str, key_of: str) -> Bus:
            own = CurveConfig.from_keys_dir(keys, key_of, ["server"])
            return Bus(name, "tcp://127.0.0.1:*", peers, heartbeat_interval=None, curve=own)

        boss, worker, impostor = [await client(n, k).start() for n, k in
                                  (("boss", "boss"), ("worker", "worker"), ("boss", "worker"))]
        assert (await boss.request("server", Order("go"), timeout=5)).text == "GO"
        assert (await worker.request("server", Echo("hi"), timeout=5)).text == "HI"   # no senders declared
        with pytest.raises(RemoteError, match=r"\[sender_not_allowed\] test.bus.order is sent by boss only; "
                                              r"'worker' is worker"):
            await worker.request("server", Order("go"), timeout=5)
        with pytest.raises(RemoteError, match=r"\[spoofed_sender\] the message says it is from 'boss', but its "
                                              r"CURVE key is worker's"):
            await impostor.request("server", Order("go"), timeout=5)
        assert server.rejected == {"sender_not_allowed": 1, "spoofed_sender": 1}
        for bus in (impostor, worker, boss, server):
            await bus.close()

    run(main())


def test_heartbeat_detects_dead_peer_and_its_return(tmp_path: Any) -> None:
    async def main() -> None:
        endpoint = f"ipc://{tmp_path}/hb"
        loop = asyncio.get_running_loop()
        dead: asyncio.Future = loop.create_future()
        alive_again: asyncio.Future = loop.create_future()

        def on_dead(name: str) -> None:
            if not dead.done():
                dead.set_result((name, loop.time()))

        def on_alive(name: str) -> None:
            if not alive_again.done():
                alive_again.set_result(name)

        # A second watcher with a longer timeout is the clock: the first must notice the death before it does
        # (its own timeout is what counts), a comparison side by side rather than a wall-clock bound, which a
        # loaded machine broke (0.4 s + slack).
        slow_dead: asyncio.Future = loop.create_future()
        peer = await Bus("peer", endpoint, handler=echo_handler, heartbeat_interval=None).start()
        watcher = await Bus("watcher", "tcp://127.0.0.1:*", {"peer": endpoint}, heartbeat_interval=0.05,
                            heartbeat_timeout=0.4, on_peer_dead=on_dead, on_peer_alive=on_alive).start()
        slow = await Bus("slow", "tcp://127.0.0.1:*", {"peer": endpoint}, heartbeat_interval=0.05,
                         heartbeat_timeout=3.0, on_peer_dead=lambda n: slow_dead.done() or slow_dead.set_result(n)).start()
        await watcher.request("peer", Echo("x"), timeout=30)
        await slow.request("peer", Echo("x"), timeout=30)
        await peer.close()
        name, _ = await asyncio.wait_for(dead, 60)
        assert name == "peer" and not watcher.peer_alive("peer")
        assert not slow_dead.done(), "the 3 s watcher noticed first: the 0.4 s timeout was not the one used"
        assert await asyncio.wait_for(slow_dead, 60) == "peer"
        peer = await Bus("peer", endpoint, handler=echo_handler, heartbeat_interval=None).start()
        assert await asyncio.wait_for(alive_again, 60) == "peer"
        assert watcher.stats["peer_dead"] == 1 and watcher.stats["peer_alive"] == 1
        for bus in (watcher, slow, peer):
            await bus.close()

    run(main())


def test_a_peer_never_heard_from_has_longer_to_come_up_than_one_that_went_silent(tmp_path: Any) -> None:
    # The run's processes start seconds apart: a rehearsal's reward actors, up 5-6 s after the others' buses,
    # were declared dead by every actor at every start. A peer not up yet is given first_contact_timeout; one
    # that was heard and went silent, the heartbeat timeout; one that never comes up is still declared dead.
    async def main() -> None:
        loop = asyncio.get_running_loop()
        dead: dict[str, asyncio.Future] = {"early": loop.create_future(), "never": loop.create_future()}
        log = ListLog()
        early_ep, never_ep = f"ipc://{tmp_path}/early", f"ipc://{tmp_path}/never"
        early = await Bus("early", early_ep, handler=echo_handler, heartbeat_interval=None).start()
        watcher = await Bus("watcher", "tcp://127.0.0.1:*", {"early": early_ep, "never": never_ep}, log=log,
                            heartbeat_interval=0.05, heartbeat_timeout=0.3, first_contact_timeout=3.0,
                            on_peer_dead=lambda n: dead[n].done() or dead[n].set_result(n)).start()
        await watcher.request("early", Echo("x"), timeout=30)
        await early.close()
        assert await asyncio.wait_for(dead["early"], 60) == "early"
        assert not dead["never"].done(), "the peer never heard from was judged by the heartbeat timeout"
        assert await asyncio.wait_for(dead["never"], 60) == "never"
        lines = {kw["peer"]: kw for _, e, kw in log.events if e == "peer_dead"}
        assert lines["never"].get("never_heard") is True and "never_heard" not in lines["early"]
        await watcher.close()
        with pytest.raises(ValueError, match="first_contact_timeout"):
            Bus("w", "tcp://127.0.0.1:*", heartbeat_interval=0.05, heartbeat_timeout=0.3, first_contact_timeout=0.1)

    run(main())


def test_coalesced_sends_keep_order_and_each_message_is_handled_alone(tmp_path: Any) -> None:
    from transport.msglog import MessageLogWriter, read_log

    async def main() -> None:
        got: list[Any] = []
        done = asyncio.Event()

        def handler(env: Any) -> Any:
            if env.wants_reply:
                return echo_handler(env)
            got.append(env.msg.n if isinstance(env.msg, Count) else ("t", env.msg.n))
            if len(got) == 1010:
                done.set()
            return None

        recorder = MessageLogWriter(str(tmp_path / "server.msglog"))
        server = await Bus("server", "tcp://127.0.0.1:*", handler=handler, recorder=recorder,
                           heartbeat_interval=None).start()
        client = await Bus("client", "tcp://127.0.0.1:*", {"server": server.endpoint},
                           heartbeat_interval=None).start()
        expected: list[Any] = []
        for i in range(1000):     # no yield between sends: they coalesce, tensors go alone, order is kept
            await client.send("server", Count(i))
            expected.append(i)
            if i % 100 == 99:
                await client.send("server", Echo("t", i, torch.full((4,), float(i))))
                expected.append(("t", i))
        await asyncio.wait_for(done.wait(), 10)
        assert got == expected
        assert client.stats["sent"] == 1010 and server.stats["received"] == 1010
        assert client.stats["batches"] >= 10 and server.stats["batches_received"] == client.stats["batches"]
        # requests coalesce too; each gets its own reply
        replies = await asyncio.gather(*(client.request("server", Echo(f"r{i}", i), timeout=5) for i in range(50)))
        assert [r.n for r in replies] == list(range(1, 51))
        await client.close()
        await server.close()
        recorder.close()
        # the message log holds one record per message, each decodable alone, as without coalescing
        records, torn = read_log(str(tmp_path / "server.msglog"))
        inbound = [decode(r.frames)[1] for r in records if r.kind == "in"]
        assert torn is None and len(inbound) == 1060
        assert [m.n for m in inbound[:1010] if isinstance(m, Count)] == list(range(1000))

    run(main())


def test_bad_messages_inside_a_batch_are_counted_and_answered_one_by_one() -> None:
    from transport.messages import encode_batch

    async def main() -> None:
        log = ListLog()
        handled: list[Any] = []

        def handler(env: Any) -> Any:
            handled.append(env.msg)
            return echo_handler(env)

        server = await Bus("server", "tcp://127.0.0.1:*", handler=handler, log=log, heartbeat_interval=None).start()
        ctx = zmq.asyncio.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.connect(server.endpoint)

        def head(tag: str, body: Any, mid: str, wants_reply: bool = True) -> bytes:
            return msgpack.packb([tag, SCHEMA_VERSION, "evil", mid, 1.0, None, wants_reply, body])

        items = [head("test.bus.echo", {"text": "ok", "n": 1}, "m1"),
                 head("test.bus.echo", {"text": 5}, "m2"),
                 head("test.bus.count", {"n": 9}, "m3", wants_reply=False),
                 head("no.such.kind", {}, "m4"),
                 b"\xc1not msgpack"]
        await raw.send(encode_batch(items, "evil"))
        answers = {}
        for _ in range(3):
            header, msg = decode(await asyncio.wait_for(raw.recv_multipart(), 5))
            answers[header.reply_to] = msg
        assert answers["m1"] == Echo("OK", 2)
        assert isinstance(answers["m2"], Error) and answers["m2"].code == "bad_field"
        assert "field 'text': expected str, got int" in answers["m2"].text
        assert isinstance(answers["m4"], Error) and answers["m4"].code == "unknown_kind"
        await until(lambda: server.rejected["malformed"] == 1)
        assert handled == [Echo("ok", 1), Count(9)]
        assert server.rejected["bad_field"] == 1 and server.rejected["unknown_kind"] == 1
        # a broken container is rejected as a whole (no readable request inside it to answer)
        await raw.send(msgpack.packb(["$batch", SCHEMA_VERSION, "evil", "", 1.0, None, False, [b"x", 5]]))
        await until(lambda: server.rejected["malformed"] == 2)
        assert any("element 1 is int" in kw.get("error", "") for _, _, kw in log.events)
        assert (await asyncio.wait_for(_raw_request(raw, "m5"), 5)).text == "FINE"
        raw.close(0)
        ctx.term()
        await server.close()

    async def _raw_request(raw: Any, mid: str) -> Any:
        await raw.send(encode(Echo("fine"), "evil", msg_id=mid, wants_reply=True)[0])
        return decode(await raw.recv_multipart())[1]

    run(main())


def test_pending_batch_is_flushed_on_close() -> None:
    async def main() -> None:
        got: list[int] = []
        done = asyncio.Event()

        def handler(env: Any) -> None:
            got.append(env.msg.n)
            if len(got) == 10:
                done.set()

        server = await Bus("server", "tcp://127.0.0.1:*", handler=handler, heartbeat_interval=None).start()
        client = await Bus("client", "tcp://127.0.0.1:*", {"server": server.endpoint},
                           heartbeat_interval=None).start()
        for i in range(10):
            await client.send("server", Count(i))
        await client.close(linger=2.0)      # no tick has passed: the batch is still pending here
        await asyncio.wait_for(done.wait(), 5)
        assert got == list(range(10))
        await server.close()

    run(main())


def test_a_bus_dropped_without_close_does_not_hang_its_process() -> None:
    # An actor or test that fails with a bus open, its sender blocked on a full queue: garbage collection
    # clears the context's references to its sockets, and a term() that waited for them would wait forever.
    code = textwrap.dedent("""
        import asyncio, gc, uvloop
        from transport.bus import Bus
        from transport.messages import Message, message

        @message("test.bus.dropped_count")
        class Count(Message):
            n: int

        async def main():
            async def stuck(env):
                await asyncio.Event().wait()
            server = await Bus("server", "tcp://127.0.0.1:*", handler=stuck, hwm=5, max_inflight=1,
                               heartbeat_interval=None).start()
            client = await Bus("client", "tcp://127.0.0.1:*", {"server": server.endpoint}, hwm=5,
                               heartbeat_interval=None).start()
            for i in range(100_000):
                await asyncio.wait_for(client.send("server", Count(i)), 0.5)

        try:
            uvloop.run(main())
        except TimeoutError:
            print("sender blocked")
        gc.collect()
        print("collected")
    """)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sender", "blocked", "collected"]


@pytest.mark.parametrize("hwm", [5, 64])
def test_backpressure_sender_waits_and_nothing_is_dropped(hwm: int) -> None:
    # hwm 5: one ZeroMQ message per bus message (coalescing off); hwm 64: containers of up to 4 messages
    async def main() -> None:
        release = asyncio.Event()
        got: list[int] = []

        async def slow(env: Any) -> None:
            await release.wait()
            got.append(env.msg.n)

        server = await Bus("server", "tcp://127.0.0.1:*", handler=slow, hwm=hwm, max_inflight=1,
                           heartbeat_interval=None).start()
        client = await Bus("client", "tcp://127.0.0.1:*", {"server": server.endpoint}, hwm=hwm,
                           heartbeat_interval=None).start()
        assert client.coalesce == (hwm >= 32)
        sent = 0

        async def produce() -> None:
            nonlocal sent
            # until the queues (ZeroMQ's and the kernel's) are full and the sender has to wait
            while client.stats["send_waits"] < 50 and sent < 400_000:
                await client.send("server", Count(sent))
                sent += 1

        producer = asyncio.create_task(produce())
        await until(lambda: client.stats["send_waits"] >= 1, timeout=30)
        # The sender had to wait while the handler had taken nothing: held back, not dropping. (Whether
        # the producer is still waiting at this instant is a race: the queues drain into the kernel's
        # buffers in bursts, so it may already have passed its 50 waits.)
        assert len(got) == 0
        release.set()
        await asyncio.wait_for(producer, 30)
        await until(lambda: len(got) == sent, timeout=30)
        assert got == list(range(sent)) and (client.stats["batches"] >= 1) == client.coalesce
        assert server.stats["received"] == sent and not server.rejected
        await client.close()
        await server.close()

    run(main(), timeout=90)


def test_sends_between_polls_never_strand_arrived_messages(tmp_path: Any) -> None:
    # ZeroMQ's notification fd is edge-triggered and a send can consume its edge: before the bus re-armed
    # its asyncio sockets after each send on their plain shadows, replies sent from handler tasks and
    # pings let a message that had arrived sit unread until some other message came, in this exchange
    # within 0 to 42 rounds (a rollout stopped answering pings for good). Seeded; bounded rounds.
    import random

    rng = random.Random(7)

    async def main() -> None:
        received = 0

        async def answer_later(env: Any) -> Echo:
            await asyncio.sleep(rng.random() * 0.002)
            return Echo("x")

        def handler(env: Any) -> Any:
            nonlocal received
            if isinstance(env.msg, Count):
                received += 1
                return None
            return answer_later(env)

        server = await Bus("server", f"ipc://{tmp_path}/server", handler=handler, heartbeat_interval=None).start()
        clients = [await Bus(f"client{i}", f"ipc://{tmp_path}/client{i}", {"server": server.endpoint},
                             heartbeat_interval=None).start() for i in range(3)]
        sent = 0
        try:
            for _ in range(400):
                replies = [asyncio.ensure_future(c.request("server", Echo("q"), timeout=5.0))
                           for c in clients for _ in range(3)]
                for _ in range(rng.randint(1, 3)):
                    await asyncio.sleep(rng.random() * 0.002)
                    await rng.choice(clients).send("server", Count(1))
                    sent += 1
                assert all(isinstance(r, Echo) for r in await asyncio.gather(*replies))
                await until(lambda: received == sent, timeout=5.0, what="every one-way message handled")
        finally:
            for c in clients:
                await c.close()
            await server.close()

    run(main(), timeout=120)


def test_an_actor_with_every_handler_busy_stays_alive_to_its_peers(tmp_path: Any) -> None:
    # With max_inflight handlers running the bus stops reading, so it answers no pings; its own pings still
    # reach its peers, which must not declare it dead (they did: a rollout whose generate handlers all
    # waited on a paused engine was taken out of the weights group).
    async def main() -> None:
        release = asyncio.Event()
        started = asyncio.Event()

        async def hold(env: Any) -> Echo:
            started.set()
            await release.wait()
            return Echo("done")

        def handler(env: Any) -> Any:
            return hold(env) if isinstance(env.msg, Echo) else None

        busy_ep, watcher_ep = f"ipc://{tmp_path}/busy", f"ipc://{tmp_path}/watcher"
        busy = await Bus("busy", busy_ep, {"watcher": watcher_ep}, handler=handler, max_inflight=1,
                         heartbeat_interval=0.1, heartbeat_timeout=1.0).start()
        watcher = await Bus("watcher", watcher_ep, {"busy": busy_ep}, heartbeat_interval=0.1,
                            heartbeat_timeout=1.0).start()
        first = asyncio.ensure_future(watcher.request("busy", Echo("a"), timeout=30))
        await asyncio.wait_for(started.wait(), 5)
        queued = asyncio.ensure_future(watcher.request("busy", Echo("b"), timeout=30))
        await until(lambda: busy.stats["received"] == 2)        # read; the loop now waits for a slot
        pongs = busy.stats["replies"]
        await asyncio.sleep(2.5)   # observing an absence: 2.5 heartbeat timeouts with busy unreading
        assert busy.stats["replies"] == pongs                   # it really answered no ping meanwhile
        assert watcher.stats["peer_dead"] == 0 and watcher.peer_alive("busy")
        release.set()
        assert await first == Echo("done") and await queued == Echo("done")
        await watcher.close()
        await busy.close()

    run(main())


@message("test.bus.said")
class Said(Message):
    n: int


# A peer in a process of its own: it says Said(n) the moment its bus is up, then only answers and pings.
PEER_PROCESS = textwrap.dedent("""
    import asyncio, sys, uvloop
    from transport.bus import Bus
    from transport.messages import Message, message

    @message("test.bus.said")
    class Said(Message):
        n: int

    async def main():
        bus = await Bus("peer", sys.argv[1], {"watcher": sys.argv[2]}, heartbeat_interval=0.05).start()
        await bus.send("watcher", Said(int(sys.argv[3])))
        await asyncio.Event().wait()

    uvloop.run(main())
""")


def test_a_restarted_peer_is_told_once_before_its_first_message_and_a_paused_one_never(tmp_path: Any) -> None:
    # A worker's supervisor restarted it and the new process never became ready: its pings made the old one's
    # death go unnoticed (the buffer kept its groups until their timeout). A paused process that resumes is the
    # same process: nothing it held is lost.
    async def main() -> None:
        loop = asyncio.get_running_loop()
        seen: list[tuple[str, Any]] = []        # what the watcher learnt, in order
        dead, alive = loop.create_future(), loop.create_future()

        def handler(env: Any) -> None:
            seen.append(("said", env.msg.n))

        peer_ep, watcher_ep = f"ipc://{tmp_path}/peer", f"ipc://{tmp_path}/watcher"
        log = ListLog()
        watcher = await Bus("watcher", watcher_ep, {"peer": peer_ep}, handler=handler, heartbeat_interval=0.05,
                            heartbeat_timeout=0.5, log=log,
                            on_peer_dead=lambda n: dead.done() or dead.set_result(n),
                            on_peer_alive=lambda n: alive.done() or alive.set_result(n),
                            on_peer_restarted=lambda n: seen.append(("restarted", n))).start()
        pings: list[str] = []                   # the incarnations the watcher's pings from "peer" carried
        note = watcher.liveness.incarnation
        watcher.liveness.incarnation = lambda p, inc: (pings.append(inc), note(p, inc))[1]   # type: ignore[method-assign]

        def start_peer(n: int) -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-W", "ignore", "-c", PEER_PROCESS, peer_ep, watcher_ep, str(n)],
                                    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

        first = start_peer(1)
        try:
            await poll_until(lambda: ("said", 1) in seen, timeout=60, what="the first process's message")
            assert seen == [("said", 1)]                        # the first incarnation seen is no restart
            # paused past the heartbeat timeout, then resumed: dead, alive again, the same process
            first.send_signal(signal.SIGSTOP)
            assert await asyncio.wait_for(dead, 60) == "peer"
            first.send_signal(signal.SIGCONT)
            assert await asyncio.wait_for(alive, 60) == "peer"
            resumed_at = len(pings)
            await poll_until(lambda: len(pings) > resumed_at, timeout=60, what="a ping of the resumed process")
            assert seen == [("said", 1)] and watcher.stats["peer_restarted"] == 0 and len(set(pings)) == 1
            # killed and started again: told once, before the new process's first message is handled
            first.kill()
            first.wait(timeout=60)
            second = start_peer(2)
            try:
                await poll_until(lambda: ("said", 2) in seen, timeout=60, what="the second process's message")
                n_pings = len(pings)
                await poll_until(lambda: len(pings) > n_pings + 2, timeout=60, what="more pings of the new process")
                assert seen == [("said", 1), ("restarted", "peer"), ("said", 2)], seen
                assert watcher.stats["peer_restarted"] == 1 and len(set(pings)) == 2
                assert [e for _, e, kw in log.events if e == "peer_restarted"] == ["peer_restarted"]
            finally:
                second.kill()
                second.wait(timeout=60)
        finally:
            first.kill()
            first.wait(timeout=60)
        await watcher.close()

    run(main(), timeout=240)


def test_a_watcher_whose_own_loop_was_blocked_declares_no_live_peer_dead(tmp_path: Any) -> None:
    # A watcher whose own loop is blocked (a long call on it, a process given no core: a rehearsal's trainer loop
    # ran 1.9 s late) cannot read what its peers send meanwhile; that silence is its own, and no peer is declared
    # dead for it. A peer that really died is still declared dead.
    import time

    async def main() -> None:
        loop = asyncio.get_running_loop()
        seen: list[Any] = []
        dead: asyncio.Future = loop.create_future()
        peer_ep, watcher_ep = f"ipc://{tmp_path}/peer", f"ipc://{tmp_path}/watcher"
        log = ListLog()
        watcher = await Bus("watcher", watcher_ep, {"peer": peer_ep}, handler=lambda env: seen.append(env.msg.n),
                            heartbeat_interval=0.05, heartbeat_timeout=0.5, log=log,
                            on_peer_dead=lambda n: dead.done() or dead.set_result(n)).start()
        peer = subprocess.Popen([sys.executable, "-W", "ignore", "-c", PEER_PROCESS, peer_ep, watcher_ep, "1"],
                                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        try:
            await poll_until(lambda: seen == [1] and watcher.peer_alive("peer"), timeout=60, what="the peer's message")
            time.sleep(1.5)     # the watcher's loop blocked: three heartbeat timeouts
            unblocked = time.monotonic()
            await poll_until(lambda: watcher.stats["heartbeat_stalled"] == 1, timeout=60, what="the stalled tick")
            await poll_until(lambda: watcher.liveness.peers["peer"].last_seen > unblocked, timeout=60,
                             what="the peer's pings read after the stall")
            assert not dead.done() and watcher.peer_alive("peer") and watcher.stats["peer_dead"] == 0
            assert [e for _, e, _ in log.events if e == "heartbeat_stalled"] == ["heartbeat_stalled"]
            peer.kill()
            peer.wait(timeout=60)
            assert await asyncio.wait_for(dead, 60) == "peer"
        finally:
            peer.kill()
            peer.wait(timeout=60)
        await watcher.close()

    run(main(), timeout=240)


def test_an_actor_cannot_announce_another_ones_restart(tmp_path: Any) -> None:
    # With tokens (or CURVE) and roles, a ping passes the sender check every message passes: an actor whose
    # pings claim another's name is refused, and the other's incarnation stays what its own pings say.
    async def main() -> None:
        tokens_dir = generate_run_tokens(str(tmp_path), ["watcher", "peer", "worker"])
        roles = {"watcher": "watcher", "peer": "peer", "worker": "worker"}

        def tokens(name: str) -> TokenConfig:
            return TokenConfig.from_spec({"tokens_dir": tokens_dir}, name)

        restarted: list[str] = []
        peer_ep, watcher_ep = f"ipc://{tmp_path}/peer", f"ipc://{tmp_path}/watcher"
        watcher = await Bus("watcher", watcher_ep, {"peer": peer_ep}, handler=echo_handler, roles=roles,
                            tokens=tokens("watcher"), heartbeat_interval=0.05, heartbeat_timeout=5.0,
                            on_peer_restarted=restarted.append).start()
        peer = await Bus("peer", peer_ep, {"watcher": watcher_ep}, handler=echo_handler, roles=roles,
                         tokens=tokens("peer"), heartbeat_interval=0.05).start()
        await until(lambda: watcher.liveness.peers["peer"].incarnation == peer.incarnation)
        # the worker's token, the peer's name: its pings say the peer is a new process
        impostor = await Bus("peer", "tcp://127.0.0.1:*", {"watcher": watcher_ep}, tokens=tokens("worker"),
                             heartbeat_interval=0.05).start()
        await until(lambda: watcher.rejected["spoofed_sender"] >= 3)
        assert restarted == [] and watcher.stats["peer_restarted"] == 0
        assert watcher.liveness.peers["peer"].incarnation == peer.incarnation != impostor.incarnation
        for bus in (impostor, peer, watcher):
            await bus.close()

    run(main())


def test_a_peer_re_pointed_to_a_new_process_is_a_restart_and_one_re_pointed_before_any_ping_is_not(
        tmp_path: Any) -> None:
    async def main() -> None:
        restarted: list[str] = []
        watcher_ep = f"ipc://{tmp_path}/watcher"
        watcher = await Bus("watcher", watcher_ep, {"peer": f"ipc://{tmp_path}/a"}, heartbeat_interval=0.05,
                            heartbeat_timeout=5.0, on_peer_restarted=restarted.append).start()
        a = await Bus("peer", f"ipc://{tmp_path}/a", {"watcher": watcher_ep}, heartbeat_interval=0.05).start()
        await until(lambda: watcher.liveness.peers["peer"].incarnation == a.incarnation)
        await a.close()
        watcher.add_peer("peer", f"ipc://{tmp_path}/b")
        b = await Bus("peer", f"ipc://{tmp_path}/b", {"watcher": watcher_ep}, heartbeat_interval=0.05).start()
        await until(lambda: restarted == ["peer"])
        assert watcher.liveness.peers["peer"].incarnation == b.incarnation and watcher.stats["peer_restarted"] == 1
        watcher.add_peer("other", f"ipc://{tmp_path}/c")          # a name never heard from: nothing to compare
        c = await Bus("other", f"ipc://{tmp_path}/c", {"watcher": watcher_ep}, heartbeat_interval=0.05).start()
        await until(lambda: watcher.liveness.peers["other"].incarnation == c.incarnation)
        assert restarted == ["peer"]
        for bus in (c, b, watcher):
            await bus.close()

    run(main())
