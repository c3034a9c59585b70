"""`python -m tools.replay LOG`: read a message log; `--into MODULE:Class`: replay it into a fresh actor.

Printing: one line per record (index, time since the segment start, direction, kind, sender/peer, fields),
filtered with ``--type KIND`` and ``--sender NAME`` (repeatable), ``--dir in|out``, ``--limit N``, or one
JSON object per line with ``--json``. Buckets moved on bulk links print as kind ``bulk`` with their header, a
link's formations as ``link_formed``.
A torn last record is reported and skipped.

Replaying: a fresh instance of the class is built from the spec stored in the log (run_dir replaced by a
temporary directory, message logging off, ``--set KEY=VALUE`` applied to its settings) with a ReplayBus
instead of the network and a ReplayLink for every bulk link. ``on_start`` and ``on_ready`` run, then the
recorded inbound messages and replies of the chosen segment are delivered in log order, each once the actor
has sent, stream by stream, what the original had sent before it arrived (see docs/transport.md). What
the actor sends is compared, per (cause, peer) stream in order, with what the original sent (wire bodies
without their VOLATILE fields, tensors by sha256, link buckets by header); the first divergence is reported
naming the inbound message that caused it, the outbound message and its first differing field. A wait is
bounded by ``--idle-timeout``: a replay never hangs. With ``--set`` the whole log is delivered even past a
divergence, and a replayed trainer's metrics print beside the recorded run's (offline re-training).
Exit status: 0 identical, 1 divergence, 2 usage or log errors.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import hashlib
import json
import math
import signal
import sys
import tempfile
import threading
import types
import typing
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import msgpack

import transport.protocol  # noqa: F401  (registers the rl.* message kinds so records decode)
from topology import TopologyError, apply_overrides
from transport.bulk import BulkError
from transport.bus import MAX_INFLIGHT, Envelope, RemoteError, current_cause, wait_for_tasks
from transport.messages import (DecodeError, Error, Message, decode, decode_header, encode, registry, to_plain,
                                upgraded_body)
from transport.msglog import LogRecord, MessageLogError, read_log

__all__ = ["main", "replay_into", "ReplayResult", "Divergence", "ReplayError"]


class ReplayError(RuntimeError):
    """The log cannot drive the actor (e.g. it requests something the original never asked)."""


# ------------------------------------------------------------------------------------------- printing

def _describe(rec: LogRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"index": rec.index, "t": rec.t, "dir": rec.kind, "segment": rec.segment}
    if rec.kind == "meta":
        out["meta"] = {k: v for k, v in rec.meta.items() if k != "spec"}
        return out
    if rec.kind == "event":   # the bus's heartbeat verdict on a peer
        out.update(peer=rec.peer, kind=rec.event, sender=rec.peer, fields={})
        return out
    if rec.kind.startswith("bulk_"):   # a bucket on a bulk link: its header (names, shapes, checksum)
        kind = "link_formed" if rec.kind == "bulk_formed" else "bulk"   # or an epoch formed: members, error
        out.update(peer=rec.peer, kind=kind, sender=rec.peer if rec.kind == "bulk_in" else None,
                   fields=msgpack.unpackb(rec.frames[0], raw=False))
        return out
    out["peer"] = rec.peer
    if rec.rejected:
        out["rejected"] = rec.rejected
    try:
        if rec.tensors_stored:
            header, msg = decode(rec.frames)
            out["fields"] = to_plain(msg)
        else:
            header, body = decode_header(rec.frames)
            out["fields"] = body
            out["tensor_sha256"] = rec.sums
        out.update(kind=header.kind, sender=header.sender, id=header.id, reply_to=header.reply_to)
    except DecodeError as exc:
        out.update(kind="?", error=str(exc))
    return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.hex() if len(v) <= 64 else v[:64].hex() + "..."
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    return v


def _import_quietly(module: str) -> None:
    import importlib

    try:
        importlib.import_module(module)
    except Exception as exc:   # printing goes on; those records stay undecoded
        print(f"warning: cannot import {module} for its message kinds: {exc}", file=sys.stderr)


def print_log(path: str, types: list[str], senders: list[str], direction: str | None, limit: int | None,
              as_json: bool, out: Any = None) -> int:
    out = out if out is not None else sys.stdout
    records, torn = read_log(path)
    start = 0.0
    shown = 0
    spec_module = next((r.meta["spec"]["cls"].partition(":")[0] for r in records
                        if r.kind == "meta" and isinstance(r.meta.get("spec"), dict) and r.meta["spec"].get("cls")),
                       None)
    for rec in records:
        if rec.kind == "meta":
            start = rec.t
            if not as_json and not types and not senders:
                print(f"--- segment {rec.segment}: {json.dumps(_jsonable({k: v for k, v in rec.meta.items() if k != 'spec'}))}",
                      file=out)
            continue
        d = _describe(rec)
        if d.get("kind") == "?" and "unknown message kind" in str(d.get("error")) and spec_module:
            # a kind the actor's own module defines (ps.weights_status): import it once, then decode
            _import_quietly(spec_module)
            spec_module = None
            d = _describe(rec)
        if types and d.get("kind") not in types:
            continue
        if senders and d.get("sender") not in senders:
            continue
        if direction and rec.kind.removeprefix("bulk_") != direction:
            continue
        if limit is not None and shown >= limit:
            break
        shown += 1
        if as_json:
            print(json.dumps(_jsonable(d)), file=out)
            continue
        arrow = f"{d.get('sender', '?')} ->" if rec.kind in ("in", "bulk_in", "event") else f"-> {rec.peer}"
        extra = f" REJECTED[{rec.rejected}]" if rec.rejected else ""
        extra += f" reply_to={d['reply_to']}" if d.get("reply_to") else ""
        body = json.dumps(_jsonable(d.get("fields", d.get("error"))), separators=(",", ":"))
        print(f"#{rec.index:<6} +{rec.t - start:9.4f}s {rec.kind.removeprefix('bulk_'):<3} {d.get('kind', '?'):<24} {arrow:<20}{extra} {body}",
              file=out)
    if torn:
        print(f"warning: {torn} (skipped)", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------ replaying

def _wire_key(frames: list, peer: str, sums: list[str] | None = None) -> tuple:
    """What must match between the original and the replay: peer, kind, body (its VOLATILE fields left
    out), tensor checksums."""
    head = msgpack.unpackb(bytes(frames[0]), raw=False)
    tensor_sums = sums if sums is not None else [hashlib.sha256(memoryview(f).cast("B")).hexdigest()
                                                 for f in frames[1:]]
    cls = registry().get(head[0])
    body = upgraded_body(head[0], head[1], head[7])   # a log written by an older schema, as this one lays it out
    body = _without_volatile(body, cls) if cls is not None else body
    return peer, head[0], msgpack.packb(body), tuple(tensor_sums)


def _without_volatile(body: Any, tp: Any) -> Any:
    """``body`` with the fields that its annotation ``tp`` (a message class, and the dataclasses nested in
    it, in lists, dicts and optionals) declares VOLATILE replaced by a marker: wall-clock measurements and
    process identities differ in any rerun."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list and isinstance(body, list) and args:
        return [_without_volatile(x, args[0]) for x in body]
    if origin is dict and isinstance(body, dict) and len(args) == 2:
        return {k: _without_volatile(v, args[1]) for k, v in body.items()}
    if args and origin not in (list, dict):   # X | None and the like
        inner = [a for a in args if a is not type(None)]
        return _without_volatile(body, inner[0]) if len(inner) == 1 else body
    if not (isinstance(body, dict) and dataclasses.is_dataclass(tp)):
        return body
    hints = _hints(tp)
    volatile = getattr(tp, "VOLATILE", ())
    return {k: "(volatile)" if k in volatile else _without_volatile(v, hints.get(k)) for k, v in body.items()}


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:    # an annotation that cannot be resolved: compare that class's fields as they are
        return {}


