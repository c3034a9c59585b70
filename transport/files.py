"""Files written whole or not at all: the one way the project writes a file that another process, or a
later run, reads (checkpoint parts and manifests, actor specs and ready files, key files, status and
progress files).

It lives in transport/, the lowest layer that does I/O, so that transport's own key and secret files use
it too (the import direction is tools -> actors -> (topology, transport, algo)).
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

Content = bytes | bytearray | memoryview | str | Iterable[bytes | memoryview] | Callable[[BinaryIO], object]


def atomic_write(path: str | os.PathLike, data: Content, *, mode: int = 0o666, durable: bool = True) -> None:
    """Write `path` whole or not at all: into a temporary file beside it, then renamed over it, so a reader
    (or a crash) sees the old file or the new one, never half of one.

    `data`: bytes, a str (UTF-8), parts written in order (a large file need not be joined in memory), or a
    function that writes into the open binary file (`torch.save`, `json.dump` through a wrapper...).
    `mode`: the new file's permissions, set when it is created (the umask applies, as for `open`), so a
    secret is never readable by others, not even for a moment. The temporary name is unique to this
    writer and created exclusively, so writers that race on one path, and a planted file or link at the
    temporary name, cannot mix their content into it. `durable`: fsync the file before the rename and the
    directory after it, so the new content survives a machine crash (leave it on for anything a resume
    reads; a file rewritten every second for a live view need not).
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                for part in ((data.encode() if isinstance(data, str) else data,)
                             if isinstance(data, (bytes, bytearray, memoryview, str)) else data):
                    f.write(part)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of directory `path` (a file renamed into it) survive a machine crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
