"""The timeline of a run in the Chrome trace-event JSON format (what ui.perfetto.dev and chrome://tracing open).

One process per actor (its main track, a second track for what overlaps the main one: the trainer's publisher,
a rollout's weight receives), each group's generation and grading as async slices on its rollout and its
reward actor, and counters on a "run" process. Times are microseconds since the run's first record.

Spans and where they come from (RunRecords; actors/runtime/spans.py states what the trace records hold):

=====================  ============================================================================
buffer                 "wait for groups" and "serve batch N" (trace ``batch``), stale drops (instants)
rollout.*              "generate G" (async: ends when grading starts, lasts ``gen_s``; args: the answers'
                       token versions), "receive vN" / "swap vN" (log ``weights_updated``)
reward.*               "grade G" (async: the ``score_s`` before the buffer got it)
trainer                "wait for batch N", "step N" with "log-probs", "forward/backward", "optimizer"
                       (trace ``step``; without it metrics.jsonl's wait/train seconds), "publish wait";
                       publisher track: "export vN", "send vN" (trace ``publish``)
param_server           "push vN" (log ``weights_pushed``: its ``sync_s`` up to the line)
evaluator              "evaluate vN" (log ``evaluated``)
run (counters)         buffer depth, groups in flight, staleness (mean, max), rollout utilisation
=====================  ============================================================================
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tools.trace.records import RunRecords

MAIN, SIDE = 0, 1   # the tracks of an actor's process


class Timeline:
    """Chrome trace events with seconds turned to microseconds from ``origin``."""

    def __init__(self, origin: float) -> None:
        self.origin = origin
        self.events: list[dict[str, Any]] = []
        self.pids: dict[str, int] = {}
        self._async_id = 0

    def pid(self, process: str) -> int:
        if process not in self.pids:
            self.pids[process] = len(self.pids) + 1
            self.events.append({"ph": "M", "name": "process_name", "pid": self.pids[process], "tid": MAIN,
                                "args": {"name": process}})
            self.events.append({"ph": "M", "name": "process_sort_index", "pid": self.pids[process], "tid": MAIN,
                                "args": {"sort_index": self.pids[process]}})
        return self.pids[process]

    def us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 1)

    def thread(self, process: str, tid: int, name: str) -> None:
        self.events.append({"ph": "M", "name": "thread_name", "pid": self.pid(process), "tid": tid,
                            "args": {"name": name}})

    def span(self, process: str, name: str, start: float, end: float, tid: int = MAIN, cat: str = "run",
             **args: Any) -> None:
        self.events.append({"ph": "X", "name": name, "cat": cat, "pid": self.pid(process), "tid": tid,
                            "ts": self.us(start), "dur": round(max(self.us(end) - self.us(start), 0.0), 1), "args": args})

    def async_span(self, process: str, name: str, start: float, end: float, cat: str, **args: Any) -> None:
        """A slice that may overlap others on its process (groups generating side by side)."""
        self._async_id += 1
        common = {"name": name, "cat": cat, "pid": self.pid(process), "tid": MAIN, "id": self._async_id}
        self.events.append({**common, "ph": "b", "ts": self.us(start), "args": args})
        self.events.append({**common, "ph": "e", "ts": self.us(max(end, start))})

    def instant(self, process: str, name: str, t: float, **args: Any) -> None:
        self.events.append({"ph": "i", "s": "p", "name": name, "pid": self.pid(process), "tid": MAIN,
                            "ts": self.us(t), "args": args})

    def counter(self, name: str, t: float, **values: float) -> None:
        self.events.append({"ph": "C", "name": name, "pid": self.pid("run"), "tid": MAIN, "ts": self.us(t),
                            "args": values})

    def document(self, metadata: dict[str, Any]) -> dict[str, Any]:
        return {"traceEvents": self.events, "displayTimeUnit": "ms", "metadata": metadata}


def _first_time(rec: RunRecords) -> float | None:
    times: list[float] = []
    for records in rec.trace.values():
        for r in records:
            for key in ("t", "issued", "asked"):
                if isinstance(r.get(key), (int, float)):
                    times.append(r[key])
            for key in ("wait", "export"):
                if isinstance(r.get(key), list) and r[key]:
                    times.append(r[key][0])
    times += [e["t"] for events in rec.logs.values() for e in events[:1]]
    times += [m["time"] - m.get("step_seconds", 0.0) for m in rec.metrics[:1] if isinstance(m.get("time"), (int, float))]
    return min(times) if times else None


def _last_time(rec: RunRecords) -> float:
    times = [r.get("t") or r.get("served") or r.get("end") or 0.0 for rs in rec.trace.values() for r in rs]
    times += [e["t"] for events in rec.logs.values() for e in events[-1:]]
    times += [s.get("time", 0.0) for s in rec.statuses.values()]
    return max(times, default=0.0)


def build(rec: RunRecords) -> dict[str, Any]:
    """The trace document of a run (live or finished); ``metadata.missing`` lists what could not be read."""
    origin = _first_time(rec)
    tl = Timeline(origin if origin is not None else 0.0)
    for name in ["trainer", "buffer", "param_server"] + rec.actors():
        if name in rec.actors() or name == "buffer":
            tl.pid(name)
    _buffer_and_groups(rec, tl)
    _trainer(rec, tl)
    _weights(rec, tl)
    _evaluations(rec, tl)
    _metric_counters(rec, tl)
    return tl.document({"run_dir": str(rec.run_dir), "origin_unix_s": origin, "missing": rec.notes,
                        "source": "areal-lite tools.trace"})


def _buffer_and_groups(rec: RunRecords, tl: Timeline) -> None:
    buffers = rec.by_role("buffer")
    if not buffers:
        return
    buffer = buffers[0]
    now = _last_time(rec)
    changes: list[tuple[float, int, int]] = []   # (time, change of groups in flight, change of ready groups)
    issued: dict[str, dict[str, Any]] = {}
    for r in rec.records(buffer, "issue"):
        issued[r["group"]] = r
        changes.append((r["t"], 1, 0))
    back: set[str] = set()
    for r in rec.records(buffer, "group"):
        back.add(r["group"])
        t, gen_s, score_s = r["t"], r.get("gen_s") or 0.0, r.get("score_s") or 0.0
        versions = sorted({v for a in r.get("answers") or [] for v in a[:2] if v >= 0})
        graded = t - score_s
        tl.async_span(r.get("rollout") or "rollout", f"generate {r['group']}", graded - gen_s, graded, "generate",
                      group=r["group"], token_versions=versions, answers=len(r.get("answers") or []),
                      answer_tokens=[a[2] for a in r.get("answers") or []], outcome=r.get("outcome"))
        if r.get("reward"):
            tl.async_span(r["reward"], f"grade {r['group']}", graded, t, "grade", group=r["group"],
                          rewards=[a[3] for a in r.get("answers") or []])
        if r["group"] in issued:
            changes.append((t, -1, 1 if r.get("outcome") == "accepted" else 0))
    reissued = {e.get("group") for e in rec.events(buffer, "group_reissued")}
    for e in rec.events(buffer, "group_reissued"):
        if e.get("group") in issued and e.get("group") not in back:
            changes.append((e["t"], -1, 0))
            tl.instant(buffer, f"issued again: {e.get('group')}", e["t"], reason=e.get("reason"))
    for gid, r in issued.items():   # still generating (a live run) or lost with the run: open to the end
        if gid not in back and gid not in reissued:
            tl.async_span(r["rollout"], f"generate {gid}", r["t"], max(now, r["t"]), "generate", group=gid,
                          outcome="in flight at the last record")
    for r in rec.records(buffer, "stale"):
        tl.instant(buffer, f"{len(r['groups'])} stale group(s) dropped", r["t"], version=r.get("version"),
                   groups=r["groups"], start_versions=r.get("start_versions"))
        changes.append((r["t"], 0, -len(r["groups"])))
    for r in rec.records(buffer, "batch"):
        tl.span(buffer, f"wait for groups (step {r['step']})", r["asked"], r["taken"], step=r["step"])
        tl.span(buffer, f"serve batch {r['step']}", r["taken"], r["served"], step=r["step"], groups=r["groups"])
        changes.append((r["taken"], 0, -len(r["groups"])))
    in_flight = ready = 0
    for t, d_flight, d_ready in sorted(changes):
        in_flight, ready = in_flight + d_flight, max(ready + d_ready, 0)
        tl.counter("groups in flight", t, groups=in_flight)
        tl.counter("buffer depth (scored groups waiting)", t, groups=ready)


def _trainer(rec: RunRecords, tl: Timeline) -> None:
    trainers = rec.by_role("trainer")
    if not trainers:
        return
    trainer = trainers[0]
    steps = rec.records(trainer, "step")
    if steps:
        for r in steps:
            n = r["step"]
            tl.span(trainer, f"wait for batch {n}", *r["wait"], step=n)
            t0, t1 = r["train"]
            tl.span(trainer, f"step {n}", t0, t1, step=n)
            t = t0
            for key, label in (("logprobs_s", "log-probs"), ("forward_backward_s", "forward/backward"),
                               ("optimizer_s", "optimizer")):
                seconds = r.get(key)
                if isinstance(seconds, (int, float)) and seconds > 0:
                    tl.span(trainer, label, t, min(t + seconds, t1), step=n)
                    t += seconds
            if r.get("end", t1) > t1:
                tl.span(trainer, f"publish wait {n}", t1, r["end"], step=n)
    else:   # no trace records: the spans metrics.jsonl implies
        for m in rec.metrics:
            if not all(isinstance(m.get(k), (int, float)) for k in ("time", "train_seconds", "wait_seconds")):
                continue
            end, n = m["time"], m.get("step")
            t0 = end - m["step_seconds"] + m["wait_seconds"] if "step_seconds" in m else end - m["train_seconds"]
            tl.span(trainer, f"wait for batch {n}", t0 - m["wait_seconds"], t0, step=n)
            tl.span(trainer, f"step {n}", t0, t0 + m["train_seconds"], step=n)
    tl.thread(trainer, SIDE, "publisher")
    for r in rec.records(trainer, "publish"):
        tl.span(trainer, f"export v{r['version']}", *r["export"], tid=SIDE, version=r["version"])
        tl.span(trainer, f"send v{r['version']}", *r["send"], tid=SIDE, version=r["version"])


def _spans_ending_at_lines(rec: RunRecords, tl: Timeline, role: str, event: str, seconds_key: str, label: str,
                           args: tuple[str, ...]) -> None:
    """A span per log line ``event`` of the ``role``'s actors: it ends at the line and lasts its ``seconds_key``."""
    for actor in rec.by_role(role):
        for e in rec.events(actor, event):
            seconds = float(e.get(seconds_key) or 0.0)
            tl.span(actor, f"{label} v{e.get('version')}", e["t"] - seconds, e["t"],
                    **{k: e.get(k) for k in ("version", *args)})