@dataclass
class _Sent:
    peer: str
    kind: str
    key: tuple
    plain: Any
    body: Any
    sums: list[str]


def _first_field_diff(a: Any, b: Any, sums_a: list[str], sums_b: list[str], path: str = "",
                     tol: float = 0.0) -> str | None:
    """The path of the first field where two wire bodies differ (tensors by their checksums, floats within a
    relative and absolute ``tol``), or None."""
    if tol and isinstance(a, float) and isinstance(b, float):
        return None if math.isclose(a, b, rel_tol=tol, abs_tol=tol) else (path or "(body)")
    if isinstance(a, dict) and isinstance(b, dict):
        if "$t" in a and "$t" in b:
            sa = sums_a[a["$t"] - 1] if 0 < a["$t"] <= len(sums_a) else None
            sb = sums_b[b["$t"] - 1] if 0 < b["$t"] <= len(sums_b) else None
            if (a.get("dtype"), a.get("shape")) != (b.get("dtype"), b.get("shape")) or sa != sb:
                return path or "(body)"
            return None
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                return f"{path}.{k}" if path else str(k)
            d = _first_field_diff(a[k], b[k], sums_a, sums_b, f"{path}.{k}" if path else str(k), tol)
            if d is not None:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_field_diff(x, y, sums_a, sums_b, f"{path}[{i}]", tol)
            if d is not None:
                return d
        return None if len(a) == len(b) else f"{path} (length {len(a)} vs {len(b)})"
    return None if (type(a) is type(b) and a == b) else (path or "(body)")


def _field_value(body: Any, path: str) -> Any:
    """The value at ``path`` (as _first_field_diff names it) in a plain body, for the report."""
    import re

    cur = body
    for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path.split(" (length")[0]):
        try:
            cur = cur[int(index)] if index else cur[name]
        except (KeyError, IndexError, TypeError):
            return "(absent)"
    return cur


@dataclass
class Divergence:
    inbound_position: int          # 0-based position among the replayed inbound messages (-1: startup)
    record_index: int | None       # index of that inbound record in the log
    cause_kind: str | None
    outbound_position: int         # position among the messages to one peer caused by that inbound message
    expected: str
    actual: str
    message: str | None = None     # the kind of the outbound message that differs
    field: str | None = None       # the first field that differs, when both sides sent the same kind
    peer: str | None = None        # the peer (or bulk link#rank) the messages went to

    def __str__(self) -> str:
        where = ("during startup or in background work (on_start/on_ready/timers)" if self.inbound_position < 0 else
                 f"at inbound message #{self.inbound_position} (log record {self.record_index}, {self.cause_kind})")
        what = f"\n  message {self.message}, field {self.field}" if self.field else \
            (f"\n  message {self.message}" if self.message else "")
        return (f"first divergence {where}, outbound #{self.outbound_position} to {self.peer}:{what}\n"
                f"  original: {self.expected}\n  replay:   {self.actual}")


@dataclass
class ReplayResult:
    fed: int = 0
    sent: int = 0
    compared: bool = False
    divergence: Divergence | None = None
    notes: list[str] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)   # what the replayed actor wrote to metrics.jsonl


