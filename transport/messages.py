"""Typed messages on the wire: one dataclass per kind, a registry of short tags, msgpack encoding.

A message travels as a list of ZeroMQ frames::

    frame 0   msgpack [tag, schema_version, sender, id, ts, reply_to, wants_reply, body]
    frame 1.. raw tensor bytes, one frame per torch.Tensor field (zero-copy both ways)

``body`` is a map of field name -> value.  A tensor field's value in the body is the small map
``{"$t": frame_index, "dtype": "bfloat16", "shape": [..]}``; its bytes are the frame itself, sent from a
memoryview of the tensor's storage and received with ``torch.frombuffer`` over the ZeroMQ frame, so a
64 MiB tensor is never pickled or re-encoded.

Decoding validates everything a peer controls (frame layout, tag, schema version, field names, field
types, tensor sizes) and raises a :class:`DecodeError` subclass whose message names the field or cause.
Its ``reason`` is a short code the bus uses for counters and error replies.

Supported field types: int, float, str, bool, bytes, None / Optional[...], list[...], dict[str, ...],
nested dataclasses, typing.Any (unchecked), and torch.Tensor.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import sys
import time
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, TypeVar

import msgpack

SCHEMA_VERSION = 1

__all__ = [
    "SCHEMA_VERSION", "Message", "message", "Header", "encode", "decode", "decode_header",
    "registry", "kind_of", "new_message_id", "to_plain",
    "EncodeError", "DecodeError", "MalformedFrame", "UnknownKind", "SchemaMismatch", "FieldError",
    "FrameTooLarge", "TensorFrameMismatch",
    "Error", "Ping", "Pong",
]


# --------------------------------------------------------------------------------------------- errors

class EncodeError(ValueError):
    """A message could not be encoded (a field holds a value of a type the wire cannot carry)."""


class DecodeError(ValueError):
    """Frames from a peer do not form a valid message. ``reason`` is a short code for counters."""

    reason = "malformed"

    def __init__(self, text: str, header: "Header | None" = None) -> None:
        super().__init__(text)
        # The header, when it could be parsed, lets the bus send an error reply to a request.
        self.header = header


class MalformedFrame(DecodeError):
    reason = "malformed"


class UnknownKind(DecodeError):
    reason = "unknown_kind"


class SchemaMismatch(DecodeError):
    reason = "schema_version"


class FieldError(DecodeError):
    reason = "bad_field"


class FrameTooLarge(DecodeError):
    reason = "frame_too_large"


class TensorFrameMismatch(DecodeError):
    reason = "tensor_size"


# ------------------------------------------------------------------------------------------ registry

@dataclass
class Message:
    """Base of every message kind. Subclass it and decorate with ``@message("tag")``."""

    KIND: ClassVar[str] = ""


M = TypeVar("M", bound=type)

_REGISTRY: dict[str, type] = {}


def message(tag: str) -> Callable[[M], M]:
    """Class decorator: make ``cls`` a dataclass (if it is not already) and register it under ``tag``."""
    if not isinstance(tag, str) or not tag:
        raise ValueError("message tag must be a non-empty string")

    def wrap(cls: M) -> M:
        if "__dataclass_fields__" not in cls.__dict__:
            cls = dataclass(cls)
        existing = _REGISTRY.get(tag)
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(f"message tag {tag!r} already registered by {existing.__module__}.{existing.__qualname__}")
        cls.KIND = tag
        _REGISTRY[tag] = cls
        _CODECS.pop(cls, None)
        return cls

    return wrap


def registry() -> dict[str, type]:
    """A copy of the tag -> class registry (every kind imported in this process)."""
    return dict(_REGISTRY)


def kind_of(msg_or_cls: Any) -> str:
    cls = msg_or_cls if isinstance(msg_or_cls, type) else type(msg_or_cls)
    tag = cls.__dict__.get("KIND") or ""
    if not tag or _REGISTRY.get(tag) is not cls:
        raise EncodeError(f"{cls.__qualname__} is not a registered message kind (decorate it with @message)")
    return tag


# -------------------------------------------------------------------------------------------- header

@dataclass(slots=True)
class Header:
    kind: str
    version: int
    sender: str
    id: str
    ts: float
    reply_to: str | None = None
    wants_reply: bool = False


_ID_PREFIX = os.urandom(5).hex()
_ID_COUNTER = itertools.count()


def new_message_id() -> str:
    """Unique across processes (random per-process prefix) and cheap (a counter)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):x}"


# ---------------------------------------------------------------------------- torch (imported lazily)

