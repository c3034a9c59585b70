"""`python -m tools.replay LOG`: read a message log; `--into MODULE:Class`: replay it into a fresh actor.

The command line of the package (its docstring says what printing and replaying do)."""
from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from transport.msglog import MessageLogError

from .doubles import ReplayError
from .driver import replay_into
from .metrics import metrics_table, read_metrics
from .records import print_log

__all__ = ["main"]


RECORD_HOW = ("message logs are written only when asked: launch with `python3 -m tools.up TOPOLOGY ... --record` "
              "(every actor) or set `message_log: true` in an actor group's settings")


def unreadable_log(path: Path) -> str | None:
    """Why ``path`` is no message log to read, saying how to get one; None when it is a file."""
    if path.is_file():
        return None
    if path.is_dir():
        logs = sorted(path.glob("*.msglog")) or sorted(path.glob("msglog/*.msglog"))
        if logs:
            return f"{path} is a directory: give one actor's log, one of {', '.join(str(x) for x in logs)}"
        return f"{path} is a directory and holds no message logs; {RECORD_HOW}"
    run_dir = path.parent.parent if path.parent.name == "msglog" else None
    if run_dir is not None and (run_dir / "specs").is_dir() and not path.parent.is_dir():
        return f"{path}: no such file: the run in {run_dir} kept no message logs; {RECORD_HOW}"
    if path.parent.is_dir() and (others := sorted(path.parent.glob("*.msglog"))):
        return f"{path}: no such file; the logs there: {', '.join(x.name for x in others)}"
    return f"{path}: no such file; {RECORD_HOW}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="message log file (RUN_DIR/msglog/<actor>.msglog)")
    ap.add_argument("--type", action="append", default=[], help="only this message kind (repeatable)")
    ap.add_argument("--sender", action="append", default=[], help="only messages sent by this actor (repeatable)")
    ap.add_argument("--dir", choices=("in", "out"), help="only inbound or outbound records")
    ap.add_argument("--limit", type=int, help="print at most N records")
    ap.add_argument("--json", action="store_true", help="one JSON object per record")
    ap.add_argument("--into", metavar="MODULE:Class", help="replay the inbound messages into a fresh actor")
    ap.add_argument("--segment", type=int, default=0, help="which run of the actor to replay (default 0)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="change one of the actor's settings for the replay (dotted key, YAML value; repeatable)")
    ap.add_argument("--idle-timeout", type=float, default=60.0, metavar="S",
                    help="give up waiting for the actor once it has sent nothing for S seconds (default 60)")
    ap.add_argument("--float-tol", type=float, default=0.0, metavar="T",
                    help="floats match within relative and absolute T (default 0: exactly). Batched generation "
                         "on CPU sums in an order that depends on which sequences share a batch, so a rollout's "
                         "log-probs differ in the 7th digit between runs: 1e-5 compares them")
    args = ap.parse_args(argv)
    # Stopped with SIGTERM (a replay that hangs), it still removes its temporary run directory on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if (why := unreadable_log(Path(args.log))) is not None:
        print(f"replay: {why}", file=sys.stderr)
        return 2
    try:
        if not args.into:
            return print_log(args.log, args.type, args.sender, args.dir, args.limit, args.json)
        overrides = list(args.set)
        # With changed settings a divergence is expected: the whole log is delivered, so a trainer re-trains
        # on every recorded batch.
        result = replay_into(args.log, args.into, args.segment, args.idle_timeout, overrides, args.float_tol,
                             to_end=bool(overrides))
    except (MessageLogError, ReplayError, OSError) as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    for note in result.notes:
        print(f"note: {note}")
    if result.metrics:
        print(metrics_table(read_metrics(Path(args.log).resolve().parent.parent / "metrics.jsonl"), result.metrics))
    print(f"replayed {result.fed} inbound messages into {args.into}; it sent {result.sent}")
    if result.divergence is not None:
        print(result.divergence)
        return 1
    if result.compared:
        print("identical: every outbound message matches the original")
    return 0
