"""The zygote: a small trusted server inside one long-lived bubblewrap sandbox that starts each program fresh.

This file is not imported by the project: `actors/reward/zygote.py` passes its source to the sandbox's
system Python (`python3 -I -B -c SOURCE FD`), so it uses the standard library only. FD is one end of a
SOCK_SEQPACKET socket pair whose other end the host process keeps.

The server (the sandbox's PID 1, an unprivileged host uid) has no capability. For each program it forks
a middle process that makes a fresh user namespace (mapping only its own uid and gid) with a fresh PID
namespace and forks the program's process into them as PID 1; the middle process exits at once, so the
program's process is adopted by the server, which reaps it. Before the program starts, that process
(with capabilities in its own user namespace only)

* makes its own mount, IPC, UTS and network namespaces, mounts a fresh /proc (its PID namespace only:
  the server and earlier programs are out of sight and out of reach of kill(2) and ptrace(2)), fresh
  size-capped tmpfs dirs /tmp and /dev/shm, and a /sandbox holding the request's files, then makes
  /sandbox read-only;
* sets user.max_user_namespaces to 0 in its user namespace, so the program can make no user namespace
  of its own (as bwrap's --disable-userns does); its own user namespace also gives it fresh key rings
  (the kernel keeps user and persistent key rings per user namespace and uid: in a shared one, a key
  one program added was readable by the next);
* starts a new session (so kill(0, ...) reaches only its own process group), sets the rlimits, keeps only
  fds 0-3 (stdin, stdout, stderr, result channel: pipes and a file the host passed for this program alone),
  and drops every capability (effective, permitted, inheritable, ambient and the bounding set).

Then it execs the program, or, when argv is this interpreter with only `-I` and `-B` before a file (the
flags the server itself was started with, in the programs' environment), runs that file itself as the
`__main__` module, exits as the interpreter would (SystemExit, traceback and status 1, thread join,
atexit, flush) and so skips the interpreter's start. The forked interpreter holds nothing of an earlier
program (the server never reads one); what a program can tell apart from a fresh interpreter is that
modules the server imported are already in sys.modules, that sys.flags.dont_write_bytecode is set
without -B too, and that the programs of one zygote share its hash seed (with -I, PYTHONHASHSEED is
ignored and a fresh interpreter draws one per run).

When the program's process, PID 1 of its namespace, dies the kernel kills everything else in that
namespace, and the namespaces (with their tmpfs files and SysV IPC objects) go away, so nothing of one
program is left when the next starts. The server reads neither the program nor its input: the request
(argv, environment, limits, files) reaches the program's own process as a file descriptor.

Protocol, one message per datagram, host -> server: b"run" with fds [request, stdin, stdout, stderr,
result]; b"kill" (SIGKILL the running program). Server -> host: b"ready" once; per run b"started" or
b"failed <reason>" (the sandbox could not be set up: not the program's fault), then b"exit STATUS CPU_S"
(the wait status and the CPU seconds of the program's processes).
"""
import ctypes
import gc
import importlib.util  # noqa: F401 - preloaded for the programs run in-process (the grader's harness uses it)
import json
import os
import resource
import select
import signal
import socket
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 16384, 1 << 18
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 4, 24, 38, 47, 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522
RESULT_FD = 3  # the program's result channel; RESULT_FD in its environment says so

libc = ctypes.CDLL(None, use_errno=True)
with open("/proc/sys/kernel/cap_last_cap") as cap_file:
    LAST_CAP = int(cap_file.read())


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def prctl(option, arg2=0):
    return libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0))


def mount(source, target, fstype, flags, data=None):
    check(libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, ctypes.c_ulong(flags),
                     data.encode() if data else None), "mount %s" % target)


def drop_capabilities():
    for cap in range(LAST_CAP + 1):
        check(prctl(PR_CAPBSET_DROP, cap), "dropping capability %d from the bounding set" % cap)
    check(prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL), "clearing ambient capabilities")
    header = CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (CapData * 2)()  # all zero
    check(libc.capset(ctypes.byref(header), data), "capset")
    check(prctl(PR_SET_NO_NEW_PRIVS, 1), "no_new_privs")


