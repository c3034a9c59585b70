"""Trace records: the few moments of a run that no log line states, one JSON line each in
``RUN_DIR/trace/<actor>.jsonl``, for `python -m tools.trace` (timeline, a sample's lineage, the run report).

What is recorded (the rest of the timeline comes from the actors' structlog lines and metrics.jsonl):

* buffer: ``issue`` (a group handed to a rollout and reward actor), ``group`` (it came back scored: its
  generation and grading seconds, each answer's token versions, length, reward, and what became of it),
  ``stale`` (ready groups dropped at batch time), ``batch`` (the groups of a step's batch, asked/taken/served);
* trainer: ``step`` (the wait and train intervals, the phases of the train step, each answer's share of the
  loss's weight) and ``publish`` (export and hand-off of a version).

Each line is written and flushed when it happens, so a running run can be read and a killed one loses at
most its last, partial line (the reader skips it and says so). Times are ``time.time()`` seconds. A record
costs one ``json.dumps`` and one ``write``: tens of microseconds, against steps of seconds (docs/tools.md
states the measured cost)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TRACE_DIR = "trace"


class SpanLog:
    """Append-only JSON lines for one actor. Never raises on write: a full disk must not stop a run."""

    def __init__(self, run_dir: str | os.PathLike, name: str) -> None:
        path = Path(run_dir) / TRACE_DIR / f"{name}.jsonl"
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file: Any = open(path, "a", buffering=1)   # line-buffered: each record reaches the file whole
        except OSError:
            self._file = None
        self.failed = 0

    def write(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps({"ev": event, **fields}, separators=(",", ":")) + "\n")
        except (OSError, ValueError):
            self.failed += 1

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
