"""Reading a message log: one line (or JSON object) per record, filtered by kind, sender and direction."""
from __future__ import annotations

import json
import sys
from typing import Any

import msgpack

from transport.messages import DecodeError, decode, decode_header, to_plain
from transport.msglog import LogRecord, read_log

__all__ = ["describe", "jsonable", "print_log"]


def describe(rec: LogRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"index": rec.index, "t": rec.t, "dir": rec.kind, "segment": rec.segment}
    if rec.kind == "meta":
        out["meta"] = {k: v for k, v in rec.meta.items() if k != "spec"}
        return out
    if rec.kind == "event":   # the bus's verdict on a peer (dead, alive, restarted), or the actor stopping
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


def jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.hex() if len(v) <= 64 else v[:64].hex() + "..."
    if isinstance(v, dict):
        return {k: jsonable(x) for k, x in v.items()}
    if isinstance(v, list):
        return [jsonable(x) for x in v]
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
                print(f"--- segment {rec.segment}: {json.dumps(jsonable({k: v for k, v in rec.meta.items() if k != 'spec'}))}",
                      file=out)
            continue
        d = describe(rec)
        if d.get("kind") == "?" and "unknown message kind" in str(d.get("error")) and spec_module:
            # a kind the actor's own module defines (ps.weights_status): import it once, then decode
            _import_quietly(spec_module)
            spec_module = None
            d = describe(rec)
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
            print(json.dumps(jsonable(d)), file=out)
            continue
        arrow = f"{d.get('sender', '?')} ->" if rec.kind in ("in", "bulk_in", "event") else f"-> {rec.peer}"
        extra = f" REJECTED[{rec.rejected}]" if rec.rejected else ""
        extra += f" reply_to={d['reply_to']}" if d.get("reply_to") else ""
        body = json.dumps(jsonable(d.get("fields", d.get("error"))), separators=(",", ":"))
        print(f"#{rec.index:<6} +{rec.t - start:9.4f}s {rec.kind.removeprefix('bulk_'):<3} {d.get('kind', '?'):<24} {arrow:<20}{extra} {body}",
              file=out)
    if torn:
        print(f"warning: {torn} (skipped)", file=sys.stderr)
    return 0