def _weights(rec: RunRecords, tl: Timeline) -> None:
    _spans_ending_at_lines(rec, tl, "param_server", "weights_pushed", "sync_s", "push", ("broadcast_s", "nbytes"))
    for rollout in rec.by_role("rollout"):
        updates = rec.events(rollout, "weights_updated")
        if updates:
            tl.thread(rollout, SIDE, "weights")
        for e in updates:
            total = float(e.get("total_s") or 0.0)
            start = e["t"] - total
            receive = float(e.get("receive_s", total) or 0.0)
            tl.span(rollout, f"receive v{e.get('version')}", start, start + receive, tid=SIDE, version=e.get("version"))
            stall = float(e.get("stall_s") or 0.0)
            if stall > 0:
                tl.span(rollout, f"swap v{e.get('version')}", max(e["t"] - stall, start + receive), e["t"], tid=SIDE,
                        version=e.get("version"), active_groups=e.get("active_groups"))


def _evaluations(rec: RunRecords, tl: Timeline) -> None:
    _spans_ending_at_lines(rec, tl, "evaluator", "evaluated", "seconds", "evaluate", ("accuracy", "problems"))


def _metric_counters(rec: RunRecords, tl: Timeline) -> None:
    for m in rec.metrics:
        t = m.get("time")
        if not isinstance(t, (int, float)):
            continue
        if "staleness_mean" in m:
            tl.counter("staleness of the step's samples", t, mean=m["staleness_mean"], max=m.get("staleness_max", 0))
        if "rollout_utilisation" in m:
            tl.counter("rollout utilisation", t, fraction=m["rollout_utilisation"])


