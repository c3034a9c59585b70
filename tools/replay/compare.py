"""Comparing a replay with the original: what must match in an outbound message (its wire body without the
VOLATILE fields, tensors by checksum, link buckets by header), and the first divergence, cause by cause and
peer by peer."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from transport.messages import registry, upgraded_body
from transport.msglog import LogRecord

from .records import describe, jsonable

__all__ = ["BULK_HEADER", "Divergence", "Sent", "bulk_key", "differs_so_far", "expected_key", "first_divergence",
           "wire_key"]


def wire_key(frames: list, peer: str, sums: list[str] | None = None) -> tuple:
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
    return {k: "(volatile)" if k in volatile else _without_volatile(v, hints.get(k))
            for k, v in _with_defaults(body, tp).items()}


def _with_defaults(body: dict, tp: Any) -> dict:
    """``body`` with each field it lacks that has a plain default filled in, in the class's field order: a field
    added with a default since a log was written is decoded as that default, so the comparison reads it so too
    (a recorded body without it equals a replayed one that sends the default)."""
    filled = {}
    for f in dataclasses.fields(tp):
        if f.name in body:
            filled[f.name] = body[f.name]
        elif f.default is not dataclasses.MISSING and isinstance(f.default, (str, int, float, bool, type(None))):
            filled[f.name] = f.default
        elif f.default_factory in (list, dict):   # type: ignore[comparison-overlap]
            filled[f.name] = f.default_factory()
    return {**filled, **body} if list(filled) != list(body) else body


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:    # an annotation that cannot be resolved: compare that class's fields as they are
        return {}


@dataclass
class Sent:
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


def _same(exp_key: tuple, act: Sent, tol: float) -> bool:
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


def first_divergence(inbound: list, originals: dict, bus: Any, skip_missing: bool,
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
                exp_key = expected_key(exp) if exp else None
                if exp is not None and act is not None and _same(exp_key, act, tol):
                    continue
                exp_text = "nothing" if exp is None else \
                    f"{exp[1].kind} -> {exp[0].peer} {json.dumps(jsonable(describe(exp[0]).get('fields')))}"
                act_text = "nothing" if act is None else f"{act.kind} -> {act.peer} {json.dumps(jsonable(act.plain))}"
                d = Divergence(pos, rec.index if rec else None, inbound[pos][1].kind if pos >= 0 else None, j,
                               exp_text, act_text, message=(exp[1].kind if exp else act.kind), peer=peer)
                if exp is not None and act is not None and exp[1].kind == act.kind:
                    exp_body = msgpack.unpackb(exp_key[2], raw=False)
                    d.field = _first_field_diff(exp_body, act.body, list(exp_key[3]), act.sums, tol=tol)
                    if d.field is not None:
                        d.expected = json.dumps(jsonable(_field_value(to_plain_body(exp, exp_body), d.field)))
                        d.actual = json.dumps(jsonable(_field_value(act.plain, d.field)))
                return d
    return None


def differs_so_far(bus: Any, expected_keys: dict, checked: list[int], tol: float) -> bool:
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


def expected_key(exp: tuple) -> tuple:
    rec = exp[0]
    if rec.kind == "bulk_out":
        return bulk_key(rec.peer, msgpack.unpackb(rec.frames[0], raw=False))
    return wire_key(rec.frames if rec.tensors_stored else rec.frames[:1], rec.peer, rec.sums)


def bulk_key(peer: str, header: dict) -> tuple:
    """A bucket sent on a bulk link compares by its header: names, shapes, offsets and its bytes' checksum."""
    return peer, "bulk", msgpack.packb(header), ()


# The header that stands for a bucket sent on a bulk link among the outbound messages.
BULK_HEADER = types.SimpleNamespace(kind="bulk", id=None, wants_reply=False, reply_to=None)


def to_plain_body(exp: tuple, body: Any) -> Any:
    """The original's fields as to_plain gives them (tensors described), for the report."""
    return describe(exp[0]).get("fields", body)
