"""The launcher's progress watchdog: a run that stops making progress is stopped, with a diagnosis.

A run can stall with every process alive: the buffer finished early and the trainer waits for a batch that
will never come, or the buffer's version was pushed out of the rollouts' reach and every group is dropped as
stale. Nothing dies, so the supervisor sees nothing wrong. The watchdog follows what the actors write in
``RUN_DIR/status/<name>.json`` (actors/runtime/base.py: their state, what they wait on, the last message of each kind):

* progress is a trained step (the trainer's ``version``); before the first step of this launch, a group the
  buffer accepted and kept (``groups_kept`` reaching a new high) counts too, since a first long generation
  may take many minutes;
* the limit is ``run.watchdog.after_steps`` times the longest step so far, at least ``run.watchdog.min_s``,
  and ``run.watchdog.first_step_s`` before the first step;
* past it, `check` returns a diagnosis: what the trainer, the buffer and every other actor are doing, whom
  each waits on and who waits on it, hints for the stalls it recognises (a buffer that has stopped, a version
  beyond the rollouts' reach, an actor whose process is stopped or whose status stopped changing), and the
  last message of each kind. The launcher prints it, writes it to ``RUN_DIR/stall.txt``, stops the run and
  exits non-zero.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from actors.runtime.recovery import run_finished
from topology.experiment import WatchdogSection

STATUS_DIR = "status"
STALL_FILE = "stall.txt"
SILENT_S = 30.0   # a live actor whose status has not changed for this long is named as silent


def read_statuses(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Every actor's last status (a file being replaced is read whole or not at all)."""
    out = {}
    for path in sorted((Path(run_dir) / STATUS_DIR).glob("*.json")):
        try:
            status = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(status, dict):
            out[path.stem] = status
    return out


