"""Run untrusted programs isolated with bubblewrap, resource limits and a hard wall-time kill.

Why it is built this way (measured on the project's machines, see docs/reward-code.md):

* We usually run as root. `bwrap --unshare-user --uid 65534` started by root maps the sandbox user onto
  host uid 0, so the "nobody" inside still owns every root file it can see and reads /root and
  /etc/shadow. Instead the child drops to an unprivileged host uid *before* exec'ing bwrap (setpriv,
  see `_as_limited`), and bwrap then builds its namespaces as that unprivileged user (unprivileged user
  namespaces). File permissions on the host therefore apply to the program as to any other stranger.
* The sandbox sees only /usr (read-only, plus the /bin, /lib... links of a merged-/usr system), a new
  /proc and /dev, its own files under /sandbox, and size-capped writable tmpfs dirs /tmp (its working
  directory) and /dev/shm. The sandbox root and /dev are remounted read-only. No network (new net namespace: loopback only),
  new PID/IPC/UTS namespaces, and `--die-with-parent`, so killing bwrap kills everything inside.
* The program is PID 1 of its namespace (`--as-pid-1`). With bwrap's own init there, bwrap exits before
  reaping that init, which is then reparented to the host's PID 1; where that reaps lazily (containers),
  the zombies pile up, still count against RLIMIT_NPROC of the uid, and later runs fail to fork
  ("Can't fork for pid 1"). As PID 1 the program is bwrap's direct child and is always reaped by it.
  (A namespace's PID 1 ignores SIGXCPU, so the CPU limit ends it with SIGKILL at the hard limit.)
* rlimits (CPU, address space, file size, process count, open files, no core files) are set by prlimit,
  after setpriv dropped the uid, both exec'ing in turn before bwrap, and inherited by everything it starts. RLIMIT_NPROC counts per host uid, so each worker
  process picks its own uid from a range: a fork bomb in one sandbox cannot starve a neighbour.
* Output is read through pipes with a byte cap per stream; past the cap, or past the wall time, the whole
  process group gets SIGKILL (and with it bwrap's PID namespace).
* The sandboxed interpreter is the system Python (/usr/bin/python3): the project's own interpreter may
  live under a directory the unprivileged uid cannot enter (pyenv under /root).
* Two runners give this isolation. `runner="bwrap"` starts one bwrap per program, as described above.
  `runner="zygote"` (the default) starts bwrap once per process with a small trusted server as its PID 1
  (`actors/reward/zygote.py`, `zygote_server.py`); for each program the server forks a process into
  fresh user, PID, mount, IPC, UTS and network namespaces with its own /proc, /tmp, /dev/shm and
  /sandbox, sets the same rlimits and drops every capability; that process, PID 1 of its namespace as
  above (its death takes everything it started with it), then execs the program or, for
  `{python} -I [-B] FILE`, runs the file in the forked interpreter, which was started as that command
  would start it. That saves bwrap's and the interpreter's start per program (figures in
  docs/reward-code.md). A process that cannot start a zygote, or loses one twice in a run, runs with one
  bwrap per program (see `Sandbox._run_zygote`).

When no working sandbox exists, `Sandbox.run` raises `SandboxUnavailable` unless the caller passed
`allow_unsandboxed=True`; then programs run with the same limits, uid drop and process-group kill, but
they can see the host file system and network.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import resource
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence

from actors.reward import zygote as zygote_module
from actors.reward.sandbox_run import (  # noqa: F401 - MiB, RunResult and SandboxLimits are public here too
    MiB,
    RunCollector,
    RunResult,
    SandboxConfigError,
    SandboxLimits,
    close_pipes,
    rlimit_settings,
)

log = logging.getLogger("reward.sandbox")

# Directories every sandbox gets read-only; links among them (merged /usr) are recreated as links.
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
SANDBOX_FILES_DIR = "/sandbox"
SANDBOX_WORK_DIR = "/tmp"
RUNNERS = ("zygote", "bwrap")
_ZYGOTE_DIR_BYTES = 1 * MiB  # the zygote's own /tmp and /dev/shm: every program gets fresh ones over them


class SandboxUnavailable(RuntimeError):
    """No working sandbox on this machine and unsandboxed execution was not explicitly allowed."""


@dataclasses.dataclass(frozen=True)
class SandboxStatus:
    available: bool
    reason: str


def _system_python() -> str:
    for candidate in ("/usr/bin/python3", "/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    raise SandboxConfigError("no system python3 found for the sandbox; pass Sandbox(python=...)")


def _bwrap_path() -> str | None:
    return shutil.which("bwrap")


def _system_dir_args() -> list[str]:
    args: list[str] = []
    for name in SYSTEM_DIRS:
        host = f"/{name}"
        if os.path.islink(host):
            args += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            args += ["--ro-bind", host, host]
    return args


class Sandbox:
    """Runs programs under bubblewrap with limits. One instance is cheap; it holds no processes.

    `uid` is the unprivileged host uid used when we are root; by default each worker process gets its own
    uid in [uid_base, uid_base + uid_span) so RLIMIT_NPROC is not shared between concurrent runs.
    `runner` is "zygote" (one long-lived sandbox per process that starts each program fresh) or "bwrap"
    (one bwrap start per program); both isolate the same way, see the module docstring. The instance is
    picklable: the zygotes live in the process that runs, not in the Sandbox.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        allow_unsandboxed: bool = False,
        python: str | None = None,
        uid: int | None = None,
        uid_base: int = 200_000,
        uid_span: int = 50_000,
        runner: str = "zygote",
    ) -> None:
        if runner not in RUNNERS:
            raise SandboxConfigError(f"runner must be one of {RUNNERS}, got {runner!r}")
        self.runner = runner
        self.limits = limits or SandboxLimits()
        self.allow_unsandboxed = allow_unsandboxed
        self._python = python
        self._uid = uid
        self._uid_base = uid_base
        self._uid_span = uid_span

    @property
    def python(self) -> str:
        """The interpreter used for Python programs (inside the sandbox: the system one)."""
        return self._python or _system_python()

    def run_uid(self) -> int | None:
        """The host uid the program runs as, or None when we are not root (we are unprivileged already)."""
        if os.geteuid() != 0:
            return None
        if self._uid is not None:
            return self._uid
        return self._uid_base + os.getpid() % self._uid_span

    def status(self) -> SandboxStatus:
        return probe_sandbox(self.python)

    def run(
        self,
        argv: Sequence[str],
        *,
        files: Mapping[str, bytes] | None = None,
        stdin: bytes = b"",
        limits: SandboxLimits | None = None,
        binds: Mapping[str, str] | None = None,
    ) -> RunResult:
        """Run argv with `files` placed read-only in /sandbox and cwd a private writable /tmp.

        `binds` maps host paths to paths in the sandbox, bound read-only (a unix socket bound so stays
        connectable: it is the only way out of the sandbox's network namespace). Runs with binds take one
        bwrap each (the zygote builds its programs' mounts itself) and need the sandbox.

        argv may name `{files}` (the directory holding `files`) and `{python}`; both are substituted, so the
        same call works sandboxed and (when allowed) unsandboxed. The program may write its answer to the
        file descriptor named by the environment variable RESULT_FD; that channel is returned separately
        from stdout so the program's own prints cannot corrupt it.
        """
        limits = limits or self.limits
        files = dict(files or {})
        for name in files:
            if not name or "/" in name or name.startswith("."):
                raise SandboxConfigError(f"sandbox file name must be a plain name, got {name!r}")
        binds = dict(binds or {})
        for inside in binds.values():
            if not inside.startswith("/") or inside.rstrip("/") in ("", SANDBOX_FILES_DIR, SANDBOX_WORK_DIR):
                raise SandboxConfigError(f"sandbox bind target must be an absolute path of its own, got {inside!r}")
        status = self.status()
        if status.available:
            if self.runner == "zygote" and not binds:
                result = self._run_zygote(argv, files, stdin, limits)
                if result is not None:
                    return result
            return self._run_bwrap(argv, files, stdin, limits, binds)
        if binds:
            raise SandboxUnavailable(f"paths bound into a sandbox need a working bubblewrap sandbox ({status.reason})")
        if not self.allow_unsandboxed:
            raise SandboxUnavailable(
                f"refusing to run untrusted code: no working bubblewrap sandbox ({status.reason}); "
                "install bubblewrap and allow user namespaces, or pass allow_unsandboxed=True "
                "(CLI: --allow-unsandboxed) to run it without isolation"
            )
        return self._run_unsandboxed(argv, files, stdin, limits)

    # -- the two ways of running -------------------------------------------------------------------------

    def _run_zygote(
        self, argv: Sequence[str], files: Mapping[str, bytes], stdin: bytes, limits: SandboxLimits
    ) -> RunResult | None:
        """Run in this process's zygote. A run whose zygote died is run again on a fresh one; None (run it
        with one bwrap instead) if no zygote can start here or a second one is lost too."""
        global _zygote_unavailable
        if _zygote_unavailable is not None:
            return None
        uid, python = self.run_uid(), self.python
        key = (python, uid)
        for _ in range(2):
            try:
                with zygote_module.checkout(key, lambda: zygote_module.Zygote(_zygote_bwrap_args(), python, uid)
                                            ) as zygote:
                    return zygote_module.run_in_zygote(
                        zygote, _substitute(argv, SANDBOX_FILES_DIR, python), _sandbox_env(zygote_module.RESULT_FD),
                        files, stdin, limits)
            except zygote_module.ZygoteLost as exc:
                log.warning("%s; running the program again", exc)
                continue
            except zygote_module.ZygoteStartError as exc:
                _zygote_unavailable = str(exc)  # this machine cannot: per-run bwrap from now on
                log.warning("%s; running one bwrap per program in this process", exc)
                return None
            except zygote_module.ZygoteError as exc:
                log.warning("%s; running this program with one bwrap", exc)
                return None
        return None

    def _run_bwrap(
        self, argv: Sequence[str], files: Mapping[str, bytes], stdin: bytes, limits: SandboxLimits,
        binds: Mapping[str, str] | None = None,
    ) -> RunResult:
        python = self.python
        # Files travel as unlinked temp files that bwrap copies into its own tmpfs: nothing lands on the
        # host disk where other users could read it, and no size limit applies as it would to a pipe.
        file_handles = []
        try:
            args = _bwrap_args(limits.tmpfs_bytes)
            for name, content in files.items():
                handle = tempfile.TemporaryFile()
                handle.write(content)
                handle.flush()
                handle.seek(0)
                file_handles.append(handle)
                args += ["--perms", "0444", "--file", str(handle.fileno()), f"{SANDBOX_FILES_DIR}/{name}"]
            for host, inside in (binds or {}).items():
                args += ["--ro-bind", host, inside]
            args += ["--remount-ro", "/", "--chdir", SANDBOX_WORK_DIR, "--clearenv"]
            result_r, result_w = os.pipe()
            env = _sandbox_env(result_w)
            for key, value in env.items():
                args += ["--setenv", key, value]
            # bwrap reports the host pid of the sandbox's PID 1 on this pipe; see _PopenProcess.kill.
            info_r, info_w = os.pipe()
            args += ["--info-fd", str(info_w)]
            args += ["--", *_substitute(argv, SANDBOX_FILES_DIR, python)]
            result = _spawn_and_collect(
                args, stdin, limits, self.run_uid(), [*(h.fileno() for h in file_handles)],
                (result_r, result_w), (info_r, info_w),
                # bwrap's own environment is readable inside as /proc/1/environ: give it nothing of ours.
                cwd=None, env={"PATH": "/usr/bin:/bin"}, sandboxed=True,
            )
            # bwrap exits 128+N when its program died of signal N; report it as subprocess does (-N).
            # (A program's own exit status above 128 reads as a signal too; either way the run failed.)
            if result.returncode is not None and 128 < result.returncode < 128 + signal.NSIG:
                result.returncode = 128 - result.returncode
            return result
        finally:
            for handle in file_handles:
                handle.close()

    def _run_unsandboxed(
        self, argv: Sequence[str], files: Mapping[str, bytes], stdin: bytes, limits: SandboxLimits
    ) -> RunResult:
        uid = self.run_uid()
        root = tempfile.mkdtemp(prefix="reward-run-")
        try:
            files_dir = os.path.join(root, "files")
            work_dir = os.path.join(root, "work")
            os.mkdir(files_dir)
            os.mkdir(work_dir)
            for name, content in files.items():
                with open(os.path.join(files_dir, name), "wb") as out:
                    out.write(content)
                os.chmod(os.path.join(files_dir, name), 0o444)
            os.chmod(root, 0o755)
            os.chmod(files_dir, 0o755)
            if uid is not None:
                os.chown(work_dir, uid, uid)
            result_r, result_w = os.pipe()
            env = {"PATH": "/usr/bin:/bin", "HOME": work_dir, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
                   "RESULT_FD": str(result_w)}
            return _spawn_and_collect(
                _substitute(argv, files_dir, self.python), stdin, limits, uid, [], (result_r, result_w), None,
                cwd=work_dir, env=env, sandboxed=False,
            )
        finally:
            shutil.rmtree(root, ignore_errors=True)


