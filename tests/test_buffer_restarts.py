"""The buffer actor and a rollout process that is killed and restarted, its new process never ready (its SGLang
server never gets healthy, say): the new process pings the buffer but never says hello. The old process's groups
must be issued again at once, not after the group timeout (tens of minutes to hours at 32k-token answers).
The buffer runs here with its real bus; the rollout is a process of its own, killed with SIGKILL."""
from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path

from actors.buffer.actor import BufferActor
from actors.runtime.base import ready_path
from testsupport.bounded import run_bounded, until
from testsupport.local_actors import actor_spec, ipc_endpoints
from transport.bus import Bus
from transport.protocol import GenerateGroup, WorkerHello

ROOT = Path(__file__).resolve().parents[1]

# A rollout process as the buffer sees it: its bus, its hello (or none), and every group it is given, printed.
# Its stdout carries only those lines: the bus's own log (a reply to a buffer already gone, say) goes to stderr.
ROLLOUT = textwrap.dedent("""
    import asyncio, sys, structlog, uvloop
    from transport.bus import Bus
    from transport.protocol import GenerateGroup, WorkerHello

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))

    async def main():
        name, endpoint, buffer, hello = sys.argv[1:5]

        def handler(env):
            if isinstance(env.msg, GenerateGroup):
                print(env.msg.group_id, flush=True)

        bus = await Bus(name, endpoint, {"buffer": buffer}, handler=handler, heartbeat_interval=0.05).start()
        if hello == "hello":
            await bus.send("buffer", WorkerHello(role="rollout"))
        print("up", flush=True)
        await asyncio.Event().wait()

    uvloop.run(main())
""")


def test_a_killed_rollout_whose_new_process_never_says_hello_has_its_groups_issued_again_at_once(
        tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"query_id": f"q{i}", "prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n" for i in range(8)))
    names = ["buffer", "rollout.0", "rollout.1", "reward.0"]
    endpoints = ipc_endpoints(tmp_path / "sockets", names)
    settings = {"model": {"path": str(ROOT / "configs" / "models" / "arith-tiny")}, "data": {"train": str(data)},
                "algo": {"batch_size": 2, "group_size": 2, "eta": 1}, "run": {"recover": "off"},
                # neither the group timeout nor the silence limit may be what hands the groups back
                "buffer": {"group_timeout_s": 3600.0, "worker_lost_after_s": 3600.0},
                "bus": {"heartbeat_interval": 0.05, "heartbeat_timeout": 5.0}, "log_console": False,
                "groups": {"buffer": ["buffer"], "rollout": ["rollout.0", "rollout.1"], "reward": ["reward.0"]}}
    run_dir = tmp_path / "run"
    held: list[str] = []           # the groups the killed process had

    async def rollout_process(hello: bool) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-W", "ignore", "-c", ROLLOUT, "rollout.1", endpoints["rollout.1"], endpoints["buffer"],
            "hello" if hello else "silent", cwd=ROOT, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL)
        assert await asyncio.wait_for(proc.stdout.readline(), 60) == b"up\n"
        return proc

    async def main() -> None:
        buffer = BufferActor(actor_spec("buffer", "actors.buffer:BufferActor", endpoints, settings, run_dir))
        task = asyncio.create_task(buffer.run())
        await until(lambda: ready_path(run_dir, "buffer").exists() or task.done(), timeout=60, what="the buffer's start")
        assert not task.done(), (run_dir / "logs" / "buffer.jsonl").read_text()[-3000:]
        reward = await Bus("reward.0", endpoints["reward.0"], {"buffer": endpoints["buffer"]},
                           heartbeat_interval=0.05).start()
        await reward.send("buffer", WorkerHello(role="reward"))
        old = await rollout_process(hello=True)
        new = None
        try:
            # the gate admits (version 0 + eta 1 + 1) x batch 2 = 4 groups, all to the only rollout greeted
            held.extend([(await asyncio.wait_for(old.stdout.readline(), 60)).decode().strip() for _ in range(4)])
            old.kill()
            await asyncio.wait_for(old.wait(), 60)
            new = await rollout_process(hello=False)
            await until(lambda: buffer.state.rollout_load["rollout.1"] == 0, timeout=60,
                        what="the old process's groups handed back")
            assert "rollout.1" not in buffer.state.greeted and len(buffer.state.reissue) == 4
            # a rollout that is ready takes them, issued again as they were (same prompts, new attempts)
            given: list[str] = []
            took_all = asyncio.Event()

            def rollout_0(env) -> None:
                if isinstance(env.msg, GenerateGroup):
                    given.append(env.msg.group_id)
                    if len(given) == 4:
                        took_all.set()

            other = await Bus("rollout.0", endpoints["rollout.0"], {"buffer": endpoints["buffer"]}, handler=rollout_0,
                              heartbeat_interval=0.05).start()
            await other.send("buffer", WorkerHello(role="rollout"))
            await asyncio.wait_for(took_all.wait(), 60)
            assert sorted(g.rsplit("-", 1)[0] for g in given) == sorted(g.rsplit("-", 1)[0] for g in held)
            assert not set(given) & set(held)
            buffer.request_stop("test over")
            assert await asyncio.wait_for(task, 60) == 0
            new.kill()
            assert await asyncio.wait_for(new.stdout.read(), 60) == b""     # the new process was given nothing
            await other.close(linger=0)
        finally:
            for proc in (old, new):
                if proc is not None and proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            await reward.close(linger=0)

    run_bounded(main(), timeout=240)
    records = [json.loads(line) for line in (run_dir / "logs" / "buffer.jsonl").read_text().splitlines()]
    reissued = [r for r in records if r.get("event") == "group_reissued"]
    assert sorted(r["group"] for r in reissued) == sorted(held)
    assert {r["reason"] for r in reissued} == {"rollout.1 restarted"}
    assert [r["groups_reissued"] for r in records if r.get("event") == "worker_restarted"] == [4]
    assert not [r for r in records if r.get("event") == "group_overdue"]
