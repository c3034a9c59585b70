"""One sandboxed run: its limits, its result, and the loop that collects its output under the caps.

`actors/reward/sandbox.py` (one bwrap, or no sandbox, per run) and `actors/reward/zygote.py` (a run in the
zygote) start a program their own way and hand a `RunProcess` for it to a `RunCollector`, which reads
stdout, stderr and the result channel under the output cap and the wall-time deadline and has the run
killed completely past either.
"""
from __future__ import annotations

import dataclasses
import math
import os
import resource
import selectors
import signal
import time
from typing import Protocol

MiB = 1 << 20


class SandboxConfigError(ValueError):
    """A sandbox limit or option is invalid; the message names it."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one sandboxed run. Sizes are bytes, times seconds."""

    wall_time_s: float = 2.0
    cpu_time_s: float = 2.0
    memory_bytes: int = 512 * MiB  # RLIMIT_AS of every process inside
    file_size_bytes: int = 16 * MiB  # RLIMIT_FSIZE: largest single file written
    tmpfs_bytes: int = 64 * MiB  # total size of the writable /tmp
    max_processes: int = 32  # RLIMIT_NPROC for the run's uid
    max_open_files: int = 256
    output_bytes: int = 1 * MiB  # per stream (stdout, stderr, result channel)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise SandboxConfigError(f"SandboxLimits.{field.name} must be a positive number, got {value!r}")


@dataclasses.dataclass
class RunResult:
    """What one run produced. `returncode` is negative for a signal, as in subprocess."""

    returncode: int | None
    stdout: bytes
    stderr: bytes
    result: bytes  # bytes written to the result channel (fd named by $RESULT_FD)
    timed_out: bool
    output_limited: bool  # a stream went past SandboxLimits.output_bytes
    wall_s: float
    sandboxed: bool
    cpu_s: float | None = None  # CPU time of the run's processes (None if it could not be read)
    cpu_limited: bool = False   # ended by RLIMIT_CPU (SIGXCPU, or SIGKILL past the soft limit)

    @property
    def signal_name(self) -> str | None:
        if self.returncode is not None and self.returncode < 0:
            try:
                return signal.Signals(-self.returncode).name
            except ValueError:
                return f"signal {-self.returncode}"
        return None


def rlimit_settings(limits: SandboxLimits) -> list[tuple[int, int, int]]:
    """(resource, soft, hard) for every rlimit a run gets."""
    cpu = max(1, math.ceil(limits.cpu_time_s))
    return [
        (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL one second later
        (resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes),
        (resource.RLIMIT_FSIZE, limits.file_size_bytes, limits.file_size_bytes),
        (resource.RLIMIT_NPROC, limits.max_processes, limits.max_processes),
        (resource.RLIMIT_NOFILE, limits.max_open_files, limits.max_open_files),
        (resource.RLIMIT_CORE, 0, 0),
    ]


def close_pipes(pipes: list[tuple[int, int]]) -> None:
    """Close both ends of each (read, write) pair; an end already closed is -1."""
    for read_end, write_end in pipes:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)


class RunProcess(Protocol):
    """The started program as a RunCollector sees it."""

    returncode: int | None  # negative for a signal, as in subprocess
    cpu_s: float | None  # CPU time of the run's processes, once reaped
    killed: bool  # kill() was called
    watched_fds: list[int]  # more fds for the collector to read and pass to on_data
    exit_status_encodes_signal: bool  # an exit status 128+N means "killed by signal N" (bwrap)

    def reaped(self, timeout: float = 0.0) -> bool:
        """True once the program has ended (waiting up to `timeout` seconds)."""

    def on_data(self, fd: int, chunk: bytes) -> None:
        """Bytes read from one of `watched_fds` (b"" at its end)."""

    def kill(self) -> None:
        """Kill everything of the run; returns once nothing of it is left."""

    def close(self) -> None:
        """Release what the handle holds (after kill)."""


class RunCollector:
    """One started program: reads its pipes under the caps and the deadline, and has it killed completely."""

    def __init__(self, process: RunProcess, out_fd: int, err_fd: int, result_r: int) -> None:
        self.process = process
        self.out_fd, self.err_fd, self.result_r = out_fd, err_fd, result_r
        self.buffers = {out_fd: bytearray(), err_fd: bytearray(), result_r: bytearray()}

    def collect(self, limits: SandboxLimits, started: float, sandboxed: bool) -> RunResult:
        process = self.process
        deadline = started + limits.wall_time_s
        timed_out = output_limited = False
        selector = selectors.DefaultSelector()
        for fd in [*self.buffers, *process.watched_fds]:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        try:
            while selector.get_map():
                now = time.monotonic()
                if now >= deadline:
                    if process.killed:
                        break  # killed and still no EOF: something outside our reach holds a pipe
                    timed_out = True
                    process.kill()
                    deadline = now + 1.0  # grace for the pipes to reach EOF
                for key, _ in selector.select(timeout=max(0.0, min(deadline - now, 0.05))):
                    chunk = os.read(key.fd, 65536)
                    if key.fd not in self.buffers:
                        process.on_data(key.fd, chunk)
                        if not chunk:
                            selector.unregister(key.fd)
                    elif not chunk:
                        selector.unregister(key.fd)
                    elif self._keep(key.fd, chunk, limits.output_bytes) and not process.killed:
                        output_limited = True
                        process.kill()
                        deadline = time.monotonic() + 1.0
                if not process.killed and process.reaped():
                    # The main process is gone. Anything it left behind must not outlive it (unsandboxed,
                    # a daemon would otherwise hold our pipes open until the deadline).
                    process.kill()
                    deadline = min(deadline, time.monotonic() + 1.0)
        finally:
            selector.close()
            process.kill()
            process.close()
        returncode = process.returncode
        # bwrap exits 128+N when its program died of signal N; a plain run or a zygote's reports -N.
        signum = -returncode if returncode is not None and returncode < 0 else (
            returncode - 128 if process.exit_status_encodes_signal and returncode is not None
            and 128 < returncode < 128 + signal.NSIG else 0)
        soft_limit = max(1, math.ceil(limits.cpu_time_s))
        cpu_limited = signum == signal.SIGXCPU or (
            signum == signal.SIGKILL and not timed_out and process.cpu_s is not None and process.cpu_s >= soft_limit)
        return RunResult(
            returncode=returncode,
            stdout=bytes(self.buffers[self.out_fd]),
            stderr=bytes(self.buffers[self.err_fd]),
            result=bytes(self.buffers[self.result_r]),
            timed_out=timed_out,
            output_limited=output_limited,
            wall_s=time.monotonic() - started,
            sandboxed=sandboxed,
            cpu_s=process.cpu_s,
            cpu_limited=cpu_limited,
        )

    def _keep(self, fd: int, chunk: bytes, cap: int) -> bool:
        """Append up to the cap; True when the stream went past it."""
        buf = self.buffers[fd]
        room = cap - len(buf)
        buf += chunk[:max(room, 0)]
        return len(chunk) > room
