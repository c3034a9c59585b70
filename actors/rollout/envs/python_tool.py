"""A Python interpreter as a tool: the model writes a program, the sandbox runs it, the output is the observation.

The model opens a call with ``call_open`` and ends its turn on ``call_end`` (one token of the model's
tokenizer); the program is the text between them (the whole turn when it has no ``call_open``). It runs in
the reward's bubblewrap sandbox (actors/reward/sandbox.py: its zygote, its limits) as
``python3 -I -B prog.py``, with no network, no view of the host's files and the ``sandbox`` limits; the
observation says how it ended and what it printed, truncated, and the model goes on::

    Is 2**61-1 prime?          (prompt)
    <python>n = 2**61 - 1
    print(all(n % d for d in range(2, 10**5)))</python>      model turn 1, ends on "</python>"
    [exit 0]                                                 observation
    True
    ...                                                      model turn 2

Whatever the program does, the episode goes on: an exception, a killed run (wall or CPU time, output past
its cap, memory), a sandbox that cannot start or a call that gets no answer within ``timeout_s`` are each an
observation (``[error: ...]`` or the run's status line) the model reads, never an exception that ends the
episode or the rollout. A turn that ends on eos is the answer: the episode is over.

Where it runs: in the caller's process (the rollout's). `CodeRunner` keeps ``workers`` daemon threads, each
with its own sandbox: its own unprivileged uid (a fork bomb's RLIMIT_NPROC then never starves a neighbour's
run) and so its own zygote. The threads live as long as the runner: bubblewrap runs with
``--die-with-parent``, whose signal the kernel sends when the *thread* that started it ends, so a zygote
started on a short-lived thread would die with it and every program would pay a new sandbox. A call the
sandbox does not answer within ``timeout_s`` is abandoned (its thread goes on until the sandbox's own
kill), never joined. A zygote that dies is replaced by the sandbox on the next run
(`actors.reward.zygote.checkout`), and a run it was in the middle of runs again on the fresh one.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import os
import queue
import threading
from collections.abc import Callable

from actors.rollout.episode import Environment
from actors.reward.sandbox import RunResult, Sandbox, SandboxLimits, SandboxUnavailable
from topology.settings import PythonToolSettings

CALL_OPEN, CALL_END = "<python>", "</python>"
PROGRAM = "prog.py"
ARGV = ("{python}", "-I", "-B", f"{{files}}/{PROGRAM}")
# The default per-call bound beyond the sandbox's wall time: starting a zygote, and the zygote's own
# reply timeouts when one dies mid-run and the run goes again on a fresh one.
CALL_GRACE_S = 3.0


@dataclasses.dataclass(frozen=True)
class ToolOutput:
    """What an observation keeps of a run: ``max_chars`` characters of stdout and of stderr each (stdout's
    head, stderr's tail: a traceback ends with its cause)."""

    max_chars: int = 1000


class CodeRunner:
    """Runs programs for the Python tool: ``workers`` sandboxes, one run at a time each, on daemon threads.

    ``timeout_s`` bounds each call as seen by the episode (default: the sandbox's wall time plus
    `CALL_GRACE_S`); the sandbox itself kills the program at its wall time. ``uid_base`` is where the
    workers' uids start when we are root (each worker its own).
    """

    def __init__(self, limits: SandboxLimits | None = None, *, workers: int = 2, timeout_s: float | None = None,
                 allow_unsandboxed: bool = False, output: ToolOutput = ToolOutput(), uid_base: int = 250_000,
                 uid_span: int = 50_000) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers!r}")
        self.limits = limits or SandboxLimits()
        self.timeout_s = float(timeout_s) if timeout_s is not None else self.limits.wall_time_s + CALL_GRACE_S
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.output = output
        self.workers = workers
        first = uid_base + (os.getpid() * workers) % max(uid_span - workers, 1)
        self._sandboxes = [Sandbox(self.limits, allow_unsandboxed=allow_unsandboxed, uid=first + i)
                           for i in range(workers)]
        self._calls: queue.SimpleQueue[tuple[str, concurrent.futures.Future]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._start_lock = threading.Lock()
        # runs, calls abandoned at the timeout, refused for want of a sandbox, failed in the sandbox itself
        self.counters = {"runs": 0, "abandoned": 0, "unavailable": 0, "failed": 0}

    def _start_workers(self) -> None:
        with self._start_lock:
            if not self._threads:
                self._threads = [threading.Thread(target=self._work, args=(sandbox,), name=f"python-tool-{i}",
                                                  daemon=True) for i, sandbox in enumerate(self._sandboxes)]
                for thread in self._threads:
                    thread.start()

    def _work(self, sandbox: Sandbox) -> None:
        """One worker thread: runs the calls it takes, one at a time, in its own sandbox (and zygote)."""
        while True:
            program, outcome = self._calls.get()
            if not outcome.set_running_or_notify_cancel():
                continue   # abandoned before it started
            try:
                outcome.set_result(sandbox.run(list(ARGV), files={PROGRAM: program.encode()}))
            except BaseException as exc:  # handed to the call's waiter, never lost
                outcome.set_exception(exc)

    async def run(self, program: str) -> str:
        """The observation for one program: its status line and output, or ``[error: ...]``. Never raises
        for anything the program or the sandbox does."""
        self.counters["runs"] += 1
        self._start_workers()
        outcome: concurrent.futures.Future[RunResult] = concurrent.futures.Future()
        self._calls.put((program, outcome))
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(outcome), self.timeout_s)
        except TimeoutError:
            self.counters["abandoned"] += 1
            return error_observation(f"the sandbox gave no result within {self.timeout_s:g} s")
        except SandboxUnavailable as exc:
            self.counters["unavailable"] += 1
            return error_observation(str(exc))
        except Exception as exc:   # the sandbox's own failure (could not start bwrap, ...): the model is told
            self.counters["failed"] += 1
            return error_observation(f"the sandbox failed: {type(exc).__name__}: {exc}")
        return observation(result, self.limits, self.output)