def _torch():
    # torch is imported on first tensor use only: actors.run sets CPU affinity and thread counts
    # before torch loads, and tools that never touch tensors (replay printing, bench raw side) stay light.
    import torch
    return torch


def _is_tensor_type(tp: Any) -> bool:
    return isinstance(tp, type) and tp.__name__ == "Tensor" and tp.__module__ == "torch"


_DTYPES: dict[str, Any] = {}


def _dtype(name: str):
    if not _DTYPES:
        torch = _torch()
        for n in ("float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64",
                  "uint8", "bool", "complex64"):
            _DTYPES[n] = getattr(torch, n)
    return _DTYPES.get(name)


def _dtype_name(dt: Any) -> str:
    return str(dt).removeprefix("torch.")


# ------------------------------------------------------------------------------------ field codecs
# A codec per declared type: ``enc(value, ctx) -> wire value`` and ``dec(value, path, ctx) -> value``.
# ``None`` as an encoder means "the value goes to msgpack as is"; simple decoders are reduced to a tuple
# of accepted exact types so the common case costs one ``type(v) in (...)`` test per field.

class _Ctx:
    __slots__ = ("frames", "used")

    def __init__(self, frames: list) -> None:
        self.frames = frames
        self.used = 0


class _Codec:
    __slots__ = ("enc", "fast", "dec", "desc")

    def __init__(self, enc, fast, dec, desc: str) -> None:
        self.enc = enc      # None -> identity
        self.fast = fast    # tuple of exact types accepted without conversion, or None
        self.dec = dec      # slow path: (value, path, ctx) -> value, raises FieldError
        self.desc = desc


def _type_name(v: Any) -> str:
    return type(v).__name__


def _bad(path: str, want: str, v: Any) -> FieldError:
    shown = repr(v)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return FieldError(f"field {path!r}: expected {want}, got {_type_name(v)} {shown}")


def _scalar_codec(tp: type) -> _Codec:
    name = tp.__name__

    if tp is float:
        def dec(v, path, ctx):
            if type(v) is int:
                return float(v)
            raise _bad(path, "float", v)
        return _Codec(None, (float,), dec, "float")

    def dec(v, path, ctx):
        raise _bad(path, name, v)
    return _Codec(None, (tp,), dec, name)


def _run(codec: _Codec, v: Any, path: str, ctx: _Ctx) -> Any:
    if codec.fast is not None and type(v) in codec.fast:
        return v
    return codec.dec(v, path, ctx)


def _encode_value(codec: _Codec, v: Any, ctx: _Ctx) -> Any:
    return v if codec.enc is None else codec.enc(v, ctx)


_CODEC_CACHE: dict[Any, _Codec] = {}


def _codec_for(tp: Any) -> _Codec:
    try:
        return _CODEC_CACHE[tp]
    except (KeyError, TypeError):
        pass
    codec = _build_codec(tp)
    try:
        _CODEC_CACHE[tp] = codec
    except TypeError:
        pass
    return codec


def _build_codec(tp: Any) -> _Codec:
    if tp is Any:
        return _Codec(None, None, lambda v, path, ctx: v, "any")
    if tp is type(None) or tp is None:
        def dec_none(v, path, ctx):
            raise _bad(path, "None", v)
        return _Codec(None, (type(None),), dec_none, "None")
    if tp in (int, float, str, bool, bytes):
        return _scalar_codec(tp)
    if _is_tensor_type(tp):
        return _tensor_codec()
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _dataclass_codec(tp)

    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _union_codec(args)
    if origin is list:
        return _list_codec(args[0] if args else Any)
    if origin is dict:
        key_t = args[0] if args else str
        if key_t is not str:
            raise TypeError(f"dict keys must be str on the wire, not {key_t!r}")
        return _dict_codec(args[1] if len(args) > 1 else Any)
    raise TypeError(f"unsupported field type {tp!r} (use int, float, str, bool, bytes, None, list, "
                    f"dict[str, ...], a dataclass, typing.Any or torch.Tensor)")


def _union_codec(args: tuple) -> _Codec:
    codecs = [_codec_for(a) for a in args]
    desc = " | ".join(c.desc for c in codecs)
    fast_types = set()
    all_fast = True
    for c in codecs:
        if c.enc is not None:
            all_fast = False
        if c.fast is not None:
            fast_types.update(c.fast)

    def dec(v, path, ctx):
        for c in codecs:
            if c.fast is not None and type(v) in c.fast:
                return v
        for c in codecs:
            try:
                return c.dec(v, path, ctx)
            except FieldError:
                continue
        raise _bad(path, desc, v)

    def enc(v, ctx):
        if v is None:
            return None
        for c, a in zip(codecs, args):
            if c.enc is None:
                continue
            if (_is_tensor_type(a) and _is_tensor(v)) or (isinstance(a, type) and isinstance(v, a)):
                return c.enc(v, ctx)
        return v

    return _Codec(None if all_fast else enc, tuple(fast_types) if all_fast else None, dec, desc)


