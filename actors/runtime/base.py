"""The actor runtime: ActorSpec (how an actor is described) and Actor (the base every actor subclasses).

An actor is one process with one asyncio (uvloop) event loop and one Bus. Subclasses register handlers
with ``@handles(Kind, ...)``; a handler is ``def``/``async def name(self, msg)`` or ``(self, msg, env)``
(``env`` is the :class:`transport.bus.Envelope`: sender, header, ``env.reply()``). Returning a Message
from a handler answers a request. Plain ``def`` handlers run inline on the receive path (cheap
bookkeeping); ``async def`` handlers run as tasks, at most ``bus.max_inflight`` at once.

Lifecycle (``await actor.run()``, normally through ``python -m actors.runtime.run SPEC.json``):
Messages that arrive before on_start has finished wait for it (in arrival order), then reach their handler.

    bus.start -> on_start() -> ready file written -> on_ready() -> ... serving ... -> stop requested
    (SIGTERM/SIGINT, self.request_stop(), or a failed critical background task)
    -> draining: requests are refused with Error("draining"), one-way messages still handled
    -> on_drain() (finish or hand back in-flight work) -> running handlers get what is left of drain_timeout
       (both together) to finish, the rest are cancelled and their requesters answered Error("draining")
    -> background tasks cancelled -> on_stop() -> bus closed (queued sends flushed) -> logs flushed.

A second SIGTERM/SIGINT skips the rest of the drain. ``run()`` returns the exit code (0 clean).

Readiness: after on_start the actor writes ``RUN_DIR/ready/<name>.json`` ({"pid", "endpoint", "time"})
atomically; the supervisor waits for a file with the child's pid. It is removed on stop.

Status: every ``status_every_s`` seconds (and once more as it stops) the actor writes
``RUN_DIR/status/<name>.json``: its pid and state, what it is doing (``progress()``, each actor's own), the
requests it waits on and those it is still answering, and the last message of each kind in and out
(``Bus.activity``). The launcher's progress watchdog (launch/watchdog.py) diagnoses a stalled run from them; a
file that stops changing while its process lives says the event loop is blocked or the process stopped.

Settings: ``spec.settings`` is validated by the class's ``Settings`` model (topology.settings; unknown keys and
wrong types are refused before on_start) into ``actor.cfg``, which actors read (``self.cfg.algo.eta``). The
base reads ``message_log``, ``bus``, ``drain_timeout``, ``close_linger`` and ``log_console``
(topology.settings.ActorSettings declares them).
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Coroutine

import structlog

from topology.settings import ActorSettings, read_settings
from transport.auth import CurveConfig, TokenConfig
from transport.bus import Bus, Envelope
from transport.files import atomic_write
from transport.messages import Error, Message
from transport.msglog import MessageLogWriter

__all__ = ["ActorSpec", "SpecError", "Actor", "handles", "configure_logging", "actor_logger",
           "ready_path", "load_actor_class"]


class SpecError(ValueError):
    """An ActorSpec is malformed; the message names the key."""


@dataclass
class ActorSpec:
    name: str
    cls: str
    endpoint: str
    peers: dict[str, str] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    run_dir: str = "."
    curve: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    tokens: dict[str, Any] | None = None       # the run's bus tokens when CURVE is off: {"tokens_dir": DIR}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "spec") -> "ActorSpec":
        if not isinstance(d, dict):
            raise SpecError(f"{where}: expected a map, got {type(d).__name__}")
        known = {"name", "cls", "endpoint", "peers", "settings", "run_dir", "curve", "env", "tokens"}
        for key in d:
            if key not in known:
                raise SpecError(f"{where}.{key}: unknown key (expected one of {sorted(known)})")
        for key in ("name", "cls", "endpoint"):
            if not isinstance(d.get(key), str) or not d[key]:
                raise SpecError(f"{where}.{key}: required, a non-empty string")
        if ":" not in d["cls"]:
            raise SpecError(f"{where}.cls: expected 'module:Class', got {d['cls']!r}")
        for key in ("peers", "env"):
            value = d.get(key) or {}
            if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in value.items()):
                raise SpecError(f"{where}.{key}: expected a map of strings to strings")
        if not isinstance(d.get("settings") or {}, dict):
            raise SpecError(f"{where}.settings: expected a map")
        for key in ("curve", "tokens"):
            if d.get(key) is not None and not isinstance(d[key], dict):
                raise SpecError(f"{where}.{key}: expected a map or null")
        if not isinstance(d.get("run_dir", "."), str):
            raise SpecError(f"{where}.run_dir: expected a path string")
        return cls(d["name"], d["cls"], d["endpoint"], dict(d.get("peers") or {}), dict(d.get("settings") or {}),
                   d.get("run_dir", "."), d.get("curve"), dict(d.get("env") or {}), d.get("tokens"))

    def write(self, path: str | os.PathLike) -> None:
        atomic_write(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ActorSpec":
        try:
            with open(path) as fh:
                data = json.load(fh)
        except json.JSONDecodeError as exc:
            raise SpecError(f"{path}: not valid JSON (line {exc.lineno}): {exc.msg}") from None
        return cls.from_dict(data, where=str(path))


def ready_path(run_dir: str | os.PathLike, name: str) -> Path:
    return Path(run_dir) / "ready" / f"{name}.json"


def load_actor_class(path: str) -> type["Actor"]:
    """Import ``module:Class`` and check it is an Actor subclass."""
    import importlib

    module_name, _, cls_name = path.partition(":")
    if not module_name or not cls_name:
        raise SpecError(f"cls: expected 'module:Class', got {path!r}")
    module = importlib.import_module(module_name)
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise SpecError(f"cls: module {module_name!r} has no attribute {cls_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise SpecError(f"cls: {path} is not a subclass of actors.runtime.base.Actor")
    return cls


# ---------------------------------------------------------------------------------------------- logs

_CONFIGURED = False


def configure_logging() -> None:
    """Route structlog through stdlib logging so each actor logger can have its own file + console."""
    global _CONFIGURED
    if _CONFIGURED:
        return
    _CONFIGURED = True
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )


def actor_logger(name: str, run_dir: str | os.PathLike, console: bool = True,
                 not_on_console: Callable[[dict[str, Any]], bool] | None = None, console_stream: Any = None) -> Any:
    """A structlog logger bound to ``actor=name`` writing JSON lines to RUN_DIR/logs/<name>.jsonl, and each
    event for which ``not_on_console`` is not true to ``console_stream`` (stderr by default) as well
    (``console``)."""
    configure_logging()
    log_dir = Path(run_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    std = logging.getLogger(f"actor.{name}")
    std.setLevel(logging.INFO)
    std.propagate = False
    for h in list(std.handlers):
        std.removeHandler(h)
        h.close()
    file_handler = logging.FileHandler(log_dir / f"{name}.jsonl")
    file_handler.setFormatter(structlog.stdlib.ProcessorFormatter(processors=[
        structlog.stdlib.ProcessorFormatter.remove_processors_meta,
        structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer(default=repr),
    ]))
    std.addHandler(file_handler)
    if console:
        console_handler = logging.StreamHandler(console_stream or sys.stderr)
        console_handler.setFormatter(structlog.stdlib.ProcessorFormatter(processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            # A plain traceback: rich's (structlog's default where rich is installed) renders every frame's
            # locals with syntax highlighting: 0.17 s of CPU for an exception through 10 coroutine frames, against
            # 0.001 s plain (2-core machine), and the console of an actor is its log file.
            structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback),
        ]))
        if not_on_console is not None:
            console_handler.addFilter(lambda record: not (isinstance(record.msg, dict) and not_on_console(record.msg)))
        std.addHandler(console_handler)
    return structlog.get_logger(f"actor.{name}").bind(actor=name)


def _close_logger(name: str) -> None:
    std = logging.getLogger(f"actor.{name}")
    for h in list(std.handlers):
        h.flush()
        h.close()
        std.removeHandler(h)


# -------------------------------------------------------------------------------------------- actor

def handles(*kinds: type) -> Callable[[Callable], Callable]:
    """Mark a method as the handler of the given message kinds."""
    if not kinds:
        raise TypeError("@handles needs at least one message class")

    def mark(fn: Callable) -> Callable:
        fn.__handles__ = tuple(getattr(fn, "__handles__", ())) + kinds
        return fn

    return mark


class Actor:
    """Base class of every actor. See the module docstring for the lifecycle and settings."""

    _handlers: ClassVar[dict[type, tuple[str, bool]]] = {}
    # The model of this class's settings; a class with keys of its own names a subclass of ActorSettings.
    Settings: ClassVar[type[ActorSettings]] = ActorSettings

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        table: dict[type, tuple[str, bool]] = {}
        for base in reversed(cls.__mro__[1:]):
            table.update(getattr(base, "_handlers", {}))
        for attr, fn in cls.__dict__.items():
            kinds = getattr(fn, "__handles__", None)
            if not kinds:
                continue
            params = [p for p in inspect.signature(fn).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            if len(params) not in (2, 3):
                raise TypeError(f"{cls.__qualname__}.{attr}: a handler takes (self, msg) or (self, msg, env)")
            for kind in kinds:
                table[kind] = (attr, len(params) == 3)
        cls._handlers = table

    @classmethod
    def check_settings(cls, cfg: Any) -> list[str]:
        """What this class would refuse at start of one instance's typed settings (``cfg``, its ``Settings``), one
        line each naming the key: the launcher runs it for every instance before any starts, and the dry run
        too, so nothing a dry run can know is first refused at start. A class with such checks overrides it and
        raises on them at start as well."""
        return []

    def __init__(self, spec: ActorSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.cfg = read_settings(type(self), spec.settings, self.name)
        self.run_dir = Path(spec.run_dir)
        self.log = actor_logger(self.name, self.run_dir, console=self.cfg.log_console)
        self.bus: Any = None
        self.counters: Counter[str] = Counter()
        self.draining = False
        self.exit_code = 0
        self.msglog: MessageLogWriter | None = None
        self._stop_event: asyncio.Event | None = None
        self._force_event: asyncio.Event | None = None
        self._stop_reason = ""
        self._background: set[asyncio.Task] = set()
        # Set once on_start has finished: a message that arrives earlier (peers may be up first) waits
        # for it instead of reaching a half-initialised actor.
        self._started = asyncio.Event()

    # ----------------------------------------------------------------------------- hooks to override

    async def on_start(self) -> None:
        """Set up (load models, open files). The bus is up; peers may not be ready yet."""

    async def on_ready(self) -> None:
        """Called once readiness is announced (e.g. start producing work)."""

    async def on_drain(self) -> None:
        """Stop taking work; finish in-flight work or hand it back (e.g. return prompts to the buffer)."""

    async def on_stop(self) -> None:
        """Last words: save state, close resources. The bus is still open (sends are flushed after)."""

    def on_peer_dead(self, peer: str) -> None:
        """Heartbeats say ``peer`` is gone."""

    def on_peer_alive(self, peer: str) -> None:
        """A peer declared dead answers again."""

    def on_peer_restarted(self, peer: str) -> None:
        """``peer`` is a new process (its pings carry another incarnation): the one before is gone, with
        whatever it held. Called before the new process's first message is handled; it may never be ready."""

    def progress(self) -> dict[str, Any]:
        """What this actor is doing, as plain data for its status file (the trainer: its version and phase;
        the buffer: its gate and queues). The watchdog reads ``version`` (the trainer's trained steps) and
        ``groups_kept`` (the buffer's accepted groups that were not dropped as stale)."""
        return {}

    def make_link(self, config: Any) -> Any:
        """This actor's end of a bulk link (a transport.bulk.LinkConfig): its buckets go into the message log
        when the actor keeps one; tools.replay puts a stand-in fed from the log in its place."""
        from transport.bulk import BulkLink   # torch: only the actors that move tensors pay for the import

        return BulkLink(config, recorder=self.msglog)

    # ---------------------------------------------------------------------------------- dispatching

    def dispatch(self, env: Envelope) -> Any:
        """Route a received message to its handler (used by the bus and by tools.replay)."""
        entry = self._handlers.get(type(env.msg))
        if entry is None:
            self.counters["rejected.no_handler"] += 1
            if self.bus is not None and hasattr(self.bus, "rejected"):
                self.bus.rejected["no_handler"] += 1
            self.log.warning("message_rejected", reason="no_handler", kind=env.header.kind, sender=env.sender)
            if env.wants_reply:
                return Error("no_handler", f"{self.name} has no handler for {env.header.kind!r}", env.header.kind)
            return None
        method = getattr(self, entry[0])
        if not self._started.is_set():
            self.counters["early_messages"] += 1
            return self._after_start(method, env, entry[1])
        return method(env.msg, env) if entry[1] else method(env.msg)

    async def start(self) -> None:
        """on_start, then handlers run directly (messages that arrived meanwhile go first, in order).
        `run()` calls it; so do in-process drivers such as tools.replay."""
        await self.on_start()
        self._started.set()

    async def _after_start(self, method: Callable, env: Envelope, takes_env: bool) -> Any:
        await self._started.wait()  # waiters resume in arrival order, so early messages keep their order
        result = method(env.msg, env) if takes_env else method(env.msg)
        return await result if inspect.isawaitable(result) else result

    def spawn(self, coro: Coroutine, name: str = "task", critical: bool = True) -> asyncio.Task:
        """Run ``coro`` in the background until stop. A critical task that fails stops the actor (exit 1)."""
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.name}:{name}")
        self._background.add(task)

        def done(t: asyncio.Task) -> None:
            self._background.discard(t)
            if t.cancelled():
                return
            exc = t.exception()
            if exc is not None:
                self.log.error("background_task_failed", task=name, error=repr(exc), exc_info=exc)
                if critical:
                    self.request_stop(f"background task {name!r} failed: {exc!r}", exit_code=1)

        task.add_done_callback(done)
        return task

    def request_stop(self, reason: str = "requested", exit_code: int = 0) -> None:
        """Begin a clean shutdown (idempotent; safe from signal handlers and callbacks)."""
        if self._stop_event is None:
            return
        if self._stop_event.is_set():
            return
        self._stop_reason = reason
        self.exit_code = max(self.exit_code, exit_code)
        if self.msglog is not None:   # what it answers from here on, it answers as it stops (tools.replay)
            self.msglog.record_event("stopping", self.name)
        self._stop_event.set()

    def _on_signal(self, signame: str) -> None:
        if self._stop_event is not None and self._stop_event.is_set():
            self.log.warning("forced_stop", signal=signame)
            self._force_event.set()
        else:
            self.request_stop(f"signal {signame}")

    # ------------------------------------------------------------------------------------- lifecycle

    def _make_bus(self) -> Bus:
        bus_kw = self.cfg.bus.bus_kwargs()
        record = self.cfg.message_log
        recorder, outbound = None, False
        if record is not None:
            opts = record
            outbound = opts.outbound
            recorder = self.msglog = MessageLogWriter(
                self.run_dir / "msglog" / f"{self.name}.msglog", tensors=opts.tensors, flush_every=opts.flush_every,
                meta={"actor": self.name, "spec": self.spec.to_dict(), "outbound": outbound})
        curve = tokens = None
        if self.spec.curve:
            curve = CurveConfig.from_spec(self.spec.curve, self.name, list(self.spec.peers))
        elif self.spec.tokens:
            tokens = TokenConfig.from_spec(self.spec.tokens, self.name)
        # The launcher lists every actor of the run by group: the group is the role messages are checked by.
        groups = self.cfg.groups
        roles = {name: group for group, names in groups.items() for name in names} if groups else None
        return Bus(self.name, self.spec.endpoint, self.spec.peers, handler=self.dispatch, curve=curve, tokens=tokens,
                   roles=roles,
                   recorder=recorder, record_outbound=outbound, log=self.log.bind(component="bus"),
                   on_peer_dead=self._peer_dead, on_peer_alive=self._peer_alive,
                   on_peer_restarted=self._peer_restarted, **bus_kw)

    # Heartbeat verdicts go into the message log too: an actor acts on them (a trainer asks the buffer again
    # once it is back), so a replay must deliver them where they happened.
    def _peer_dead(self, peer: str) -> None:
        if self.msglog is not None:
            self.msglog.record_event("peer_dead", peer)
        self.on_peer_dead(peer)

    def _peer_alive(self, peer: str) -> None:
        if self.msglog is not None:
            self.msglog.record_event("peer_alive", peer)
        self.on_peer_alive(peer)

    def _peer_restarted(self, peer: str) -> None:
        if self.msglog is not None:
            self.msglog.record_event("peer_restarted", peer)
        self.on_peer_restarted(peer)

    def _announce_ready(self) -> None:
        path = ready_path(self.run_dir, self.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Live state of this run only (gone with the process): no fsync.
        atomic_write(path, json.dumps({"pid": os.getpid(), "endpoint": self.bus.endpoint, "time": time.time()}),
                     durable=False)

    async def run(self) -> int:
        """Run the whole lifecycle; returns the process exit code."""
        loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        self._force_event = asyncio.Event()
        installed = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig.name)
                installed.append(sig)
            except (RuntimeError, ValueError, NotImplementedError):
                pass    # not the main thread (in-process tests): request_stop() still works
        try:
            loop.add_signal_handler(signal.SIGUSR1, self.dump_stacks)
            installed.append(signal.SIGUSR1)
        except (RuntimeError, ValueError, NotImplementedError, AttributeError):
            pass
        started = False
        try:
            self.bus = self._make_bus()
            await self.bus.start()
            # A stop requested while still starting (e.g. the supervisor gave up waiting) cancels on_start.
            if not await self._unless(self._stop_event, self.start()):
                self.log.info("stopped_before_ready", reason=self._stop_reason)
                return self.exit_code
            started = True
            self._announce_ready()
            self.log.info("ready", endpoint=self.bus.endpoint, pid=os.getpid())
            if self.cfg.status_every_s > 0:
                self.spawn(self._status_loop(self.cfg.status_every_s), name="status", critical=False)
            await self.on_ready()
            await self._stop_event.wait()
            self.log.info("stopping", reason=self._stop_reason)
            await self._unless(self._force_event, self._drain())
        except Exception as exc:
            self.exit_code = 1
            self.log.error("actor_failed", error=repr(exc), exc_info=exc)
        finally:
            for t in list(self._background):
                t.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            if started:
                try:
                    await self._unless(self._force_event, self.on_stop())
                except Exception as exc:
                    self.exit_code = 1
                    self.log.error("on_stop_failed", error=repr(exc), exc_info=exc)
            if self.bus is not None:
                await self.bus.close(linger=self.cfg.close_linger)
            if self.msglog is not None:
                self.msglog.close()
            ready_path(self.run_dir, self.name).unlink(missing_ok=True)
            if started and self.cfg.status_every_s > 0:
                self._write_status("stopped")
            for sig in installed:
                loop.remove_signal_handler(sig)
            self.log.info("stopped", exit_code=self.exit_code, counters=dict(self.counters),
                          bus=self.bus.counters() if self.bus is not None else {})
            _close_logger(self.name)
        return self.exit_code

    async def _status_loop(self, every: float) -> None:
        while True:
            self._write_status("stopping" if self.draining else "running")
            await asyncio.sleep(every)

    def _write_status(self, state: str) -> None:
        """RUN_DIR/status/<name>.json, replaced whole (a reader never sees half a file)."""
        try:
            progress = self.progress()
        except Exception as exc:   # a status must never fail the actor
            progress = {"error": repr(exc)}
        status = {"actor": self.name, "pid": os.getpid(), "time": time.time(), "state": state,
                  "progress": progress, **(self.bus.activity() if self.bus is not None else {})}
        if state == "stopped":
            status.update(exit_code=self.exit_code, reason=self._stop_reason)
        path = Path(self.run_dir) / "status" / f"{self.name}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps(status, default=str), durable=False)   # live state, rewritten often
        except OSError as exc:
            self.log.warning("status_not_written", error=str(exc))

    def dump_stacks(self) -> Path:
        """Write where every asyncio task and thread of this actor is waiting to
        ``<run_dir>/logs/<name>.stacks.txt`` (``kill -USR1 <pid>`` on a stuck actor)."""
        import faulthandler
        import io

        out = io.StringIO()
        out.write(f"{self.name} pid {os.getpid()} at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        for task in sorted(asyncio.all_tasks(), key=lambda t: t.get_name()):
            out.write(f"\n--- task {task.get_name()} ({task.get_coro()!r})\n")
            task.print_stack(limit=12, file=out)
        path = Path(self.run_dir) / "logs" / f"{self.name}.stacks.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(out.getvalue())
            f.write("\n--- threads\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        self.log.warning("stacks_dumped", path=str(path))
        return path

    @staticmethod
    async def _unless(event: asyncio.Event, coro: Coroutine) -> bool:
        """Await ``coro`` unless ``event`` fires first (then cancel it and return False)."""
        work = asyncio.ensure_future(coro)
        interrupt = asyncio.ensure_future(event.wait())
        await asyncio.wait({work, interrupt}, return_when=asyncio.FIRST_COMPLETED)
        interrupt.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return False
        work.result()
        return True

    async def _drain(self) -> None:
        # One budget for the whole drain (drain_timeout, a share of the supervisor's stop_timeout): what is left
        # of the stop is for cancelling the rest, on_stop's final state and closing the bus, before any SIGKILL.
        timeout = self.cfg.drain_timeout
        deadline = time.monotonic() + timeout
        self.draining = True
        self.bus.draining = True
        await self.on_drain()
        if not await self.bus.wait_handlers(max(0.0, deadline - time.monotonic())):
            left = self.bus.inflight
            self.log.warning("drain_timeout", handlers_cancelled=left, timeout_s=timeout)
            self.bus.cancel_handlers()     # their requesters are answered Error("draining") by the bus
            await self.bus.wait_handlers(5.0)