def error_observation(reason: str) -> str:
    return f"\n[error: {reason}]\n"


def status_line(result: RunResult, limits: SandboxLimits) -> str:
    """How a run ended, in the words the model reads."""
    if result.timed_out:
        return f"killed: wall time limit of {limits.wall_time_s:g} s"
    if result.cpu_limited:
        return f"killed: CPU time limit of {limits.cpu_time_s:g} s"
    if result.output_limited:
        return f"killed: output past {limits.output_bytes} bytes"
    if result.signal_name:
        return f"killed by {result.signal_name}"
    return f"exit {result.returncode}"


def _clip(text: str, max_chars: int, keep: str) -> str:
    if len(text) <= max_chars:
        return text
    cut = len(text) - max_chars
    if keep == "head":
        return f"{text[:max_chars]}...[{cut} more characters]\n"
    return f"[{cut} characters before]...{text[-max_chars:]}"


def observation(result: RunResult, limits: SandboxLimits, output: ToolOutput = ToolOutput()) -> str:
    """The observation of one run: ``[STATUS]``, then stdout, then stderr (each clipped)."""
    text = f"\n[{status_line(result, limits)}]\n"
    stdout = result.stdout.decode(errors="replace")
    stderr = result.stderr.decode(errors="replace")
    if stdout:
        text += _clip(stdout, output.max_chars, "head")
    if stderr:
        text += ("" if text.endswith("\n") else "\n") + "[stderr]\n" + _clip(stderr, output.max_chars, "tail")
    return text if text.endswith("\n") else text + "\n"


def program_of(turn_text: str, call_open: str, call_end: str) -> str:
    """The program a turn asked to run: the text after its last ``call_open`` (the whole turn without one),
    without the ``call_end`` that ended it."""
    body = turn_text[:-len(call_end)] if call_end and turn_text.endswith(call_end) else turn_text
    start = body.rfind(call_open) if call_open else -1
    return body[start + len(call_open):] if start >= 0 else body


_default_runner: CodeRunner | None = None
_default_lock = threading.Lock()


def default_runner() -> CodeRunner:
    """This process's runner with the default limits (for evaluations outside a rollout actor, which builds
    its own from its settings); sandboxed only."""
    global _default_runner
    with _default_lock:
        if _default_runner is None:
            _default_runner = CodeRunner()
        return _default_runner


class PythonTool(Environment):
    """The Python tool (see the module docstring). Stateless: every program runs in a fresh sandbox."""

    def __init__(self, runner: CodeRunner | None = None, *, call_open: str = CALL_OPEN,
                 call_end: str = CALL_END) -> None:
        self.runner = runner or default_runner()
        self.call_open = call_open
        self.turn_end = (call_end,)

    async def step(self, turn_text: str, ended_by: str) -> str | None:
        if ended_by not in self.turn_end:
            return None   # the turn ended on eos: it is the answer
        return await self.runner.run(program_of(turn_text, self.call_open, ended_by))


def timeout_problem(settings: PythonToolSettings, env_timeout_s: float | None) -> str | None:
    """Why ``python_tool.timeout_s`` is refused beside ``gen.env_timeout_s`` (see `python_tool`), or None."""
    if env_timeout_s is None or settings.timeout_s is None or settings.timeout_s < env_timeout_s:
        return None
    return (f"python_tool.timeout_s ({settings.timeout_s:g} s) must be below gen.env_timeout_s ({env_timeout_s:g} s): "
            "a slow program is then answered by the tool, not an env_error that ends the episode")


def python_tool(settings: PythonToolSettings,
                env_timeout_s: float | None = None) -> tuple[CodeRunner, Callable[[], PythonTool]]:
    """A runner built from an actor's ``python_tool`` settings, and the factory of episodes' tools on it.

    The call timeout must be below the episode's bound on a step (``env_timeout_s``, gen.env_timeout_s), so
    that a slow program is answered by the tool ("[error: ...]") and the episode goes on, rather than ended
    as env_error: unset, it is the sandbox's wall time + `CALL_GRACE_S`, at most 90% of ``env_timeout_s``;
    set at or above ``env_timeout_s``, it is refused (ValueError naming both keys)."""
    limits = SandboxLimits(**settings.sandbox.model_dump(exclude_none=True))
    timeout_s = settings.timeout_s
    if problem := timeout_problem(settings, env_timeout_s):
        raise ValueError(problem)
    if env_timeout_s is not None and timeout_s is None:
        timeout_s = min(limits.wall_time_s + CALL_GRACE_S, 0.9 * env_timeout_s)
    runner = CodeRunner(limits, workers=settings.workers, timeout_s=timeout_s,
                        allow_unsandboxed=settings.allow_unsandboxed, output=ToolOutput(settings.output_chars))
    return runner, functools.partial(PythonTool, runner, call_open=settings.call_open, call_end=settings.call_end)
