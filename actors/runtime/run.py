"""`python -m actors.runtime.run SPEC.json`: how every actor process starts, as a fresh interpreter or forked
from the start template (actors/runtime/template.py, which calls :func:`main` with ``forked_from``).

Order matters: the spec's ``env`` is applied to os.environ and AREAL_CPU_AFFINITY ("0,1": core ids) is
applied with os.sched_setaffinity before anything imports torch, so thread pools size themselves to the
pinned cores (OMP_NUM_THREADS comes from the same env). A forked actor finds torch and OpenBLAS loaded by
the template with one thread each and sets their counts from the same env (:func:`follow_thread_settings`).
Then the actor class is imported, checked to be an Actor subclass, and run under uvloop. The exit code is
the actor's (0 after a clean stop), given with os._exit (see exit_now).
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable


def apply_cpu_affinity(value: str | None) -> list[int] | None:
    """Pin this process to the comma-separated core ids in ``value``; returns the cores or None."""
    if not value:
        return None
    try:
        cores = sorted({int(c) for c in value.split(",") if c.strip()})
    except ValueError:
        raise SystemExit(f"AREAL_CPU_AFFINITY={value!r}: expected comma-separated core ids like '0,1'")
    if not cores:
        return None
    available = os.sched_getaffinity(0)
    usable = [c for c in cores if c in available]
    if not usable:
        raise SystemExit(f"AREAL_CPU_AFFINITY={value!r}: none of these cores is available "
                         f"(this process may use {sorted(available)})")
    os.sched_setaffinity(0, usable)
    return usable


def parent_death_signal() -> Callable[[], None] | None:
    """A call that makes Linux send the calling process SIGTERM when the process that started it dies, even
    by SIGKILL (prctl PR_SET_PDEATHSIG); None off Linux. libc is looked up here, not in the call, so the
    call also serves as a Popen ``preexec_fn``: the child then makes only the one system call before exec."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import signal

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    PR_SET_PDEATHSIG = 1
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def die_with_parent(parent: int | None = None) -> None:
    """Ask Linux to send SIGTERM when our parent process dies: actors run in their own sessions (so a
    terminal's Ctrl-C reaches only the launcher), and without this a launcher killed by SIGKILL would leave
    them running, holding ports and cores. SIGTERM is the actor's clean shutdown. ``parent``: the pid our
    parent must be (a forked actor's launcher); a parent that is already another process (init, once the
    launcher died) gets us the SIGTERM at once."""
    set_death_signal = parent_death_signal()
    if set_death_signal is None:
        return
    set_death_signal()
    if os.getppid() == 1 or (parent is not None and os.getppid() != parent):  # it died before prctl took effect
        import signal

        os.kill(os.getpid(), signal.SIGTERM)


def thread_count(value: str | None) -> int:
    """The thread count an OpenMP-style variable gives ("4", or a nested list "4,2" whose first entry counts
    here); 0 when unset or not a count."""
    try:
        n = int((value or "").split(",")[0])
    except ValueError:
        return 0
    return max(n, 0)


def follow_thread_settings() -> tuple[int, int]:
    """In an actor forked from the start template: set the thread counts libraries read as they loaded. The
    template loaded torch (libgomp) and numpy (OpenBLAS) with one thread each, so as to have no thread at
    fork; a fresh interpreter would have read them from the environment then, and these are the counts it
    would have had (measured side by side; tests/test_actors_supervisor.py checks both starts): torch takes
    OMP_NUM_THREADS up to the machine's cores, else the cores it may use; OpenBLAS takes
    OPENBLAS_NUM_THREADS, else OMP_NUM_THREADS, up to the cores it may use. Returns (torch's, OpenBLAS's)."""
    import torch

    usable = len(os.sched_getaffinity(0))
    omp = thread_count(os.environ.get("OMP_NUM_THREADS"))
    threads = min(omp, os.cpu_count() or omp) if omp else usable
    torch.set_num_threads(threads)
    blas = min(thread_count(os.environ.get("OPENBLAS_NUM_THREADS")) or omp or usable, usable)
    set_openblas_threads(blas)
    return threads, blas


def set_openblas_threads(n: int) -> bool:
    """Set the thread count of the OpenBLAS this process has loaded (numpy's); False when none is loaded."""
    import ctypes

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1].lower()}
    for path in sorted(paths):
        lib = ctypes.CDLL(path)
        for symbol in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
            if hasattr(lib, symbol):
                getattr(lib, symbol)(ctypes.c_int(n))
                return True
    return False


def keep_files_private() -> None:
    """Everything this process and its children create is its user's alone (files 0600, directories 0700): a
    run directory holds the run's keys and tokens, its specs, logs, metrics and ledger."""
    os.umask(0o077)


def main(argv: list[str] | None = None, *, forked_from: int | None = None) -> int:
    """Start the actor of the spec in ``argv``. ``forked_from``: this process was forked from the start
    template and adopted by the launcher of that pid, which must be its parent."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m actors.runtime.run SPEC.json", file=sys.stderr)
        return 2
    path = argv[0]
    try:
        with open(path) as fh:
            raw = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        print(f"actors.runtime.run: cannot read spec {path}: {exc}", file=sys.stderr)
        return 2
    env = raw.get("env") if isinstance(raw, dict) else None
    if isinstance(env, dict):
        os.environ.update({str(k): str(v) for k, v in env.items()})
    apply_cpu_affinity(os.environ.get("AREAL_CPU_AFFINITY"))
    die_with_parent(forked_from)
    keep_files_private()
    if forked_from is not None:
        follow_thread_settings()

    # Only now import what may pull in torch.
    import uvloop

    from actors.runtime.base import ActorSpec, SpecError, load_actor_class

    try:
        spec = ActorSpec.from_dict(raw, where=path)
        cls = load_actor_class(spec.cls)
    except (SpecError, ImportError) as exc:
        print(f"actors.runtime.run: {exc}", file=sys.stderr)
        return 2
    actor = cls(spec)
    return int(uvloop.run(actor.run()) or 0)


def exit_now(code: int) -> None:
    """Leave without interpreter teardown once the actor has stopped (logs flushed, bus closed). A bulk-link
    rendezvous still blocked in a daemon thread (a peer that never came) would otherwise be destroyed by
    C++ static teardown, which aborts ("terminate called without an active exception"): the supervisor
    would see a crash instead of the actor's own exit code, and restart it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
