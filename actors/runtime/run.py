"""`python -m actors.runtime.run SPEC.json`: the one way any actor process starts.

Order matters: the spec's ``env`` is applied to os.environ and AREAL_CPU_AFFINITY ("0,1": core ids) is
applied with os.sched_setaffinity before anything imports torch, so thread pools size themselves to the
pinned cores (OMP_NUM_THREADS comes from the same env). Then the actor class is imported, checked to be an
Actor subclass, and run under uvloop. The exit code is the actor's (0 after a clean stop), given with
os._exit (see exit_now).
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


def die_with_parent() -> None:
    """Ask Linux to send SIGTERM when the process that started us dies: actors run in their own sessions
    (so a terminal's Ctrl-C reaches only the launcher), and without this a launcher killed by SIGKILL
    would leave them running, holding ports and cores. SIGTERM is the actor's clean shutdown."""
    set_death_signal = parent_death_signal()
    if set_death_signal is None:
        return
    set_death_signal()
    if os.getppid() == 1:  # the parent died before prctl took effect
        import signal

        os.kill(os.getpid(), signal.SIGTERM)


def keep_files_private() -> None:
    """Everything this process and its children create is its user's alone (files 0600, directories 0700): a
    run directory holds the run's keys and tokens, its specs, logs, metrics and ledger."""
    os.umask(0o077)


def main(argv: list[str] | None = None) -> int:
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
    die_with_parent()
    keep_files_private()

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