def _bwrap_args(tmpfs_bytes: int, disable_userns: bool = True) -> list[str]:
    """bwrap and the sandbox it builds, up to the program's own files and command."""
    bwrap = _bwrap_path()
    assert bwrap is not None  # status() said available
    # --disable-userns: without it the program could make a nested user namespace (`unshare -r`)
    # and be uid 0 there, with the kernel attack surface that brings. (The zygote's server needs one
    # per program, and forbids them to the program itself.)
    args = [bwrap, "--unshare-all", "--unshare-user", *(["--disable-userns"] if disable_userns else []),
            "--die-with-parent", "--as-pid-1", *_system_dir_args()]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--size", str(tmpfs_bytes), "--tmpfs", SANDBOX_WORK_DIR]
    # bwrap's /dev is itself an unbounded tmpfs: keep only a size-capped /dev/shm writable.
    args += ["--size", str(tmpfs_bytes), "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    args += ["--dir", SANDBOX_FILES_DIR]
    return args


def _zygote_bwrap_args() -> list[str]:
    """The zygote's sandbox: the per-run one, except that its server (with no capability) may make a user
    namespace, one per program, in which it builds that program's namespaces and mounts and which it
    closes to further user namespaces before the program starts. The server gets the programs'
    environment, so that its interpreter, forked for a Python program, is configured as that program's
    own would be (locale, encodings)."""
    args = [*_bwrap_args(_ZYGOTE_DIR_BYTES, disable_userns=False),
            "--remount-ro", "/", "--chdir", SANDBOX_WORK_DIR, "--clearenv"]
    for key, value in _sandbox_env(zygote_module.RESULT_FD).items():
        if key != "RESULT_FD":
            args += ["--setenv", key, value]
    return args


# Set when this process found it cannot start a zygote (the reason); runs then use per-run bwrap.
_zygote_unavailable: str | None = None


def _sandbox_env(result_fd: int) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": SANDBOX_WORK_DIR, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
            "RESULT_FD": str(result_fd)}