def write(doc: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(doc, separators=(",", ":")))
    return path


def format_problems(doc: Any) -> list[str]:
    """What in ``doc`` breaks the Trace Event Format (the JSON object form: ``traceEvents``, and per event the
    fields its phase needs), or would be drawn wrongly by Perfetto's JSON importer: a complete event ("X") that
    overlaps another on its track without nesting in it, an async end ("e") without its begin. Empty: valid."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["not a JSON object with a traceEvents list"]
    problems: list[str] = []
    open_async: dict[tuple[Any, ...], int] = {}
    by_track: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    for i, e in enumerate(doc["traceEvents"]):
        where = f"event {i} ({e.get('name')!r})" if isinstance(e, dict) else f"event {i}"
        if not isinstance(e, dict):
            problems.append(f"{where}: not an object")
            continue
        ph = e.get("ph")
        needs = {"X": ("name", "ts", "dur", "pid", "tid"), "b": ("name", "ts", "pid", "id", "cat"),
                 "e": ("ts", "pid", "id", "cat"), "i": ("name", "ts", "pid"), "C": ("name", "ts", "pid", "args"),
                 "M": ("name", "pid", "args")}.get(ph)
        if needs is None:
            problems.append(f"{where}: phase {ph!r} is not one this trace uses")
            continue
        missing = [k for k in needs if k not in e]
        if missing:
            problems.append(f"{where}: phase {ph} lacks {', '.join(missing)}")
            continue
        for key in ("ts", "dur"):
            if key in e and (not isinstance(e[key], (int, float)) or isinstance(e[key], bool) or e[key] != e[key]):
                problems.append(f"{where}: {key} is not a number")
        if ph == "X" and isinstance(e["dur"], (int, float)) and e["dur"] < 0:
            problems.append(f"{where}: negative duration")
        if ph == "C" and not all(isinstance(v, (int, float)) for v in e["args"].values()):
            problems.append(f"{where}: a counter's values must be numbers")
        if ph == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], str(e["name"])))
        elif ph == "b":
            open_async[(e["pid"], e["cat"], e["id"])] = i
        elif ph == "e" and open_async.pop((e["pid"], e["cat"], e["id"]), None) is None:
            problems.append(f"{where}: an async end with no begin (id {e['id']})")
    for key, i in open_async.items():
        problems.append(f"event {i}: an async begin never ended (id {key[2]})")
    for (pid, tid), spans in by_track.items():
        stack: list[tuple[float, float, str]] = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= start + 1.0:
                stack.pop()
            if stack and end > stack[-1][1] + 1.0:   # 1 us: the rounding of ts and dur
                problems.append(f"track {pid}/{tid}: {name!r} overlaps {stack[-1][2]!r} without nesting in it")
            stack.append((start, end, name))
    return problems