def process_state(pid: int) -> str | None:
    """The kernel's word for a local process's state (``/proc/<pid>/stat``), or None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    code = stat.rpartition(")")[2].split()[0]
    return {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped (SIGSTOP)",
            "t": "stopped by a tracer", "Z": "a zombie (exited, not reaped)"}.get(code, code)


class ProgressWatchdog:
    """Call `start` once every actor is ready, then `check` periodically: None while the run progresses, the
    diagnosis (its first line says why) once it has stalled. ``clock``: seconds, monotonic, and ``wall``: the
    time of day the status files are stamped with (tests pass their own); ``local_pids``: where the processes
    run on this machine, their states are looked up."""

    def __init__(self, run_dir: Path, settings: WatchdogSection, clock: Callable[[], float] = time.monotonic,
                 local_pids: Callable[[], dict[str, int | None]] | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self.run_dir = Path(run_dir)
        self.settings = settings
        self.clock = clock
        self.wall = wall
        self.local_pids = local_pids
        self.version: int | None = None       # the trainer's version when first seen, then its newest
        self.steps = 0                        # steps trained since start
        self.groups_high: int | None = None
        self.started = False
        self.last_progress = 0.0
        self.longest_step = 0.0

    @property
    def enabled(self) -> bool:
        return self.settings.after_steps > 0

    def start(self) -> None:
        self.started = True
        self.last_progress = self.clock()

    def limit(self) -> float:
        if self.steps == 0:
            return self.settings.first_step_s
        return max(self.settings.min_s, self.settings.after_steps * self.longest_step)

    def check(self) -> str | None:
        if not self.enabled or not self.started or run_finished(self.run_dir):
            return None
        now = self.clock()
        statuses = read_statuses(self.run_dir)
        trainer = _trainer(statuses)
        if trainer is not None:
            progress = trainer.get("progress") or {}
            version = progress.get("version")
            if isinstance(version, int):
                if self.version is not None and version > self.version:
                    self.steps += version - self.version
                    self.last_progress = now
                self.version = version if self.version is None else max(self.version, version)
            self.longest_step = max(self.longest_step, float(progress.get("step_seconds_max") or 0.0))
        kept = ((statuses.get("buffer") or {}).get("progress") or {}).get("groups_kept")
        if isinstance(kept, int):
            if self.groups_high is None or kept < self.groups_high - 1:   # first seen, or a restarted buffer
                self.groups_high = kept
            elif kept > self.groups_high:
                self.groups_high = kept
                if self.steps == 0:
                    self.last_progress = now
        quiet = now - self.last_progress
        if quiet <= self.limit():
            return None
        tp = (trainer or {}).get("progress") or {}
        if isinstance(tp.get("version"), int) and tp["version"] >= (tp.get("total_steps") or float("inf")):
            return None   # every step is trained: the run is finishing (its last publish, RunFinished)
        return self.diagnose(statuses, quiet)

    def diagnose(self, statuses: dict[str, dict[str, Any]], quiet: float) -> str:
        """The report of a stalled run (also written to RUN_DIR/stall.txt)."""
        now = self.wall()
        if self.steps == 0:
            why = (f"no trained step and no newly accepted group for {quiet:.0f} s (run.watchdog.first_step_s "
                   f"{self.settings.first_step_s:g} s before the first step)")
        else:
            why = (f"no trained step for {quiet:.0f} s (limit {self.limit():.0f} s: {self.settings.after_steps:g} x "
                   f"the longest step so far, {self.longest_step:.1f} s, at least run.watchdog.min_s "
                   f"{self.settings.min_s:g} s)")
        trainer = _trainer(statuses)
        tp = (trainer or {}).get("progress") or {}
        if tp.get("version") is not None:
            why += f"; the trainer is at version {tp['version']} of {tp.get('total_steps', '?')}"
        text = "\n".join([f"NO PROGRESS: {why}", "", *self.who_waits(statuses, now)])
        try:
            (self.run_dir / STALL_FILE).write_text(text + "\n")
        except OSError:
            pass
        return text

    def who_waits(self, statuses: dict[str, dict[str, Any]], now: float) -> list[str]:
        """What each actor does and waits on, and since when (as of ``now``: a live actor's waits have gone on
        since its status was written), hints for the stalls recognised, and the last message of each kind.
        The stall report's body, and `python -m tools.trace why`."""
        lines = ["who waits on whom:"]
        pids = self.local_pids() if self.local_pids is not None else {}
        first = [n for n in ("trainer", "trainer.0", "buffer", "param_server") if n in statuses]
        for name in first + [n for n in statuses if n not in first]:
            status = statuses[name]
            lines.append(f"  {name}: {self._actor_line(name, status, now, pids.get(name))}")
            since = 0.0 if status.get("state") == "stopped" else max(now - float(status.get("time", now)), 0.0)
            for ask in status.get("asking") or []:
                lines.append(f"      waits on {ask['peer']} for the answer to {ask['kind']} "
                             f"({ask['for_s'] + since:.0f} s{_since(now - ask['for_s'] - since)})")
            for serve in status.get("serving") or []:
                lines.append(f"      {serve['peer']} waits on it for the answer to {serve['kind']} "
                             f"({serve['for_s'] + since:.0f} s{_since(now - serve['for_s'] - since)})")
        hints = self._hints(statuses, now, pids)
        if hints:
            lines += ["", "what that means:", *(f"  - {h}" for h in hints)]
        last = _last_messages(statuses)
        if last:
            lines += ["", "last message of each kind (newest first):"]
            width = max(len(kind) for kind, *_ in last)
            lines += [f"  {kind:<{width}}  {sender} -> {peer}, {now - t:.1f} s ago" for kind, sender, peer, t in last]
        return lines

    def _actor_line(self, name: str, status: dict[str, Any], now: float, local_pid: int | None) -> str:
        state = status.get("state", "?")
        parts = [f"pid {status.get('pid')}"]
        if state == "stopped":
            parts.append(f"STOPPED {now - status.get('time', now):.0f} s ago (exit {status.get('exit_code')}: "
                         f"{status.get('reason') or 'no reason given'})")
        else:
            parts.append(state)
            age = now - float(status.get("time", now))
            if age > SILENT_S:
                parts.append(f"SILENT: its status has not changed for {age:.0f} s")
            proc = process_state(local_pid) if local_pid else None
            if proc is not None and proc not in ("running", "sleeping"):
                parts.append(f"its process is {proc}")
        progress = status.get("progress") or {}
        if "phase" in progress:
            began = float(status.get("time", now)) - float(progress.get("phase_for_s", 0))
            parts.append(f"{progress['phase']} ({now - began:.0f} s{_since(began)})")
        elif progress:
            parts.append(", ".join(f"{k} {v}" for k, v in progress.items()
                                   if k in ("version", "weights_version", "groups", "ready", "in_flight", "epoch")))
        return "; ".join(p for p in parts if p)

    def _hints(self, statuses: dict[str, dict[str, Any]], now: float, pids: dict[str, int | None]) -> list[str]:
        hints = []
        buffer = statuses.get("buffer")
        trainer = _trainer(statuses)
        tp = (trainer or {}).get("progress") or {}
        waits_on = {ask["peer"] for s in statuses.values() for ask in s.get("asking") or []}
        for name, status in statuses.items():
            if status.get("state") == "stopped" and name in waits_on:
                hints.append(f"{name} has stopped ({status.get('reason') or 'exit ' + str(status.get('exit_code'))}), "
                             f"but others still wait on it; the run cannot go on without it")
            elif status.get("state") != "stopped":
                pid = pids.get(name)
                proc = process_state(pid) if pid else None
                if proc is not None and proc.startswith("stopped"):
                    hints.append(f"{name}'s process (pid {pid}) is {proc}: it answers nothing until it is continued")
                elif now - float(status.get("time", now)) > SILENT_S:
                    hints.append(f"{name} has not written its status for {now - status['time']:.0f} s: its process "
                                 f"is stopped or its event loop is blocked (kill -USR1 {status.get('pid')} writes "
                                 f"where it waits to logs/{name}.stacks.txt)")
        if buffer is not None:
            bp = buffer.get("progress") or {}
            version, eta = bp.get("version"), bp.get("eta")
            rollout_versions = [v for v in (bp.get("rollout_versions") or {}).values() if isinstance(v, int)]
            if isinstance(version, int) and isinstance(tp.get("version"), int) and version > tp["version"]:
                hints.append(f"the buffer's version ({version}) is ahead of the trainer's ({tp['version']}): a version "
                             f"update that did not come from the trainer's steps reached it")
            if isinstance(version, int) and isinstance(eta, int) and rollout_versions \
                    and version - max(rollout_versions) > eta:
                hints.append(f"the buffer's version {version} is more than eta={eta} versions ahead of every rollout's "
                             f"weights (newest {max(rollout_versions)}): every group they make is dropped as stale. "
                             f"Are the weights reaching them (the param_server's log)?")
            if (bp.get("uniform_streak") or 0) >= 2 * (bp.get("batch_size") or 1):
                hints.append(f"the last {bp['uniform_streak']} groups all got one reward for every answer and were "
                             f"dropped (algo.dynamic_sampling): can the model solve any prompt?")
        return hints


def _since(t: float) -> str:
    """", since 14:02:07" (local time of day), the moment a wait began."""
    return f", since {time.strftime('%H:%M:%S', time.localtime(t))}"


def _trainer(statuses: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The status of the trainer that leads (trainer, or trainer.0 of a world)."""
    for name in ("trainer", "trainer.0"):
        if name in statuses:
            return statuses[name]
    return None


def _last_messages(statuses: dict[str, dict[str, Any]]) -> list[tuple[str, str, str, float]]:
    """(kind, sender, receiver, time) of the newest message of each kind any actor sent, newest first."""
    newest: dict[str, tuple[str, str, float]] = {}
    for name, status in statuses.items():
        for kind, sent in (status.get("last_out") or {}).items():
            if kind not in newest or sent["time"] > newest[kind][2]:
                newest[kind] = (name, sent["peer"], sent["time"])
    return sorted(((k, s, p, t) for k, (s, p, t) in newest.items()), key=lambda row: -row[3])
