"""Supervisor: starts actor processes from ActorSpecs, waits until all are ready, restarts the dead.

Each actor runs ``actors.runtime.run`` on ``RUN_DIR/specs/<name>.json`` with ``spec.env`` applied (CPU affinity
and thread counts are applied before torch loads or, in a forked actor, set after); stdout/stderr go to
``RUN_DIR/logs/<name>.out``. Readiness is the actor's ready file carrying the child's pid. With ``fork_start``
(the default) each actor is forked from a start template that imported torch and the runtime once
(actors/runtime/template.py: the actor is still this process's child, so the rest of this file does not
tell the two apart); without it, or when the template cannot start or is lost, each actor is a fresh
``python -m actors.runtime.run SPEC`` (an exec start).

A process that exits non-zero (or is killed) is restarted after an exponential backoff
(``backoff_initial * 2**k``, capped at ``backoff_max``). More than ``max_restarts`` restarts within
``restart_window`` seconds means the actor cannot be kept up: the supervisor logs why (exit code, last
log lines), calls ``on_giveup``, stops every actor and ``run()`` raises :class:`SupervisorError`.
An actor that exits 0 by itself has finished and is not restarted. Restarts are logged, counted in
``restarts[name]`` and reported to ``on_restart(name, count, exit_code)``.

Once the run is over (``run_over()``: the trainer marked it finished), an actor that exits has finished
whatever its exit code, and one still running ``RUN_END_GRACE_S`` later (``AFTER_RUN_GRACE_S`` for a restarted
one) missed the RunFinished and is stopped: SIGTERM, then SIGKILL after ``stop_timeout``. Otherwise an actor
left waiting for peers that have gone would keep the launcher waiting with it.

Readiness. Each actor has its own ready budget (``ready_budgets[name]``, else ``ready_timeout``) from its
first start: what it starts decides it (a rollout waits for its SGLang server, which may take minutes to
load weights and capture CUDA graphs; launch/readiness.py derives the budgets). ``start()`` returns
once every actor is ready, except those of late-joining groups (``late_joiners[group]``: how many of the
group's instances must be ready first). The others join when they are ready; one past its budget is reported
(``actor_not_ready``) and left starting; one given up on (restart limit) is reported and left down, and the
run goes on while its group keeps at least that many. A required actor past its budget, or a group that can
no longer reach its number, is a NotReadyError.

Clean stop: SIGTERM to all, wait ``stop_timeout``, SIGKILL stragglers.

    sup = Supervisor(specs, run_dir)
    await sup.start()          # raises NotReadyError naming who is not ready, with their last log lines
    await sup.run()            # until stop() is called or an actor is given up on (SupervisorError)
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import structlog

import actors
from actors.runtime.base import ActorSpec, ready_path
from actors.runtime.process import ActorProcess
from actors.runtime.template import StartTemplate
from topology.schema import SupervisorSection

__all__ = ["Supervisor", "SupervisorError", "NotReadyError"]

_POLL_S = 0.05
AFTER_RUN_GRACE_S = 5.0   # for a restarted actor still running after the run ended to end by itself
RUN_END_GRACE_S = 60.0    # for any other actor (RunFinished reaches it within seconds)
TMP_RECORDS = "tmpdirs"   # RUN_DIR/tmpdirs/<actor>: the path of its current process's TMPDIR


class SupervisorError(RuntimeError):
    pass


class NotReadyError(SupervisorError):
    pass


@dataclass
class _Child:
    spec: ActorSpec
    proc: ActorProcess | None = None
    started_at: float = 0.0
    ready: bool = False
    finished: bool = False
    restart_times: deque = field(default_factory=deque)
    last_exit: int | None = None
    ready_by: float = 0.0            # its ready budget ends here (from its first start)
    late_reported: bool = False      # a late joiner past its budget was reported
    given_up: bool = False           # a late joiner left down after its restart limit
    monitor: asyncio.Task | None = None
    first_error: str | None = None   # the error of its first death: what went wrong, before any restart


def _project_root() -> str:
    return str(Path(actors.__file__).resolve().parent.parent)


def _with_project_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the project first on PYTHONPATH (an actor imports this tree, wherever it is installed)."""
    env["PYTHONPATH"] = _project_root() + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _signal(proc: ActorProcess, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:   # it has just exited
        pass


def tail(path: Path, lines: int = 10) -> list[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 16384))
            return fh.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


