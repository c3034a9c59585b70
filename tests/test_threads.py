"""actors/runtime/threads.py: the one way blocking work that may wait on another process leaves the event loop."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
import structlog

from actors.runtime.threads import DaemonThreads, costed, in_thread, on_daemon_thread, run_blocking_on
from transport.bulk import LinkConfig
from transport.protocol import WeightsStored


def test_on_daemon_thread_runs_in_the_callers_context_and_reports_errors() -> None:
    import contextvars

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    var.set("caller")
    seen = on_daemon_thread("t", lambda: (threading.current_thread().daemon, threading.current_thread().name,
                                          var.get()))
    assert seen.result(timeout=10) == (True, "t", "caller")
    failed = on_daemon_thread("t", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failed.result(timeout=10)


def test_an_abandoned_in_thread_call_runs_to_its_end_without_an_error() -> None:
    """Cancelling the coroutine that awaits a transfer abandons it: the thread goes on (a collective cannot
    be stopped) and its late result is dropped quietly."""
    release = threading.Event()
    finished: list[int] = []

    def transfer() -> int:
        release.wait(10)
        finished.append(1)
        return 1

    async def main() -> None:
        fut = in_thread(transfer)
        await asyncio.sleep(0)
        fut.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fut
        ended = on_daemon_thread("watch", lambda: (release.set(), [t.join(10) for t in threading.enumerate()
                                                                  if t.name == "blocking-transfer"]))
        await asyncio.wrap_future(ended)

    errors: list[Any] = []
    old = threading.excepthook
    threading.excepthook = errors.append
    try:
        asyncio.run(main())
    finally:
        threading.excepthook = old
    assert finished == [1] and errors == []


def test_a_loops_owner_picks_where_its_in_thread_calls_run() -> None:
    class Counting(DaemonThreads):
        calls = 0

        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            Counting.calls += 1
            return super().submit(fn, *args, **kwargs)

    async def main() -> tuple[bool, int]:
        loop = asyncio.get_running_loop()
        run_blocking_on(loop, Counting())
        try:
            daemon = await in_thread(lambda: threading.current_thread().daemon)
        finally:
            run_blocking_on(loop, None)
        await in_thread(lambda: None)   # back on the default: not counted
        return daemon, Counting.calls

    assert asyncio.run(main()) == (True, 1)


def test_the_relay_sends_its_buckets_on_a_daemon_thread() -> None:
    """A collective on asyncio's default executor would hold a stopping trainer at interpreter exit until the
    link timeout: the relay's buckets go out on a daemon thread of their own."""
    from actors.weight_sync import RelaySender

    threads: list[tuple[str, bool]] = []

    class Link:
        config = LinkConfig(name="train_to_ps", master_addr="127.0.0.1", master_port=1, rank=0, backend="gloo", world_size=2,
                            members=["trainer.0", "param_server"])
        epoch = 0

        def send_packed(self, packed: Any, dst: int) -> None:
            threads.append((threading.current_thread().name, threading.current_thread().daemon))

    class Bus:
        async def request(self, peer: str, msg: Any, timeout: float | None = None) -> WeightsStored:
            return WeightsStored(version=msg.version, receive_seconds=0.0)

    sender = RelaySender(Link(), Bus(), "param_server", "inc", Counter(), structlog.get_logger())
    asyncio.run(sender.publish(1, [SimpleNamespace(), SimpleNamespace()], []))
    assert [daemon for _, daemon in threads] == [True, True]


def _spin(n: int) -> int:
    x = 0
    for i in range(n):
        x += i * i
    return x


def test_costed_tells_cpu_work_from_waiting_and_counts_the_wait_for_a_core() -> None:
    # A blocked call costs next to no CPU; CPU work costs its CPU; work that shares its one core with a busy
    # process waits for the core (the buffer's serve logs both, and tools.rehearse reads the machine's stretch there).
    result, blocked = costed(threading.Event().wait, 0.05)
    assert result is False and blocked.cpu_s < 0.05
    _, worked = costed(_spin, 2_000_000)
    assert worked.cpu_s > blocked.cpu_s
    if worked.core_wait_s is None:
        pytest.skip("this kernel gives no per-thread scheduler statistics")
    core = sorted(os.sched_getaffinity(0))[0]
    hog = subprocess.Popen([sys.executable, "-c", "print('spinning', flush=True)\nwhile True: pass"],
                           stdout=subprocess.PIPE, preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    mine = os.sched_getaffinity(0)
    try:
        assert hog.stdout is not None and hog.stdout.readline() == b"spinning\n"
        os.sched_setaffinity(0, {core})   # this thread only (Linux): it and the hog take turns on one core
        _, shared = costed(_spin, 4_000_000)
    finally:
        os.sched_setaffinity(0, mine)
        hog.kill()
        hog.wait(timeout=30)
    assert shared.core_wait_s is not None and shared.core_wait_s > 0