class ReplayBus:
    """Stands in for transport.bus.Bus: captures what the actor sends, answers requests from the log."""

    def __init__(self, name: str, replies: dict[tuple, list], peers: dict[str, str] | None = None) -> None:
        self.name = name
        self.peers = dict(peers or {})
        self.alive: dict[str, bool] = {}
        self.endpoint = "replay://"
        self.draining = False
        self.frozen = False                      # set once the comparison is done: later sends are dropped
        self._lock = threading.Lock()            # bulk links send from their own threads
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.sent: dict[str | None, list[_Sent]] = defaultdict(list)
        self.count = 0                           # messages sent so far, all causes
        self.order: list[tuple[str | None, int]] = []    # (cause, position within that cause) of each send
        self.per_peer_seen: dict[tuple, int] = defaultdict(int)   # (cause, peer) -> sends checked so far
        self.stream_counts: dict[tuple, int] = defaultdict(int)   # (cause, peer) -> sends so far
        self.progress = asyncio.Event()          # set on every send: the driver waits for the actor with it
        self._replies = replies                  # (cause, ordinal of that cause's requests) -> frames
        self._released: dict[tuple, list] = {}   # replies whose place in the log the replay has reached
        self._waiting: dict[tuple, asyncio.Future] = {}
        self._request_counts: dict[str | None, int] = defaultdict(int)
        self._handler_tasks: set[asyncio.Task] = set()
        from collections import Counter
        self.stats: Counter = Counter()
        self.rejected: Counter = Counter()

    def _capture(self, peer: str, msg: Message, cause: str | None, **kw: Any) -> None:
        frames = encode(msg, self.name, **kw)
        key = _wire_key(frames, peer)
        self._add(cause, _Sent(peer, type(msg).KIND, key, to_plain(msg), msgpack.unpackb(key[2], raw=False),
                               list(key[3])))

    def capture_bulk(self, peer: str, header: dict) -> None:
        """A bucket the actor sent on a (stand-in) bulk link; called from the thread the transfer runs in."""
        self._add(current_cause.get(), _Sent(peer, "bulk", _bulk_key(peer, header), header, header, []))

    def _add(self, cause: str | None, sent: _Sent) -> None:
        with self._lock:
            if self.frozen:
                return
            self.sent[cause].append(sent)
            self.stream_counts[(cause, sent.peer)] += 1
            self.order.append((cause, len(self.sent[cause]) - 1))
            self.count += 1
        if threading.get_ident() == self._loop_thread:
            self.progress.set()
        else:
            self._loop.call_soon_threadsafe(self.progress.set)

    async def send(self, peer: str, msg: Message) -> None:
        self._capture(peer, msg, current_cause.get())

    async def request(self, peer: str, msg: Message, timeout: float | None = None) -> Message:
        cause = current_cause.get()
        self._capture(peer, msg, cause, wants_reply=True)
        n = self._request_counts[cause]
        self._request_counts[cause] += 1
        if (cause, n) not in self._replies:
            # The original got no answer either (the run ended first, or it timed out: then the replay
            # stalls where the original went on, and says so): it waits, as the original did.
            await asyncio.get_running_loop().create_future()
        # The reply comes when the original got it (the driver releases it at its place in the log): a status
        # asked for meanwhile must not see the answer early.
        frames = self._released.get((cause, n))
        if frames is None:
            waiter = self._waiting[(cause, n)] = asyncio.get_running_loop().create_future()
            frames = await waiter
        _, reply = decode(frames)
        if type(reply) is Error:
            raise RemoteError(peer, reply.code, reply.text, reply.kind)
        return reply

    def release(self, key: tuple) -> None:
        """The original received the reply to request ``key`` at this point: hand it over."""
        self._released[key] = self._replies[key]
        waiter = self._waiting.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(self._replies[key])

    def _send_reply(self, ident: Any, msg: Message, to: Any) -> None:
        self._capture(to.sender, msg, to.id, reply_to=to.id)

    def counters(self) -> dict[str, int]:
        return {}

    def peer_alive(self, peer: str) -> bool:
        # As the original's heartbeats said, from the log's peer_dead/peer_alive events.
        return self.alive.get(peer, True)

    # The parts of Bus that Actor._drain uses.
    async def wait_handlers(self, timeout: float | None = None) -> bool:
        return await wait_for_tasks(self._handler_tasks, timeout)

    def cancel_handlers(self) -> int:
        for t in self._handler_tasks:
            t.cancel()
        return len(self._handler_tasks)

    @property
    def inflight(self) -> int:
        return len(self._handler_tasks)


def _load(path: str, segment: int) -> tuple[dict, list[LogRecord], str | None]:
    records, torn = read_log(path)
    metas = [r for r in records if r.kind == "meta"]
    if segment >= len(metas):
        raise ReplayError(f"{path} has {len(metas)} segment(s); segment {segment} does not exist")
    return metas[segment].meta, [r for r in records if r.kind != "meta" and r.segment == segment], torn


async def _caught_up(bus: ReplayBus, streams: list[tuple], done: list[int], upto: int, idle_timeout: float) -> bool:
    """Wait until the actor has sent what the original had sent before a record: for each of the first
    ``upto`` outbound records (``streams``: its (cause, peer) and its place there), as many messages on that
    stream. False once the actor sent nothing for ``idle_timeout`` s. ``done``: how far it got, kept between
    calls (what was sent stays sent)."""
    while done[0] < upto:
        stream, k = streams[done[0]]
        if bus.stream_counts[stream] > k:
            done[0] += 1
            continue
        bus.progress.clear()
        try:
            await asyncio.wait_for(bus.progress.wait(), idle_timeout)
        except TimeoutError:
            return False
    return True


