"""What a launch shows while it runs and when it ends: each actor's state (`ProgressView`, a live table on a
terminal, a line per change otherwise), the latest training step (`TrainingProgress`), and the summary
table printed at the end."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from launch.report import table_lines
from actors.runtime.base import actor_logger

# The supervisor's events that the progress view shows already as an actor's state: they go to the launcher's
# log file only, so that the console says each thing once (a late joiner's ready is news, and is shown).
SHOWN_AS_STATE = frozenset({"actor_started", "actor_ready", "actor_finished"})


def launcher_logger(run_dir: Path, name: str = "launcher") -> Any:
    """The supervisor's log: every event to RUN_DIR/logs/<name>.jsonl; on the console only those the progress
    view does not show (deaths, restarts, kills, late actors)."""
    return actor_logger(name, run_dir, not_on_console=lambda event: event.get("event") in SHOWN_AS_STATE
                        and not event.get("joined_late"), console_stream=sys.stdout)   # beside the progress lines


class ProgressView:
    """Live actor status: a rich table on a terminal, one line per change otherwise."""

    def __init__(self, title: str, enabled: bool) -> None:
        self.title = title
        self.live = None
        self.last: dict[str, str] = {}
        if enabled and sys.stdout.isatty():
            from rich.live import Live
            self.live = Live(refresh_per_second=4, transient=False)
            self.live.start()

    def update(self, rows: dict[str, dict[str, Any]], elapsed: float, training: str | None = None) -> None:
        if self.live is not None:
            from rich.table import Table
            table = Table(title=f"{self.title}  {elapsed:6.1f} s", caption=training)
            for col in ("actor", "node", "state", "pid", "restarts"):
                table.add_column(col)
            for name, row in rows.items():
                table.add_row(name, str(row.get("node", "")), row["state"], str(row.get("pid") or ""),
                              str(row.get("restarts", 0)))
            self.live.update(table)
            return
        for name, row in rows.items():
            text = f"{row['state']} (restarts {row.get('restarts', 0)})"
            if self.last.get(name) != text:
                self.last[name] = text
                print(f"[{elapsed:7.1f}s] {name:<20} {row.get('node', ''):<10} {text}", flush=True)
        if training and self.last.get("\0training") != training:
            self.last["\0training"] = training
            print(f"[{elapsed:7.1f}s] {training}", flush=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


class TrainingProgress:
    """Follows RUN_DIR/metrics.jsonl (one line per training step, written by the trainer) and renders
    the latest step as one progress line: the step, the mean reward on its scale, the share of the step's
    sampled answers that were correct (training accuracy; the held-out accuracy is the evaluator's and the
    final evaluation's), the time left at the pace of the steps so far, and the system's figures."""

    def __init__(self, run_dir: Path, total_steps: int | None,
                 reward_range: tuple[float, float] | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.total = total_steps
        self.reward_range = reward_range
        self.offset = 0
        self.first: dict[str, Any] | None = None
        self.latest: dict[str, Any] | None = None

    def poll(self) -> str | None:
        if self.path.exists():
            with open(self.path) as f:
                f.seek(self.offset)
                for line in f:
                    if not line.endswith("\n"):
                        break  # a line still being written: read it next time
                    self.offset += len(line)
                    self.latest = json.loads(line)
                    self.first = self.first or self.latest
        m = self.latest
        if m is None:
            return None
        of = f"/{self.total}" if self.total else ""
        scale = (f" (wrong {self.reward_range[0]:+g}, right {self.reward_range[1]:+g})"
                 if self.reward_range else "")
        return (f"step {m['step']}{of}{self.time_left()}  reward {m['task_reward']:+.2f}{scale}  "
                f"training accuracy {100 * m['accuracy']:5.1f}% (sampled answers)  "
                f"throughput {m['effective_throughput']:7.0f} tok/s  staleness {m['staleness_mean']:.2f} "
                f"(max {m['staleness_max']:.0f})  weight sync {m['weight_sync_seconds']:.3f} s  "
                f"buffer {m['buffer_depth']}" + (f"  WARNING {m['mismatch_warning']}" if m.get("mismatch_warning") else ""))

    def time_left(self) -> str:
        """`  ~N s left` at the mean pace since the first step read; empty before two steps or without a total."""
        first, m = self.first, self.latest
        if not self.total or first is None or m is None or m["step"] <= first["step"] or "time" not in m:
            return ""
        pace = (m["time"] - first["time"]) / (m["step"] - first["step"])
        return f"  ~{max(0.0, pace * (self.total - m['step'])):.0f} s left"


def see_the_run(run_dir: str) -> list[str]:
    """The commands that show a run: its timeline and its report (tools/trace, tools/report.py)."""
    return ["see the run:",
            f"  python3 -m tools.trace {run_dir}     # RUN_DIR/trace.json, every actor's timeline: ui.perfetto.dev",
            f"  python3 -m tools.report {run_dir}    # RUN_DIR/report.html, one self-contained page of the run"]


def summary(title: str, rows: dict[str, dict[str, Any]], elapsed: float, run_dir: Path, outcome: str) -> str:
    lines = [f"{title}: {outcome} after {elapsed:.1f} s; run directory {run_dir}"]
    table = [("actor", "node", "state", "exit", "restarts")]
    for name, row in rows.items():
        table.append((name, str(row.get("node", "")), row["state"], str(row.get("exit", "")),
                      str(row.get("restarts", 0))))
    lines.extend(table_lines(table))
    lines.extend(see_the_run(str(run_dir)))
    return "\n".join(lines)


def child_rows(sup: Any, node_of: dict[str, str]) -> dict[str, dict[str, Any]]:
    rows = {}
    for name, child in sup.children.items():
        proc = child.proc
        if child.given_up:
            state = "failed"        # a late joiner left down after its restart limit; the run goes on
        elif child.finished:
            state = "finished"
        elif child.ready:
            state = "ready"
        elif proc is not None and proc.returncode is not None:
            state = "restarting"
        elif child.late_reported:
            state = "late"          # past its ready budget, still starting
        else:
            state = "starting"
        rows[name] = {"node": node_of.get(name, ""), "state": state, "restarts": sup.restarts[name],
                      "pid": proc.pid if proc is not None and proc.returncode is None else None,
                      "exit": child.last_exit if child.last_exit is not None else ""}
    return rows
