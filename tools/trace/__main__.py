"""``python -m tools.trace RUN_DIR [--out FILE]``: the run's timeline as a Chrome/Perfetto JSON trace (default
RUN_DIR/trace.json; open it at ui.perfetto.dev or chrome://tracing). Works on a finished run, a running one
and a killed one (what is missing is printed and kept in the trace's metadata).

``python -m tools.trace sample RUN_DIR GROUP[:ANSWER]``: one sample's lineage (tools/trace/lineage.py).

``python -m tools.trace why RUN_DIR``: what each actor does and waits on, and since when, from the status
files the actors keep (the progress watchdog's diagnosis, asked for at any moment).

Exit status: 0, or 2 with one line naming the cause (not a run directory, unknown sample).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

from launch.watchdog import ProgressWatchdog
from actors.runtime.recovery import run_finished
from topology.experiment import WatchdogSection
from tools.trace import lineage, timeline
from tools.trace.records import NotARunDir, read_run

TRACE_FILE = "trace.json"


def why(run_dir: Path) -> list[str]:
    rec = read_run(run_dir)
    if not rec.statuses:
        return [f"{run_dir}: no status/ files: no actor of this run has started"]
    now = time.time()
    newest = max(float(s.get("time", 0.0)) for s in rec.statuses.values())
    if run_finished(run_dir):
        head = f"the run finished; the actors' last statuses, written up to {now - newest:.0f} s ago:"
    elif now - newest > 60:
        head = (f"no actor has written its status for {now - newest:.0f} s: the run was stopped or killed "
                f"(or every process is frozen); as they last were:")
    else:
        head = "the run is live:"
    last_step = rec.metrics[-1] if rec.metrics else None
    if last_step is not None and isinstance(last_step.get("time"), (int, float)):
        head += f" last trained step {last_step.get('step')} at {time.strftime('%H:%M:%S', time.localtime(last_step['time']))} ({now - last_step['time']:.0f} s ago)"
    return [head, "", *ProgressWatchdog(run_dir, WatchdogSection()).who_waits(rec.statuses, now)]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in ("sample", "why") else "timeline"
    ap = argparse.ArgumentParser(prog=f"python -m tools.trace{'' if command == 'timeline' else ' ' + command}",
                                 description=__doc__.split("\n\n")[{"timeline": 0, "sample": 1, "why": 2}[command]])
    ap.add_argument("run_dir", type=Path)
    if command == "sample":
        ap.add_argument("id", help="GROUP or GROUP:ANSWER (a group id from the trace or the buffer's log)")
    if command == "timeline":
        ap.add_argument("--out", type=Path, help=f"the trace file (default RUN_DIR/{TRACE_FILE})")
    args = ap.parse_args(argv)
    try:
        if command == "why":
            print("\n".join(why(args.run_dir)))
            return 0
        rec = read_run(args.run_dir)
        if command == "sample":
            print("\n".join(lineage.describe(rec, args.id)))
            return 0
        doc = timeline.build(rec)
        out = timeline.write(doc, args.out or args.run_dir / TRACE_FILE)
    except (NotARunDir, lineage.UnknownSample) as exc:
        print(f"trace: {exc}", file=sys.stderr)
        return 2
    for note in rec.notes:
        print(f"missing: {note}", file=sys.stderr)
    spans = sum(1 for e in doc["traceEvents"] if e["ph"] in ("X", "b"))
    print(f"{out}: {spans} spans on {len(doc['traceEvents']) and len({e['pid'] for e in doc['traceEvents']})} "
          f"tracks; open it at https://ui.perfetto.dev (Open trace file) or chrome://tracing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