# The topology's `supervisor:` section declares each option's default once; a Supervisor built in code (tests,
# tools.replay) gets the same ones.
_DEFAULTS = SupervisorSection()


class Supervisor:
    def __init__(self, specs: list[ActorSpec], run_dir: str | os.PathLike, *,
                 python: str = sys.executable,
                 max_restarts: int = _DEFAULTS.max_restarts,
                 restart_window: float = _DEFAULTS.restart_window,
                 backoff_initial: float = _DEFAULTS.backoff_initial,
                 backoff_max: float = _DEFAULTS.backoff_max,
                 ready_timeout: float = _DEFAULTS.ready_timeout,
                 stop_timeout: float = _DEFAULTS.stop_timeout,
                 fork_start: bool = _DEFAULTS.fork_start,
                 ready_budgets: dict[str, float] | None = None,
                 late_joiners: dict[str, int] | None = None,
                 on_restart: Callable[[str, int, int | None], Any] | None = None,
                 on_giveup: Callable[[str, str], Any] | None = None,
                 run_over: Callable[[], bool] | None = None,
                 log: Any = None) -> None:
        """``run_over``: when it returns True, an actor that exits is finished whatever its exit code (the
        run's work is done; a restart would wait forever for peers that have already left).
        ``ready_budgets``: seconds each actor (by name) has to report ready, else ``ready_timeout``;
        ``late_joiners``: group -> instances that must be ready before start() returns (the rest join later)."""
        names = [s.name for s in specs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise SupervisorError(f"duplicate actor names: {dupes}")
        self.run_dir = Path(run_dir)
        self._tmp_dirs: dict[str, Path] = {}   # actor name -> the TMPDIR of its current process
        self.python = python
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.fork_start = fork_start
        self._template: StartTemplate | None = None
        self.ready_budgets = dict(ready_budgets or {})
        self.late_joiners = dict(late_joiners or {})
        self._started = False
        self.on_restart = on_restart
        self.on_giveup = on_giveup
        self.run_over = run_over
        self.log = log if log is not None else structlog.get_logger("actors.runtime.supervisor")
        self.children = {s.name: _Child(s) for s in specs}
        self.restarts: Counter[str] = Counter()
        self._stopping = False
        self._failure: str | None = None
        self._done: asyncio.Event | None = None

    # ---------------------------------------------------------------------------------------- public

    async def start(self) -> None:
        """Start every actor and wait until the run can begin: every actor ready but the late joiners beyond
        their group's number (NotReadyError when an actor's ready budget runs out first)."""
        self._done = asyncio.Event()
        for d in ("specs", "logs", "ready", TMP_RECORDS):
            (self.run_dir / d).mkdir(parents=True, exist_ok=True)
        self._remove_left_tmp()
        if self.fork_start:
            self._template = await StartTemplate.open(
                self.python, _with_project_path(dict(os.environ)), _project_root(),
                self.run_dir / "logs" / "start-template.out", self.log, timeout=self.ready_timeout,
                actor_classes=sorted({c.spec.cls for c in self.children.values()}))
        for child in self.children.values():
            await self._spawn(child)
            child.ready_by = child.started_at + self.budget(child.spec.name)
            child.monitor = asyncio.get_running_loop().create_task(self._watch(child),
                                                                   name=f"supervise-{child.spec.name}")
        try:
            await self.wait_ready()
        except SupervisorError:
            await self.stop()
            raise
        self._started = True
        late = sorted(n for n, c in self.children.items() if not c.ready and not c.finished)
        if late:
            self.log.info("run_starts_without", actors=late,
                          hint="they join when they are ready (late_joiners); each has its own ready budget")

    def budget(self, name: str) -> float:
        """Seconds the actor has to report ready, from its first start."""
        return self.ready_budgets.get(name, self.ready_timeout)

    @staticmethod
    def group_of(name: str) -> str:
        return name.rsplit(".", 1)[0] if name.rpartition(".")[2].isdigit() else name

    def _late_group(self, name: str) -> str | None:
        group = self.group_of(name)
        return group if group in self.late_joiners else None

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Until the run can begin (see start()); ``timeout`` caps every actor's budget."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._failure is not None:
                raise SupervisorError(self._failure)
            now = time.monotonic()
            waiting = [c for c in self.children.values() if not c.ready and not c.finished]
            required = [c for c in waiting if self._late_group(c.spec.name) is None]
            short = {g: n for g, n in self.late_joiners.items() if self._ready_in(g) < n}
            if not required and not short:
                return
            expired = [c for c in required if now >= min(c.ready_by, deadline or c.ready_by)]
            hopeless = {g: n for g, n in short.items() if self._possible_in(g, now, deadline) < n}
            if expired or hopeless:
                parts = [self._not_ready_line(c, now) for c in expired]
                for group, need in hopeless.items():
                    out = [c for c in waiting if self.group_of(c.spec.name) == group]
                    parts.append(f"group {group}: {self._ready_in(group)} of the {need} instances the run needs "
                                 f"are ready, and the others' ready budgets ran out:\n"
                                 + "\n".join(self._not_ready_line(c, now) for c in out[:4]))
                raise NotReadyError("not ready in time: " + "\n".join(parts))
            await asyncio.sleep(_POLL_S)

    def _members(self, group: str) -> list[_Child]:
        return [c for n, c in self.children.items() if self.group_of(n) == group]

    def _ready_in(self, group: str) -> int:
        return sum(1 for c in self._members(group) if c.ready)

    def _possible_in(self, group: str, now: float, deadline: float | None) -> int:
        """Members that are ready, or may still be: alive and within their budget."""
        return sum(1 for c in self._members(group)
                   if c.ready or (not c.given_up and not c.finished and now < min(c.ready_by, deadline or c.ready_by)))

    def _not_ready_line(self, c: _Child, now: float) -> str:
        state = "running" if c.proc is not None and c.proc.returncode is None else \
            f"exited {c.proc.returncode if c.proc else '?'}"
        lines = self._last_lines(c.spec.name)
        return (f"{c.spec.name} ({state}; ready budget {self.budget(c.spec.name):.0f}s); last log lines:\n    "
                + "\n    ".join(lines or ["<none>"]))

    async def run(self) -> None:
        """Supervise until stop() (returns) or an actor cannot be kept up (raises SupervisorError)."""
        await self._done.wait()
        if self._failure is not None:
            raise SupervisorError(self._failure)

    @property
    def start_template_pid(self) -> int | None:
        """The start template's pid while actors are forked from it (None: they start as fresh interpreters)."""
        return self._template.proc.pid if self._template is not None and self._template.usable else None

    def pids(self) -> dict[str, int | None]:
        return {n: (c.proc.pid if c.proc is not None and c.proc.returncode is None else None)
                for n, c in self.children.items()}

    async def stop(self) -> dict[str, int | None]:
        """SIGTERM every actor, wait stop_timeout, SIGKILL stragglers; returns exit codes by name."""
        self._stopping = True
        me = asyncio.current_task()
        for c in self.children.values():
            if c.monitor is not None and c.monitor is not me:
                c.monitor.cancel()
        procs = {n: c.proc for n, c in self.children.items() if c.proc is not None}
        for n, p in procs.items():
            if p.returncode is None:
                _signal(p, signal.SIGTERM)
        waits = {n: asyncio.ensure_future(p.wait()) for n, p in procs.items()}
        if waits:
            _, pending = await asyncio.wait(waits.values(), timeout=self.stop_timeout)
            for n, p in procs.items():
                if p.returncode is None:
                    self.log.warning("actor_killed", actor=n, reason=f"still running {self.stop_timeout}s after SIGTERM")
                    _signal(p, signal.SIGKILL)
            await asyncio.gather(*waits.values(), return_exceptions=True)
        if self._template is not None:
            await self._template.close()
            self._template = None
        for name, path in self._tmp_dirs.items():
            shutil.rmtree(path, ignore_errors=True)
            (self.run_dir / TMP_RECORDS / name).unlink(missing_ok=True)
        self._tmp_dirs.clear()
        if self._done is not None:
            self._done.set()
        return {n: p.returncode for n, p in procs.items()}

    # ------------------------------------------------------------------------------------- internals

    def _last_lines(self, name: str) -> list[str]:
        return (tail(self.run_dir / "logs" / f"{name}.out", 6)
                + tail(self.run_dir / "logs" / f"{name}.jsonl", 4))

    async def _spawn(self, child: _Child) -> None:
        spec = child.spec
        spec_path = self.run_dir / "specs" / f"{spec.name}.json"
        spec.write(spec_path)
        ready_path(self.run_dir, spec.name).unlink(missing_ok=True)
        env = _with_project_path({**os.environ, **spec.env, "TMPDIR": str(self._fresh_tmp(spec.name))})
        root = _project_root()
        out = open(self.run_dir / "logs" / f"{spec.name}.out", "ab")
        try:
            proc = None
            if self._template is not None:
                proc = await self._template.start(spec_path, env, out.fileno(), root)
            if proc is None:
                proc = ActorProcess.of_subprocess(await asyncio.create_subprocess_exec(
                    self.python, "-m", "actors.runtime.run", str(spec_path), env=env, stdout=out, stderr=out,
                    stdin=asyncio.subprocess.DEVNULL, cwd=root, start_new_session=True))
        finally:
            out.close()
        child.proc = proc
        child.started_at = time.monotonic()
        child.ready = False
        self.log.info("actor_started", actor=spec.name, pid=proc.pid, start=proc.start)

    def _fresh_tmp(self, name: str) -> Path:
        """An empty temporary directory for one actor process (its TMPDIR), removed when that process is
        replaced and when the supervisor stops: what the actor and its children leave there
        (multiprocessing's pymp-* directories, reward runs) goes with it, even after a kill -9. It lives
        in the system's temporary directory, not the run directory: multiprocessing puts unix sockets
        there, whose paths may not exceed 107 bytes. 0711: an unsandboxed reward run's uid must pass
        through it to its own files."""
        old = self._tmp_dirs.pop(name, None)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        path = Path(tempfile.mkdtemp(prefix=f"areal-{name}-"))
        path.chmod(0o711)
        self._tmp_dirs[name] = path
        # Recorded in the run directory: a launcher killed with -9 cannot remove it, its relaunch does.
        (self.run_dir / TMP_RECORDS / name).write_text(str(path))
        return path

    def _remove_left_tmp(self) -> None:
        """Remove the temporary directories a previous launcher of this run directory left (it was killed
        before it could): each is recorded under RUN_DIR/tmpdirs/<actor>. Only a directory of that actor's
        name made by this user in the temporary directory is removed, whatever the record says."""
        for name in self.children:
            record = self.run_dir / TMP_RECORDS / name
            try:
                left = Path(record.read_text().strip())
            except OSError:
                continue
            try:
                owned = left.stat().st_uid == os.getuid()
            except OSError:   # gone already (or on another node's disk)
                owned = False
            if (owned and left.parent == Path(tempfile.gettempdir()) and left.name.startswith(f"areal-{name}-")
                    and left not in self._tmp_dirs.values()):
                shutil.rmtree(left, ignore_errors=True)
                self.log.info("tmp_dir_removed", actor=name, path=str(left), why="left by an earlier launcher")
            record.unlink(missing_ok=True)

    def _check_ready(self, child: _Child) -> bool:
        try:
            info = json.loads(ready_path(self.run_dir, child.spec.name).read_text())
        except (OSError, ValueError):
            return False
        return info.get("pid") == child.proc.pid

    async def _watch(self, child: _Child) -> None:
        name = child.spec.name
        try:
            while True:
                proc = child.proc
                wait = asyncio.ensure_future(proc.wait())
                over_since: float | None = None
                terminated_at: float | None = None
                while not wait.done():
                    if not child.ready and self._check_ready(child):
                        child.ready = True
                        self.log.info("actor_ready", actor=name, pid=proc.pid,
                                      after_s=round(time.monotonic() - child.started_at, 3),
                                      **({"joined_late": True} if self._started else {}))
                    if (self._started and not child.ready and not child.late_reported
                            and time.monotonic() > child.ready_by):
                        # A late joiner whose budget ran out (a server that never comes up): the run goes on
                        # without it; it keeps starting, and joins if it ever is ready.
                        child.late_reported = True
                        self.log.warning("actor_not_ready", actor=name, ready_budget_s=self.budget(name),
                                         restarts=self.restarts[name], last_lines=self._last_lines(name))
                    # Once the run is over, every actor ends by itself, unless it missed the RunFinished: a
                    # restarted process can have been starting when the run ended (the message went to its dead
                    # predecessor), and the actor that ends the run can fail or die before telling everyone. It
                    # would wait for ever for peers that have left, and the launcher with it: stop it.
                    now = time.monotonic()
                    if self.run_over is not None and over_since is None and self.run_over():
                        over_since = now
                    grace = AFTER_RUN_GRACE_S if self.restarts[name] > 0 else RUN_END_GRACE_S
                    if terminated_at is None and over_since is not None and now - over_since > grace:
                        self.log.warning("actor_stopped_after_run_end", actor=name, pid=proc.pid, grace_s=grace)
                        _signal(proc, signal.SIGTERM)
                        terminated_at = now
                    if terminated_at is not None and now - terminated_at > self.stop_timeout:
                        self.log.warning("actor_killed", actor=name,
                                         reason=f"still running {self.stop_timeout}s after SIGTERM")
                        _signal(proc, signal.SIGKILL)
                        terminated_at = float("inf")   # killed once
                    await asyncio.wait({wait}, timeout=_POLL_S if not child.ready else
                                       (1.0 if self.run_over is not None else None))
                code = proc.returncode
                child.last_exit = code
                child.ready = False
                if self._stopping:
                    return
                if code != 0 and child.first_error is None:
                    child.first_error = self._error_of(name)
                if code == 0:
                    child.finished = True
                    self.log.info("actor_finished", actor=name)
                    return
                if self.run_over is not None and self.run_over():
                    child.finished = True
                    self.log.warning("actor_exited_after_run_end", actor=name, exit_code=code,
                                     last_lines=self._last_lines(name))
                    return
                now = time.monotonic()
                while child.restart_times and now - child.restart_times[0] > self.restart_window:
                    child.restart_times.popleft()
                if len(child.restart_times) >= self.max_restarts:
                    await self._give_up(child, code)
                    return
                child.restart_times.append(now)
                self.restarts[name] += 1
                n = self.restarts[name]
                delay = min(self.backoff_initial * 2 ** (len(child.restart_times) - 1), self.backoff_max)
                self.log.warning("actor_died", actor=name, exit_code=code, restart=n, backoff_s=delay,
                                 last_lines=self._last_lines(name))
                if self.on_restart is not None:
                    try:
                        self.on_restart(name, n, code)
                    except Exception as exc:
                        self.log.error("on_restart_failed", error=repr(exc))
                await asyncio.sleep(delay)
                if self._stopping:
                    return
                if self.run_over is not None and self.run_over():
                    # The run ended during the backoff: the RunFinished the others got went to the dead
                    # process, so a new one would wait forever for peers that have left.
                    child.finished = True
                    self.log.warning("actor_not_restarted_after_run_end", actor=name)
                    return
                await self._spawn(child)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failure = f"supervising {name} failed: {exc!r}"
            self.log.error("supervisor_failed", actor=name, error=repr(exc))
            asyncio.get_running_loop().create_task(self.stop())

    def _error_of(self, name: str) -> str | None:
        """The error an actor process logged as it failed (its last ``actor_failed`` line), if any."""
        for line in reversed(tail(self.run_dir / "logs" / f"{name}.jsonl", 50)):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "actor_failed":
                return str(event.get("error"))
        return None

    async def _give_up(self, child: _Child, code: int | None) -> None:
        name = child.spec.name
        lines = self._last_lines(name)
        group = self._late_group(name)
        if group is not None:
            child.given_up = True
            left = sum(1 for c in self._members(group) if not c.given_up)
            if left >= self.late_joiners[group]:
                # One of many interchangeable workers: reported and left down; the run goes on.
                self.log.error("actor_given_up", actor=name, exit_code=code, restarts=self.restarts[name],
                               last_lines=lines, run_goes_on=True, group_left=left,
                               first_error=child.first_error)
                if self.on_giveup is not None:
                    try:
                        self.on_giveup(name, f"{name} left down after {len(child.restart_times) + 1} deaths")
                    except Exception as exc:
                        self.log.error("on_giveup_failed", error=repr(exc))
                return
        # A restart can fail for a reason of its own (a stateful actor refuses one): the first error is the
        # cause, and it leads the message.
        cause = f"; its first failure: {child.first_error}" if child.first_error else ""
        self._failure = (f"actor {name} died {len(child.restart_times) + 1} times within "
                         f"{self.restart_window:.0f}s (last exit code {code}){cause}; giving up and stopping the "
                         f"run. Last log lines:\n    " + "\n    ".join(lines or ["<none>"]))
        self.log.error("actor_given_up", actor=name, exit_code=code, restarts=self.restarts[name], last_lines=lines)
        if self.on_giveup is not None:
            try:
                self.on_giveup(name, self._failure)
            except Exception as exc:
                self.log.error("on_giveup_failed", error=repr(exc))
        await self.stop()
