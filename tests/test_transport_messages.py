"""Typed messages: round trips of every kind and field type, zero-copy tensor frames, and each bad input."""
from __future__ import annotations

import dataclasses
import importlib
import typing
from dataclasses import field
from typing import Any, Optional

import msgpack
import pytest
import torch
import zmq

from transport import messages as M
from transport.messages import (SCHEMA_VERSION, DecodeError, EncodeError, Error, FieldError, FrameTooLarge,
                                MalformedFrame, Message, Ping, Pong, SchemaMismatch, TensorFrameMismatch,
                                UnknownKind, decode, encode, message)


@dataclasses.dataclass
class Point:
    x: int
    y: float


@message("test.msg.all")
class AllTypes(Message):
    i: int
    f: float
    s: str
    b: bool
    raw: bytes
    nothing: None
    maybe: Optional[int]
    ints: list[int]
    nested: list[list[str]]
    table: dict[str, float]
    point: Point
    points: list[Point]
    anything: Any
    t: torch.Tensor
    maybe_t: Optional[torch.Tensor] = None
    tensors: list[torch.Tensor] = field(default_factory=list)
    default_s: str = "d"


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def full_example() -> AllTypes:
    g = torch.Generator().manual_seed(0)
    return AllTypes(
        i=-7, f=0.25, s="héllo", b=True, raw=b"\x00\xff", nothing=None, maybe=None, ints=[1, 2, 3],
        nested=[["a"], [], ["b", "c"]], table={"lr": 2e-5}, point=Point(1, 2.5), points=[Point(3, 4.0)],
        anything={"k": [1, "two"]},
        t=torch.randn(3, 4, generator=g).to(torch.bfloat16),
        maybe_t=torch.arange(5, dtype=torch.int64),
        tensors=[torch.randn(2, 2, generator=g), torch.zeros(0, 3), torch.tensor([True, False])],
    )


def roundtrip(msg: Any) -> Any:
    frames = encode(msg, sender="tester")
    # what the bus hands to decode: the header frame as bytes, tensor frames as zmq.Frame (zero-copy)
    wire = [bytes(frames[0])] + [zmq.Frame(bytes(f)) for f in frames[1:]]
    header, out = decode(wire)
    assert header.kind == type(msg).KIND and header.sender == "tester" and header.version == SCHEMA_VERSION
    return out


def test_roundtrip_every_field_type() -> None:
    msg = full_example()
    assert same(roundtrip(msg), msg)


def test_tensor_dtypes_and_layouts_roundtrip() -> None:
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int32,
                  torch.int64, torch.uint8, torch.bool):
        t = (torch.arange(24) % 3).to(dtype).reshape(2, 3, 4)
        msg = dataclasses.replace(full_example(), t=t)
        assert same(roundtrip(msg).t, t), dtype
    non_contiguous = torch.arange(12.0).reshape(3, 4).t()
    assert same(roundtrip(dataclasses.replace(full_example(), t=non_contiguous)).t, non_contiguous.contiguous())


def test_tensor_frames_are_zero_copy_both_ways() -> None:
    t = torch.arange(1 << 16, dtype=torch.float32)
    frames = encode(dataclasses.replace(full_example(), t=t, maybe_t=None, tensors=[]), sender="x")
    # send side: the frame is a view of the tensor's storage, not a copy
    view = frames[1]
    assert isinstance(view, memoryview)
    assert torch.frombuffer(view, dtype=torch.uint8).data_ptr() == t.data_ptr()
    # receive side: the tensor aliases the zmq frame's memory
    zframe = zmq.Frame(bytes(view))
    _, out = decode([bytes(frames[0]), zframe])
    assert out.t.data_ptr() == torch.frombuffer(zframe.buffer, dtype=torch.uint8).data_ptr()