def read_request(request_fd):
    """The request file: an 8-byte header length, the JSON header, then the files' bytes in order."""
    size = int(os.pread(request_fd, 8, 0))
    header = json.loads(os.pread(request_fd, size, 8))
    offset = 8 + size
    files = []
    for name, length in header["files"]:
        content = b""
        while len(content) < length:
            chunk = os.pread(request_fd, length - len(content), offset + len(content))
            if not chunk:
                raise OSError("request file ends inside %s" % name)
            content += chunk
        files.append((name, content))
        offset += length
    return header, files


def setup_program(fds, keep_fd):
    """In the program's process (PID 1 of a fresh PID namespace): isolate and limit it. Returns the request.

    Afterwards the process holds only fds 0-3 and `keep_fd` (the error pipe, which closes at exec)."""
    request_fd, stdin_fd, out_fd, err_fd, result_fd = fds
    header, files = read_request(request_fd)
    check(libc.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET), "unshare")
    mount("none", "/", None, MS_REC | MS_PRIVATE)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    with open("/proc/sys/user/max_user_namespaces", "w") as limit:  # this user namespace's own limit
        limit.write("0")
    tmpfs = "size=%d,mode=0755" % header["tmpfs_bytes"]
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmpfs)
    mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, tmpfs)
    files_size = sum(len(content) for _, content in files) + (1 << 20)
    mount("tmpfs", "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV, "size=%d,mode=0755" % files_size)
    for name, content in files:
        path = "/sandbox/" + name
        with open(path, "wb") as out:
            out.write(content)
        os.chmod(path, 0o444)
    mount("none", "/sandbox", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.setsid()
    os.chdir("/tmp")
    for target, fd in enumerate((stdin_fd, out_fd, err_fd, result_fd)):
        os.dup2(fd, target + 10)  # first out of the way: a passed fd may already be 0-3
    for target in range(4):
        os.dup2(target + 10, target)
    os.closerange(RESULT_FD + 1, keep_fd)
    os.closerange(keep_fd + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    for which, soft, hard in header["rlimits"]:
        resource.setrlimit(which, (soft, hard))
    drop_capabilities()
    prctl(PR_SET_DUMPABLE, 1)  # as after an exec: the program may read its own /proc/self
    return header


def in_process_script(argv):
    """The script and its arguments when argv runs a Python file with only the flags this server itself was
    started with (so a forked copy of it behaves as that fresh interpreter would), else None."""
    if not argv or argv[0] != sys.executable:
        return None
    index = 1
    while index < len(argv) and argv[index] in ("-I", "-B"):
        index += 1
    if "-I" not in argv[1:index] or index >= len(argv) or argv[index].startswith("-"):
        return None
    return argv[index], argv[index + 1:], "-B" in argv[1:index]


def run_script(script, args, argv, dont_write_bytecode):
    """Run a Python file in this (forked, already initialised) interpreter as `python -I [-B] script args`
    would, and exit with the status that interpreter would. Never returns."""
    import builtins
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__file__ = script
    main.__builtins__ = builtins
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
    main.__cached__ = None
    sys.modules["__main__"] = main
    sys.argv = [script] + list(args)
    sys.orig_argv = list(argv)
    sys.dont_write_bytecode = dont_write_bytecode
    depth, frame = 0, sys._getframe()
    while frame is not None:  # the program gets the recursion headroom a fresh interpreter gives it
        depth, frame = depth + 1, frame.f_back
    sys.setrecursionlimit(sys.getrecursionlimit() + depth)
    status = 0
    try:
        with open(script, "rb") as source:
            code = compile(source.read(), script, "exec", dont_inherit=True)
        exec(code, main.__dict__)
    except SystemExit as exc:
        status = exit_status(exc)
    except BaseException as exc:  # noqa: BLE001 - reported as the interpreter does: traceback, status 1
        exc.__traceback__ = exc.__traceback__.tb_next  # without this function's own frame
        sys.excepthook(type(exc), exc, exc.__traceback__)
        status = 1
    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()  # the interpreter waits for non-daemon threads before it exits
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, SystemExit):
                status = exit_status(exc)
    import atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - as the interpreter: a failed flush at exit is status 120
            status = status or 120
    os._exit(status & 0xFF)


def exit_status(exc):
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    try:
        sys.stderr.write(str(code) + "\n")
    except BaseException:  # noqa: BLE001
        pass
    return 1


def start_program(fds, error_w, channel):
    """Set up the program's process, then exec the program or, for a Python file, run it right here."""
    channel.detach()  # the server's socket object must never close a number the program reuses
    try:
        header = setup_program(fds, error_w)
        argv, env = header["argv"], header["env"]
        script = in_process_script(argv)
        if script is not None:
            os.environ.clear()
            os.environ.update(env)
    except BaseException as exc:  # noqa: BLE001 - reported to the host as a sandbox failure
        os.write(error_w, ("%s: %s" % (type(exc).__name__, exc)).encode()[:500] or b"setup failed")
        os._exit(1)
    if script is not None:
        os.close(error_w)  # tells the server the program starts
        run_script(script[0], script[1], argv, script[2])
    for signum in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores these; an exec'd program must not
        signal.signal(signum, signal.SIG_DFL)
    try:
        os.execvpe(argv[0], argv, env)
    except BaseException as exc:  # noqa: BLE001 - a program that cannot start is the program's failure
        os.write(2, ("sandbox: cannot execute %r: %s\n" % (argv[0], exc)).encode())
    os._exit(127)


def enter_new_user_and_pid_namespaces():
    """Unshare a user namespace that maps our own uid and gid only, and a PID namespace for our children."""
    uid, gid = os.getuid(), os.getgid()
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWPID), "unshare(CLONE_NEWUSER | CLONE_NEWPID)")
    for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)), ("gid_map", "%d %d 1" % (gid, gid))):
        with open("/proc/self/" + name, "w") as out:
            out.write(text)


