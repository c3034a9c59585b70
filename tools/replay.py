"""`python -m tools.replay LOG`: read a message log; `--into MODULE:Class`: replay it into a fresh actor.

Printing: one line per record (index, time since the segment start, direction, kind, sender/peer, fields),
filtered with ``--type KIND`` and ``--sender NAME`` (repeatable), ``--dir in|out``, ``--limit N``, or one
JSON object per line with ``--json``. A torn last record is reported and skipped.

Replaying: a fresh instance of the class is built from the spec stored in the log (run_dir replaced by a
temporary directory, message logging off) with a capture bus instead of the network. ``on_start`` and
``on_ready`` run, then every recorded inbound message of the chosen segment (not replies, not rejected
ones) is dispatched in order, each handler finishing before the next message. Requests the actor makes are
answered with the replies recorded for the original requests. What the actor sends (one-way, requests,
replies) is grouped by the inbound message that caused it and compared, wire body by wire body (tensors by
sha256), with the outbound messages the original recorded; the first divergence is reported with the
inbound message that caused it. Exit status: 0 identical, 1 divergence, 2 usage or log errors.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import signal
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import msgpack

import transport.protocol  # noqa: F401  (registers the rl.* message kinds so records decode)
from transport.bus import Envelope, RemoteError, current_cause
from transport.messages import DecodeError, Error, Message, decode, decode_header, encode, to_plain
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


def print_log(path: str, types: list[str], senders: list[str], direction: str | None, limit: int | None,
              as_json: bool, out: Any = None) -> int:
    out = out if out is not None else sys.stdout
    records, torn = read_log(path)
    start = 0.0
    shown = 0
    for rec in records:
        if rec.kind == "meta":
            start = rec.t
            if not as_json and not types and not senders:
                print(f"--- segment {rec.segment}: {json.dumps(_jsonable({k: v for k, v in rec.meta.items() if k != 'spec'}))}",
                      file=out)
            continue
        d = _describe(rec)
        if types and d.get("kind") not in types:
            continue
        if senders and d.get("sender") not in senders:
            continue
        if direction and rec.kind != direction:
            continue
        if limit is not None and shown >= limit:
            break
        shown += 1
        if as_json:
            print(json.dumps(_jsonable(d)), file=out)
            continue
        arrow = f"{d.get('sender', '?')} ->" if rec.kind == "in" else f"-> {rec.peer}"
        extra = f" REJECTED[{rec.rejected}]" if rec.rejected else ""
        extra += f" reply_to={d['reply_to']}" if d.get("reply_to") else ""
        body = json.dumps(_jsonable(d.get("fields", d.get("error"))), separators=(",", ":"))
        print(f"#{rec.index:<6} +{rec.t - start:9.4f}s {rec.kind:<3} {d.get('kind', '?'):<24} {arrow:<20}{extra} {body}",
              file=out)
    if torn:
        print(f"warning: {torn} (skipped)", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------ replaying

def _wire_key(frames: list, peer: str, sums: list[str] | None = None) -> tuple:
    """What must match between the original and the replay: peer, kind, body, tensor checksums."""
    head = msgpack.unpackb(bytes(frames[0]), raw=False)
    tensor_sums = sums if sums is not None else [hashlib.sha256(memoryview(f).cast("B")).hexdigest()
                                                 for f in frames[1:]]
    return peer, head[0], msgpack.packb(head[7]), tuple(tensor_sums)


@dataclass
class _Sent:
    peer: str
    kind: str
    key: tuple
    plain: Any


@dataclass
class Divergence:
    inbound_position: int          # 0-based position among the replayed inbound messages (-1: startup)
    record_index: int | None       # index of that inbound record in the log
    cause_kind: str | None
    outbound_position: int         # position among the messages caused by that inbound message
    expected: str
    actual: str

    def __str__(self) -> str:
        where = ("during startup (on_start/on_ready)" if self.inbound_position < 0 else
                 f"at inbound message #{self.inbound_position} (log record {self.record_index}, {self.cause_kind})")
        return (f"first divergence {where}, outbound #{self.outbound_position}:\n"
                f"  original: {self.expected}\n  replay:   {self.actual}")


@dataclass
class ReplayResult:
    fed: int = 0
    sent: int = 0
    compared: bool = False
    divergence: Divergence | None = None
    notes: list[str] = field(default_factory=list)


class ReplayBus:
    """Stands in for transport.bus.Bus: captures what the actor sends, answers requests from the log."""

    def __init__(self, name: str, replies: dict[tuple, list]) -> None:
        self.name = name
        self.endpoint = "replay://"
        self.draining = False
        self.sent: dict[str | None, list[_Sent]] = defaultdict(list)
        self._replies = replies                  # (cause, ordinal of that cause's requests) -> frames
        self._request_counts: dict[str | None, int] = defaultdict(int)
        from collections import Counter
        self.stats: Counter = Counter()
        self.rejected: Counter = Counter()

    def _capture(self, peer: str, msg: Message, cause: str | None, **kw: Any) -> None:
        frames = encode(msg, self.name, **kw)
        self.sent[cause].append(_Sent(peer, type(msg).KIND, _wire_key(frames, peer), to_plain(msg)))

    async def send(self, peer: str, msg: Message) -> None:
        self._capture(peer, msg, current_cause.get())

    async def request(self, peer: str, msg: Message, timeout: float | None = None) -> Message:
        cause = current_cause.get()
        self._capture(peer, msg, cause, wants_reply=True)
        n = self._request_counts[cause]
        self._request_counts[cause] += 1
        frames = self._replies.get((cause, n))
        if frames is None:
            raise ReplayError(f"the actor made request #{n} ({type(msg).KIND} to {peer}) in response to {cause!r}, "
                              f"but the log holds no reply for it")
        _, reply = decode(frames)
        if type(reply) is Error:
            raise RemoteError(peer, reply.code, reply.text, reply.kind)
        return reply

    def _send_reply(self, ident: Any, msg: Message, to: Any) -> None:
        self._capture(to.sender, msg, to.id, reply_to=to.id)

    def counters(self) -> dict[str, int]:
        return {}

    def peer_alive(self, peer: str) -> bool:
        return True


def _load(path: str, segment: int) -> tuple[dict, list[LogRecord], str | None]:
    records, torn = read_log(path)
    metas = [r for r in records if r.kind == "meta"]
    if segment >= len(metas):
        raise ReplayError(f"{path} has {len(metas)} segment(s); segment {segment} does not exist")
    return metas[segment].meta, [r for r in records if r.kind != "meta" and r.segment == segment], torn


async def _replay(path: str, cls_path: str, segment: int) -> ReplayResult:
    from actors.base import ActorSpec, load_actor_class

    meta, records, torn = _load(path, segment)
    result = ReplayResult()
    if torn:
        result.notes.append(f"{torn} (skipped)")
    if "spec" not in meta:
        raise ReplayError(f"{path}: segment {segment} has no actor spec (not written by an Actor)")
    outbound_recorded = bool(meta.get("outbound"))

    # The original's requests in order per cause, and the replies it received (by the request's id).
    inbound, replies_by_id = [], {}
    originals: dict[str | None, list[tuple]] = defaultdict(list)
    original_requests: dict[str | None, list[str]] = defaultdict(list)
    for rec in records:
        if rec.rejected:
            continue
        header, _ = decode_header(rec.frames)
        if rec.kind == "in":
            if header.reply_to is not None:
                replies_by_id[header.reply_to] = rec
            else:
                inbound.append((rec, header))
        else:
            originals[rec.cause].append((rec, header))
            if header.wants_reply:
                original_requests[rec.cause].append(header.id)
    replies = {}
    for cause, ids in original_requests.items():
        for n, mid in enumerate(ids):
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
        spec_dict.update(cls=cls_path, run_dir=run_dir, settings=settings, curve=None)
        spec = ActorSpec.from_dict(spec_dict)
        actor = load_actor_class(cls_path)(spec)
        bus = ReplayBus(spec.name, replies)
        actor.bus = bus
        await actor.start()
        await actor.on_ready()
        for rec, header in inbound:
            if not rec.tensors_stored:
                raise ReplayError(f"{path}: record {rec.index} kept tensor checksums only; replay needs tensors='store'")
            header, msg = decode(rec.frames)
            env = Envelope(header, msg, rec.frames, None, bus)
            token = current_cause.set(header.id)
            try:
                out = actor.dispatch(env)
                if asyncio.iscoroutine(out):
                    out = await out
                if isinstance(out, Message):
                    env.reply(out)
            finally:
                current_cause.reset(token)
            result.fed += 1
        for t in list(actor._background):
            t.cancel()
        await asyncio.gather(*actor._background, return_exceptions=True)
    result.sent = sum(len(v) for v in bus.sent.values())
    if not outbound_recorded:
        result.notes.append("the log has no outbound records (message_log.outbound was off): nothing to compare")
        return result
    result.compared = True
    order: list[tuple[int, LogRecord | None, str | None]] = [(-1, None, None)]
    order += [(i, rec, h.id) for i, (rec, h) in enumerate(inbound)]
    for pos, rec, cause in order:
        expected = originals.get(cause, [])
        actual = bus.sent.get(cause, [])
        for j in range(max(len(expected), len(actual))):
            exp = expected[j] if j < len(expected) else None
            act = actual[j] if j < len(actual) else None
            exp_key = _wire_key(exp[0].frames[:1] if not exp[0].tensors_stored else exp[0].frames, exp[0].peer,
                                exp[0].sums) if exp else None
            if exp is not None and act is not None and exp_key == act.key:
                continue
            exp_text = "nothing" if exp is None else \
                f"{exp[1].kind} -> {exp[0].peer} {json.dumps(_jsonable(_describe(exp[0]).get('fields')))}"
            act_text = "nothing" if act is None else f"{act.kind} -> {act.peer} {json.dumps(_jsonable(act.plain))}"
            result.divergence = Divergence(pos, rec.index if rec else None,
                                           inbound[pos][1].kind if pos >= 0 else None, j, exp_text, act_text)
            return result
    return result


def replay_into(path: str, cls_path: str, segment: int = 0) -> ReplayResult:
    """Replay ``path``'s inbound messages into a fresh ``cls_path`` actor and compare what it sends."""
    import uvloop

    return uvloop.run(_replay(path, cls_path, segment))


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
    args = ap.parse_args(argv)
    # Stopped with SIGTERM (a replay that hangs), it still removes its temporary run directory on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        if not args.into:
            return print_log(args.log, args.type, args.sender, args.dir, args.limit, args.json)
        result = replay_into(args.log, args.into, args.segment)
    except (MessageLogError, ReplayError, OSError) as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    for note in result.notes:
        print(f"note: {note}")
    print(f"replayed {result.fed} inbound messages into {args.into}; it sent {result.sent}")
    if result.divergence is not None:
        print(result.divergence)
        return 1
    if result.compared:
        print("identical: every outbound message matches the original")
    return 0


if __name__ == "__main__":
    sys.exit(main())
