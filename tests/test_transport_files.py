"""transport.files.atomic_write: the one way a file another process or a later run reads is written."""
from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path

import pytest
import torch

from transport.files import atomic_write


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp" in p.name)


@pytest.mark.parametrize("data, want", [
    (b"bytes", b"bytes"), ("text \u00e9", "text \u00e9".encode()), ([b"par", memoryview(b"ts")], b"parts"),
    (lambda f: f.write(b"by a writer"), b"by a writer"),
])
def test_every_form_of_content_lands_whole(tmp_path: Path, data, want: bytes) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"old")
    atomic_write(path, data)
    assert path.read_bytes() == want and leftovers(tmp_path) == []


def test_torch_save_through_the_writer_loads_back(tmp_path: Path) -> None:
    state = {"step": 3, "t": torch.arange(5)}
    atomic_write(tmp_path / "state.pt", lambda f: torch.save(state, f))
    got = torch.load(tmp_path / "state.pt", weights_only=True)
    assert got["step"] == 3 and torch.equal(got["t"], state["t"])


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "progress.json"
    atomic_write(path, json.dumps({"done": 1}))

    def half(f: io.BufferedWriter) -> None:
        f.write(b'{"done": 2, "by_le')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half)
    assert json.loads(path.read_text()) == {"done": 1} and leftovers(tmp_path) == []


@pytest.mark.parametrize("mode", [0o600, 0o644])
def test_the_mode_is_the_files_from_its_creation(tmp_path: Path, mode: int) -> None:
    # A secret is never readable by others, not even before a chmod: the temporary file is created with it.
    seen = []

    def record(f: io.BufferedWriter) -> None:
        seen.append(stat.S_IMODE(os.fstat(f.fileno()).st_mode))
        f.write(b"key")

    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "k", record, mode=mode)
    finally:
        os.umask(old)
    assert seen == [mode] and stat.S_IMODE((tmp_path / "k").stat().st_mode) == mode


def test_a_planted_link_at_the_final_name_is_replaced_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("untouched")
    (tmp_path / "run.key").symlink_to(target)
    atomic_write(tmp_path / "run.key", b"secret", mode=0o600)
    assert target.read_text() == "untouched" and not (tmp_path / "run.key").is_symlink()
    assert (tmp_path / "run.key").read_bytes() == b"secret"