class _Work:
    """The replayed actor's work in hand on threads, so the replay can let it finish before the next record,
    as the original (it was not racing a replay) mostly did: what it handed to ``asyncio.to_thread`` (the
    default executor) and its transfers in ``actors.threads.in_thread`` daemon threads, each counted by the
    executor the replay's loop runs them on (:func:`_counted`). A thread waiting on a stand-in link for the place in the log where
    the original's transfer ended is *parked*: not in hand, the driver has to move on to release it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.busy = 0
        self.parked = 0
        self.changed = asyncio.Event()
        self.loop = loop
        self._lock = threading.Lock()

    @property
    def in_hand(self) -> int:
        return self.busy - self.parked

    def count(self, n: int) -> None:
        """``n`` calls started (+) or ended (-), from any thread. An ended call has already handed its result
        to the event loop (queued before this wake-up), so the driver's next turns run what awaited it."""
        with self._lock:
            self.busy += n
        if n < 0 and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.changed.set)

    def park(self, n: int) -> None:
        """``n`` threads began (+) or ended (-, by the driver's release) waiting on a stand-in link."""
        with self._lock:
            self.parked += n
        if n > 0 and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.changed.set)


def _counted(base: type) -> type:
    """An executor class like ``base`` whose calls are counted in a :class:`_Work` (the replayed actor's default
    executor, and the executor its loop runs ``in_thread`` calls on)."""

    class Counting(base):
        def __init__(self, work: _Work, **kw: Any) -> None:
            super().__init__(**kw)
            self.work = work

        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
            self.work.count(1)
            fut = super().submit(fn, *args, **kwargs)
            # Counted done after the callback asyncio adds once this returns (run_in_executor, on the loop), so
            # the result is on its way to the loop before the driver hears the work ended.
            self.work.loop.call_soon_threadsafe(fut.add_done_callback, lambda _: self.work.count(-1))
            return fut

    Counting.__name__ = f"Counting{base.__name__}"
    return Counting


async def _settle(work: _Work, idle_timeout: float) -> bool:
    """Let work the actor has handed to threads finish and its continuations run; False if it is still
    busy after ``idle_timeout`` s. Nothing to do (no work in threads) costs no yield, so messages that
    arrived together are still handled together."""
    try:
        async with asyncio.timeout(idle_timeout):
            while work.in_hand > 0:
                while work.in_hand > 0:
                    work.changed.clear()
                    await work.changed.wait()
                for _ in range(8):   # the awaiting coroutines resume, and may hand over more work
                    await asyncio.sleep(0)
    except TimeoutError:
        return False
    return True


class TransferNeverEnded(BulkError):
    """A stand-in link's transfer that the original never finished, failed once the replay is over."""


