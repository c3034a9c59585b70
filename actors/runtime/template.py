"""The start template: one process per supervisor that imports what every actor imports (torch, numpy,
msgpack, zmq, structlog, uvloop and our runtime and transport modules) once, then forks each actor from
itself, so an actor's start skips those imports: they are shared copy-on-write.

``python -m actors.runtime.template FD [MODULE:CLASS ...]`` is the template; :class:`StartTemplate` is the
supervisor's side of it. The project's own actor classes among those named (the supervisor's actors') are
imported too, so an actor's own modules are shared as well; a class that does not import is left for its
actor to report, and a user's class is left to its actor: its imports might start a thread, which would make
every fork unsafe. FD is one end of a SOCK_SEQPACKET pair; the supervisor sends one request per actor (spec path, full
environment, cwd, its own pid) with the actor's log file as a passed descriptor, and gets back
``started PID`` or ``refused WHY`` (the supervisor then starts that actor as a fresh interpreter).

How an actor is forked. The template forks a middle process, which forks the actor and exits at once; the
supervisor's process marks itself a child subreaper (PR_SET_CHILD_SUBREAPER) while it waits for the answer,
so the actor is reparented to the supervisor, not to init. The actor is then the supervisor's own child,
exactly like an exec-started one: the supervisor reaps it and gets its true exit status (negative for a
signal), signals it by pid, and the actor's parent-death signal (SIGTERM, set only once it has been adopted)
fires when the launcher dies, even by kill -9. The actor then makes itself what a fresh interpreter would
be: its own session, stdin /dev/null, stdout and stderr its log, its cwd, its environment replaced by its
own, `actors.runtime.run` as ``__main__``, and runs :func:`actors.runtime.run.main`, which applies its CPU
affinity, umask and thread counts (torch and OpenBLAS were loaded here with one thread each).

Death rules. The template dies with the launcher (parent-death signal). When the template itself dies, no
actor is touched: they are the supervisor's children, not the template's, and run on; the supervisor logs
``start_template_lost`` once and starts every later actor (restarts included) as a fresh interpreter.

Forking is safe only from a process with one thread and no CUDA context: the template imports nothing that
starts a thread or creates a ZeroMQ context, loads OpenBLAS and OpenMP with one thread
(``OMP_NUM_THREADS=1``, ``OPENBLAS_NUM_THREADS=1``), and before each fork checks that it has one thread (Python
and native) and that CUDA is not initialised; otherwise it refuses, and the supervisor falls back to
exec starts, logged once. Variables a library reads only as it loads (PYTHON*, LD_*, OpenMP, MKL, torch
ones: ``LOAD_TIME_PREFIXES``) cannot take effect in a forked actor, so an actor whose environment sets one
differently from the template's is started as a fresh interpreter.
"""
from __future__ import annotations

import asyncio
import ctypes
import importlib
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn, Sequence

from actors.runtime.process import ActorProcess

__all__ = ["StartTemplate", "PRELOAD", "load_time_differences"]

PRELOAD = ("torch", "numpy", "msgpack", "zmq", "structlog", "uvloop", "transport.messages", "transport.bus",
           "actors.runtime.base", "actors.runtime.threads", "actors.runtime.run")
