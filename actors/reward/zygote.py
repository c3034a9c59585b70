"""Host side of the zygote: one long-lived bubblewrap sandbox that starts every program fresh inside it.

An empty Python program took 41 ms of wall time with a bubblewrap start per program on the project machine,
idle, where the interpreter alone starts in 10 ms (docs/reward-code.md). A `Zygote` starts bwrap once,
with `zygote_server.py` as the sandbox's PID 1, and for each program the server forks a process into
fresh user, PID, mount, IPC, UTS and network namespaces with its own /proc, /tmp, /dev/shm and
/sandbox, sets the rlimits, drops every capability and execs the program, or runs a Python file in the
forked, already started interpreter (the server's docstring says how and why). What the host gives a run never passes
through the server: the request (argv, environment, limits, files), stdin and the stdout, stderr and
result pipes travel as file descriptors straight to the program's process.

Failures: a zygote that dies, or does not answer within `REPLY_TIMEOUT_S`, raises `ZygoteLost`; a setup
that failed inside raises `ZygoteError`. Either way the zygote is discarded (its sandbox killed) and the
next run starts a new one, so a broken zygote never decides another program's verdict.

Zygotes belong to the process that started them: a forked child (a pool worker) starts its own, and one
zygote runs one program at a time (`checkout` hands a thread an idle one or starts another).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from actors.reward.sandbox_run import RunCollector, RunResult, SandboxLimits, close_pipes, rlimit_settings

SERVER_SOURCE = Path(__file__).with_name("zygote_server.py")
START_TIMEOUT_S = 10.0  # bwrap plus the server's interpreter start
RESULT_FD = 3  # the server puts each program's result channel here (zygote_server.RESULT_FD)
REPLY_TIMEOUT_S = 10.0  # the server answers "started" after a setup of a few ms, "exit" at once after a kill


class ZygoteError(RuntimeError):
    """The zygote could not start, or could not set up a program's sandbox; the message says why."""


class ZygoteStartError(ZygoteError):
    """No zygote can start here (the kernel or bwrap refuses what it needs); the message says why."""


class ZygoteLost(ZygoteError):
    """The zygote died or stopped answering in the middle of a run."""


