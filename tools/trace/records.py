"""What a run directory holds for the timeline, read leniently: a killed run's files may be missing or end in a
torn line, and whatever is readable still makes a timeline; each gap is a note naming the file.

Sources: ``trace/<actor>.jsonl`` (actors/runtime/spans.py: groups, batches, steps, publishes), ``logs/<actor>.jsonl``
(the actors' structlog lines: weight pushes and swaps, evaluations, re-issued groups), ``metrics.jsonl`` (the
trainer's steps: the fallback for its spans, and the counters), ``eval.jsonl`` and ``status/<actor>.json``.
"""
from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launch.watchdog import read_statuses
from actors.runtime.spans import TRACE_DIR


class NotARunDir(ValueError):
    """The path holds nothing a run writes; the message says what was looked for."""


@dataclass
class RunRecords:
    run_dir: Path
    trace: dict[str, list[dict[str, Any]]] = field(default_factory=dict)     # actor -> trace records
    logs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)      # actor -> structlog events
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    statuses: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)                           # what is missing or unreadable

    def actors(self) -> list[str]:
        return sorted(set(self.trace) | set(self.logs) | set(self.statuses))

    def events(self, actor: str, event: str) -> list[dict[str, Any]]:
        """The structlog events named ``event`` an actor logged, each with its time in seconds as ``t``."""
        return [e for e in self.logs.get(actor, []) if e.get("event") == event and "t" in e]

    def records(self, actor: str, event: str) -> list[dict[str, Any]]:
        return [r for r in self.trace.get(actor, []) if r.get("ev") == event]

    def by_role(self, role: str) -> list[str]:
        """Actors of a group ("rollout" -> rollout.0, rollout.1; "trainer" -> trainer or trainer.0)."""
        return [a for a in self.actors() if a == role or a.startswith(role + ".")]


def read_lines(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file; a torn or unreadable line is skipped with a note."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        notes.append(f"{path}: unreadable ({exc.strerror or exc})")
        return []
    lines = text.split("\n")
    out, bad = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            torn = number == len(lines) and not text.endswith("\n")
            bad.append(f"line {number}{' (torn: the run was killed or is writing it)' if torn else ''}")
            continue
        if isinstance(obj, dict):
            out.append(obj)
    if bad:
        notes.append(f"{path}: {len(bad)} unreadable line(s) skipped: {', '.join(bad[:3])}")
    return out


def log_time(event: dict[str, Any]) -> float | None:
    """A structlog line's ISO timestamp in seconds since the epoch."""
    stamp = event.get("timestamp")
    if not isinstance(stamp, str):
        return None
    try:
        return _dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def read_run(run_dir: str | Path) -> RunRecords:
    """Everything the timeline uses. NotARunDir when the path has none of a run's files."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NotARunDir(f"{run_dir}: no such directory")
    rec = RunRecords(run_dir)
    notes = rec.notes
    for path in sorted((run_dir / TRACE_DIR).glob("*.jsonl")):
        rec.trace[path.stem] = read_lines(path, notes)
    for path in sorted((run_dir / "logs").glob("*.jsonl")):
        events = read_lines(path, notes)
        for e in events:
            t = log_time(e)
            if t is not None:
                e["t"] = t
        rec.logs[path.stem] = events
    if (run_dir / "metrics.jsonl").is_file():
        rec.metrics = read_lines(run_dir / "metrics.jsonl", notes)
    if (run_dir / "eval.jsonl").is_file():
        rec.evals = read_lines(run_dir / "eval.jsonl", notes)
    rec.statuses = read_statuses(run_dir)
    if not (rec.trace or rec.logs or rec.metrics or rec.statuses):
        raise NotARunDir(f"{run_dir}: not a run directory (no trace/, logs/, metrics.jsonl or status/)")
    if not rec.trace:
        notes.append(f"{run_dir / TRACE_DIR}: missing (experiment.run.trace off, or a run from before it): no "
                     f"group, grading or batch spans; the trainer's come from metrics.jsonl")
    else:
        for role in ("buffer", "trainer"):
            if not any(a == role or a.startswith(role + ".") for a in rec.trace):
                notes.append(f"{run_dir / TRACE_DIR}/{role}.jsonl: missing: no {role} spans from trace records")
    if not rec.logs:
        notes.append(f"{run_dir / 'logs'}: missing: no weight push, swap or evaluation spans")
    if not rec.metrics:
        notes.append(f"{run_dir / 'metrics.jsonl'}: missing or empty: no trained step recorded there")
    return rec