# Thread counts a forked actor sets itself (actors.runtime.run.follow_thread_settings); the template loads
# its libraries with one thread.
THREAD_VARIABLES = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
LOAD_TIME_PREFIXES = ("PYTHON", "LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "MALLOC_", "TORCH_", "PYTORCH_")
ADOPTION_WAIT_S = 30.0       # for the middle process to exit (microseconds, unless the machine is loaded)
# For the template's answer to one start (two forks: milliseconds). A template that has not answered by then
# is hung (stopped, or stuck): it is killed and this and every later actor start as a fresh interpreter, so
# a hung template delays one start by this much, not each start by the supervisor's ready budget.
FORK_ANSWER_S = ADOPTION_WAIT_S
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37
MAX_REQUEST = 1 << 20


def load_time_differences(template_env: dict[str, str], actor_env: dict[str, str]) -> list[str]:
    """Variables read only as a library loads that the actor's environment sets differently from the
    template's: a forked actor could not apply them."""
    names = {k for k in (*template_env, *actor_env) if k.startswith(LOAD_TIME_PREFIXES) and k not in THREAD_VARIABLES}
    return sorted(k for k in names if template_env.get(k) != actor_env.get(k))


# ------------------------------------------------------------------------------------------- template side

def fork_problem() -> str | None:
    """Why forking this process now would be unsafe (None: it is safe)."""
    import threading

    python_threads = threading.active_count()
    native_threads = len(os.listdir("/proc/self/task"))
    if python_threads != 1 or native_threads != 1:
        return f"the template has {python_threads} Python and {native_threads} native threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the template has initialised CUDA"
    return None


def preload(actor_classes: Sequence[str] = ()) -> list[str]:
    """Import PRELOAD and the project's own classes among ``actor_classes``; returns the classes imported."""
    for name in PRELOAD:
        importlib.import_module(name)
    from actors.runtime.base import load_actor_class

    loaded = []
    for path in actor_classes:
        if not path.startswith("actors."):
            continue
        try:
            load_actor_class(path)
        except Exception:   # the actor itself reports it, in its own log, when it starts
            continue
        loaded.append(path)
    return loaded


def serve(channel: socket.socket, actor_classes: Sequence[str] = ()) -> None:
    """Answer the supervisor's requests until it closes its end."""
    preload(actor_classes)
    problem = fork_problem()
    channel.send(b"ready" if problem is None else b"refused " + problem.encode())
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(channel, MAX_REQUEST, 1)
        except ConnectionResetError:
            return
        if not data:
            return
        try:
            problem = fork_problem()
            reply = b"refused " + problem.encode() if problem else fork_actor(channel, json.loads(data), fds)
        except OSError as exc:   # no process could be forked (a limit reached)
            reply = f"refused {exc}".encode()
        finally:
            for fd in fds:
                os.close(fd)
        channel.send(reply)


def fork_actor(channel: socket.socket, request: dict[str, Any], fds: list[int]) -> bytes:
    """Fork the actor through a middle process that exits at once (the launcher adopts the actor)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid_r, pid_w = os.pipe()
    middle = os.fork()
    if middle == 0:
        code = 1
        try:
            os.close(pid_r)
            actor = os.fork()
            if actor == 0:
                os.close(pid_w)
                become_actor(channel, request, fds[0])
            os.write(pid_w, str(actor).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(pid_w)
    with os.fdopen(pid_r, "rb") as pipe:
        pid = pipe.read()
    os.waitpid(middle, 0)
    return b"started " + pid if pid else b"refused the template could not fork"


def become_actor(channel: socket.socket, request: dict[str, Any], log_fd: int) -> NoReturn:
    """In the forked actor: turn into what a fresh `python -m actors.runtime.run SPEC` would be, run it, exit."""
    code = 1
    try:
        channel.close()
        os.setsid()
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import tempfile

        tempfile.tempdir = None   # gettempdir() read the template's TMPDIR
        import numpy

        numpy.random.seed()       # numpy's global generator drew its seed in the template (Python's own is reseeded at fork)
        from actors.runtime import run

        sys.argv = [run.__file__, request["spec"]]
        sys.modules["__main__"] = run   # what a worker of its multiprocessing pools imports, as in an exec start
        launcher = int(request["launcher"])
        deadline = time.monotonic() + ADOPTION_WAIT_S
        while os.getppid() != launcher and time.monotonic() < deadline:
            time.sleep(0.001)   # the middle process is exiting; run.main refuses any other parent
        code = run.main([request["spec"]], forked_from=launcher)
    except SystemExit as exc:   # as the interpreter treats an uncaught one
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
    finally:
        from actors.runtime.run import exit_now

        exit_now(code)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].isdigit():
        print("usage: python -m actors.runtime.template FD [MODULE:CLASS ...] (started by the supervisor)",
              file=sys.stderr)
        return 2
    from actors.runtime.run import die_with_parent, keep_files_private

    die_with_parent()
    keep_files_private()
    serve(socket.socket(fileno=int(argv[0])), argv[1:])
    return 0


# ----------------------------------------------------------------------------------------- supervisor side

def _subreaper(on: bool) -> bool:
    """Set this process's child-subreaper flag; returns what it was."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    was = ctypes.c_int(0)
    prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(was))
    if bool(was.value) != on:
        prctl(PR_SET_CHILD_SUBREAPER, int(on))
    return bool(was.value)


