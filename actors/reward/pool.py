"""A pool of worker processes with a hard per-item timeout, for reward checks.

Reward checks (sympy equivalence, sandboxed program runs) are CPU-bound and can hang or crash on
hostile input. They must never run on an actor's event loop, and one bad item must not stall or
kill the reward service. `RewardPool` runs any importable function in long-lived worker
processes and enforces, per item:

- a wall-clock deadline: a worker still busy at the deadline is SIGKILLed (a thread cannot be
  stopped, and `signal.alarm` only works in a main thread, so processes are the only reliable
  way to bound sympy), a fresh worker replaces it, and the item is retried once;
- crash handling: a worker that dies mid-item (segfault, `os._exit`, OOM kill) is replaced
  and its item retried once;
- after the retry an item that still times out or crashes is reported as a `TaskFailure`,
  counted, never lost. An exception raised by the function is deterministic, so it is
  reported at once as a `TaskFailure(kind="error")` without retry.

Both APIs share one dispatcher thread:
- `await pool.run(fn, *args, timeout=...)` for asyncio actors (the loop only awaits a future);
- `pool.map(fn, [args, ...], timeout=...)` for tools, results in input order.

Speed: workers are started once and reused; with the default `forkserver` context the modules
named in `preload` (e.g. sympy via the math grader) are imported once in the fork server, so
every worker, including replacements after a kill, starts already warm. A function is sent as
its import path (a short string) and resolved once per worker; only the item's own arguments
are pickled per item.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import importlib
import itertools
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterable, Sequence

__all__ = ["PoolClosedError", "PoolCounters", "RewardPool", "TaskFailure", "resolve_function"]

FunctionRef = "str | Callable[..., Any]"

# How long a new worker may take to report ready before it counts as a failed start.
_WORKER_START_TIMEOUT_S = 120.0
# Extra time for a worker's first call of a function, which may import its module (sympy takes
# about a second); the item's own clock restarts once the import is done.
_IMPORT_GRACE_S = 60.0
# Workers that die before ever becoming ready, in a row: the pool gives up instead of respawning
# forever (a broken preload module, or a main script without the `if __name__ == "__main__"` guard).
_MAX_START_FAILURES = 3


class PoolClosedError(RuntimeError):
    """Raised when work is submitted to a pool that has been closed."""


@dataclasses.dataclass(frozen=True)
class TaskFailure:
    """Why an item produced no result.

    kind: "timeout" (still running at the deadline on every attempt), "crash" (the worker died),
    "error" (the function raised; `detail` holds the exception and traceback), "closed"
    (the pool shut down first) or "start_failed" (workers could not even start). attempts: how many times the item was started.
    """

    kind: str
    detail: str
    attempts: int

    def __bool__(self) -> bool:  # a failure is never a truthy result
        return False


@dataclasses.dataclass
class PoolCounters:
    """Event counts since the pool started. `timeouts` and `crashes` count attempts, so an item
    that times out twice adds 2 timeouts, 1 retry and 1 failure."""

    done: int = 0
    timeouts: int = 0
    crashes: int = 0
    retries: int = 0
    errors: int = 0
    failures: int = 0
    workers_started: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def resolve_function(ref: str) -> Callable[..., Any]:
    """Turn "package.module:function" (or "package.module.function") into the function."""
    if not isinstance(ref, str) or not ref:
        raise ValueError(f"function reference must be a non-empty 'module:function' string, got {ref!r}")
    module_name, sep, attr = ref.partition(":")
    if not sep:
        module_name, _, attr = ref.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"function reference {ref!r} is not of the form 'module:function'")
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"function reference {ref!r} names a {type(target).__name__}, not a callable")
    return target


def _function_ref(fn: str | Callable[..., Any]) -> str:
    """The import path of fn; lambdas and nested functions cannot be imported by a worker."""
    if isinstance(fn, str):
        if ":" not in fn and "." not in fn:
            raise ValueError(f"function reference {fn!r} is not of the form 'module:function'")
        return fn
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        raise ValueError(f"{fn!r} is not importable by a worker: pass a module-level function or 'module:function'")
    if module == "__main__":
        # A spawned worker re-imports the main script as __mp_main__, so its functions are found there.
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        if not main_file:
            raise ValueError(f"{fn!r} lives in an interactive __main__ that workers cannot import")
        module = "__mp_main__"
    return f"{module}:{qualname}"


# --------------------------------------------------------------------------- worker process side


def _worker_main(conn: multiprocessing.connection.Connection, preload: Sequence[str],
                 memory_limit_bytes: int | None) -> None:
    """Loop of one worker: receive (task_id, fn_ref, args, kwargs), reply (task_id, ok, payload)."""
    # The parent handles Ctrl-C and shuts workers down itself; a worker must not die mid-item on it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_limit_bytes:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    for module_name in preload:
        importlib.import_module(module_name)
    functions: dict[str, Callable[..., Any]] = {}
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        task_id, ref, args, kwargs = message
        try:
            fn = functions.get(ref)
            if fn is None:
                fn = functions[ref] = resolve_function(ref)
                conn.send(("resolved", task_id))  # the item's timeout starts now, not at the import
            result = fn(*args, **kwargs)
            reply = (task_id, True, result)
        except BaseException as exc:  # noqa: BLE001 - everything the function raises is reported
            reply = (task_id, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}")
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
        except Exception as exc:  # the result itself could not be pickled
            conn.send((task_id, False, f"result of {ref} could not be sent back: {type(exc).__name__}: {exc}"))


# --------------------------------------------------------------------------- parent side


@dataclasses.dataclass
class _Task:
    task_id: int
    ref: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    timeout: float
    future: concurrent.futures.Future
    attempts: int = 0


@dataclasses.dataclass
class _Worker:
    process: Any
    conn: multiprocessing.connection.Connection
    started_at: float
    ready: bool = False
    task: _Task | None = None
    deadline: float = 0.0
    tasks_run: int = 0
    known_refs: set[str] = dataclasses.field(default_factory=set)


class RewardPool:
    """Worker processes with per-item hard timeouts, retry-once and counters.

    workers: number of processes (default: CPU count). timeout: default per-item limit in
    seconds. retries: extra attempts after a timeout or crash (the issue asks for 1).
    preload: modules each worker imports before taking work. context: "forkserver" (default on
    Linux) or "spawn"; "fork" is refused because forking a process with running threads (the
    dispatcher, an event loop) can deadlock the child. memory_limit_bytes: RLIMIT_AS per worker.
    max_tasks_per_worker: recycle a worker after this many items (bounds slow leaks).
    """

    def __init__(self, workers: int | None = None, *, timeout: float = 10.0, retries: int = 1,
                 preload: Sequence[str] = (), context: str | None = None,
                 memory_limit_bytes: int | None = None, max_tasks_per_worker: int | None = None) -> None:
        if workers is None:
            workers = os.cpu_count() or 1
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be a non-negative integer, got {retries!r}")
        if max_tasks_per_worker is not None and max_tasks_per_worker < 1:
            raise ValueError(f"max_tasks_per_worker must be positive, got {max_tasks_per_worker!r}")
        if context is None:
            context = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        if context not in ("forkserver", "spawn"):
            raise ValueError(f"context must be 'forkserver' or 'spawn', got {context!r}")
        self._ctx = multiprocessing.get_context(context)
        self.preload = tuple(preload)
        if context == "forkserver" and self.preload:
            # Only takes effect if the fork server is not running yet; workers import them anyway.
            self._ctx.set_forkserver_preload(list(self.preload))
        self.size = workers
        self.default_timeout = float(timeout)
        self.retries = retries
        self.memory_limit_bytes = memory_limit_bytes
        self.max_tasks_per_worker = max_tasks_per_worker
        self.counters = PoolCounters()
        self._lock = threading.Lock()
        self._pending: collections.deque[_Task] = collections.deque()
        self._ids = itertools.count()
        self._closed = False
        self._stopped = False  # close() ran (the pool may also close itself when broken)
        self._broken: str | None = None
        self._start_failures = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._workers: list[_Worker] = [self._start_worker() for _ in range(workers)]
        self._thread = threading.Thread(target=self._dispatch_loop, name="reward-pool", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API

    def submit(self, fn: str | Callable[..., Any], *args: Any, timeout: float | None = None,
               **kwargs: Any) -> concurrent.futures.Future:
        """Queue one call; the future resolves to the result or a TaskFailure (never raises)."""
        timeout = self.default_timeout if timeout is None else float(timeout)
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        task = _Task(next(self._ids), _function_ref(fn), args, kwargs, timeout, concurrent.futures.Future())
        with self._lock:
            if self._broken:
                raise PoolClosedError(f"the reward pool is broken: {self._broken}")
            if self._closed:
                raise PoolClosedError("the reward pool is closed")
            self._pending.append(task)
        self._wake()
        return task.future

    async def run(self, fn: str | Callable[..., Any], *args: Any, timeout: float | None = None,
                  **kwargs: Any) -> Any:
        """Run fn(*args, **kwargs) in a worker; returns its result or a TaskFailure.

        Never blocks the event loop: the dispatcher thread does the waiting.
        """
        return await asyncio.wrap_future(self.submit(fn, *args, timeout=timeout, **kwargs))

    def map(self, fn: str | Callable[..., Any], items: Iterable[Sequence[Any]], *,
            timeout: float | None = None) -> list[Any]:
        """Run fn(*args) for every args tuple in parallel; results (or TaskFailure) in input order."""
        futures = [self.submit(fn, *args, timeout=timeout) for args in items]
        return [future.result() for future in futures]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self.counters.as_dict()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers; items not yet finished resolve to TaskFailure(kind="closed")."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = self._closed = True
        self._wake()
        self._thread.join(timeout)
        for worker in self._workers:
            self._stop_worker(worker, graceful=True)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> RewardPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    # ------------------------------------------------------------------ workers

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=_worker_main, name="reward-worker", daemon=True,
                                    args=(child_conn, self.preload, self.memory_limit_bytes))
        process.start()
        child_conn.close()
        with self._lock:
            self.counters.workers_started += 1
        return _Worker(process=process, conn=parent_conn, started_at=time.monotonic())

    def _stop_worker(self, worker: _Worker, graceful: bool) -> None:
        if graceful and worker.task is None and worker.process.is_alive():
            try:
                worker.conn.send(None)
            except (OSError, EOFError):
                pass
            worker.process.join(0.5)
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(5.0)
        worker.conn.close()

    def _replace(self, worker: _Worker) -> None:
        self._stop_worker(worker, graceful=False)
        self._workers[self._workers.index(worker)] = self._start_worker()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full, so the dispatcher is already due to wake; or it is closed

    # ------------------------------------------------------------------ dispatcher thread

    def _dispatch_loop(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed:
                        break
                self._assign()
                self._wait_and_handle()
        finally:
            self._fail_everything("closed", "the reward pool was closed before the item finished")

    def _assign(self) -> None:
        now = time.monotonic()
        for worker in self._workers:
            if not worker.ready or worker.task is not None:
                continue
            with self._lock:
                if not self._pending:
                    return
                task = self._pending.popleft()
            if task.future.cancelled():
                continue
            task.attempts += 1
            grace = 0.0 if task.ref in worker.known_refs else _IMPORT_GRACE_S
            worker.task, worker.deadline = task, now + task.timeout + grace
            try:
                worker.conn.send((task.task_id, task.ref, task.args, task.kwargs))
            except (OSError, EOFError):
                self._on_lost(worker, "crash", "worker pipe closed when the item was sent")
            except Exception as exc:  # the arguments cannot be pickled: the caller's error
                worker.task = None
                self._finish(task, TaskFailure("error", f"arguments could not be sent: {type(exc).__name__}: {exc}",
                                               task.attempts), kind="errors")

    def _wait_and_handle(self) -> None:
        now = time.monotonic()
        deadlines = [w.deadline for w in self._workers if w.task is not None]
        deadlines += [w.started_at + _WORKER_START_TIMEOUT_S for w in self._workers if not w.ready]
        wait_s = max(0.0, min(deadlines) - now) if deadlines else None
        by_conn = {w.conn: w for w in self._workers}
        by_sentinel = {w.process.sentinel: w for w in self._workers}
        ready = multiprocessing.connection.wait([self._wake_r, *by_conn, *by_sentinel], wait_s)
        handled: set[int] = set()
        for obj in ready:
            if obj == self._wake_r:
                os.read(self._wake_r, 4096)
                continue
            worker = by_conn.get(obj) or by_sentinel.get(obj)
            if worker is None or id(worker) in handled:
                continue
            handled.add(id(worker))
            self._on_readable(worker)
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.task is not None and now >= worker.deadline:
                self._on_lost(worker, "timeout", f"no result within {worker.task.timeout:g}s")
            elif not worker.ready and now >= worker.started_at + _WORKER_START_TIMEOUT_S:
                self._replace(worker)

    def _on_readable(self, worker: _Worker) -> None:
        try:
            if not worker.conn.poll():
                raise EOFError
            message = worker.conn.recv()
        except (EOFError, OSError):
            if worker.task is not None:
                worker.process.join(1.0)  # reap it, so the exit code (or killing signal) is known
                code = worker.process.exitcode
                self._on_lost(worker, "crash", f"worker died (exit code {code})")
            elif not worker.ready:
                self._on_start_failure(worker)
            else:
                self._replace(worker)
            return
        if message[0] == "ready":
            worker.ready = True
            self._start_failures = 0
            return
        if message[0] == "resolved":
            if worker.task is not None and worker.task.task_id == message[1]:
                worker.known_refs.add(worker.task.ref)
                worker.deadline = time.monotonic() + worker.task.timeout
            return
        task_id, ok, payload = message
        task = worker.task
        if task is None or task.task_id != task_id:
            return  # a stale reply for an item already given up on; cannot happen with one item per worker
        worker.task = None
        worker.tasks_run += 1
        if ok:
            self._finish(task, payload, kind="done")
        else:
            self._finish(task, TaskFailure("error", payload, task.attempts), kind="errors")
        if self.max_tasks_per_worker and worker.tasks_run >= self.max_tasks_per_worker:
            self._stop_worker(worker, graceful=True)
            self._workers[self._workers.index(worker)] = self._start_worker()

    def _on_start_failure(self, worker: _Worker) -> None:
        worker.process.join(1.0)
        code = worker.process.exitcode
        self._start_failures += 1
        if self._start_failures < _MAX_START_FAILURES:
            self._replace(worker)
            return
        detail = (f"{self._start_failures} workers in a row died before becoming ready (last exit code {code}); "
                  "check the preload modules and that the main script guards its code with "
                  "`if __name__ == '__main__':`")
        with self._lock:
            self._broken = detail
            self._closed = True
        self._fail_everything("start_failed", detail)

    def _on_lost(self, worker: _Worker, kind: str, detail: str) -> None:
        """The worker's item timed out or the worker died: replace it, retry or fail the item."""
        task = worker.task
        worker.task = None
        self._replace(worker)
        if task is None:
            return
        with self._lock:
            if kind == "timeout":
                self.counters.timeouts += 1
            else:
                self.counters.crashes += 1
            retry = task.attempts <= self.retries and not self._closed
            if retry:
                self.counters.retries += 1
                self._pending.appendleft(task)
        if not retry:
            self._finish(task, TaskFailure(kind, detail, task.attempts), kind=None)

    def _finish(self, task: _Task, value: Any, kind: str | None) -> None:
        with self._lock:
            if kind == "done":
                self.counters.done += 1
            else:
                if kind == "errors":
                    self.counters.errors += 1
                self.counters.failures += 1
        if not task.future.done():
            task.future.set_result(value)

    def _fail_everything(self, kind: str, detail: str) -> None:
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
        running = [w.task for w in self._workers if w.task is not None]
        for task in pending + running:
            self._finish(task, TaskFailure(kind, detail, task.attempts), kind=None)