def _substitute(argv: Sequence[str], files_dir: str, python: str) -> list[str]:
    return [arg.replace("{files}", files_dir).replace("{python}", python) for arg in argv]


_PRLIMIT_OPTIONS = {resource.RLIMIT_CPU: "--cpu", resource.RLIMIT_AS: "--as", resource.RLIMIT_FSIZE: "--fsize",
                    resource.RLIMIT_NPROC: "--nproc", resource.RLIMIT_NOFILE: "--nofile", resource.RLIMIT_CORE: "--core"}


def _as_limited(args: list[str], limits: SandboxLimits, uid: int | None) -> list[str]:
    """``args`` run as ``uid`` under the run's rlimits: setpriv drops to the uid, prlimit sets the limits (as that
    uid, which may lower its own), and each execs the next, so the process we start is the program's own pid.

    Not Popen's ``user=`` and a ``preexec_fn``: with either, Popen forks the whole calling process instead of
    vfork'ing it, and a rollout with its model loaded then copied ~450 MB of page tables per sandboxed episode
    (about 30 ms of CPU with the GIL held, measured), against well under a millisecond for a vfork."""
    tools = {name: shutil.which(name, path="/usr/bin:/bin") for name in ("setpriv", "prlimit")}
    if None in tools.values():
        raise SandboxConfigError("setpriv and prlimit (Debian package util-linux) are needed to start a sandboxed run")
    drop = [tools["setpriv"], f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"] if uid is not None else []
    limit = [f"{_PRLIMIT_OPTIONS[which]}={soft}:{hard}" for which, soft, hard in rlimit_settings(limits)]
    return [*drop, tools["prlimit"], *limit, "--", *args]


def _spawn_and_collect(
    args: list[str],
    stdin: bytes,
    limits: SandboxLimits,
    uid: int | None,
    extra_fds: list[int],
    result_pipe: tuple[int, int],
    info_pipe: tuple[int, int] | None,
    *,
    cwd: str | None,
    env: dict[str, str],
    sandboxed: bool,
) -> RunResult:
    """Start the process with limits and a fresh process group, and collect what it writes."""
    pipes = [result_pipe] + ([info_pipe] if info_pipe else [])
    try:
        # stdin from a temp file, not a pipe: a program that never reads its input cannot block us.
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin)
            stdin_file.flush()
            stdin_file.seek(0)
            started = time.monotonic()
            proc = subprocess.Popen(
                _as_limited(args, limits, uid),
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(*(w for _, w in pipes), *extra_fds),
                cwd=cwd,
                env=env,
                start_new_session=True,  # its own process group, which we kill as a whole
            )
        for _, write_end in pipes:  # only the child writes; EOF must come when it is gone
            os.close(write_end)
        pipes = [(r, -1) for r, _ in pipes]
        assert proc.stdout is not None and proc.stderr is not None
        process = _PopenProcess(proc, info_pipe[0] if info_pipe else None, sandboxed)
        run = RunCollector(process, proc.stdout.fileno(), proc.stderr.fileno(), result_pipe[0])
        return run.collect(limits, started, sandboxed)
    finally:
        close_pipes(pipes)


