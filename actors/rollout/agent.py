"""Agents written as ordinary code, run as episodes against the rollout's OpenAI endpoint.

An agent is either an async Python function ``agent(client, task) -> float | None`` (``client`` an
`AgentClient`: the endpoint's ``base_url`` and the episode's ``api_key``; ``task`` the task record) or an
external program, started with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``AGENT_TASK`` (the record as JSON) and
``AGENT_TIMEOUT_S`` (the episode's bound, what its HTTP client's timeouts should be) in its environment, whose last
line on stdout may be its reward. It returns a reward, or None to leave the
grading to the task's reward actor, which reads the final reply (`AgentRun.final_text`).

A program that runs untrusted code runs in the reward actor's bubblewrap sandbox (`AgentSandbox`,
actors/reward/sandbox.py): no network of its own, the host's files hidden, resource limits, and the endpoint's
unix socket bound in as the only way out; `actors/rollout/agent_relay.py` serves it inside at
``OPENAI_BASE_URL`` for any OpenAI client.

`run_agent` opens one episode (key) per sample, runs the agent under ``timeout_s`` and closes the episode,
whatever happened: an agent that raises, hangs or exits with an error ends its episode with the cause in
`AgentRun.error` (and every trajectory's ``error``); the tokens it had sampled are kept.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import importlib
import inspect
import itertools
import json
import math
import os
import shutil
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from actors.reward.sandbox import SANDBOX_FILES_DIR, Sandbox, SandboxLimits
from actors.rollout.episode import Trajectory
from actors.rollout.openai_server import AgentEndpoint
from topology.settings import AgentSettings

RELAY_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent_relay.py")
SANDBOX_SOCKET = "/run/agent/endpoint.sock"   # where the endpoint's socket is bound in the sandbox
SANDBOX_PORT = 8000                            # the relay's port on the sandbox's own loopback
SANDBOX_UID_BASE = 250_000                     # agents' host uids, past the reward sandboxes' range (Sandbox)
_sandbox_runs = itertools.count()
# A sandboxed program holds a thread for its whole episode (Sandbox.run blocks). On asyncio's default executor
# (CPUs + 4 threads: 6 on a 2-core machine) only that many of a step's episodes would run at once, the rest
# queued while the engine decodes nearly empty batches. Threads are made as episodes need them, up to this.
SANDBOX_THREADS = 512
_sandbox_threads = concurrent.futures.ThreadPoolExecutor(SANDBOX_THREADS, thread_name_prefix="agent-sandbox")


@dataclasses.dataclass(frozen=True)
class AgentSandbox:
    """How agent programs are sandboxed: the endpoint's unix socket on the host, the files placed read-only in
    the sandbox's /sandbox (the program's own files; its argv names that folder ``{files}`` and the sandbox's
    Python ``{python}``), and the limits of one run (its wall time is the agent's timeout)."""

    socket_path: str
    files: Mapping[str, bytes] = dataclasses.field(default_factory=dict)
    limits: SandboxLimits = SandboxLimits()


@dataclasses.dataclass(frozen=True)
class AgentClient:
    """Where an agent's OpenAI client points: ``AsyncOpenAI(base_url=..., api_key=...)`` (see `openai`), with the
    episode's timeout, and the HTTP connection pool the rollout's agents share (None: the client makes its own)."""

    base_url: str
    api_key: str
    timeout_s: float | None = None
    http_client: Any = None

    def openai(self, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` on this endpoint (the ``openai`` package, imported only here).

        Its timeouts, connect included, are the episode's: the package's own 5 s connect timeout fails episodes
        whose calls wait behind a busy event loop, though the episode has minutes left. On the shared pool the
        client costs nothing to make; each making its own pool (an SSL context, tens of milliseconds of CPU) holds
        the event loop for seconds when a whole batch of episodes starts at once."""
        from openai import AsyncOpenAI
        options: dict[str, Any] = {"max_retries": 0}
        if self.timeout_s is not None:
            options["timeout"] = self.timeout_s
        if self.http_client is not None:
            options["http_client"] = self.http_client
        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **{**options, **kwargs})


def preload_openai() -> None:
    """Import the ``openai`` package if it is installed (what `AgentClient.openai` would import at first use)."""
    try:
        importlib.import_module("openai")
    except ImportError:
        pass   # an agent that does not use it needs nothing; one that does fails at its first call, with the cause


def shared_http_client() -> Any:
    """One HTTP connection pool for every agent's ``openai`` client in this process (`AgentClient.http_client`;
    ``aclose`` it at the end); None without the ``openai`` package."""
    try:
        from openai import DefaultAsyncHttpxClient
    except ImportError:
        return None
    return DefaultAsyncHttpxClient()


AgentFn = Callable[[AgentClient, Mapping[str, Any]], Awaitable[float | None]]


@dataclasses.dataclass
class AgentRun:
    """One episode of an agent: its trajectories (one per branch), its reward (None: the reward actor grades
    ``final_text``), why it ended early, and the conversation's counters (drift, forks, tool calls)."""

    trajectories: list[Trajectory]
    reward: float | None = None
    error: str = ""
    counters: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def final_text(self) -> str:
        """The last reply of the branch the agent answered on last (the last trajectory)."""
        return self.trajectories[-1].final_text if self.trajectories else ""


async def run_agent(endpoint: AgentEndpoint, agent: AgentFn | Sequence[str], task: Mapping[str, Any], name: str,
                    timeout_s: float, seed: int | None = None, sandbox: AgentSandbox | None = None,
                    http_client: Any = None) -> AgentRun:
    """Run one episode of ``agent`` (a function, or a program's argv, sandboxed when ``sandbox`` is given) on
    ``task`` (see the module docstring); a function's client uses ``http_client`` (`shared_http_client`)."""
    key = endpoint.open(name, seed)
    client = AgentClient(endpoint.base_url, key, timeout_s, http_client)
    reward: float | None = None
    error = ""
    try:
        if callable(agent):
            reward = await asyncio.wait_for(agent(client, task), timeout_s)
        else:
            reward = await run_program(list(agent), client, task, timeout_s, sandbox)
        if reward is not None:
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise TypeError(f"the agent returned {reward!r}, expected a finite number or None")
            reward = float(reward)
    except TimeoutError:
        error = f"agent timed out after {timeout_s:g} s"
        reward = None
    except asyncio.CancelledError:   # the group was aborted or the rollout drains: end the episode, then go
        await endpoint.close(key, "cancelled")
        raise
    except Exception as exc:   # the agent's failure is its episode's outcome, never the rollout's crash
        error = f"agent failed: {type(exc).__name__}: {str(exc)[:500]}"
        reward = None
    conversation = await endpoint.close(key, error or "done")
    trajectories = conversation.trajectories()
    for t in trajectories:
        t.end = "env_error" if error else ("tokens" if t.finish_reason == "length" else
                                           "abort" if t.finish_reason == "abort" else "done")
        t.error = error
    return AgentRun(trajectories, reward, error, dict(conversation.counters))


class AgentProgramError(RuntimeError):
    """An agent program that failed: its exit status and the end of its stderr."""


async def run_program(argv: list[str], client: AgentClient, task: Mapping[str, Any], timeout_s: float,
                      sandbox: AgentSandbox | None = None) -> float | None:
    """Run an agent program (see the module docstring); killed at ``timeout_s`` (TimeoutError)."""
    if sandbox is not None:
        return _last_line_reward(*await _run_sandboxed(argv, client, task, timeout_s, sandbox))
    env = {**os.environ, "OPENAI_BASE_URL": client.base_url, "OPENAI_API_KEY": client.api_key,
           "AGENT_TASK": json.dumps(dict(task)), "AGENT_TIMEOUT_S": f"{timeout_s:g}"}
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, env=env)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except BaseException:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        raise
    return _last_line_reward(proc.returncode, out, err)


async def _run_sandboxed(argv: list[str], client: AgentClient, task: Mapping[str, Any], timeout_s: float,
                         sandbox: AgentSandbox) -> tuple[int | None, bytes, bytes]:
    """The program in the sandbox behind the relay: (exit status, stdout, stderr); TimeoutError past the wall
    time. The run blocks a thread (Sandbox.run); a cancelled episode's program stops at its next call, which
    the closed episode answers 410, or at the wall time."""
    # A uid of its own per run: a group's episodes run at once, and with one uid their processes and threads
    # would share one RLIMIT_NPROC (the sandbox's max_processes).
    uid = SANDBOX_UID_BASE + (os.getpid() % 50) * 1000 + next(_sandbox_runs) % 1000
    runner = Sandbox(dataclasses.replace(sandbox.limits, wall_time_s=timeout_s, cpu_time_s=timeout_s), uid=uid,
                     runner="bwrap")
    # The relay starts the program itself: {files} and {python} in its argv are substituted here.
    program = [a.replace("{files}", SANDBOX_FILES_DIR).replace("{python}", runner.python) for a in argv]
    settings = {"socket": SANDBOX_SOCKET, "port": SANDBOX_PORT, "argv": program, "env": {
        "OPENAI_BASE_URL": f"http://127.0.0.1:{SANDBOX_PORT}/v1", "OPENAI_API_KEY": client.api_key,
        "AGENT_TASK": json.dumps(dict(task)), "AGENT_TIMEOUT_S": f"{timeout_s:g}"}}
    with open(RELAY_SOURCE, "rb") as f:
        files = {**sandbox.files, "agent_relay.py": f.read(), "agent_relay.json": json.dumps(settings).encode()}
    result = await asyncio.get_running_loop().run_in_executor(_sandbox_threads, functools.partial(
        runner.run, ["{python}", "-I", "{files}/agent_relay.py", "{files}/agent_relay.json"],
        files=files, binds={sandbox.socket_path: SANDBOX_SOCKET}))
    if result.timed_out:
        raise TimeoutError
    return result.returncode, result.stdout, result.stderr


def _last_line_reward(returncode: int | None, out: bytes, err: bytes) -> float | None:
    """A finished program's reward: the number on its last line of stdout, None without one; a failed
    program raises AgentProgramError with its status and the end of its stderr."""
    if returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        raise AgentProgramError(f"exit {returncode}: {' | '.join(tail)[:400]}")
    lines = out.decode(errors="replace").strip().splitlines()
    if not lines:
        return None
    try:
        return float(lines[-1])
    except ValueError:
        return None   # no reward printed: the reward actor grades the final reply


def python_agent_argv(module: str) -> list[str]:
    """The argv of an agent program written as a Python module (run with this interpreter)."""
    return [sys.executable, "-m", module]


def load_agent(path: str) -> AgentFn:
    """The async agent function named ``module:function``; ValueError names what is missing."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"agent.function {path!r}: expected 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"agent.function {path!r}: {exc}") from None
    except Exception as exc:   # the module's own code failed on import: its cause, in one line
        raise ValueError(f"agent.function {path!r}: importing {module} failed: {type(exc).__name__}: {exc}") from None
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))):
        raise ValueError(f"agent.function {path!r}: not an async function (expected async def {name}(client, task))")
    return fn


def agent_problems(settings: AgentSettings) -> list[str]:
    """What the rollout would refuse of ``settings.agent`` at start, one line each, checked before launch: a
    function that cannot be imported or is not async, a program that does not exist (its argv[0] on PATH, a
    Python script it names, or in the sandbox a ``{files}/NAME`` that is not one of ``agent.files``), a file
    that cannot be read."""
    out = []
    if settings.function is not None:
        try:
            load_agent(settings.function)
        except ValueError as exc:
            out.append(str(exc))
    files = [("agent.files", p) for p in settings.files]
    if settings.chat_template:
        files.append(("agent.chat_template", settings.chat_template))
    out += [f"{key}: {path}: no such file" for key, path in files if not os.path.isfile(path)]
    if settings.command:
        out += [f"agent.command {settings.command}: {why}" for why in _program_problems(settings)]
    return out


def _program_problems(settings: AgentSettings) -> list[str]:
    argv = list(settings.command or [])
    shipped = {os.path.basename(p) for p in settings.files}
    if settings.sandbox:   # {python} is the sandbox's own; the program's files are agent.files
        return [f"{arg} is not one of agent.files {sorted(shipped)}" for arg in argv
                if arg.startswith("{files}/") and arg[len("{files}/"):] not in shipped]
    if shutil.which(argv[0]) is None:
        return [f"{argv[0]!r}: no such program (not a file, nor found on PATH)"]
    out = []
    if os.path.basename(argv[0]).startswith("python"):   # the script a Python program names must exist
        rest = iter(argv[1:])
        for arg in rest:
            if arg in ("-m", "-c"):
                break
            if arg in ("-W", "-X", "--check-hash-based-pycs"):   # options that take a value
                next(rest, None)
            elif not arg.startswith("-"):
                if not os.path.isfile(arg):
                    out.append(f"{arg}: no such file")
                break
    return out


class AgentGroupError(ValueError):
    """A group whose agent runs cannot become answers to one prompt; the message says why."""


def group_answers(runs: Sequence[AgentRun]) -> tuple[list[int], list[Trajectory]]:
    """One group's answers from its agent runs: ``(prompt, trajectories)``, one trajectory per run.

    A run's answer is its last trajectory (the branch the agent answered on last; other branches are not
    trained). Each conversation starts from its own first chat rendering; the group's prompt is the longest
    prefix those renderings share, and whatever a rendering holds past it opens that answer as prompt-like
    tokens (loss mask 0, version -1), so every answer is exactly the tokens its conversation held."""
    finals = []
    for i, run in enumerate(runs):
        if not run.trajectories:
            raise AgentGroupError(f"sample {i}: the agent sampled nothing ({run.error or 'it made no request'})")
        finals.append(run.trajectories[-1])
    prompt = finals[0].prompt_ids
    for t in finals[1:]:
        same = next((k for k, (a, b) in enumerate(zip(prompt, t.prompt_ids)) if a != b),
                    min(len(prompt), len(t.prompt_ids)))
        prompt = prompt[:same]
    if not prompt:
        raise AgentGroupError("the samples' first chat renderings share no token: no prompt to train them on")
    answers = []
    for t in finals:
        answer = Trajectory(list(prompt), turns=list(t.turns), end=t.end, error=t.error)
        answer.add_observation(t.prompt_ids[len(prompt):])
        answer.output_ids += t.output_ids
        answer.loss_mask += t.loss_mask
        answer.logprobs += t.logprobs
        answer.versions += t.versions
        answers.append(answer)
    return prompt, answers
