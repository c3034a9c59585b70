"""Blocking work off the event loop: the one way an actor runs a call that may block on another process (a
bulk-link collective, a rank group's command, a weights group being joined).

Every such call runs on a daemon thread of its own (:func:`on_daemon_thread`), never on asyncio's default
executor (``asyncio.to_thread``): a collective blocked on a dead peer can be neither cancelled nor joined, and
the default executor is joined at interpreter exit, which would hold a stopping actor until the link timeout.
From a coroutine, :func:`in_thread` awaits the same; from a thread, the concurrent future of
:func:`on_daemon_thread` is waited on. ``asyncio.to_thread`` stays for local work that must finish (loading a
model, hashing, writing a checkpoint).

The owner of an event loop may run that loop's :func:`in_thread` calls on an executor of its own
(:func:`run_blocking_on`): tools.replay counts them there, to let them finish before it delivers the next
recorded message.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["DaemonThreads", "ThreadCost", "costed", "in_thread", "on_daemon_thread", "run_blocking_on"]

T = TypeVar("T")


def on_daemon_thread(name: str, fn: Callable[..., T], *args: Any) -> "concurrent.futures.Future[T]":
    """``fn(*args)`` on a daemon thread called ``name``, in the caller's context (what a link moves is logged as
    caused by the caller's message), and its outcome. Nothing may wait for the thread itself."""
    outcome: concurrent.futures.Future[T] = concurrent.futures.Future()
    outcome.set_running_or_notify_cancel()   # running from here on: it cannot be cancelled, only abandoned

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to whoever waits on the outcome, never swallowed
            outcome.set_exception(exc)
        else:
            outcome.set_result(result)

    threading.Thread(target=contextvars.copy_context().run, args=(run,), name=name, daemon=True).start()
    return outcome


class DaemonThreads(concurrent.futures.Executor):
    """An executor that runs each call on a daemon thread of its own (:func:`on_daemon_thread`) and joins
    none of them when it shuts down."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> "concurrent.futures.Future[T]":
        call = (lambda *a: fn(*a, **kwargs)) if kwargs else fn
        return on_daemon_thread(f"blocking-{getattr(fn, '__name__', 'call')}", call, *args)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing to join: a thread blocked in a collective ends with its link or with the process."""


_DAEMON_THREADS = DaemonThreads()
_EXECUTORS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, DaemonThreads]" = weakref.WeakKeyDictionary()


def run_blocking_on(loop: asyncio.AbstractEventLoop, executor: DaemonThreads | None) -> None:
    """Run ``loop``'s :func:`in_thread` calls on ``executor`` (None: a daemon thread each, the default)."""
    if executor is None:
        _EXECUTORS.pop(loop, None)
    else:
        _EXECUTORS[loop] = executor


def in_thread(fn: Callable[..., T], *args: Any) -> "asyncio.Future[T]":
    """Await ``fn(*args)`` run on a daemon thread (the running loop's executor, :func:`run_blocking_on`)."""
    loop = asyncio.get_running_loop()
    return loop.run_in_executor(_EXECUTORS.get(loop, _DAEMON_THREADS), fn, *args)


@dataclasses.dataclass(frozen=True)
class ThreadCost:
    """What a call cost the thread that ran it: its CPU seconds, and the seconds it was ready to run but waited
    for a core (None where the kernel does not say). The two tell a call slowed by a busy machine (the wait grows)
    from one that is slow itself (the CPU grows) or blocked on I/O (neither grows)."""

    cpu_s: float
    core_wait_s: float | None


def _core_wait_s() -> float | None:
    # Linux's per-thread scheduler statistics: nanoseconds on a core, waiting on a run queue, timeslices.
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def costed(fn: Callable[..., T], *args: Any) -> tuple[T, ThreadCost]:
    """``fn(*args)`` and what it cost this thread (:class:`ThreadCost`)."""
    cpu0, wait0 = time.thread_time(), _core_wait_s()
    result = fn(*args)
    wait1 = _core_wait_s()
    return result, ThreadCost(time.thread_time() - cpu0,
                              None if wait0 is None or wait1 is None else wait1 - wait0)