class StartTemplate:
    """The supervisor's template: ``await StartTemplate.open(...)`` (None when it cannot start), then
    ``await start(...)`` per actor (None: start this one as a fresh interpreter), ``await close()``."""

    def __init__(self, proc: asyncio.subprocess.Process, channel: socket.socket, env: dict[str, str],
                 log: Any) -> None:
        self.proc = proc
        self.channel = channel
        self.env = env
        self.log = log
        self.usable = True
        self._lock = asyncio.Lock()

    @classmethod
    async def open(cls, python: str, env: dict[str, str], cwd: str, log_path: Path, log: Any,
                   timeout: float, actor_classes: Sequence[str] = ()) -> "StartTemplate | None":
        """Start the template and wait (up to ``timeout`` s) until it has imported what it preloads and
        ``actor_classes`` (``module:Class``)."""
        if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
            log.info("start_template_off", why="forked starts need Linux pidfds")
            return None
        env = {**env, **THREAD_VARIABLES}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        was_subreaper = _subreaper(True)   # inherited by the template's children: the launcher adopts the actors
        try:
            with open(log_path, "ab") as out:
                proc = await asyncio.create_subprocess_exec(
                    python, "-m", "actors.runtime.template", str(theirs.fileno()), *actor_classes,
                    pass_fds=[theirs.fileno()],
                    env=env, stdout=out, stderr=out, stdin=asyncio.subprocess.DEVNULL, cwd=cwd,
                    start_new_session=True)
        except OSError as exc:
            ours.close()
            log.warning("start_template_unusable", answer=str(exc), hint="every actor starts as a fresh interpreter")
            return None
        finally:
            theirs.close()
            _subreaper(was_subreaper)
        ours.setblocking(False)
        template = cls(proc, ours, env, log)
        answer = await template._answer(timeout)   # its imports: as long as an actor's start may take
        if answer != b"ready":
            template.usable = False
            log.warning("start_template_unusable", answer=answer.decode(errors="replace"),
                        hint="every actor starts as a fresh interpreter")
            await template.close()
            return None
        log.info("start_template_ready", pid=proc.pid)
        return template

    async def _answer(self, timeout: float) -> bytes:
        """The template's next answer; b"" when it died or did not answer within ``timeout`` s (it is then
        killed)."""
        loop = asyncio.get_running_loop()
        recv = asyncio.ensure_future(loop.sock_recv(self.channel, 4096))
        died = asyncio.ensure_future(self.proc.wait())
        await asyncio.wait({recv, died}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        died.cancel()
        if recv.done():
            return recv.result()
        recv.cancel()
        if self.proc.returncode is None:
            self.proc.kill()
        return b""

    async def start(self, spec_path: Path, env: dict[str, str], out_fd: int, cwd: str) -> ActorProcess | None:
        """Fork one actor; None when this actor (or, once the template is lost, any) must start by exec."""
        if not self.usable:
            return None
        differ = load_time_differences(self.env, env)
        if differ:
            self.log.info("actor_start_by_exec", spec=str(spec_path), why="its environment sets variables read as "
                          "libraries load, which a forked process cannot apply", variables=differ)
            return None
        request = json.dumps({"spec": str(spec_path), "env": env, "cwd": cwd, "launcher": os.getpid()}).encode()
        async with self._lock:
            was_subreaper = _subreaper(True)   # the middle process exits: its child, the actor, becomes ours
            try:
                try:
                    socket.send_fds(self.channel, [request], [out_fd])
                except OSError:
                    answer = b""
                else:
                    answer = await self._answer(FORK_ANSWER_S)
            finally:
                _subreaper(was_subreaper)
        if answer.startswith(b"started "):
            return ActorProcess.adopted(int(answer.split()[1]))
        self.usable = False
        if answer:
            self.log.warning("start_template_refused", why=answer.decode(errors="replace"),
                             hint="this and every later actor start as a fresh interpreter")
        else:
            self.log.warning("start_template_lost", pid=self.proc.pid, exit_code=self.proc.returncode,
                             hint="running actors go on; this and every later actor start as a fresh interpreter")
        return None

    async def close(self) -> None:
        self.usable = False
        self.channel.close()   # the template's recv sees the end and it exits
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()


if __name__ == "__main__":
    sys.exit(main())
