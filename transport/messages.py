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
from typing import Any, Callable, ClassVar, Iterable, TypeVar

import msgpack

SCHEMA_VERSION = 8
# Versions whose single-message layout this process reads. Version 2 added the batch container (below);
# a version-1 frame is laid out identically, so message logs written by version 1 still decode. Version 3
# changed the bodies of rl.generate_group, rl.trajectories, rl.scored_group and rl.batch (transport/
# protocol.py); version 4 changed rl.batch again (columns and tensor frames: BatchTensors); version 5
# dropped the task's level from rl.generate_group and rl.trajectories; version 6 renamed the weights
# link's re-formation count to epoch in rl.link_reform, rl.link_formed, rl.weights_ready,
# rl.weights_broadcast, ps.weights_status_request (min_epoch) and ps.weights_status; version 7 renamed the
# batch stats' count of passes over the data from epoch to data_pass (rl.batch), so that "epoch" names only
# the link's re-formation count; version 8 added the rollout's prompt to the answers (rl.trajectories,
# rl.scored_group: Answers.prompt_ids) and an agent's reward to each sample (Sample.agent_reward). A message of an older
# version is read as the current version lays it out: the module that defines a kind registers how each version
# changed its body (@upgrade; transport/protocol.py does so for versions 5 to 8), so a message log written
# before an upgrade still replays. A change nobody registered (versions 3 and 4 reshaped whole bodies) is refused
# naming the old body's first unknown field; every other kind still decodes.
READABLE_VERSIONS = frozenset({1, 2, 3, 4, 5, 6, 7, 8})

# A batch container: several small tensor-free messages to one peer in one ZeroMQ frame,
#     msgpack [BATCH_TAG, SCHEMA_VERSION, sender, "", ts, None, False, [frame0, frame0, ...]]
# where every element is one message's frame 0 exactly as it would travel alone. The receiver decodes,
# validates, counts, logs and answers each element as if it had arrived alone. A version-1 receiver reads
# the container's header, sees a version it cannot read and rejects it as a schema mismatch (counted, logged).
BATCH_TAG = "$batch"
BATCH_MAX_MESSAGES = 64
BATCH_MAX_BYTES = 32 << 10      # protocol cap on a container; receivers accept it whatever their frame limit