class _PopenProcess:
    """A run we started ourselves: bwrap (which reports its PID 1 on an info pipe) or an unsandboxed program."""

    def __init__(self, proc: subprocess.Popen, info_r: int | None, sandboxed: bool) -> None:
        self.proc = proc
        self.watched_fds = [info_r] if info_r is not None else []
        self.exit_status_encodes_signal = sandboxed  # bwrap exits 128+N for a program killed by signal N
        self.info = bytearray()
        self.init_pidfd: int | None = None  # the sandbox's PID 1 (bwrap only)
        self.killed = False
        self.pidfd = os.pidfd_open(proc.pid)   # the process we started: reaped through it, with its rusage
        self.cpu_s: float | None = None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def reaped(self, timeout: float = 0.0) -> bool:
        """Reap the started process if it exits within `timeout`. os.wait4 rather than Popen.wait: its rusage
        (which includes every descendant the process reaped, so the sandboxed program) tells a CPU-limit
        kill from a program that sent itself SIGKILL."""
        if self.proc.returncode is not None:
            return True
        if not select.select([self.pidfd], [], [], timeout)[0]:
            return False
        _, status, usage = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.cpu_s = usage.ru_utime + usage.ru_stime
        return True

    def on_data(self, fd: int, chunk: bytes) -> None:
        self.info += chunk
        try:
            child_pid = json.loads(self.info).get("child-pid")
        except ValueError:
            return  # not complete yet
        if isinstance(child_pid, int) and self.init_pidfd is None:
            try:
                self.init_pidfd = os.pidfd_open(child_pid)
            except ProcessLookupError:
                pass  # already gone: the sandbox ended by itself

    def kill(self) -> None:
        """SIGKILL everything of the run and reap it; returns once no process of the run is left.

        In bwrap we kill the namespace's PID 1 (the program), not bwrap: the kernel then kills every
        process of the PID namespace (also those that left our process group with setsid), and bwrap
        reaps its child and exits. Killing bwrap first would orphan that child to the host's PID 1.
        """
        self.killed = True
        if self.init_pidfd is not None and not self.reaped():
            try:
                signal.pidfd_send_signal(self.init_pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.reaped(timeout=2.0)
        # Also the fallback when bwrap had not yet reported its PID 1, and the stragglers of an unsandboxed
        # run (while any member lives, the group id cannot be reused by another process).
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.reaped(timeout=5.0)
        if self.init_pidfd is not None:
            # Returns at once normally; after the fallback group kill it waits for the namespace teardown.
            select.select([self.init_pidfd], [], [], 5.0)

    def close(self) -> None:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()
        if self.init_pidfd is not None:
            os.close(self.init_pidfd)
        os.close(self.pidfd)


def probe_sandbox(python: str | None = None) -> SandboxStatus:
    """Check that bwrap can start `python` (default: the system one) as an unprivileged uid.

    Cached per process and interpreter: the answer depends on the machine (bwrap installed, user
    namespaces allowed), not on the program.
    """
    if python is None:
        try:
            python = _system_python()
        except SandboxConfigError as exc:
            return SandboxStatus(False, str(exc))
    return _probe(python)


@functools.lru_cache(maxsize=8)
def _probe(python: str) -> SandboxStatus:
    if _bwrap_path() is None:
        return SandboxStatus(False, "bwrap not found on PATH (Debian package 'bubblewrap')")
    probe = Sandbox(SandboxLimits(wall_time_s=10.0, cpu_time_s=5.0), python=python)
    check = "import os; print(os.getuid())"
    try:
        result = probe._run_bwrap(["{python}", "-I", "-c", check], {}, b"", probe.limits)
    except OSError as exc:
        return SandboxStatus(False, f"could not start bwrap: {exc}")
    except SandboxConfigError as exc:   # setpriv or prlimit missing
        return SandboxStatus(False, str(exc))
    if result.returncode != 0:
        tail = result.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        return SandboxStatus(False, f"bwrap failed (exit {result.returncode}): {tail[0]}")
    uid = result.stdout.decode().strip()
    if os.geteuid() == 0 and uid == "0":
        return SandboxStatus(False, "sandboxed program ran as uid 0")
    return SandboxStatus(True, f"bubblewrap, program uid {uid}")


def forget_probe() -> None:
    """Drop cached probe answers (after installing bwrap, or in tests that fake a machine)."""
    _probe.cache_clear()