def _list_codec(item_t: Any) -> _Codec:
    item = _codec_for(item_t)
    desc = f"list[{item.desc}]"

    simple_items = item.fast is not None and item.enc is None

    def dec(v, path, ctx):
        if type(v) is not list:
            raise _bad(path, desc, v)
        if simple_items:
            fast = item.fast
            for x in v:
                if type(x) not in fast:
                    break
            else:
                return v
            return [x if type(x) in fast else item.dec(x, f"{path}[{i}]", ctx) for i, x in enumerate(v)]
        return [_run(item, x, f"{path}[{i}]", ctx) for i, x in enumerate(v)]

    enc = None
    if item.enc is not None:
        def enc(v, ctx):
            return [item.enc(x, ctx) for x in v]
    elif item.fast is not None:
        def enc(v, ctx):
            # msgpack packs tuples as arrays; normalise so a decoded message equals the sent one
            return v if type(v) is list else list(v)
    return _Codec(enc, None, dec, desc)


def _dict_codec(val_t: Any) -> _Codec:
    val = _codec_for(val_t)
    desc = f"dict[str, {val.desc}]"

    def dec(v, path, ctx):
        if type(v) is not dict:
            raise _bad(path, desc, v)
        out = {}
        for k, x in v.items():
            if type(k) is not str:
                raise FieldError(f"field {path!r}: key {k!r} is {_type_name(k)}, expected str")
            out[k] = _run(val, x, f"{path}[{k!r}]", ctx)
        return out

    enc = None
    if val.enc is not None:
        def enc(v, ctx):
            return {k: val.enc(x, ctx) for k, x in v.items()}
    return _Codec(enc, None, dec, desc)


