"""Append-only message logs: what an actor received (and optionally sent), replayable later.

File layout: an 8-byte magic ``AREALML1`` then records, each ``<u32 length><u32 crc32><payload>``
(little endian) where payload is one msgpack map:

    {"k": "meta", "t": time, "actor": name, "spec": {...}, "link_formations": true}   # once per open
    {"k": "in" | "out", "t": time, "peer": name, "frames": [frame0, tensor bytes...],
     "sums": [sha256 hex of each tensor frame], "rejected": reason?, "cause": id?}
    {"k": "bulk_in" | "bulk_out", "t": time, "peer": "link#rank", "link": name,
     "frames": [msgpack bucket header, bucket bytes (bulk_in, tensors="store")], "sums": [sha256]?, "cause": id?}
    {"k": "bulk_formed", "t": time, "peer": "link#all", "link": name,
     "frames": [msgpack {"epoch", "members", "rank", "error"?}], "cause": id?}   # an epoch formed (or failed)
    {"k": "event", "t": time, "peer": name, "event": "peer_dead" | "peer_alive" | "peer_restarted"}  # bus verdicts
    {"k": "event", "t": time, "peer": own name, "event": "stopping"}                   # the actor began to stop

A bulk record is written when its operation ended (a bucket received or sent, an epoch formed): where it
stands among the messages is where the actor saw the transfer end. ``link_formations`` in the meta says that
formations are recorded (logs written before they were have none).

``frames[0]`` is the message's header+body frame exactly as it crossed the wire, so a record decodes with
:func:`transport.messages.decode`. Tensor frames are stored whole (``tensors="store"``) or only as
checksums (``tensors="checksum"``, then ``frames`` holds frame 0 alone and replay cannot rebuild tensors).

Every record is written with one ``os.write`` (flushed per record by default, or per small batch with
``flush_every``), so a crashed process loses at most the unflushed batch; a torn final record (short or
failing its CRC) is reported by :class:`MessageLogReader` and skipped. Damage before the last record is an
error naming the record and byte offset, including a corrupt length that overruns the file while intact
records follow it (a crash tears only the last write, so that is not a torn tail).
"""
from __future__ import annotations

import hashlib
import os
import re
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import msgpack

MAGIC = b"AREALML1"
_HEAD = struct.Struct("<II")
MAX_RECORD_BYTES = 1 << 31

__all__ = ["MessageLogWriter", "MessageLogReader", "LogRecord", "MessageLogError", "read_log"]


class MessageLogError(ValueError):
    """A message log is not readable: wrong magic, or a damaged record before the end (offset named)."""


def _frame_bytes(frame: Any) -> memoryview | bytes:
    if type(frame) is bytes:
        return frame
    if hasattr(frame, "buffer"):
        return frame.buffer
    return memoryview(frame).cast("B")


class MessageLogWriter:
    """Appends records to ``path``; one writer per actor process.

    ``tensors``: "store" (whole tensor frames) or "checksum" (sha256 only). ``flush_every``: records per
    write batch (1 = every record reaches the OS before the call returns).
    """

    def __init__(self, path: str | os.PathLike, *, tensors: str = "store", flush_every: int = 1,
                 meta: dict | None = None) -> None:
        if tensors not in ("store", "checksum"):
            raise ValueError(f"tensors must be 'store' or 'checksum', not {tensors!r}")
        if flush_every < 1:
            raise ValueError("flush_every must be >= 1")
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self.tensors = tensors
        self.flush_every = flush_every
        self._pending: list[bytes] = []
        # Bulk links record from the threads their transfers run in, alongside the event loop's records.
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.records = 0
        if os.fstat(self._fd).st_size == 0:
            os.write(self._fd, MAGIC)
        self._append({"k": "meta", "t": time.time(), "pid": os.getpid(), "link_formations": True, **(meta or {})},
                     force=True)

    def record(self, direction: str, frames: list, *, peer: str = "", t: float | None = None,
               rejected: str | None = None, cause: str | None = None) -> None:
        """Append one message. ``frames`` as on the wire (bytes, memoryviews or zmq.Frame)."""
        tensor_frames = [_frame_bytes(f) for f in frames[1:]]
        rec: dict[str, Any] = {"k": direction, "t": time.time() if t is None else t, "peer": peer}
        first = _frame_bytes(frames[0]) if frames else b""
        if self.tensors == "store":
            rec["frames"] = [first, *tensor_frames]
        else:
            rec["frames"] = [first]
        if tensor_frames:
            rec["sums"] = [hashlib.sha256(f).hexdigest() for f in tensor_frames]
        if rejected is not None:
            rec["rejected"] = rejected
        if cause is not None:
            rec["cause"] = cause
        self._append(rec)

    def record_bulk(self, direction: str, link: str, peer: str, header: dict, flat: Any = None,
                    cause: str | None = None) -> None:
        """Append one bucket of a bulk link (transport.bulk) once it has moved. ``direction`` "in": a received
        bucket, its bytes kept when tensors are stored (replay hands them to the replayed actor); "out": a sent
        one, its header only (names, shapes, offsets and the checksum of its bytes: enough to compare);
        "formed": not a bucket but an epoch of the link formed, ``header`` its epoch, members, this member's
        rank and, if the formation failed, the error."""
        rec: dict[str, Any] = {"k": f"bulk_{direction}", "t": time.time(), "peer": peer, "link": link,
                               "frames": [msgpack.packb(header, use_bin_type=True)]}
        if direction == "in" and flat is not None:
            data = _frame_bytes(flat)
            rec["sums"] = [hashlib.sha256(data).hexdigest()]
            if self.tensors == "store":
                rec["frames"].append(data)
        if cause is not None:
            rec["cause"] = cause
        self._append(rec)

    def record_event(self, event: str, peer: str) -> None:
        """Append what no message carries and an actor acts on: the bus's verdicts on its peers (``peer_dead``,
        ``peer_alive``, ``peer_restarted``: it re-issues work, asks again), and ``stopping`` (a signal or a
        handler began its stop: what it sends from then on, it sends as it drains)."""
        self._append({"k": "event", "t": time.time(), "peer": peer, "event": event})

    def _append(self, rec: dict, force: bool = False) -> None:
        if self._fd < 0:
            return
        payload = msgpack.packb(rec, use_bin_type=True)
        with self._lock:
            self._pending.append(_HEAD.pack(len(payload), zlib.crc32(payload)) + payload)
            self.records += 1
            if force or len(self._pending) >= self.flush_every:
                self._flush()

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        if self._pending and self._fd >= 0:
            data = b"".join(self._pending)
            self._pending.clear()
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                self._flush()
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> "MessageLogWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class LogRecord:
    index: int
    offset: int
    kind: str                  # "meta", "in", "out", "bulk_in", "bulk_out" or "event"
    t: float
    peer: str = ""
    frames: list[bytes] = field(default_factory=list)
    sums: list[str] = field(default_factory=list)
    rejected: str | None = None
    cause: str | None = None
    segment: int = 0           # which open() of the file (a restarted actor appends a new segment)
    event: str | None = None   # kind "event": peer_dead, peer_alive, peer_restarted or stopping
    meta: dict = field(default_factory=dict)

    @property
    def tensors_stored(self) -> bool:
        return len(self.frames) == 1 + len(self.sums)