def fork_program(fds, channel):
    """Fork the program's process as PID 1 of new user and PID namespaces. Returns (pid, setup error or "")."""
    error_r, error_w = os.pipe2(os.O_CLOEXEC)
    pid_r, pid_w = os.pipe2(os.O_CLOEXEC)
    middle = os.fork()
    if middle == 0:
        try:
            os.close(error_r)
            os.close(pid_r)
            prctl(PR_SET_DUMPABLE, 1)  # or /proc/self/uid_map is not ours to write
            enter_new_user_and_pid_namespaces()
            program = os.fork()
            if program == 0:
                os.close(pid_w)
                start_program(fds, error_w, channel)
            os.write(pid_w, str(program).encode())
        except BaseException as exc:  # noqa: BLE001
            os.write(error_w, ("%s: %s" % (type(exc).__name__, exc)).encode()[:500])
        os._exit(0)  # the program's process is adopted by this server, the sandbox's PID 1
    for fd in (*fds, error_w, pid_w):
        os.close(fd)
    os.waitpid(middle, 0)
    pid_text = os.read(pid_r, 32)
    os.close(pid_r)
    error = b""
    while True:  # until the program's process execs (its end closes) or reports a failed setup
        chunk = os.read(error_r, 4096)
        if not chunk:
            break
        error += chunk
    os.close(error_r)
    return (int(pid_text) if pid_text else None), error.decode(errors="replace")


def serve(channel):
    prctl(PR_SET_DUMPABLE, 0)
    # Every object so far moves to a generation the collector never scans, so a forked program's process
    # does not touch (and copy) the server's pages when it collects.
    gc.freeze()
    channel.send(b"ready")
    while True:
        message, fds, _, _ = socket.recv_fds(channel, 64, 8)
        if not message:
            return  # the host is gone
        if message != b"run" or len(fds) != 5:
            for fd in fds:
                os.close(fd)
            if message == b"kill":
                continue  # the program it meant has ended already
            raise SystemExit("zygote: unexpected message %r with %d fds" % (message[:40], len(fds)))
        pid, error = fork_program(fds, channel)
        if error or pid is None:
            if pid is not None:
                os.waitpid(pid, 0)
            channel.send(("failed " + (error or "no program process")).encode())
            continue
        channel.send(b"started")
        pidfd = os.pidfd_open(pid)
        while True:
            readable = select.select([channel, pidfd], [], [])[0]
            if pidfd in readable:
                break
            message = channel.recv(64)
            if not message or message == b"kill":
                os.kill(pid, signal.SIGKILL)
                if not message:
                    os.waitpid(pid, 0)
                    return
        os.close(pidfd)
        _, status, usage = os.wait4(pid, 0)
        channel.send(("exit %d %.6f" % (status, usage.ru_utime + usage.ru_stime)).encode())


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
