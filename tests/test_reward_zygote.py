"""Programs run one after another in one zygote must not see or affect each other, nor the zygote.

Each test runs a hostile program and then a checking one in the same process, on both runners (the zygote
and one bwrap per program), and asserts that the second one's view and verdict are what a fresh sandbox
gives. The zygote's own failure modes (killed between runs or in the middle of one) must only cost a new
zygote, never a wrong result. Program limits are 1-2 s, so the file runs in seconds.
"""
from __future__ import annotations

import os
import platform
import signal
import textwrap

import pytest

from actors.reward import sandbox as sandbox_module
from actors.reward import zygote
from actors.reward.code_grader import PASSED, grade_code
from actors.reward.sandbox import RUNNERS, MiB, Sandbox, SandboxLimits, probe_sandbox

LIMITS = SandboxLimits(wall_time_s=2.0, cpu_time_s=2.0, memory_bytes=256 * MiB, file_size_bytes=1 * MiB,
                       tmpfs_bytes=8 * MiB, max_processes=16, output_bytes=64 * 1024)

pytestmark = pytest.mark.skipif(not probe_sandbox().available,
                                reason=f"no bubblewrap sandbox here: {probe_sandbox().reason}")

# What a fresh sandbox shows a program: only itself as a process, empty writable dirs, no SysV shared
# memory segment under the hostile program's key, and room for child processes.
CHECK_FRESH = """
    import ctypes, os
    pids = sorted(int(entry) for entry in os.listdir("/proc") if entry.isdigit())
    print("pids", pids)
    print("tmp", sorted(os.listdir("/tmp")), "shm", sorted(os.listdir("/dev/shm")))
    libc = ctypes.CDLL(None, use_errno=True)
    print("sysv", libc.shmget(0x5EED, 0, 0) >= 0)
    children = []
    for _ in range(8):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)
    print("forked", len(children))
"""
FRESH_OUTPUT = "pids [1]\ntmp [] shm []\nsysv False\nforked 8\n"


@pytest.fixture(params=RUNNERS)
def box(request) -> Sandbox:
    return Sandbox(LIMITS, runner=request.param)


def run_python(box: Sandbox, source: str, stdin: bytes = b""):
    return box.run(["{python}", "-I", "-B", "{files}/prog.py"], files={"prog.py": textwrap.dedent(source).encode()},
                   stdin=stdin)


def server_pids() -> set[int]:
    return {z.server_pid for z in zygote.idle_zygotes()}


def assert_next_program_sees_a_fresh_sandbox(box: Sandbox) -> None:
    result = run_python(box, CHECK_FRESH)
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode() == FRESH_OUTPUT


def test_a_program_that_tries_to_kill_its_parent_and_everything_it_can_see(box):
    result = run_python(box, """
        import os, signal
        for target in [os.getppid(), 0, -1, *range(2, 4096)]:
            try:
                os.kill(target, signal.SIGKILL)
            except OSError:
                pass
        print("still here", os.getppid())
    """)
    if box.runner == "zygote":
        # It is PID 1 of its own namespace and session: it reached only itself, which it cannot kill.
        assert result.returncode == 0 and result.stdout == b"still here 0\n", result
    # (With one bwrap per program, kill(0) reaches bwrap, in the program's process group: that run dies.)
    before = server_pids()
    assert_next_program_sees_a_fresh_sandbox(box)
    assert server_pids() == before  # the zygote (if any) survived and served the next program


def test_a_background_process_and_files_left_behind_are_gone_for_the_next_program(box):
    result = run_python(box, """
        import ctypes, os, time
        open("/tmp/left", "w").write("secret")
        open("/dev/shm/left", "w").write("secret")
        libc = ctypes.CDLL(None, use_errno=True)
        segment = libc.shmget(0x5EED, 4096, 0o1666)  # IPC_CREAT | 0666: outlives its creator
        print("segment", segment >= 0)
        if os.fork() == 0:
            os.setsid()
            while True:
                open("/tmp/heartbeat", "a").write(".")
                time.sleep(0.01)
        print("parent done")
    """)
    assert result.returncode == 0 and result.stdout == b"segment True\nparent done\n", result
    assert_next_program_sees_a_fresh_sandbox(box)


def test_a_program_that_exhausts_the_process_limit_leaves_room_for_the_next(box):
    result = run_python(box, """
        import os, time
        count = 0
        while True:
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            count += 1
        print("forked until the limit", 0 < count < 16)
    """)
    assert result.returncode == 0 and result.stdout == b"forked until the limit True\n", result
    assert_next_program_sees_a_fresh_sandbox(box)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the program uses x86_64 syscall numbers")