def _example(tp: Any, depth: int = 0) -> Any:
    """A value of declared type ``tp`` (used to build an instance of any registered kind)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return {"any": 1}
    if tp is type(None) or tp is None:
        return None
    if tp is bool:
        return True
    if tp is int:
        return 3
    if tp is float:
        return 0.5
    if tp is str:
        return "s"
    if tp is bytes:
        return b"b"
    if tp is torch.Tensor:
        return torch.arange(6, dtype=torch.float32).reshape(2, 3)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType")):
        non_none = [a for a in args if a is not type(None)]
        return _example(non_none[0], depth) if non_none else None
    if origin is list:
        return [_example(args[0] if args else int, depth + 1)]
    if origin is dict:
        return {"k": _example(args[1] if len(args) > 1 else int, depth + 1)}
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: _example(hints[f.name], depth + 1) for f in dataclasses.fields(tp) if f.init})
    raise AssertionError(f"no example for {tp!r}")


def test_roundtrip_every_registered_kind() -> None:
    # The RL kinds live in transport.protocol (another module); include them when present.
    try:
        importlib.import_module("transport.protocol")
    except ModuleNotFoundError:
        pass
    # kinds other test modules register in the same pytest run are theirs to test
    kinds = {t: c for t, c in M.registry().items() if c.__module__.startswith("transport.") or c.__module__ == __name__}
    assert {"error", "ping", "pong", "test.msg.all"} <= kinds.keys()
    for tag, cls in kinds.items():
        msg = CONSISTENT_EXAMPLES[tag]() if tag in CONSISTENT_EXAMPLES else _example(cls)
        assert same(roundtrip(msg), msg), tag


def _batch_example() -> Any:
    from actors.batch import Batch, BatchGroup, from_batch
    from transport.protocol import BufferStats, Sample
    samples = [Sample([5, 6], [-0.5, -0.25], [1, 1], "stop", 5.0, True, "ok"), Sample([7], [-1.0], [0], "length")]
    return from_batch(Batch(2, [BatchGroup([1, 2, 3], 1, samples)], BufferStats(depth=3)))


# Kinds whose fields must agree with each other (checked when built): one example value per field will not do.
CONSISTENT_EXAMPLES = {"rl.batch": _batch_example}


def test_transport_kinds_roundtrip_explicitly() -> None:
    for msg in (Error("bad_field", "field 'x': expected int", "some.kind"), Ping(7), Ping(7, "3f2a"), Pong(7)):
        assert roundtrip(msg) == msg


def test_a_ping_carries_its_buses_incarnation_and_one_without_reads_as_unknown() -> None:
    # The field came after schema version 7 was set, with a default: a ping of a process that predates it
    # reads as "no incarnation" (nothing is concluded from it), at every readable version.
    assert decode(encode(Ping(3, "3f2a")))[1].incarnation == "3f2a"
    for version in sorted(M.READABLE_VERSIONS):
        assert decode([_head(body={"seq": 3}, version=version)])[1] == Ping(3, "")
    with pytest.raises(FieldError, match="field 'incarnation': expected str, got int"):
        decode([_head(body={"seq": 3, "incarnation": 5})])
    assert Ping.VOLATILE == ("incarnation",)


def test_float_field_accepts_int_and_list_of_tuples_normalised() -> None:
    msg = dataclasses.replace(full_example(), f=2)
    assert roundtrip(msg).f == 2.0 and type(roundtrip(msg).f) is float
    msg = dataclasses.replace(full_example(), ints=(4, 5))
    assert roundtrip(msg).ints == [4, 5]


def test_header_fields_and_unique_ids() -> None:
    frames = encode(Ping(1), sender="a", reply_to="r1", wants_reply=True, ts=12.5)
    header, _ = decode(frames)
    assert (header.sender, header.reply_to, header.wants_reply, header.ts) == ("a", "r1", True, 12.5)
    ids = {decode(encode(Ping(), sender="a"))[0].id for _ in range(1000)}
    assert len(ids) == 1000


# ------------------------------------------------------------------------------------------ bad input

def _head(tag: str = "ping", body: Any = None, version: int = SCHEMA_VERSION) -> bytes:
    return msgpack.packb([tag, version, "evil", "id1", 1.0, None, True, {} if body is None else body])


def _body_of(msg: Any) -> tuple[dict, list]:
    frames = encode(msg, sender="x")
    return msgpack.unpackb(frames[0])[7], [bytes(f) for f in frames[1:]]


@pytest.mark.parametrize("frames, exc, words", [
    ([], MalformedFrame, "no frames"),
    ([b"\xc1garbage"], MalformedFrame, "not valid msgpack"),
    ([msgpack.packb({"a": 1})], MalformedFrame, "8-element array"),
    ([msgpack.packb(["ping", 1, "x"])], MalformedFrame, "length 3"),
    ([msgpack.packb([5, SCHEMA_VERSION, "x", "id", 1.0, None, False, {}])], MalformedFrame, "'tag'"),
    ([msgpack.packb(["ping", SCHEMA_VERSION, "x", "id", "now", None, False, {}])], MalformedFrame, "'ts'"),
    ([_head("no.such.kind")], UnknownKind, "'no.such.kind'"),
    ([_head(version=SCHEMA_VERSION + 1)], SchemaMismatch, f"schema version {SCHEMA_VERSION + 1}"),
    ([_head(body=[1, 2])], FieldError, "map of fields"),
    ([_head(body={"seq": "one"})], FieldError, "field 'seq': expected int, got str"),
    ([_head(body={"seq": True})], FieldError, "field 'seq': expected int, got bool"),
    ([_head(body={"bogus": 1})], FieldError, "field 'bogus': unknown field"),
    # a checkpoint request names no file: a spoofed one once made the buffer write where it said
    ([_head("rl.checkpoint_request", body={"step": 3, "path": "/etc/cron.d/x"})], FieldError,
     "field 'path': unknown field"),
    ([_head("error", body={"code": "x"})], FieldError, "field 'text': missing"),
])
def test_bad_frames_raise_typed_errors_naming_the_cause(frames: list, exc: type, words: str) -> None:
    with pytest.raises(exc) as info:
        decode(frames)
    assert words in str(info.value)
    assert isinstance(info.value, DecodeError) and info.value.reason


def test_nested_field_errors_name_the_path() -> None:
    body, tframes = _body_of(full_example())
    body["points"][0]["x"] = "3"
    with pytest.raises(FieldError, match=r"field 'points\[0\]\.x': expected int, got str"):
        decode([_head("test.msg.all", body), *tframes])
    body, tframes = _body_of(full_example())
    body["table"]["lr"] = "fast"
    with pytest.raises(FieldError, match=r"field \"table\['lr'\]\": expected float"):
        decode([_head("test.msg.all", body), *tframes])
    body, tframes = _body_of(full_example())
    body["ints"] = [1, None, 3]
    with pytest.raises(FieldError, match=r"field 'ints\[1\]': expected int, got NoneType"):
        decode([_head("test.msg.all", body), *tframes])


def test_tensor_frame_errors() -> None:
    body, tframes = _body_of(full_example())
    short = [tframes[0][:-2], *tframes[1:]]
    with pytest.raises(TensorFrameMismatch, match=r"field 't': tensor frame 1 has 22 bytes but dtype bfloat16 "
                                                  r"shape \[3, 4\] needs 24"):
        decode([_head("test.msg.all", body), *short])
    with pytest.raises(TensorFrameMismatch, match="out of range"):
        decode([_head("test.msg.all", body), *tframes[:1]])
    with pytest.raises(TensorFrameMismatch, match="extra frames"):
        decode([_head("test.msg.all", body), *tframes, b"spare"])
    body["t"]["dtype"] = "float128"
    with pytest.raises(FieldError, match="field 't': unknown tensor dtype 'float128'"):
        decode([_head("test.msg.all", body), *tframes])


def test_frame_over_limit_is_rejected_with_header_kept() -> None:
    body, tframes = _body_of(dataclasses.replace(full_example(), t=torch.zeros(1000)))
    with pytest.raises(FrameTooLarge, match="frame 1 is 4000 bytes, over the limit of 1000") as info:
        decode([_head("test.msg.all", body), *tframes], max_frame_bytes=1000)
    assert info.value.header is not None and info.value.header.wants_reply   # so the bus can reply
    with pytest.raises(FrameTooLarge, match="frame 0"):
        decode([_head("test.msg.all", body), *tframes], max_frame_bytes=10)


def test_encode_errors_name_the_field() -> None:
    @dataclasses.dataclass
    class NotRegistered:
        a: int

    with pytest.raises(EncodeError, match="not a registered message kind"):
        encode(NotRegistered(1))
    with pytest.raises(EncodeError, match="field 'anything' cannot be encoded"):
        encode(dataclasses.replace(full_example(), anything=object()))


def test_duplicate_tag_is_refused() -> None:
    with pytest.raises(ValueError, match="already registered"):
        @message("ping")
        class OtherPing(Message):
            seq: int = 0


# ------------------------------------------------------------------ compiled fast path, batches, versions

def test_fast_path_and_general_path_agree() -> None:
    # The compiled decoder accepts exactly what the general path accepts and falls back for the rest.
    msg = full_example()
    frames = encode(msg, sender="x")
    assert same(decode(frames)[1], msg)
    body, tframes = _body_of(msg)
    body["f"] = 3                 # an int for a float field: converted by the general path
    out = decode([_head("test.msg.all", body), *tframes])[1]
    assert out.f == 3.0 and type(out.f) is float
    body, tframes = _body_of(msg)
    del body["default_s"]         # a defaulted field left out
    assert decode([_head("test.msg.all", body), *tframes])[1].default_s == "d"
    # errors come from the general path (first bad field in wire order, with its path)
    assert decode(encode(Ping(7)))[1] == Ping(7)
    with pytest.raises(FieldError, match="field 'seq': expected int, got bool"):
        decode([_head(body={"seq": True})])
    with pytest.raises(FieldError, match="field 'seq': expected int, got str"):
        decode([_head(body={"seq": "1"})])
    # a tuple in a list field is normalised by the compiled encoder too
    assert decode(encode(dataclasses.replace(msg, ints=(1, 2))))[1].ints == [1, 2]
    assert decode(encode(Error("c", "t")))[1] == Error("c", "t", None)


def test_older_versions_decode_upgraded_except_the_bodies_versions_3_and_4_reshaped() -> None:
    # version 2 only added the batch container; version 3 changed four rl message bodies (composition),
    # version 4 rl.batch (columns and tensor frames), version 5 the task of rl.generate_group and
    # rl.trajectories (no level), version 6 the weights link's epoch fields, version 7 the batch stats' data_pass,
    # version 8 the answers' rollout prompt and the samples' agent reward. Single messages (and message logs)
    # of versions 1 to 5 read fine: what versions 5 and 6 changed is upgraded on read, what 3 and 4 reshaped
    # is refused naming the old body's first unknown field
    assert SCHEMA_VERSION == 8 and M.READABLE_VERSIONS == {1, 2, 3, 4, 5, 6, 7, 8}
    for version in (1, 2, 3, 4, 5):
        header, msg = decode([_head(body={"seq": 3}, version=version)])
        assert msg == Ping(3) and header.version == version
    with pytest.raises(SchemaMismatch, match="schema version 0"):
        decode([_head(version=0)])
    protocol = importlib.import_module("transport.protocol")
    task = {"kind": "math", "answer": "2", "tests": [], "mode": "", "level": 1}
    version_2_trajectories = {"group_id": "g", "query_id": "q", "prompt_ids": [1], "task": task, "samples": [],
                              "rollout": "rollout.0"}
    with pytest.raises(FieldError, match="field 'query_id': unknown field"):
        decode([_head("rl.trajectories", body=version_2_trajectories, version=2)])
    version_3_batch = {"step": 1, "groups": [], "stats": {}}
    with pytest.raises(FieldError, match="field 'groups': unknown field"):
        decode([_head("rl.batch", body=version_3_batch, version=3)])
    # version 5 dropped the task's level: a version-4 body is read without it (transport/protocol.py upgrades it)
    version_4_trajectories = {"group_id": "g", "task": task, "answers": {"samples": [], "rollout": "rollout.0"}}
    assert decode([_head("rl.trajectories", body=version_4_trajectories, version=4)])[1].task == protocol.Task("math", "2")
    version_4_generate = {"group_id": "g", "prompt_ids": [1], "n": 2, "task": task}
    assert decode([_head("rl.generate_group", body=version_4_generate, version=4)])[1].task == protocol.Task("math", "2")
    # a current-version body that still has the level is refused: only older versions are upgraded
    with pytest.raises(FieldError, match="field 'task.level': unknown field"):
        decode([_head("rl.trajectories", body=version_4_trajectories, version=6)])
    del task["level"]
    assert decode([_head("rl.trajectories", body=version_4_trajectories, version=5)])[1].task == protocol.Task("math", "2")
    # version 6: the kinds that carry the weights link's epoch read a version-5 body, its field renamed
    version_6_bodies = {
        "rl.link_reform": {"epoch": 3, "members": ["rollout.0"]},
        "rl.link_formed": {"epoch": 3, "seconds": 0.5},
        "rl.weights_ready": {"version": 2, "n_buckets": 1, "weights_hash": "h", "epoch": 3},
        "rl.weights_broadcast": {"version": 2, "epoch": 3},
        "ps.weights_status_request": {"min_version": 2, "min_epoch": 3, "timeout_s": 1.0},
        "ps.weights_status": {"version": 2, "weights_hash": "h", "epoch": 3, "rollouts": {}, "pushes": 0,
                              "hash_mismatches": 0, "last_sync_seconds": 0.0, "reached": True},
    }
    version_5_names = {"epoch": "generation", "min_epoch": "min_generation"}
    for kind, body in version_6_bodies.items():
        old = {version_5_names.get(k, k): v for k, v in body.items()}
        assert set(old) != set(body)
        assert decode([_head(kind, body=old, version=5)])[1] == M.registry()[kind](**body)
        assert decode([_head(kind, body=body, version=6)])[1] == M.registry()[kind](**body)
    # a version-5 message of a kind version 6 left alone still decodes
    ack = {"version": 2, "weights_hash": "h", "receive_seconds": 0.5}
    assert decode([_head("rl.weights_ack", body=ack, version=5)])[1] == protocol.WeightsAck(**ack)
    # version 7: rl.batch's stats count data passes as data_pass; a version-6 body's epoch is read as it (a whole
    # version-6 batch log replays: tests/test_replay_actors.py), a current body is left as it is
    old_batch = {"step": 1, "stats": {"depth": 3, "epoch": 2}, "levels": [1]}
    assert M.upgraded_body("rl.batch", 6, old_batch)["stats"] == {"depth": 3, "data_pass": 2}
    assert M.upgraded_body("rl.batch", 7, old_batch) == old_batch
    assert protocol.BufferStats().data_pass == 0 and not hasattr(protocol.BufferStats(), "epoch")
    # version 8: answers carry the prompt the rollout rendered and samples an agent's reward; a version-7 body is
    # read with the buffer's prompt (empty) and no agent reward
    sample = {"output_ids": [5], "logprobs": [-0.5], "versions": [0], "finish_reason": "stop", "reward": 0.0,
              "correct": False, "score_detail": ""}
    old_scored = {"group_id": "g", "answers": {"samples": [sample], "rollout": "rollout.0"}, "score_seconds": 0.1}
    assert M.upgraded_body("rl.scored_group", 7, old_scored)["answers"]["prompt_ids"] == []
    scored = decode([_head("rl.scored_group", body=old_scored, version=7)])[1]
    assert scored.answers.prompt_ids == [] and scored.answers.samples[0].agent_reward is None
    new = protocol.ScoredGroup(group_id="g", answers=protocol.Answers(
        samples=[protocol.Sample([5], [-0.5], [0], "stop", agent_reward=1.0)], rollout="r", prompt_ids=[1, 2]))
    assert decode(M.encode(new, "tester"))[1] == new


def test_batch_container_round_trip_and_errors() -> None:
    firsts = [encode(Ping(i), sender="a")[0] for i in range(5)]
    container = M.encode_batch(firsts, sender="a")
    assert M.is_batch(container) and not M.is_batch(firsts[0])
    assert M.split_batch([container]) == firsts
    assert [decode([f])[1].seq for f in M.split_batch([container])] == list(range(5))
    # a container is not a message: decode() names it instead of handling it
    with pytest.raises(UnknownKind, match=r"'\$batch'"):
        decode([container])

    def head(body: Any, version: int = SCHEMA_VERSION) -> bytes:
        return msgpack.packb([M.BATCH_TAG, version, "evil", "", 1.0, None, False, body])

    with pytest.raises(SchemaMismatch, match="batch container of schema version 1"):
        M.split_batch([head(firsts, version=1)])
    with pytest.raises(MalformedFrame, match="list of 1 to"):
        M.split_batch([head({})])
    with pytest.raises(MalformedFrame, match="list of 1 to"):
        M.split_batch([head([])])
    with pytest.raises(MalformedFrame, match="list of 1 to"):
        M.split_batch([head(firsts * 20)])
    with pytest.raises(MalformedFrame, match="element 1 is str"):
        M.split_batch([head([firsts[0], "x"])])
    with pytest.raises(MalformedFrame, match="one frame"):
        M.split_batch([container, b"extra"])


def test_reserved_tags_are_refused() -> None:
    with pytest.raises(ValueError, match="reserved"):
        @message("$mine")
        class Mine(Message):
            a: int = 0