def _quiet_after_the_replay(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The replay's event loop's exception handler: a transfer failed once the replay was over is nobody's
    concern (the task that awaited it was cancelled, nothing is compared any more); the rest as usual."""
    if not isinstance(context.get("exception"), TransferNeverEnded):
        loop.default_exception_handler(context)


class _LinkGate:
    """The stand-in links' transfers end where the original's did: the n-th formation of a link at its n-th
    ``bulk_formed`` record (failing if that one failed), the n-th bucket received on a link at its n-th
    ``bulk_in`` record, the n-th bucket sent to a peer (``link#rank``) at its n-th ``bulk_out`` record. One the
    original never finished (it stopped first, or it failed) never ends; closing the gate fails those."""

    def __init__(self, work: _Work, formations: bool) -> None:
        self.work = work
        self.formations = formations       # the log records formations (else they end at once, as before)
        self._cond = threading.Condition()
        self._started: dict[tuple, int] = defaultdict(int)
        self._released: dict[tuple, int] = defaultdict(int)
        self._errors: dict[tuple, str] = {}
        self._parked: set[tuple] = set()
        self._closed = False
        self._loop_thread = threading.get_ident()

    @staticmethod
    def key(rec: LogRecord) -> tuple[str, str]:
        kind = rec.kind.removeprefix("bulk_")
        return kind, rec.peer if kind == "out" else rec.peer.split("#")[0]

    def wait(self, key: tuple[str, str]) -> None:
        """In the transfer's thread: return once the driver reached the record where the original's ended."""
        if key[0] == "formed" and not self.formations:
            return
        with self._cond:
            n = self._started[key]
            self._started[key] += 1
            # (Called on the event loop itself it cannot wait for the driver: it ends at once, as it used to.)
            if self._released[key] <= n and threading.get_ident() != self._loop_thread:
                self._parked.add((key, n))
                self.work.park(1)
                while self._released[key] <= n and not self._closed:
                    self._cond.wait()
            if (key, n) in self._errors:
                raise BulkError(self._errors[(key, n)])
            if self._released[key] <= n and self._closed:
                raise TransferNeverEnded(f"{key[1]}: the original's transfer never ended (the replay is over)")

    def release(self, rec: LogRecord) -> None:
        """The driver reached ``rec``: the transfer it records ends."""
        key = self.key(rec)
        error = msgpack.unpackb(rec.frames[0], raw=False).get("error") if key[0] == "formed" else None
        with self._cond:
            n = self._released[key]
            self._released[key] += 1
            if error is not None:
                self._errors[(key, n)] = error
            if (key, n) in self._parked:
                self._parked.discard((key, n))
                self.work.park(-1)
            self._cond.notify_all()

    def close(self) -> None:
        """The replay is over: a transfer still waiting fails, so its thread ends."""
        with self._cond:
            self._closed = True
            self.work.park(-len(self._parked))
            self._parked.clear()
            self._cond.notify_all()


class _Deliverer:
    """Delivers messages as the Bus does: the handler is called on receipt (a plain ``def`` runs there and
    then), a coroutine handler is started as a task once fewer than ``max_inflight`` run (the Bus stops
    reading meanwhile, so the log already holds the later messages after it), its reply sent when it ends."""

    def __init__(self, actor: Any, bus: ReplayBus, result: ReplayResult, max_inflight: int) -> None:
        self.actor, self.bus, self.result, self.max_inflight = actor, bus, result, max_inflight
        self.waiting: deque[tuple[Envelope, Any]] = deque()

    def deliver(self, env: Envelope) -> None:
        token = current_cause.set(env.header.id)
        try:
            out = self.actor.dispatch(env)
        except Exception as exc:   # the Bus logs it and goes on; so does the replay, noting it
            self.result.notes.append(f"handler of {env.header.kind} failed: {exc!r}")
            return
        finally:
            current_cause.reset(token)
        if asyncio.iscoroutine(out):
            self.waiting.append((env, out))
            self._pump()
        elif isinstance(out, Message):
            env.reply(out)

    def _pump(self) -> None:
        while self.waiting and self.bus.inflight < self.max_inflight:
            env, coro = self.waiting.popleft()
            token = current_cause.set(env.header.id)
            try:
                task = asyncio.get_running_loop().create_task(coro)
            finally:
                current_cause.reset(token)
            self.bus._handler_tasks.add(task)
            task.add_done_callback(lambda t, env=env: self._done(env, t))

    def _done(self, env: Envelope, t: asyncio.Task) -> None:
        self.bus._handler_tasks.discard(t)
        if not t.cancelled():
            if t.exception() is not None:
                self.result.notes.append(f"handler of {env.header.kind} failed: {t.exception()!r}")
            elif isinstance(t.result(), Message):
                env.reply(t.result())
        self._pump()

    def close(self) -> None:
        for _, coro in self.waiting:
            coro.close()
        self.waiting.clear()


async def _replay(path: str, cls_path: str, segment: int, idle_timeout: float = 60.0,
                  overrides: Sequence[str] = (), float_tol: float = 0.0,
                  to_end: bool = False) -> ReplayResult:
    from actors.base import ActorSpec, load_actor_class
    from actors.threads import DaemonThreads, run_blocking_on

    meta, records, torn = _load(path, segment)
    result = ReplayResult()
    if torn:
        result.notes.append(f"{torn} (skipped)")
    if "spec" not in meta:
        raise ReplayError(f"{path}: segment {segment} has no actor spec (not written by an Actor)")
    outbound_recorded = bool(meta.get("outbound"))

    # The original's requests in order per cause, the replies it received (by the request's id), and for
    # every inbound message how many outbound ones the original had sent before it arrived: the replay
    # delivers it only once the actor has caught up that far, so background work (a dispatch loop, a
    # handler still waiting) interleaves with the inbound messages as it did in the original.
    inbound: list[tuple[LogRecord, Any, int]] = []
    replies_by_id = {}
    originals: dict[str | None, list[tuple]] = defaultdict(list)
    original_requests: dict[str | None, list[str]] = defaultdict(list)
    # inbound messages, replies, heartbeat events and the ends of link transfers, in log order
    schedule: list[tuple[LogRecord, Any, int]] = []
    n_out = 0
    streams: list[tuple] = []          # each outbound record's (cause, peer) and its place on that stream
    stream_len: dict[tuple, int] = defaultdict(int)
    buckets: dict[str, deque] = defaultdict(deque)     # link -> the buckets the original received, in order
    stop_at: LogRecord | None = None   # where the original began to stop (a signal, or a handler asked)
    for rec in records:
        if rec.rejected:
            continue
        if rec.kind == "event" and rec.event == "stopping":
            stop_at = stop_at or rec
            continue
        if rec.kind == "event" or rec.kind.startswith("bulk_"):
            # a heartbeat verdict, or a link transfer that ended here (the stand-in link's ends here too)
            schedule.append((rec, None, n_out))
        if rec.kind in ("event", "bulk_formed"):
            continue
        if rec.kind == "bulk_in":
            if not rec.tensors_stored:
                raise ReplayError(f"{path}: bucket record {rec.index} has a checksum only; replay needs tensors='store'")
            buckets[rec.peer.split("#")[0]].append(rec.frames)
            continue
        header = _BULK_HEADER if rec.kind == "bulk_out" else decode_header(rec.frames)[0]
        if rec.kind == "in":
            if header.reply_to is not None:
                replies_by_id[header.reply_to] = rec
            else:
                inbound.append((rec, header, n_out))
            schedule.append((rec, header, n_out))
        else:
            n_out += 1
            stream = (rec.cause, rec.peer)
            streams.append((stream, stream_len[stream]))
            stream_len[stream] += 1
            originals[rec.cause].append((rec, header))
            if header.wants_reply:
                original_requests[rec.cause].append(header.id)
    replies, reply_key = {}, {}
    for cause, ids in original_requests.items():
        for n, mid in enumerate(ids):
            reply_key[mid] = (cause, n)
            if mid in replies_by_id:
                rec = replies_by_id[mid]
                if not rec.tensors_stored:
                    raise ReplayError(f"{path}: reply record {rec.index} has tensor checksums only; "
                                      f"replay needs tensors='store'")
                replies[(cause, n)] = rec.frames

    with tempfile.TemporaryDirectory(prefix="replay-") as run_dir:
        spec_dict = dict(meta["spec"])
        settings = {k: v for k, v in (spec_dict.get("settings") or {}).items() if k != "message_log"}
        settings["log_console"] = False
        try:
            problems = apply_overrides(settings, [o.removeprefix("experiment.") for o in overrides])
        except TopologyError as exc:
            raise ReplayError("; ".join(exc.problems)) from None
        if problems:
            raise ReplayError("; ".join(problems))
        spec_dict.update(cls=cls_path, run_dir=run_dir, settings=settings, curve=None, tokens=None)
        spec = ActorSpec.from_dict(spec_dict)
        _apply_threads(spec.env)
        actor = load_actor_class(cls_path)(spec)
        bus = ReplayBus(spec.name, replies, spec.peers)
        actor.bus = bus
        work = _Work(asyncio.get_running_loop())
        gate = _LinkGate(work, formations=bool(meta.get("link_formations")))
        actor.make_link = lambda config: ReplayLink(config, buckets, bus, gate)
        # request_stop() works as in a run: a handler that ends the actor (RunFinished) gets its drain.
        actor._stop_event, actor._force_event = asyncio.Event(), asyncio.Event()
        stopped_early = False
        expected_keys: dict[tuple, list] = defaultdict(list)
        for cause, recs in originals.items():
            for e in recs:
                expected_keys[(cause, e[0].peer)].append(_expected_key(e))
        checked, caught = [0], [0]
        max_inflight = actor.cfg.bus.max_inflight or MAX_INFLIGHT
        started = stopped = False
        deliverer = _Deliverer(actor, bus, result, max_inflight)
        loop = asyncio.get_running_loop()
        loop.set_default_executor(_counted(concurrent.futures.ThreadPoolExecutor)(
            work, max_workers=4, thread_name_prefix="replay-work"))
        run_blocking_on(loop, _counted(DaemonThreads)(work))
        asyncio.get_running_loop().set_exception_handler(_quiet_after_the_replay)
        try:
            await actor.start()
            started = True
            await actor.on_ready()
            stalled = None
            for rec, header, before in schedule:
                # A pair that already differs is the answer: no need to wait for what can no longer match.
                if outbound_recorded and not to_end and _differs_so_far(bus, expected_keys, checked, float_tol):
                    stopped_early = True
                    break
                if rec.kind != "event" and not rec.tensors_stored:
                    raise ReplayError(f"{path}: record {rec.index} kept tensor checksums only; replay needs tensors='store'")
                if not await _caught_up(bus, streams, caught, before, idle_timeout):
                    stalled = (rec, before)
                    break
                if not await _settle(work, idle_timeout):
                    stalled = (rec, before)
                    break
                if rec.kind.startswith("bulk_"):    # the original's transfer ended here
                    gate.release(rec)
                    continue
                if rec.kind == "event":            # the original's bus declared a peer dead or alive here
                    bus.alive[rec.peer] = rec.event == "peer_alive"
                    (actor.on_peer_alive if bus.alive[rec.peer] else actor.on_peer_dead)(rec.peer)
                    continue
                if header.reply_to is not None:    # a reply to one of the actor's requests
                    if header.reply_to in reply_key:
                        bus.release(reply_key[header.reply_to])
                    continue
                header, msg = decode(rec.frames)
                deliverer.deliver(Envelope(header, msg, rec.frames, None, bus))
                # No yield here: the next message follows at once unless the original sent something in
                # between (then _caught_up waits for it), as messages that arrived together are handled
                # together by the Bus before any handler task runs.
                result.fed += 1
            if stalled is None and not stopped_early and not await _caught_up(bus, streams, caught, n_out, idle_timeout):
                stalled = (None, n_out)
            if stalled is not None:
                rec, count = stalled
                where = f"before log record {rec.index}" if rec is not None else "by the end of the log"
                (cause, peer), k = streams[caught[0]]
                result.notes.append(f"the original had sent {count} messages {where}; the replay never sent "
                                    f"message #{k} to {peer} caused by {cause or 'startup/background work'} "
                                    f"(it sent {bus.count} in all, then nothing for {idle_timeout:g} s)")
                stopped_early = True
            elif actor._stop_event.is_set() and not stopped_early:
                async with asyncio.timeout(idle_timeout):
                    await actor._drain()
                    await actor.on_stop()
                stopped = True
            result.metrics = _read_metrics(Path(run_dir) / "metrics.jsonl")
        finally:
            deliverer.close()
            for t in [*actor._background, *bus._handler_tasks]:
                t.cancel()
            await asyncio.gather(*actor._background, *bus._handler_tasks, return_exceptions=True)
            if started and not stopped:
                # Its worker pools, threads and links still need closing; what it sends now is not compared.
                bus.frozen = True
                try:
                    async with asyncio.timeout(idle_timeout):
                        await actor.on_stop()
                except Exception as exc:
                    result.notes.append(f"on_stop after the replay failed: {exc!r}")
            # Transfers the original never finished still wait on the stand-in links: they fail now (what the
            # actor makes of that is not compared), and their threads end before the loop does.
            bus.frozen = True
            gate.close()
            await _settle(work, idle_timeout)
            run_blocking_on(loop, None)
    result.sent = bus.count
    if actor.exit_code:    # a critical background task failed (Actor.spawn): say why, not just "nothing"
        result.notes.append(f"the replayed actor stopped with exit code {actor.exit_code}: {actor._stop_reason}")
    if not outbound_recorded:
        result.notes.append("the log has no outbound records (message_log.outbound was off): nothing to compare")
        return result
    result.compared = True
    # What the original received after the last message it answered, and never answered, it received as it
    # stopped (the run ended): the log cannot say what it would have sent, so the replay's answers to those
    # are not compared.
    answered = [pos for pos, (_, h, _) in enumerate(inbound) if h.id in originals]
    tail = inbound[answered[-1] + 1:] if answered else []
    unanswered = {h.id for _, h, _ in tail}
    if extra := sum(len(bus.sent.get(cause, [])) for cause in unanswered):
        result.notes.append(f"the original answered none of the last {len(tail)} inbound messages (it stopped "
                            f"first); the replay's {extra} message(s) answering them are not compared")
    stop_index = stop_at.index if stop_at is not None else None
    if stop_index is not None and (late := sum(r.index > stop_index for sent in originals.values() for r, _ in sent)):
        result.notes.append(f"the original began to stop at log record {stop_index}: the {late} message(s) it "
                            f"sent from then on (as it drained) are not compared")
    # Stopped early, the replay lacks what it never got to send: a pair that differs is the divergence, and
    # only without one is the first missing message.
    result.divergence = \
        (stopped_early and _first_divergence(inbound, originals, bus, True, float_tol, unanswered, stop_index)) or \
        _first_divergence(inbound, originals, bus, False, float_tol, unanswered, stop_index)
    return result


def _same(exp_key: tuple, act: _Sent, tol: float) -> bool:
    """Whether a replayed message matches the original's: the same wire body, or with ``tol``, the same up
    to floats within it."""
    if exp_key == act.key:
        return True
    if not tol or exp_key[:2] != act.key[:2] or exp_key[3] != act.key[3]:
        return False
    return _first_field_diff(msgpack.unpackb(exp_key[2], raw=False), act.body, [], [], tol=tol) is None


def _by_peer(items: list, peer_of: Callable[[Any], str]) -> dict[str, list]:
    """Items split by peer, in order, the peers in order of first appearance."""
    out: dict[str, list] = {}
    for item in items:
        out.setdefault(peer_of(item), []).append(item)
    return out


def _first_divergence(inbound: list, originals: dict, bus: ReplayBus, skip_missing: bool,
                      tol: float = 0.0, unanswered: frozenset | set = frozenset(),
                      stop_index: int | None = None) -> Divergence | None:
    """Compare the replay's outbound messages with the original's, cause by cause in delivery order and, for
    one cause, peer by peer: what one peer receives comes in order, but messages to different peers (a
    weight push to every rollout at once, on threads) may interleave differently in any rerun.
    ``skip_missing``: only a pair that differs counts (the replay was stopped before it could finish).
    ``unanswered``: causes the original received as it stopped; the replay's answers to them are skipped.
    ``stop_index``: the log record where the original began to stop. What it sent from there on is left out,
    and for a cause it answered (or received) from there on only a pair that differs counts: the replay
    does not stop there, so it may send what the original did not, or not yet what it did."""
    order: list[tuple[int, LogRecord | None, str | None]] = [(-1, None, None)]
    order += [(i, rec, h.id) for i, (rec, h, _) in enumerate(inbound)]
    for pos, rec, cause in order:
        if cause in unanswered:
            continue
        sent = originals.get(cause, [])
        lenient = skip_missing
        if stop_index is not None and ((rec is not None and rec.index > stop_index)
                                       or any(e[0].index > stop_index for e in sent)):
            sent, lenient = [e for e in sent if e[0].index < stop_index], True
        expected = _by_peer(sent, lambda e: e[0].peer)
        actual = _by_peer(bus.sent.get(cause, []), lambda a: a.peer)
        for peer in [*expected, *(p for p in actual if p not in expected)]:
            exp_list, act_list = expected.get(peer, []), actual.get(peer, [])
            for j in range(max(len(exp_list), len(act_list))):
                exp = exp_list[j] if j < len(exp_list) else None
                act = act_list[j] if j < len(act_list) else None
                if lenient and (exp is None or act is None):
                    continue
                exp_key = _expected_key(exp) if exp else None
                if exp is not None and act is not None and _same(exp_key, act, tol):
                    continue
                exp_text = "nothing" if exp is None else \
                    f"{exp[1].kind} -> {exp[0].peer} {json.dumps(_jsonable(_describe(exp[0]).get('fields')))}"
                act_text = "nothing" if act is None else f"{act.kind} -> {act.peer} {json.dumps(_jsonable(act.plain))}"
                d = Divergence(pos, rec.index if rec else None, inbound[pos][1].kind if pos >= 0 else None, j,
                               exp_text, act_text, message=(exp[1].kind if exp else act.kind), peer=peer)
                if exp is not None and act is not None and exp[1].kind == act.kind:
                    exp_body = msgpack.unpackb(exp_key[2], raw=False)
                    d.field = _first_field_diff(exp_body, act.body, list(exp_key[3]), act.sums, tol=tol)
                    if d.field is not None:
                        d.expected = json.dumps(_jsonable(_field_value(to_plain_body(exp, exp_body), d.field)))
                        d.actual = json.dumps(_jsonable(_field_value(act.plain, d.field)))
                return d
    return None


def _differs_so_far(bus: ReplayBus, expected_keys: dict, checked: list[int], tol: float) -> bool:
    """Whether a message sent since the last call differs from the original's at its place."""
    seen = bus.per_peer_seen
    for cause, j in bus.order[checked[0]:]:
        checked[0] += 1
        sent = bus.sent[cause][j]
        k = seen[(cause, sent.peer)]
        seen[(cause, sent.peer)] += 1
        exp = expected_keys.get((cause, sent.peer), [])
        if k < len(exp) and not _same(exp[k], sent, tol):
            return True
    return False


def _expected_key(exp: tuple) -> tuple:
    rec = exp[0]
    if rec.kind == "bulk_out":
        return _bulk_key(rec.peer, msgpack.unpackb(rec.frames[0], raw=False))
    return _wire_key(rec.frames if rec.tensors_stored else rec.frames[:1], rec.peer, rec.sums)


def _bulk_key(peer: str, header: dict) -> tuple:
    """A bucket sent on a bulk link compares by its header: names, shapes, offsets and its bytes' checksum."""
    return peer, "bulk", msgpack.packb(header), ()


# The header that stands for a bucket sent on a bulk link among the outbound messages.
_BULK_HEADER = types.SimpleNamespace(kind="bulk", id=None, wants_reply=False, reply_to=None)


class ReplayLink:
    """Stands in for transport.bulk.BulkLink: hands the replayed actor the buckets the original received
    (from the log), and captures the headers of the buckets it sends for comparison. No peer is there to
    wait for: a formation, a bucket received and a bucket sent each end where the original's ended in the
    log (``gate``), a formation failing if the original's failed."""

    def __init__(self, config: Any, buckets: dict[str, deque], bus: ReplayBus, gate: _LinkGate) -> None:
        self.config = config
        self.epoch: int | None = None
        self.members: list[str] = list(config.members)
        self._rank = config.rank
        self._in = buckets[config.name]
        self._bus = bus
        self._gate = gate
        self._next_bucket = 0

    def open(self, epoch: int = 0, members: Any = None) -> None:
        self._gate.wait(("formed", self.config.name))
        self.members = list(members) if members else list(self.config.members)
        if self.config.members:
            self._rank = self.members.index(self.config.members[self.config.rank])
        self.epoch = epoch

    def reform(self, epoch: int, members: Any = None) -> None:
        self.open(epoch, members)

    @property
    def rank(self) -> int:
        return self._rank

    def latest_epoch(self) -> int | None:
        return self.epoch

    def close(self) -> None:
        self.epoch = None

    def barrier(self) -> None:
        pass

    def _take(self) -> Any:
        import torch

        from transport.bulk import PackedBucket

        self._gate.wait(("in", self.config.name))
        if not self._in:
            raise ReplayError(f"link {self.config.name!r}: the replayed actor receives one more bucket than the "
                              f"original did")
        frames = self._in.popleft()
        header = msgpack.unpackb(frames[0], raw=False)
        return PackedBucket(header, torch.frombuffer(bytearray(frames[1]), dtype=torch.uint8))

    def _sent(self, peer: str, packed: Any) -> None:
        # Captured once it ended, as the original logged it: one it never finished it never sent.
        self._gate.wait(("out", f"{self.config.name}#{peer}"))
        self._bus.capture_bulk(f"{self.config.name}#{peer}", packed.header)

    def broadcast(self, bucket: Any, src: int = 0, epoch: int | None = None) -> Any:
        from transport.bulk import pack_bucket, unpack_bucket

        if self._rank == src:
            self._sent("all", pack_bucket(bucket, self._take_id()))
            return bucket
        return unpack_bucket(self._take(), self.config.name)

    def broadcast_packed(self, packed: Any, src: int = 0, epoch: int | None = None) -> Any:
        if self._rank == src:
            self._sent("all", packed)
            return packed
        return self._take()

    def send(self, bucket: Any, dst: int, epoch: int | None = None) -> None:
        from transport.bulk import pack_bucket

        self._sent(str(dst), pack_bucket(bucket, self._take_id()))

    def send_packed(self, packed: Any, dst: int, epoch: int | None = None) -> None:
        self._sent(str(dst), packed)

    def recv(self, src: int, epoch: int | None = None) -> Any:
        from transport.bulk import unpack_bucket

        return unpack_bucket(self._take(), self.config.name)

    def _take_id(self) -> int:
        self._next_bucket += 1
        return self._next_bucket - 1


def to_plain_body(exp: tuple, body: Any) -> Any:
    """The original's fields as to_plain gives them (tensors described), for the report."""
    return _describe(exp[0]).get("fields", body)


def _apply_threads(env: dict[str, str]) -> None:
    """The original's thread count (float sums depend on it): OMP_NUM_THREADS from its spec's env."""
    if env.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


def replay_into(path: str, cls_path: str, segment: int = 0, idle_timeout: float = 60.0,
                overrides: Sequence[str] = (), float_tol: float = 0.0, to_end: bool = False) -> ReplayResult:
    """Replay ``path``'s inbound messages into a fresh ``cls_path`` actor and compare what it sends.
    ``overrides``: settings changed for the replay (``KEY=VALUE``, the launcher's grammar, e.g. "algo.batch_size=8";
    the actor's settings model checks them). ``to_end``:
    deliver the whole log even after a divergence (offline re-training with changed settings)."""
    import uvloop

    return uvloop.run(_replay(path, cls_path, segment, idle_timeout, overrides, float_tol, to_end))


# Per step, side by side: what an algorithm change does to the update (the trainer's metrics.jsonl keys).
TRAIN_COLUMNS = (("loss", "loss"), ("kl", "ppo_approx_kl"), ("clip ratio", "actor_clip_ratio"),
                 ("grad norm", "grad_norm"))


def _read_metrics(path: Path) -> list[dict]:
    """A metrics.jsonl's records, the last one of each step (a restarted trainer writes re-done steps again)."""
    if not path.exists():
        return []
    by_step: dict[Any, dict] = {}
    for line in path.read_text().splitlines():
        if line.endswith("}"):
            rec = json.loads(line)
            by_step[rec.get("step")] = rec
    return list(by_step.values())


def metrics_table(recorded: list[dict], replayed: list[dict]) -> str:
    """The recorded run's and the replay's loss, KL, clip ratio and grad norm, one row per step."""
    old = {r.get("step"): r for r in recorded}
    head = f"{'step':>5} " + " ".join(f"{name + ' (rec/new)':>27}" for name, _ in TRAIN_COLUMNS)
    rows = [head]
    for rec in replayed:
        step = rec.get("step")
        cells = []
        for _, key in TRAIN_COLUMNS:
            a, b = old.get(step, {}).get(key), rec.get(key)
            fmt = lambda v: f"{v:.6g}" if isinstance(v, (int, float)) else "-"   # noqa: E731
            cells.append(f"{fmt(a):>13}/{fmt(b):<13}")
        rows.append(f"{step:>5} " + " ".join(cells))
    if not recorded:
        rows.append("(the recorded run's metrics.jsonl, next to its msglog directory, was not found)")
    return "\n".join(rows)


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
        print(metrics_table(_read_metrics(Path(args.log).resolve().parent.parent / "metrics.jsonl"), result.metrics))
    print(f"replayed {result.fed} inbound messages into {args.into}; it sent {result.sent}")
    if result.divergence is not None:
        print(result.divergence)
        return 1
    if result.compared:
        print("identical: every outbound message matches the original")
    return 0


if __name__ == "__main__":
    sys.exit(main())