def _is_tensor(v: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(v, torch.Tensor)


def _tensor_codec() -> _Codec:
    def enc(t, ctx):
        if not _is_tensor(t):
            raise EncodeError(f"expected a torch.Tensor, got {_type_name(t)}")
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        idx = len(ctx.frames)
        if t.numel() == 0:
            ctx.frames.append(b"")
        else:
            # A uint8 view of the storage; its numpy memoryview is what ZeroMQ sends without copying.
            ctx.frames.append(memoryview(t.detach().reshape(-1).view(_torch().uint8).numpy()))
        return {"$t": idx, "dtype": _dtype_name(t.dtype), "shape": list(t.shape)}

    def dec(v, path, ctx):
        if type(v) is not dict or "$t" not in v:
            raise _bad(path, "tensor reference {'$t', 'dtype', 'shape'}", v)
        idx, dtype_name, shape = v.get("$t"), v.get("dtype"), v.get("shape")
        if type(idx) is not int or not (1 <= idx < len(ctx.frames)):
            raise TensorFrameMismatch(f"field {path!r}: tensor frame index {idx!r} out of range "
                                      f"(message has {len(ctx.frames) - 1} tensor frames)")
        dt = _dtype(dtype_name) if type(dtype_name) is str else None
        if dt is None:
            raise FieldError(f"field {path!r}: unknown tensor dtype {dtype_name!r}")
        if type(shape) is not list or not all(type(s) is int and s >= 0 for s in shape):
            raise FieldError(f"field {path!r}: tensor shape must be a list of non-negative ints, got {shape!r}")
        frame = ctx.frames[idx]
        buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
        itemsize = _torch().empty((), dtype=dt).element_size()
        want = math.prod(shape) * itemsize
        if buf.nbytes != want:
            raise TensorFrameMismatch(f"field {path!r}: tensor frame {idx} has {buf.nbytes} bytes but "
                                      f"dtype {dtype_name} shape {shape} needs {want}")
        ctx.used += 1
        torch = _torch()
        if buf.readonly:
            # Only frames read back from a log or built from bytes get here (ZeroMQ frames are writable);
            # a writable copy keeps torch from aliasing immutable memory.
            buf = memoryview(bytearray(buf))
        if want == 0:
            return torch.empty(shape, dtype=dt)
        # Zero-copy: the tensor aliases the ZeroMQ frame (which it keeps alive through the buffer).
        return torch.frombuffer(buf, dtype=torch.uint8).view(dt).view(shape)

    return _Codec(enc, None, dec, "tensor")


class _ClassCodec:
    """Per-dataclass field table, built on first use (so forward references can resolve)."""

    __slots__ = ("cls", "names", "fields", "required", "simple", "has_post_init")

    def __init__(self, cls: type) -> None:
        try:
            hints = typing.get_type_hints(cls)
        except Exception as exc:  # pragma: no cover - a programming error in a message definition
            raise TypeError(f"cannot resolve field types of {cls.__qualname__}: {exc}") from exc
        self.cls = cls
        self.fields: list[tuple[str, _Codec]] = []
        self.required: set[str] = set()
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            self.fields.append((f.name, _codec_for(hints[f.name])))
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                self.required.add(f.name)
        self.names = {n: c for n, c in self.fields}
        # "simple" classes (no tensors, nested dataclasses or tuple normalisation) encode as one dict build.
        self.simple = all(c.enc is None for _, c in self.fields)

    def encode_body(self, obj: Any, ctx: _Ctx) -> dict:
        if self.simple:
            d = obj.__dict__
            return {n: d[n] for n, _ in self.fields}
        out = {}
        for n, c in self.fields:
            v = getattr(obj, n)
            out[n] = v if c.enc is None else c.enc(v, ctx)
        return out

    def decode_body(self, body: Any, path: str, ctx: _Ctx) -> Any:
        if type(body) is not dict:
            raise FieldError(f"{path or 'body'}: expected a map of fields, got {_type_name(body)}")
        names = self.names
        kwargs = {}
        for k, v in body.items():
            c = names.get(k)
            if c is None:
                where = f"{path}.{k}" if path else k
                raise FieldError(f"field {where!r}: unknown field for {self.cls.__qualname__}")
            if c.fast is not None and type(v) in c.fast:
                kwargs[k] = v
            else:
                kwargs[k] = c.dec(v, f"{path}.{k}" if path else k, ctx)
        if len(kwargs) < len(self.required):
            missing = sorted(self.required - kwargs.keys())
            if missing:
                where = f"{path}.{missing[0]}" if path else missing[0]
                raise FieldError(f"field {where!r}: missing required field of {self.cls.__qualname__}")
        return self.cls(**kwargs)


_CODECS: dict[type, _ClassCodec] = {}


def _class_codec(cls: type) -> _ClassCodec:
    c = _CODECS.get(cls)
    if c is None:
        c = _CODECS[cls] = _ClassCodec(cls)
    return c


def _dataclass_codec(cls: type) -> _Codec:
    def enc(v, ctx):
        return _class_codec(cls).encode_body(v, ctx)

    def dec(v, path, ctx):
        return _class_codec(cls).decode_body(v, path, ctx)

    return _Codec(enc, None, dec, cls.__qualname__)


# ----------------------------------------------------------------------------------- encode / decode

_packb = msgpack.Packer(use_bin_type=True).pack


def encode(msg: Any, sender: str = "", *, msg_id: str | None = None, reply_to: str | None = None,
           wants_reply: bool = False, ts: float | None = None) -> list:
    """Frames for ``msg``: the header+body frame, then one frame per tensor field (memoryviews)."""
    cls = type(msg)
    tag = cls.__dict__.get("KIND")
    if not tag or _REGISTRY.get(tag) is not cls:
        # A module imported under two names registers its kinds twice; both copies encode the same way.
        if not tag or getattr(_REGISTRY.get(tag), "__qualname__", None) != cls.__qualname__:
            raise EncodeError(f"{cls.__qualname__} is not a registered message kind (decorate it with @message)")
    codec = _CODECS.get(cls) or _class_codec(cls)
    frames: list = [b""]
    ctx = _Ctx(frames)
    body = codec.encode_body(msg, ctx)
    head = [tag, SCHEMA_VERSION, sender, msg_id or new_message_id(), time.time() if ts is None else ts,
            reply_to, wants_reply, body]
    try:
        frames[0] = _packb(head)
    except (TypeError, ValueError, OverflowError) as exc:
        raise EncodeError(_explain_encode_failure(tag, body, exc)) from exc
    return frames


def _explain_encode_failure(tag: str, body: dict, exc: Exception) -> str:
    for name, value in body.items():
        try:
            _packb(value)
        except Exception as inner:
            return f"{tag}: field {name!r} cannot be encoded ({_type_name(value)}): {inner}"
    return f"{tag}: cannot encode: {exc}"


def _as_bytes(frame: Any) -> bytes:
    if type(frame) is bytes:
        return frame
    if hasattr(frame, "bytes"):
        return frame.bytes
    return bytes(frame)


def _frame_len(frame: Any) -> int:
    if type(frame) is bytes:
        return len(frame)
    if hasattr(frame, "buffer"):
        return frame.buffer.nbytes
    return memoryview(frame).nbytes


def decode_header(frames: list) -> tuple[Header, Any]:
    """Parse frame 0 into a Header and the raw body; raises MalformedFrame/SchemaMismatch/UnknownKind."""
    if not frames:
        raise MalformedFrame("empty message: no frames")
    try:
        head = msgpack.unpackb(_as_bytes(frames[0]), raw=False, strict_map_key=True)
    except Exception as exc:
        raise MalformedFrame(f"frame 0 is not valid msgpack: {exc}") from None
    if type(head) is not list or len(head) != 8:
        raise MalformedFrame(f"frame 0 must be an 8-element array [tag, version, sender, id, ts, reply_to, "
                             f"wants_reply, body], got {_type_name(head)}"
                             + (f" of length {len(head)}" if isinstance(head, list) else ""))
    tag, version, sender, mid, ts, reply_to, wants_reply, body = head
    # One combined test on the hot path; the loop below only runs to name the offending field.
    if (type(tag) is not str or type(version) is not int or type(sender) is not str or type(mid) is not str
            or (type(ts) is not float and type(ts) is not int) or type(wants_reply) is not bool
            or (reply_to is not None and type(reply_to) is not str)):
        for name, value, ok in (("tag", tag, type(tag) is str), ("version", version, type(version) is int),
                                ("sender", sender, type(sender) is str), ("id", mid, type(mid) is str),
                                ("ts", ts, type(ts) in (float, int)),
                                ("reply_to", reply_to, reply_to is None or type(reply_to) is str),
                                ("wants_reply", wants_reply, type(wants_reply) is bool)):
            if not ok:
                raise MalformedFrame(f"header field {name!r} has wrong type {_type_name(value)}")
    header = Header(tag, version, sender, mid, ts, reply_to, wants_reply)
    if version != SCHEMA_VERSION:
        raise SchemaMismatch(f"schema version {version} from {sender!r}, this process speaks {SCHEMA_VERSION}",
                             header)
    return header, body


def decode(frames: list, max_frame_bytes: int | None = None) -> tuple[Header, Any]:
    """Validate ``frames`` and return ``(header, message)``. Raises a DecodeError subclass naming the cause.

    ``frames`` may be bytes or zmq.Frame objects; tensor fields alias the frames' memory (zero-copy).
    """
    if max_frame_bytes is not None and frames and _frame_len(frames[0]) > max_frame_bytes:
        raise FrameTooLarge(f"frame 0 is {_frame_len(frames[0])} bytes, over the limit of {max_frame_bytes}")
    header, body = decode_header(frames)
    try:
        if max_frame_bytes is not None:
            for i, f in enumerate(frames[1:], 1):
                n = _frame_len(f)
                if n > max_frame_bytes:
                    raise FrameTooLarge(f"frame {i} is {n} bytes, over the limit of {max_frame_bytes}")
        cls = _REGISTRY.get(header.kind)
        if cls is None:
            raise UnknownKind(f"unknown message kind {header.kind!r} from {header.sender!r}")
        ctx = _Ctx(frames)
        msg = (_CODECS.get(cls) or _class_codec(cls)).decode_body(body, "", ctx)
        if ctx.used != len(frames) - 1:
            raise TensorFrameMismatch(f"{header.kind}: {len(frames) - 1} extra frames but "
                                      f"{ctx.used} tensor fields reference them")
        return header, msg
    except DecodeError as exc:
        exc.header = header
        raise
    except TypeError as exc:
        # e.g. a dataclass __post_init__ rejecting a value
        raise FieldError(f"{header.kind}: {exc}", header) from None


def to_plain(value: Any) -> Any:
    """A printable/JSON-able view of a message or field: tensors become dtype/shape summaries."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if _is_tensor(value):
        return {"tensor": _dtype_name(value.dtype), "shape": list(value.shape)}
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return value if len(value) <= 32 else value[:32] + b"..."
    return value


# ---------------------------------------------------------------------------- transport's own kinds

@message("error")
class Error(Message):
    """Reply to a request that failed. ``code``: malformed, unknown_kind, bad_field, frame_too_large,
    tensor_size, schema_version, no_handler, handler_error, draining, or an actor-defined code."""

    code: str
    text: str
    kind: str | None = None     # kind of the request that failed, when known


@message("ping")
class Ping(Message):
    """Heartbeat probe; the bus answers it itself with Pong (actors never see it)."""

    seq: int = 0


@message("pong")
class Pong(Message):
    seq: int = 0