class Zygote:
    """One bubblewrap sandbox running the zygote server, owned by the process that started it.

    `bwrap_args` is the bwrap command up to (not including) the program; `python` the interpreter inside.
    The sandbox is started as host uid `uid` (None: our own), like a per-run sandbox.
    """

    def __init__(self, bwrap_args: Sequence[str], python: str, uid: int | None) -> None:
        self.owner_pid = os.getpid()
        self.healthy = True
        self._stderr = tempfile.TemporaryFile()
        self._server_pidfd: int | None = None
        channel, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        info_r, info_w = os.pipe()
        args = [*bwrap_args, "--info-fd", str(info_w), "--",
                python, "-I", "-B", "-c", SERVER_SOURCE.read_text(), str(server_end.fileno())]
        try:
            self._proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._stderr,
                pass_fds=(server_end.fileno(), info_w), start_new_session=True,
                user=uid, group=uid, extra_groups=[] if uid is not None else None,
                env={"PATH": "/usr/bin:/bin"},  # bwrap's environment is the server's /proc/1/environ
            )
        finally:
            server_end.close()
            os.close(info_w)
        self._channel = channel
        self.server_pid: int | None = None
        try:
            self.server_pid, self._server_pidfd = _read_child_pid(info_r, time.monotonic() + START_TIMEOUT_S)
            reply = self.receive(START_TIMEOUT_S)
            if reply != b"ready":
                raise ZygoteError(f"zygote answered {reply!r} instead of ready")
        except ZygoteError as exc:
            tail = self._stderr_tail()
            self.close()
            raise ZygoteStartError(f"could not start the zygote: {exc}{tail}") from None
        finally:
            os.close(info_r)

    def fileno(self) -> int:
        """The channel to the server: readable when it has a message (or is gone)."""
        return self._channel.fileno()

    def start(self, fds: Sequence[int]) -> None:
        """Hand the server one run's fds [request, stdin, stdout, stderr, result]; returns once the program's
        process is about to exec. Raises ZygoteError (setup failed) or ZygoteLost."""
        try:
            socket.send_fds(self._channel, [b"run"], list(fds))
        except OSError as exc:
            self.healthy = False
            raise ZygoteLost(f"could not reach the zygote: {exc}") from None
        reply = self.receive(REPLY_TIMEOUT_S)
        if reply == b"started":
            return
        self.healthy = False
        if reply.startswith(b"failed "):
            raise ZygoteError(f"the zygote could not set up the sandbox: {reply[7:].decode(errors='replace')}")
        raise ZygoteLost(f"the zygote answered {reply[:80]!r} instead of started")

    def kill_program(self) -> None:
        """Ask the server to SIGKILL the running program (with it, its whole PID namespace)."""
        try:
            self._channel.send(b"kill")
        except OSError:
            self.healthy = False

    def receive(self, timeout: float) -> bytes:
        """The server's next message. Raises ZygoteLost if it is gone or silent for `timeout` seconds."""
        if not select.select([self._channel], [], [], timeout)[0]:
            self.healthy = False
            raise ZygoteLost(f"the zygote did not answer within {timeout:g} s")
        try:
            message = self._channel.recv(4096)
        except OSError as exc:
            message = b""
            reason = f": {exc}"
        else:
            reason = ""
        if not message:
            self.healthy = False
            raise ZygoteLost(f"the zygote ended{reason}")
        return message

    def host_pids(self) -> set[int]:
        """bwrap's and the server's pids: the processes of the sandbox uid that outlive each run."""
        return {self._proc.pid, *([self.server_pid] if self.server_pid is not None else [])}

    def cpu_s(self) -> float:
        """CPU seconds used so far by the server and the processes it reaped (every program run in it)."""
        if self.server_pid is None:
            return 0.0
        with open(f"/proc/{self.server_pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime .. cstime

    def alive(self) -> bool:
        if not self.healthy or self._proc.poll() is not None:
            return False
        if self._server_pidfd is not None and select.select([self._server_pidfd], [], [], 0)[0]:
            return False
        return True

    def close(self) -> None:
        """Kill the sandbox (the server is its PID 1: everything inside dies with it) and reap bwrap."""
        self.healthy = False
        if os.getpid() != self.owner_pid:
            self._forget()  # a forked child's copy: the sandbox belongs to the parent
            return
        if self._server_pidfd is not None:
            try:
                signal.pidfd_send_signal(self._server_pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)  # bwrap, if it had not reported the server yet
        except (ProcessLookupError, PermissionError):
            pass
        self._proc.wait()
        self._forget()

    def _forget(self) -> None:
        self._channel.close()
        if self._server_pidfd is not None:
            os.close(self._server_pidfd)
            self._server_pidfd = None
        self._stderr.close()

    def _stderr_tail(self) -> str:
        try:
            self._stderr.seek(0)
            text = self._stderr.read()[-400:].decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""
        return f" (sandbox stderr: {text})" if text else ""


def _read_child_pid(info_r: int, deadline: float) -> tuple[int, int]:
    """bwrap reports the host pid of the sandbox's PID 1 (the server) as JSON on its info fd."""
    info = b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([info_r], [], [], remaining)[0]:
            raise ZygoteError("bwrap did not report the sandbox's pid")
        chunk = os.read(info_r, 4096)
        info += chunk
        try:
            child_pid = json.loads(info).get("child-pid")
        except ValueError:
            if not chunk:
                raise ZygoteError(f"bwrap ended without reporting the sandbox's pid ({info[:200]!r})") from None
            continue
        if not isinstance(child_pid, int):
            raise ZygoteError(f"bwrap reported {info[:200]!r}")
        try:
            return child_pid, os.pidfd_open(child_pid)
        except ProcessLookupError:
            raise ZygoteError("the sandbox ended at once") from None


def run_in_zygote(zygote: Zygote, argv: list[str], env: dict[str, str], files: Mapping[str, bytes], stdin: bytes,
                  limits: SandboxLimits) -> RunResult:
    """Run one program in `zygote` (argv and files as inside the sandbox: /sandbox/NAME). The request and
    stdin travel as files, stdout, stderr and the result channel (fd RESULT_FD) as pipes. Raises ZygoteLost
    if the zygote died or went silent, ZygoteError if it could not set up the sandbox."""
    header = json.dumps({"argv": argv, "env": env, "tmpfs_bytes": limits.tmpfs_bytes,
                         "rlimits": [list(setting) for setting in rlimit_settings(limits)],
                         "files": [[name, len(content)] for name, content in files.items()]}).encode()
    pipes = [os.pipe() for _ in range(3)]  # stdout, stderr, result
    try:
        with tempfile.TemporaryFile() as request, tempfile.TemporaryFile() as stdin_file:
            request.write(b"%08d" % len(header) + header + b"".join(files.values()))
            request.flush()
            stdin_file.write(stdin)
            stdin_file.flush()
            stdin_file.seek(0)
            started = time.monotonic()
            zygote.start([request.fileno(), stdin_file.fileno(), *(w for _, w in pipes)])
        for index, (read_end, write_end) in enumerate(pipes):  # EOF must come when the program is gone
            os.close(write_end)
            pipes[index] = (read_end, -1)
        process = ZygoteProcess(zygote)
        run = RunCollector(process, pipes[0][0], pipes[1][0], pipes[2][0])
        result = run.collect(limits, started, sandboxed=True)
        if process.lost:
            raise ZygoteLost("the zygote ended during the run")
        return result
    finally:
        close_pipes(pipes)


class ZygoteProcess:
    """A run the zygote started: it reports the exit (wait status and CPU time) and kills on request.

    The program is PID 1 of its own PID namespace, so once the zygote has reaped it nothing of the run is
    left. A zygote that is gone or silent leaves `lost` set; the run is then not to be trusted.
    """

    exit_status_encodes_signal = False

    def __init__(self, zygote: Zygote) -> None:
        self.zygote = zygote
        self.watched_fds: list[int] = []  # the channel is read here, not by the collector's loop
        self.returncode: int | None = None
        self.cpu_s: float | None = None
        self.killed = False
        self.lost = False

    def reaped(self, timeout: float = 0.0) -> bool:
        if self.returncode is not None or self.lost:
            return True
        if not select.select([self.zygote], [], [], timeout)[0]:
            return False
        try:
            message = self.zygote.receive(0.0)
        except ZygoteLost:
            self.lost = True
            return True
        word, _, rest = message.partition(b" ")
        if word != b"exit":
            self.zygote.healthy = False
            self.lost = True
            return True
        status, cpu_s = rest.split()
        self.returncode = os.waitstatus_to_exitcode(int(status))
        self.cpu_s = float(cpu_s)
        return True

    def on_data(self, fd: int, chunk: bytes) -> None:
        raise AssertionError("the zygote process watches no fds")

    def kill(self) -> None:
        self.killed = True
        if self.reaped():
            return
        self.zygote.kill_program()
        if not self.reaped(timeout=REPLY_TIMEOUT_S):
            self.zygote.healthy = False
            self.lost = True

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------ the process's zygotes

_lock = threading.Lock()
_idle: dict[tuple, list[Zygote]] = {}


@contextlib.contextmanager
def checkout(key: tuple, start: Callable[[], Zygote]) -> Iterator[Zygote]:
    """An idle zygote of this process for `key` (or a new one from `start()`), for one run.

    It goes back to the idle list afterwards only if it is still healthy; otherwise it is killed.
    """
    zygote = None
    with _lock:
        idle = _idle.setdefault(key, [])
        while idle:
            candidate = idle.pop()
            if candidate.owner_pid == os.getpid() and candidate.alive():
                zygote = candidate
                break
            candidate.close()
    if zygote is None:
        zygote = start()
    try:
        yield zygote
    finally:
        if zygote.alive():
            with _lock:
                _idle.setdefault(key, []).append(zygote)
        else:
            zygote.close()


def idle_zygotes() -> list[Zygote]:
    """This process's zygotes that are waiting for a run."""
    with _lock:
        return [zygote for idle in _idle.values() for zygote in idle if zygote.owner_pid == os.getpid()]


def idle_host_pids() -> set[int]:
    """The host pids of this process's idle zygotes (bwrap and server)."""
    return {pid for zygote in idle_zygotes() for pid in zygote.host_pids()}


def close_all() -> None:
    """Kill every idle zygote of this process (tests; interpreter exit)."""
    with _lock:
        zygotes = [zygote for idle in _idle.values() for zygote in idle]
        _idle.clear()
    for zygote in zygotes:
        zygote.close()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it; the zygotes are forgotten lazily


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(close_all)