__all__ = [
    "SCHEMA_VERSION", "READABLE_VERSIONS", "BATCH_TAG", "BATCH_MAX_MESSAGES", "BATCH_MAX_BYTES",
    "encode_batch", "split_batch", "is_batch", "Message", "message", "Header", "encode", "decode", "decode_header",
    "registry", "kind_of", "new_message_id", "to_plain", "upgrade", "upgraded_body",
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
    SENDERS: ClassVar[frozenset[str] | None] = None   # roles allowed to send it; None: any peer
    # Fields no rerun can reproduce (wall-clock measurements, a process's own identity): tools.replay leaves
    # them out when it compares a replayed actor's messages with the original's. A plain dataclass nested
    # in a message may declare its own.
    VOLATILE: ClassVar[tuple[str, ...]] = ()


M = TypeVar("M", bound=type)

_REGISTRY: dict[str, type] = {}


def message(tag: str, senders: Iterable[str] | None = None) -> Callable[[M], M]:
    """Class decorator: make ``cls`` a dataclass (if it is not already) and register it under ``tag``.

    ``senders``: the roles (actor groups) allowed to send this kind; a bus that knows its peers' roles
    refuses it from anyone else (see ``Bus(roles=...)``). None: any peer of the run."""
    if not isinstance(tag, str) or not tag:
        raise ValueError("message tag must be a non-empty string")
    if tag.startswith("$"):
        raise ValueError(f"message tag {tag!r}: tags starting with '$' are reserved for the transport")

    def wrap(cls: M) -> M:
        if "__dataclass_fields__" not in cls.__dict__:
            cls = dataclass(cls)
        existing = _REGISTRY.get(tag)
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(f"message tag {tag!r} already registered by {existing.__module__}.{existing.__qualname__}")
        cls.KIND = tag
        cls.SENDERS = frozenset(senders) if senders is not None else None
        _REGISTRY[tag] = cls
        _CODECS.pop(cls, None)
        _KINDS.clear()
        _BY_TAG.pop(tag, None)
        return cls

    return wrap


# version -> kind -> how that version changed the kind's body (the previous version's body in, this one's out)
_UPGRADES: dict[int, dict[str, Callable[[dict], dict]]] = {}


def upgrade(version: int, *kinds: str) -> Callable[[Callable[[dict], dict]], Callable[[dict], dict]]:
    """Decorator: the function turns a body of ``kinds`` laid out by ``version - 1`` into ``version``'s layout.
    Registered by the module that defines the kinds, beside them, when ``version`` changes them."""
    if not 1 < version <= SCHEMA_VERSION:
        raise ValueError(f"upgrade to schema version {version}: only versions 2 to {SCHEMA_VERSION} exist")

    def register(fn: Callable[[dict], dict]) -> Callable[[dict], dict]:
        for kind in kinds:
            if kind in _UPGRADES.setdefault(version, {}):
                raise ValueError(f"{kind}: an upgrade to version {version} is registered already")
            _UPGRADES[version][kind] = fn
        return fn
    return register


def upgraded_body(kind: str, version: int, body: Any) -> Any:
    """``body`` of a ``kind`` message written at schema ``version``, laid out as this process's version lays
    it out, its fields in the order ``encode`` writes them (unchanged when no version since changed the kind,
    or the body is not a mapping)."""
    changed = False
    for v in range(version + 1, SCHEMA_VERSION + 1):
        fn = _UPGRADES.get(v, {}).get(kind)
        if fn is not None and type(body) is dict:
            body, changed = fn(body), True
    cls = _REGISTRY.get(kind)
    if changed and cls is not None:
        order = [f.name for f in dataclasses.fields(cls)]
        body = {**{k: body[k] for k in order if k in body}, **body}
    return body


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
    # torch is imported on first tensor use only: actors.runtime.run sets CPU affinity and thread counts
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
    __slots__ = ("enc", "fast", "dec", "desc", "_item_fast")

    def __init__(self, enc, fast, dec, desc: str) -> None:
        self.enc = enc      # None -> identity
        self.fast = fast    # tuple of exact types accepted without conversion, or None
        self.dec = dec      # slow path: (value, path, ctx) -> value, raises FieldError
        self.desc = desc
        self._item_fast = None  # list codecs of simple items: the items' exact types


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
    codec = _Codec(enc, None, dec, desc)
    codec._item_fast = item.fast if simple_items else None
    return codec


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


_MISS = object()


class _ClassCodec:
    """Per-dataclass field table, built on first use (so forward references can resolve).

    ``fast`` is a function compiled for the class that decodes a complete, well-typed body with inline
    type tests and one positional constructor call; it returns ``_MISS`` for anything else (a missing or
    unknown field, a value needing conversion or failing a check), and then the general path below runs
    and raises the error naming the field. So the fast path never changes what is accepted or the error.
    """

    __slots__ = ("cls", "names", "fields", "required", "simple", "has_post_init", "fast", "keys", "encode_body")

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
        self.keys = tuple(n for n, _ in self.fields)
        # "simple" classes (no tensors, nested dataclasses or tuple normalisation) encode as one dict build.
        self.simple = all(c.enc is None for _, c in self.fields)
        self.fast = self._compile_fast()
        self.encode_body = self._compile_encode() or self._encode_body

    def _compile_encode(self) -> Callable | None:
        """``enc(obj, ctx) -> body``: one dict display; values needing conversion go through their codec."""
        if not self.fields or len(self.fields) > 200:
            return None
        env: dict[str, Any] = {}
        pre: list[str] = []
        items: list[str] = []
        for i, (name, c) in enumerate(self.fields):
            if c.enc is None:
                items.append(f"{name!r}: o.{name}")
            elif c._item_fast is not None:
                # list of simple items: only a non-list (tuple) needs normalising
                env[f"E{i}"] = c.enc
                pre += [f"    v{i} = o.{name}", f"    if type(v{i}) is not list:", f"        v{i} = E{i}(v{i}, ctx)"]
                items.append(f"{name!r}: v{i}")
            else:
                env[f"E{i}"] = c.enc
                items.append(f"{name!r}: E{i}(o.{name}, ctx)")
        src = "\n".join(["def enc(o, ctx):", *pre, f"    return {{{', '.join(items)}}}"])
        try:
            exec(compile(src, f"<encode {self.cls.__qualname__}>", "exec"), env)
        except SyntaxError:  # pragma: no cover
            return None
        return env["enc"]

    def _compile_fast(self) -> Callable | None:
        if not self.fields or len(self.fields) > 200:
            return None
        env: dict[str, Any] = {"_MISS": _MISS, "cls": self.cls}
        n = len(self.fields)
        lines = ["def fast(body, ctx):", f"    if len(body) != {n}:", "        return _MISS", "    try:"]
        lines += [f"        v{i} = body[{name!r}]" for i, (name, _) in enumerate(self.fields)]
        lines += ["    except KeyError:", "        return _MISS"]
        conds: list[str] = []
        loops: list[str] = []
        calls: list[str] = []
        for i, (name, c) in enumerate(self.fields):
            v = f"v{i}"
            if c is _ANY_CODEC:
                continue
            if c.fast is not None:
                if len(c.fast) == 1:
                    env[f"T{i}"] = c.fast[0]
                    conds.append(f"type({v}) is T{i}")
                else:
                    env[f"T{i}"] = c.fast
                    conds.append(f"type({v}) in T{i}")
            elif c.desc.startswith("list[") and getattr(c, "_item_fast", None) is not None:
                item_fast = c._item_fast
                conds.append(f"type({v}) is list")
                if len(item_fast) == 1:
                    env[f"I{i}"] = item_fast[0]
                    loops += [f"    for x in {v}:", f"        if type(x) is not I{i}:", "            return _MISS"]
                else:
                    env[f"I{i}"] = item_fast
                    loops += [f"    for x in {v}:", f"        if type(x) not in I{i}:", "            return _MISS"]
            else:
                # nested dataclass, dict, tensor, list of those: its own decoder (errors fall back, see above)
                env[f"D{i}"] = c.dec
                calls.append(f"    {v} = D{i}({v}, {name!r}, ctx)")
        if conds:
            lines += [f"    if not ({' and '.join(conds)}):", "        return _MISS"]
        lines += loops + calls
        # keywords, as the general path's cls(**kwargs) (a class may define its own __init__)
        lines.append(f"    return cls({', '.join(f'{name}=v{i}' for i, (name, _) in enumerate(self.fields))})")
        try:
            exec(compile("\n".join(lines), f"<decode {self.cls.__qualname__}>", "exec"), env)
        except SyntaxError:  # pragma: no cover - field names are identifiers, so this cannot happen
            return None
        return env["fast"]

    def _encode_body(self, obj: Any, ctx: _Ctx) -> dict:
        if self.simple:
            d = obj.__dict__
            return {n: d[n] for n in self.keys}
        out = {}
        for n, c in self.fields:
            v = getattr(obj, n)
            out[n] = v if c.enc is None else c.enc(v, ctx)
        return out

    def decode_body(self, body: Any, path: str, ctx: _Ctx) -> Any:
        if type(body) is not dict:
            raise FieldError(f"{path or 'body'}: expected a map of fields, got {_type_name(body)}")
        fast = self.fast
        if fast is not None:
            used = ctx.used
            try:
                msg = fast(body, ctx)
            except Exception:
                msg = _MISS
            if msg is not _MISS:
                return msg
            ctx.used = used     # the general path below re-decodes (and names the error)
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
# tag -> codec of the registered class, filled by decode's general path (so the hot path is one lookup)
_BY_TAG: dict[str, _ClassCodec] = {}
_ANY_CODEC = _codec_for(Any)


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


_KINDS: dict[type, str] = {}     # classes checked encodable -> tag (cleared when a tag is registered)


def _kind_for_encode(cls: type) -> str:
    tag = cls.__dict__.get("KIND")
    if not tag or _REGISTRY.get(tag) is not cls:
        # A module imported under two names registers its kinds twice; both copies encode the same way.
        if not tag or getattr(_REGISTRY.get(tag), "__qualname__", None) != cls.__qualname__:
            raise EncodeError(f"{cls.__qualname__} is not a registered message kind (decorate it with @message)")
    _KINDS[cls] = tag
    return tag


def encode(msg: Any, sender: str = "", *, msg_id: str | None = None, reply_to: str | None = None,
           wants_reply: bool = False, ts: float | None = None) -> list:
    """Frames for ``msg``: the header+body frame, then one frame per tensor field (memoryviews)."""
    cls = type(msg)
    tag = _KINDS.get(cls) or _kind_for_encode(cls)
    codec = _CODECS.get(cls) or _class_codec(cls)
    frames: list = [b""]
    body = codec.encode_body(msg, _Ctx(frames))
    head = [tag, SCHEMA_VERSION, sender, msg_id or f"{_ID_PREFIX}{next(_ID_COUNTER):x}",
            time.time() if ts is None else ts, reply_to, wants_reply, body]
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


_unpackb = msgpack.unpackb     # defaults: raw=False, strict_map_key=True


def _parse_header(data: Any) -> tuple[Header, Any]:
    try:
        head = _unpackb(data)
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
    if version not in READABLE_VERSIONS:
        raise SchemaMismatch(f"schema version {version} from {sender!r}, this process speaks {SCHEMA_VERSION}",
                             header)
    return header, body


def decode_header(frames: list) -> tuple[Header, Any]:
    """Parse frame 0 into a Header and the raw body; raises MalformedFrame/SchemaMismatch/UnknownKind."""
    if not frames:
        raise MalformedFrame("empty message: no frames")
    return _parse_header(_as_bytes(frames[0]))


def decode(frames: list, max_frame_bytes: int | None = None) -> tuple[Header, Any]:
    """Validate ``frames`` and return ``(header, message)``. Raises a DecodeError subclass naming the cause.

    ``frames`` may be bytes or zmq.Frame objects; tensor fields alias the frames' memory (zero-copy).
    """
    if not frames:
        raise MalformedFrame("empty message: no frames")
    first = frames[0]
    if type(first) is not bytes:
        first = _as_bytes(first)
    if max_frame_bytes is not None and len(first) > max_frame_bytes:
        raise FrameTooLarge(f"frame 0 is {len(first)} bytes, over the limit of {max_frame_bytes}")
    # Hot path, inlined: a well-formed single-frame message of a kind whose compiled decoder accepts the
    # body. Anything else (or any doubt) takes the general path below, which names the error.
    if len(frames) == 1:
        try:
            head = _unpackb(first)
        except Exception as exc:
            raise MalformedFrame(f"frame 0 is not valid msgpack: {exc}") from None
        if type(head) is list and len(head) == 8:
            tag, version, sender, mid, ts, reply_to, wants_reply, body = head
            codec = _BY_TAG.get(tag) if type(tag) is str else None
            if (codec is not None and codec.fast is not None and type(body) is dict and type(version) is int
                    and version == SCHEMA_VERSION and type(sender) is str and type(mid) is str
                    and (type(ts) is float or type(ts) is int) and type(wants_reply) is bool
                    and (reply_to is None or type(reply_to) is str)):
                ctx = _Ctx(frames)
                try:
                    msg = codec.fast(body, ctx)
                except Exception:
                    msg = _MISS
                if msg is not _MISS and ctx.used == 0:
                    return Header(tag, version, sender, mid, ts, reply_to, wants_reply), msg
    header, body = _parse_header(first)
    if header.version != SCHEMA_VERSION:
        body = upgraded_body(header.kind, header.version, body)
    try:
        if max_frame_bytes is not None and len(frames) > 1:
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
        _BY_TAG[header.kind] = _CODECS[cls]
        return header, msg
    except DecodeError as exc:
        exc.header = header
        raise
    except TypeError as exc:
        # e.g. a dataclass __post_init__ rejecting a value
        raise FieldError(f"{header.kind}: {exc}", header) from None


# ------------------------------------------------------------------------------------------- batches

_BATCH_PREFIX = b"\x98" + msgpack.packb(BATCH_TAG)     # fixarray(8), then the tag as a msgpack str


def is_batch(frame: Any) -> bool:
    """True when ``frame`` (a frame 0) is a batch container (cheap: a prefix test)."""
    return type(frame) is bytes and frame.startswith(_BATCH_PREFIX)


def encode_batch(firsts: list[bytes], sender: str = "") -> bytes:
    """One container frame carrying ``firsts`` (each a tensor-free message's frame 0 from :func:`encode`)."""
    return _packb([BATCH_TAG, SCHEMA_VERSION, sender, "", time.time(), None, False, firsts])


def split_batch(frames: list) -> list[bytes]:
    """The messages (frame 0 each) inside a batch container; raises MalformedFrame / SchemaMismatch."""
    if len(frames) != 1:
        raise MalformedFrame(f"a batch container is one frame, got {len(frames)}")
    header, body = _parse_header(_as_bytes(frames[0]))
    if header.kind != BATCH_TAG:
        raise MalformedFrame(f"not a batch container: kind {header.kind!r}", header)
    if header.version != SCHEMA_VERSION:
        raise SchemaMismatch(f"batch container of schema version {header.version} from {header.sender!r}, "
                             f"this process speaks {SCHEMA_VERSION}", header)
    if type(body) is not list or not body or len(body) > BATCH_MAX_MESSAGES:
        raise MalformedFrame(f"batch container from {header.sender!r}: body must be a list of 1 to "
                             f"{BATCH_MAX_MESSAGES} messages, got {_type_name(body)}"
                             + (f" of length {len(body)}" if isinstance(body, list) else ""), header)
    for i, item in enumerate(body):
        if type(item) is not bytes:
            raise MalformedFrame(f"batch container from {header.sender!r}: element {i} is "
                                 f"{_type_name(item)}, expected bytes", header)
    return body


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
    """Heartbeat probe; the bus answers it itself with Pong (actors never see it). ``incarnation``: the sending
    bus's, random per start, so that a peer tells a restarted process from a live one that was only silent
    ("" from a sender older than the field: nothing is concluded from it)."""

    VOLATILE: ClassVar[tuple[str, ...]] = ("incarnation",)

    seq: int = 0
    incarnation: str = ""


@message("pong")
class Pong(Message):
    seq: int = 0
