"""`python -m tools.plan.cpushare --out FILE -- COMMAND ...`: run COMMAND and record how much CPU each of its
actor processes got, to tell a slow machine from a slow model when a measured run is compared with the
planner's simulation (docs/plan.md).

Every 0.5 s it reads /proc for COMMAND's descendants; for each actor process (a session leader writing to
RUN_DIR/logs/NAME.out, NAME having a spec in RUN_DIR/specs: so an actor forked from the start template, whose
command line is the template's, counts as well as a fresh `python -m actors.runtime.run RUN_DIR/specs/NAME.json`)
it keeps the last CPU seconds (user + system) and lifetime it saw. FILE gets one row per actor:
run directory, actor name, CPU seconds, wall seconds alive, and their ratio, the share of one core it had
(the topology pins each actor to one core, so 1.0 is a core to itself). Linux only.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _descendants(root: int) -> list[int]:
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        for k in kids.get(pid, []):
            out.append(k)
            todo.append(k)
    return out


def actor_sample(pid: int, boot: float) -> tuple[str, float, float] | None:
    """(spec path, CPU seconds, seconds alive) of an actor process, None for any other process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out = Path(os.readlink(f"/proc/{pid}/fd/1"))
    except OSError:
        return None
    # fields after the ")" start at stat's field 3: the session id is field 6
    spec = out.parent.parent / "specs" / f"{out.stem}.json"
    if int(fields[3]) != pid or out.suffix != ".out" or out.parent.name != "logs" or not spec.exists():
        return None
    # fields after the ")" start at stat's field 3: utime is field 14, stime 15, starttime 22
    cpu = (int(fields[11]) + int(fields[12])) / TICK
    alive = time.time() - (boot + int(fields[19]) / TICK)
    return str(spec), cpu, alive


def run(command: Sequence[str], interval: float = 0.5) -> tuple[int, list[dict[str, Any]]]:
    proc = subprocess.Popen(list(command))
    rows = watch(proc, interval)
    return proc.returncode, rows


def watch(proc: subprocess.Popen, interval: float = 0.5) -> list[dict[str, Any]]:
    """Sample `proc`'s actor descendants until it ends; one row per actor (see the module's docstring)."""
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime"))
    seen: dict[str, tuple[float, float]] = {}
    while proc.poll() is None:
        for pid in _descendants(proc.pid):
            got = actor_sample(pid, boot)
            if got is not None:
                seen[got[0]] = (got[1], got[2])
        time.sleep(interval)
    rows = []
    for spec, (cpu, alive) in sorted(seen.items()):
        path = Path(spec)
        rows.append({"run_dir": str(path.parent.parent), "actor": path.stem, "cpu_s": round(cpu, 2),
                     "alive_s": round(alive, 2), "core_share": round(cpu / max(alive, 1e-9), 3)})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.plan.cpushare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file for the rows")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command to run (put it after --)")
    load0 = os.getloadavg()
    code, rows = run(command)
    Path(args.out).write_text(json.dumps({"command": command, "exit": code, "loadavg_start": list(load0),
                                          "loadavg_end": list(os.getloadavg()), "actors": rows}, indent=1) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