class MessageLogReader:
    """Iterates the records of a log. After iteration, ``torn`` holds a description of a skipped torn tail."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.torn: str | None = None

    def __iter__(self) -> Iterator[LogRecord]:
        with open(self.path, "rb") as fh:
            data = fh.read()
        if data[:len(MAGIC)] != MAGIC:
            raise MessageLogError(f"{self.path}: not a message log (magic {data[:8]!r}, expected {MAGIC!r})")
        pos, index, segment = len(MAGIC), 0, -1
        size = len(data)
        while pos < size:
            if size - pos < _HEAD.size:
                self.torn = f"torn record header at offset {pos} ({size - pos} bytes)"
                return
            length, crc = _HEAD.unpack_from(data, pos)
            end = pos + _HEAD.size + length
            if end > size:
                later = _next_record_offset(data, pos + _HEAD.size)
                if later is not None:
                    raise MessageLogError(f"{self.path}: record {index} at offset {pos} has a corrupt length "
                                          f"({length} bytes, {size - pos - _HEAD.size} left) but a valid "
                                          f"record follows at offset {later}")
                self.torn = f"torn record at offset {pos}: needs {length} bytes, {size - pos - _HEAD.size} present"
                return
            payload = data[pos + _HEAD.size:end]
            if zlib.crc32(payload) != crc:
                if end == size:
                    self.torn = f"torn record at offset {pos}: checksum mismatch in the last record"
                    return
                raise MessageLogError(f"{self.path}: record {index} at offset {pos} fails its checksum")
            try:
                rec = msgpack.unpackb(payload, raw=False)
                kind = rec["k"]
            except Exception as exc:
                raise MessageLogError(f"{self.path}: record {index} at offset {pos} is not a valid record: "
                                      f"{exc}") from None
            if kind == "meta":
                segment += 1
                meta = {k: v for k, v in rec.items() if k not in ("k", "t")}
                yield LogRecord(index, pos, "meta", rec.get("t", 0.0), segment=max(segment, 0), meta=meta)
            else:
                yield LogRecord(index, pos, kind, rec.get("t", 0.0), rec.get("peer", ""),
                                list(rec.get("frames", [])), list(rec.get("sums", [])),
                                rec.get("rejected"), rec.get("cause"), max(segment, 0), event=rec.get("event"))
            index += 1
            pos = end


# Every record's payload is a msgpack map whose first key is "k": a fixmap or map16 head, then the string "k".
_RECORD_START = re.compile(rb"(?:[\x81-\x8f]|\xde..)\xa1k", re.DOTALL)


def _next_record_offset(data: bytes, start: int) -> int | None:
    """Offset of the first intact record (length fits, CRC matches) whose header begins at or after ``start``.

    A crash can only tear the last write, so an intact record after a record whose length overruns the file
    means that length is corrupt, not torn.
    """
    for m in _RECORD_START.finditer(data, start + _HEAD.size):
        head = m.start() - _HEAD.size
        length, crc = _HEAD.unpack_from(data, head)
        end = m.start() + length
        if end <= len(data) and zlib.crc32(data[m.start():end]) == crc:
            return head
    return None


def read_log(path: str | os.PathLike) -> tuple[list[LogRecord], str | None]:
    """All records of a log and the torn-tail note (None when the log ends cleanly)."""
    reader = MessageLogReader(path)
    records = list(reader)
    return records, reader.torn
