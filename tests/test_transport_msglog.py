"""Message logs: records round-trip, survive a killed writer, and a torn tail is skipped, not fatal."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from transport.messages import Message, decode, encode, message
from transport.msglog import MAGIC, MessageLogError, MessageLogReader, MessageLogWriter, read_log


@message("test.log.item")
class Item(Message):
    n: int
    t: torch.Tensor | None = None


def write_items(path: str, count: int, **kw) -> list[list]:
    sent = []
    with MessageLogWriter(path, meta={"actor": "a"}, **kw) as w:
        for i in range(count):
            frames = encode(Item(i, torch.full((4,), float(i))), sender="peer")
            w.record("in", frames, peer="peer", t=float(i))
            sent.append(frames)
    return sent


def test_records_roundtrip_and_decode(tmp_path) -> None:
    path = str(tmp_path / "a.msglog")
    write_items(path, 5)
    records, torn = read_log(path)
    assert torn is None
    assert records[0].kind == "meta" and records[0].meta["actor"] == "a"
    items = [decode(r.frames)[1] for r in records[1:]]
    assert [m.n for m in items] == list(range(5))
    assert torch.equal(items[3].t, torch.full((4,), 3.0))
    assert [r.t for r in records[1:]] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_checksum_mode_keeps_only_sums(tmp_path) -> None:
    path = str(tmp_path / "c.msglog")
    write_items(path, 2, tensors="checksum")
    records, _ = read_log(path)
    rec = records[2]
    assert len(rec.frames) == 1 and len(rec.sums) == 1 and not rec.tensors_stored
    import hashlib
    assert rec.sums[0] == hashlib.sha256(torch.full((4,), 1.0).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("cut", [1, 5, 9, 30])
def test_torn_last_record_is_skipped(tmp_path, cut: int) -> None:
    path = str(tmp_path / "t.msglog")
    write_items(path, 3)
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.truncate(size - cut)
    reader = MessageLogReader(path)
    records = list(reader)
    assert [decode(r.frames)[1].n for r in records[1:]] == [0, 1]
    assert reader.torn is not None and "torn record" in reader.torn


def test_corrupt_last_record_checksum_is_torn_but_middle_damage_is_an_error(tmp_path) -> None:
    path = str(tmp_path / "x.msglog")
    write_items(path, 3)
    records, _ = read_log(path)
    with open(path, "r+b") as fh:
        fh.seek(-1, os.SEEK_END)
        last = fh.read(1)
        fh.seek(-1, os.SEEK_END)
        fh.write(bytes([last[0] ^ 0xFF]))
    recs, torn = read_log(path)
    assert len(recs) == 3 and "checksum mismatch" in torn
    with open(path, "r+b") as fh:
        fh.seek(records[1].offset + 12)
        byte = fh.read(1)
        fh.seek(records[1].offset + 12)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(MessageLogError, match=f"record 1 at offset {records[1].offset} fails its checksum"):
        read_log(path)
    with open(str(tmp_path / "bad"), "wb") as fh:
        fh.write(b"NOTALOG!")
    with pytest.raises(MessageLogError, match="not a message log"):
        read_log(str(tmp_path / "bad"))


def test_log_survives_a_killed_writer_and_appends_a_new_segment(tmp_path) -> None:
    path = str(tmp_path / "crash.msglog")
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.getcwd()!r})
        from tests.test_transport_msglog import Item
        from transport.messages import encode
        from transport.msglog import MessageLogWriter
        w = MessageLogWriter({path!r}, meta={{"actor": "victim"}})
        for i in range(50):
            w.record("in", encode(Item(i), sender="p"), peer="p")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert proc.returncode == -signal.SIGKILL
    write_items(path, 2)      # the restarted actor appends
    records, torn = read_log(path)
    assert torn is None
    assert [r.segment for r in records if r.kind == "meta"] == [0, 1]
    first = [decode(r.frames)[1].n for r in records if r.kind == "in" and r.segment == 0]
    assert first == list(range(50))
    with open(path, "rb") as fh:
        assert fh.read(len(MAGIC)) == MAGIC