def test_keys_a_program_adds_to_the_kernel_key_rings_are_gone_for_the_next(box):
    # The kernel keeps user, user-session and persistent key rings per user namespace and uid, beyond
    # the life of any process: in one user namespace shared by all programs they were a channel.
    keyrings = """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        ADD_KEY, KEYCTL, KEYCTL_GET_PERSISTENT, KEYCTL_SEARCH = 248, 250, 22, 10
        persistent = libc.syscall(KEYCTL, KEYCTL_GET_PERSISTENT, -1, -2)
        rings = {"user": -4, "session": -3, "user-session": -5, "persistent": persistent}
    """
    written = run_python(box, keyrings + """
        added = [name for name, ring in rings.items()
                 if ring != -1 and libc.syscall(ADD_KEY, b"user", b"left-" + name.encode(), b"secret", 6, ring) > 0]
        print("added", added)
    """)
    assert written.returncode == 0 and written.stdout.startswith(b"added ['user'"), written
    found = run_python(box, keyrings + """
        print("found", [(ring_name, name) for ring_name, ring in rings.items() for name in rings
                        if libc.syscall(KEYCTL, KEYCTL_SEARCH, ring, b"user", b"left-" + name.encode(), 0) > 0])
    """)
    assert found.returncode == 0 and found.stdout == b"found []\n", found


def test_a_program_holds_no_capability_and_no_socket_to_the_zygote(box):
    result = run_python(box, """
        import os
        status = dict(line.split(":\\t") for line in open("/proc/self/status").read().splitlines() if ":\\t" in line)
        print(*[int(status[name], 16) for name in ("CapInh", "CapPrm", "CapEff", "CapAmb")])
        links = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                 if os.path.exists(f"/proc/self/fd/{fd}") or os.path.islink(f"/proc/self/fd/{fd}")]
        print("sockets", [link for link in links if link.startswith("socket:")])
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"0 0 0 0\nsockets []\n"


def test_python_programs_behave_as_in_a_fresh_interpreter():
    # The zygote runs `python -I -B FILE` in its forked interpreter; everything a program can observe
    # about how it was started and how it ends must match a fresh interpreter (the bwrap runner's).
    programs = {
        "identity": "import sys\nprint(__name__, sys.argv, sys.flags.isolated, sys.path[0] != '')\nprint(input())",
        "exit_code": "import sys\nprint('out')\nsys.exit(3)",
        "exit_message": "raise SystemExit('bye')",
        "exception": "def f():\n    return 1 // 0\nf()",
        "syntax": "def (:",
        # The interpreter joins a non-daemon thread at exit, then runs the atexit handlers.
        "atexit_and_thread": ("import atexit, threading\natexit.register(lambda: print('atexit'))\n"
                              "go = threading.Event()\n"
                              "threading.Thread(target=lambda: (go.wait(), print('thread'))).start()\n"
                              "print('main', flush=True)\ngo.set()"),
        "unflushed": "import sys\nsys.stdout.write('no newline')",
        "random_modules": "import sys\nprint('random' in sys.modules)",
    }
    results = {}
    for runner in RUNNERS:
        box = Sandbox(LIMITS, runner=runner)
        results[runner] = {name: run_python(box, source, stdin=b"line\n") for name, source in programs.items()}
    for name in programs:
        zygote_run, bwrap_run = results["zygote"][name], results["bwrap"][name]
        assert (zygote_run.returncode, zygote_run.stdout, zygote_run.stderr) == \
               (bwrap_run.returncode, bwrap_run.stdout, bwrap_run.stderr), name


def test_each_program_gets_its_own_random_state():
    box = Sandbox(LIMITS, runner="zygote")
    outputs = {run_python(box, "import random\nprint(random.random())").stdout for _ in range(3)}
    assert len(outputs) == 3


def test_a_zygote_killed_between_runs_is_replaced(monkeypatch):
    box = Sandbox(LIMITS, runner="zygote")
    assert run_python(box, "print(1)").stdout == b"1\n"
    killed = server_pids()
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    verdict = grade_code("print(int(input()) * 2)", [{"input": "21\n", "output": "42"}], sandbox=box)
    assert verdict.detail == PASSED
    assert killed and not killed & server_pids()


def test_a_zygote_lost_in_the_middle_of_a_run_costs_a_retry_not_a_wrong_verdict(monkeypatch):
    box = Sandbox(LIMITS, runner="zygote")
    assert run_python(box, "print(1)").stdout == b"1\n"
    killed = []
    start = zygote.Zygote.start

    def start_then_die(self, fds):
        start(self, fds)
        if not killed:  # the first run loses its zygote right after the program started
            killed.append(self.server_pid)
            os.kill(self.server_pid, signal.SIGKILL)

    monkeypatch.setattr(zygote.Zygote, "start", start_then_die)
    verdict = grade_code("import time\ntime.sleep(0.2)\nprint(int(input()) * 2)",
                         [{"input": "21\n", "output": "42"}], sandbox=box)
    assert killed and verdict.detail == PASSED, verdict
    assert killed[0] not in server_pids()


def test_where_no_zygote_starts_programs_run_with_one_bwrap_each(monkeypatch, caplog):
    zygote.close_all()
    monkeypatch.setattr(sandbox_module, "_zygote_unavailable", None)
    monkeypatch.setattr(sandbox_module, "_zygote_bwrap_args", lambda: ["/usr/bin/false"])
    box = Sandbox(LIMITS, runner="zygote")
    verdict = grade_code("print(int(input()) * 2)", [{"input": "21\n", "output": "42"}], sandbox=box)
    assert verdict.detail == PASSED and verdict.sandboxed
    assert "could not start the zygote" in sandbox_module._zygote_unavailable
    assert "running one bwrap per program" in caplog.text
    assert zygote.idle_zygotes() == []
