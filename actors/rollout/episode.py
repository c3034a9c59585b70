"""Episodes: generate, act on an environment, append what it answers, generate again; one trajectory.

An episode is how a task turns one prompt into one trainable answer. The model generates a turn; if the
turn ends on one of the environment's markers (the close of a tool call), the environment acts on it (runs
the tool, the tests, the checker) and answers with an observation, whose tokens are appended to the context;
the model generates the next turn from everything so far; and so on until the environment says the episode
is over, or a turn or token budget runs out. The reward is the task's grader applied to the final turn
(`Trajectory.final_text`), as for a single answer.

A single-turn task is the one-turn case of the same loop, not a second path: its environment
(`SingleTurn`) has no markers and ends the episode after the first turn, so `run_episodes` sends the engine
exactly the `GenerationRequest` it was given (one request for the group's ``n`` samples, sharing the
prompt's prefill) and the trajectory holds exactly that answer's tokens, log-probs and versions.

The trajectory keeps, per token after the prompt (`Trajectory.output_ids`):

* ``loss_mask``: 1 on generated tokens, 0 on environment tokens, which are never trained;
* ``logprobs``: the behaviour log-prob of each generated token (0.0 on environment tokens);
* ``versions``: the weight version that sampled each generated token; environment tokens carry
  `ENV_VERSION` (-1), the value the trainer's layout gives prompt tokens (actors/trainer/step.py), so
  staleness, which counts from an episode's first generated token (`Trajectory.start_version`), and the
  decoupled loss's "sampled by these very weights" check never read them.

Each turn continues from the token ids already in the context (prompt, generated and observation tokens),
so a server with a prefix cache (SGLang's radix cache) serves the next turn from cache, and a turn never
re-tokenizes text the model produced. A weight update between or inside turns changes nothing here: tokens
keep the version that sampled them and nothing is regenerated.

Every environment step runs under ``EpisodeLimits.env_timeout_s``: a slow, dead or failing tool ends the
episode with end reason "env_error" and the cause in `Trajectory.error`, never a hang. Environments must not
block the event loop (run blocking work in a thread or a worker pool: the timeout bounds the wait, not the
work). Pure apart from the engine and the environment: no files, no bus.
"""
from __future__ import annotations

import abc
import asyncio
import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

import torch

from actors.batch import ENV_VERSION
from actors.engines.base import GenerationEngine, GenerationRequest, GenerationResult, RequestError


# Why an episode ended:
#   done       the environment took the last turn as the answer (a single-turn task: its only turn)
#   turns      the turn budget ran out while the model still asked the environment for something
#   tokens     a turn hit its length limit, or the context budget left no room for an observation or a turn
#   env_error  an environment step failed or timed out (`Trajectory.error` says which and why)
#   abort      the engine aborted a turn (a drain): its tokens so far are kept
EndReason = Literal["done", "turns", "tokens", "env_error", "abort"]


class EpisodeError(ValueError):
    """An episode that cannot be run as configured (bad limits, a marker that is not one token)."""


class Codec(Protocol):
    """What an episode needs of a tokenizer (`actors.engines.tokenizer.LoadedTokenizer` has it)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class Environment(abc.ABC):
    """What one episode acts on; a fresh instance per episode, so it may keep the episode's state.

    ``turn_end``: texts that end a turn and hand it to the environment (a tool call's closing bracket),
    besides the request's own stop tokens (eos). Each must encode to exactly one token.
    """

    turn_end: tuple[str, ...] = ()

    @abc.abstractmethod
    async def step(self, turn_text: str, ended_by: str) -> str | None:
        """React to a finished turn: ``turn_text`` is its decoded text, ``ended_by`` the `turn_end` text that
        ended it, or "stop" (one of the request's stop tokens, e.g. eos). Returns the observation to append
        before the next turn, or None when the episode is over (the turn is the answer). Raise to report a
        failure; it ends the episode as "env_error" with the exception's message."""

    async def close(self) -> None:
        """Release what the episode held (a sandbox, a connection); called once, also after errors."""


class SingleTurn(Environment):
    """No environment: the first turn is the answer. The episode of every single-turn task."""

    async def step(self, turn_text: str, ended_by: str) -> str | None:
        return None


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """Budgets of one episode. ``max_turns``: generations at most (1: the environment is never consulted,
    the one-turn case). ``max_tokens``: the whole context, prompt included (None: only the engine's own
    context limit). Each turn generates at most the request's ``max_new_tokens`` and what ``max_tokens``
    leaves. ``env_timeout_s``: bound on each environment step (and on closing it)."""

    max_turns: int = 1
    max_tokens: int | None = None   # set it to the model's context for several turns: a continuation past
                                    # the engine's own limit is refused as a RequestError
    env_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if int(self.max_turns) != self.max_turns or self.max_turns < 1:
            raise EpisodeError(f"max_turns must be an integer >= 1, got {self.max_turns!r}")
        if self.max_tokens is not None and (int(self.max_tokens) != self.max_tokens or self.max_tokens < 2):
            raise EpisodeError(f"max_tokens must be an integer >= 2 or None, got {self.max_tokens!r}")
        if not self.env_timeout_s > 0:
            raise EpisodeError(f"env_timeout_s must be > 0, got {self.env_timeout_s!r}")


@dataclasses.dataclass
class Turn:
    """One generation and what the environment answered to it."""

    generated: int                  # tokens this turn generated
    finish_reason: str              # the engine's: "stop", "length" or "abort"
    ended_by: str                   # a turn_end text, "stop" (a request stop token), "length" or "abort"
    text: str                       # the turn's decoded text
    observation: str | None = None  # what the environment answered (None: nothing was appended)
    observation_tokens: int = 0
    env_seconds: float = 0.0
    error: str = ""                 # the environment step's failure, if it failed


@dataclasses.dataclass
class Trajectory:
    """One episode as one answer to its prompt. Per-token lists are aligned with ``output_ids`` (everything
    after the prompt: generated and environment tokens in order)."""

    prompt_ids: list[int]
    output_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    # The last generation's routing (engines that record it): it covers every token that turn fed, i.e. the
    # prompt and all the episode's tokens before its last generated one, as that turn's prefill routed them.
    routed_experts: torch.Tensor | None = None
    turns: list[Turn] = dataclasses.field(default_factory=list)
    end: EndReason = "done"
    error: str = ""                 # why it ended early: the environment's failure, or what did not fit

    def add_generated(self, result: GenerationResult) -> None:
        self.output_ids += result.output_ids
        self.loss_mask += [1] * len(result.output_ids)
        self.logprobs += result.logprobs
        self.versions += result.versions
        self.routed_experts = result.routed_experts

    def add_observation(self, ids: Sequence[int]) -> None:
        self.output_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [ENV_VERSION] * len(ids)

    @property
    def context(self) -> list[int]:
        """The token ids the next turn continues from."""
        return self.prompt_ids + self.output_ids

    @property
    def final_text(self) -> str:
        """The last turn's text: the answer the task's grader scores."""
        return self.turns[-1].text if self.turns else ""

    @property
    def finish_reason(self) -> str:
        """The last generation's finish reason ("stop", "length" or "abort")."""
        return self.turns[-1].finish_reason if self.turns else "abort"

    @property
    def answer_finish_reason(self) -> str:
        """The finish reason of the episode as one answer: "stop" only when it ended "done" (the model
        finished its answer), "abort" when a turn was aborted, else "length" (no answer within the budgets)."""
        return "stop" if self.end == "done" else "abort" if self.end == "abort" else "length"

    @property
    def generated_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def env_tokens(self) -> int:
        return len(self.loss_mask) - sum(self.loss_mask)

    @property
    def tool_calls(self) -> int:
        """Environment steps whose observation was appended."""
        return sum(1 for t in self.turns if t.observation is not None and not t.error)

    @property
    def env_seconds(self) -> float:
        return sum(t.env_seconds for t in self.turns)

    @property
    def start_version(self) -> int | None:
        """The oldest weight version among the generated tokens (staleness counts from it); None: none."""
        return min((v for v, m in zip(self.versions, self.loss_mask) if m), default=None)

    def check(self) -> None:
        """Raises ValueError unless the per-token lists line up and environment tokens carry their markers."""
        n = len(self.output_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"trajectory: {name} has {len(getattr(self, name))} entries for {n} tokens")
        for i, (m, lp, v) in enumerate(zip(self.loss_mask, self.logprobs, self.versions)):
            if m not in (0, 1):
                raise ValueError(f"trajectory: loss_mask[{i}] is {m!r}, expected 0 or 1")
            if m == 0 and (lp != 0.0 or v != ENV_VERSION):
                raise ValueError(f"trajectory: environment token {i} has log-prob {lp} and version {v}")
            if m == 1 and v < 0:
                raise ValueError(f"trajectory: generated token {i} has no weight version ({v})")


def turn_seed(seed: int | None, sample: int, turn: int) -> int | None:
    """The sampling seed of turn ``turn`` (>= 1) of sample ``sample``: a fresh, reproducible stream per turn
    (the engine's random numbers restart at each request's first token, so reusing the group's seed would
    replay the first turn's). Within int32 range, which every engine accepts."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}/{sample}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % ((1 << 31) - 1)


def turn_rid(rid: str, sample: int, turn: int) -> str:
    """The request id of a later turn; turn 0 keeps the group's own ``rid``."""
    return f"{rid}#s{sample}t{turn}"


def marker_ids(codec: Codec, markers: Sequence[str]) -> dict[int, str]:
    """Each ``turn_end`` text's token id; a marker that is not exactly one token is refused (a turn can only
    end on a token the engine can stop at)."""
    out: dict[int, str] = {}
    for marker in markers:
        ids = codec.encode(marker)
        if len(ids) != 1:
            raise EpisodeError(f"turn_end {marker!r} encodes to {len(ids)} tokens {ids}; it must be exactly one")
        out[ids[0]] = marker
    return out


async def run_episodes(engine: GenerationEngine, request: GenerationRequest, make_env: Callable[[], Environment],
                       codec: Codec, limits: EpisodeLimits = EpisodeLimits()) -> list[Trajectory]:
    """Run ``request.n`` episodes from ``request.input_ids``; one trajectory per sample, ordered by index.

    The first turn of every sample is one request (``request`` itself, its stop tokens extended by the
    environment's markers and its ``max_new_tokens`` capped by ``limits.max_tokens``), so the samples share
    the prompt's prefill; each sample then continues on its own, its turns concurrent with the others'.
    ``make_env`` builds one environment per sample. Cancelling the call cancels every turn in flight (the
    engines abort a cancelled request) and closes the environments.
    """
    envs = [make_env() for _ in range(request.n)]
    try:
        markers = marker_ids(codec, envs[0].turn_end)
        sampling = request.sampling
        stops = tuple(sampling.stop_token_ids) + tuple(t for t in markers if t not in sampling.stop_token_ids)
        trajectories = [Trajectory(list(request.input_ids)) for _ in range(request.n)]
        first_budget = _turn_budget(len(request.input_ids), sampling.max_new_tokens, limits)
        if first_budget < 1:
            raise RequestError(f"request {request.rid!r}: the prompt's {len(request.input_ids)} tokens leave no "
                               f"room under max_tokens={limits.max_tokens}")
        first = request
        if stops != sampling.stop_token_ids or first_budget != sampling.max_new_tokens:
            first = dataclasses.replace(request, sampling=dataclasses.replace(
                sampling, stop_token_ids=stops, max_new_tokens=first_budget))
        results = await engine.generate(first)
        await asyncio.gather(*(
            _continue(engine, request, i, result, trajectory, env, stops, markers, codec, limits)
            for i, (result, trajectory, env) in enumerate(zip(results, trajectories, envs))))
        return trajectories
    finally:
        await asyncio.gather(*(_close(env, limits.env_timeout_s) for env in envs))


def _turn_budget(context: int, per_turn: int, limits: EpisodeLimits) -> int:
    if limits.max_tokens is None:
        return per_turn
    return min(per_turn, limits.max_tokens - context)


def _ended_by(result: GenerationResult, markers: dict[int, str]) -> str:
    if result.finish_reason != "stop":
        return result.finish_reason
    return markers.get(result.output_ids[-1], "stop") if result.output_ids else "stop"


async def _continue(engine: GenerationEngine, request: GenerationRequest, index: int, result: GenerationResult,
                    trajectory: Trajectory, env: Environment, stops: tuple[int, ...], markers: dict[int, str],
                    codec: Codec, limits: EpisodeLimits) -> None:
    """One sample's episode from its first turn's result to its end."""
    while True:
        trajectory.add_generated(result)
        ended_by = _ended_by(result, markers)
        turn = Turn(generated=len(result.output_ids), finish_reason=result.finish_reason, ended_by=ended_by,
                    text=codec.decode(result.output_ids))
        trajectory.turns.append(turn)
        if ended_by in ("abort", "length"):
            trajectory.end = "abort" if ended_by == "abort" else "tokens"
            return
        if len(trajectory.turns) >= limits.max_turns:
            # No turn left to answer an observation: the episode is over without consulting the environment.
            trajectory.end = "turns" if ended_by in markers.values() else "done"
            return
        t0 = time.perf_counter()
        try:
            observation = await asyncio.wait_for(env.step(turn.text, ended_by), limits.env_timeout_s)
            if observation is not None and not isinstance(observation, str):
                raise TypeError(f"step returned {type(observation).__name__}, expected str or None")
        except TimeoutError:
            turn.error = f"environment step timed out after {limits.env_timeout_s:g} s"
        except Exception as exc:   # an environment's failure is the episode's outcome, never the rollout's crash
            turn.error = f"environment step failed: {type(exc).__name__}: {exc}"
        turn.env_seconds = time.perf_counter() - t0
        if turn.error:
            trajectory.end, trajectory.error = "env_error", turn.error
            return
        if observation is None:
            trajectory.end = "done"
            return
        ids = codec.encode(observation)
        # The observation and at least one generated token must fit the context budget.
        if _turn_budget(len(trajectory.context) + len(ids), 1, limits) < 1:
            trajectory.end = "tokens"
            trajectory.error = (f"an observation of {len(ids)} tokens after {len(trajectory.context)} leaves no room "
                                f"under max_tokens={limits.max_tokens}")
            return
        trajectory.add_observation(ids)
        turn.observation, turn.observation_tokens = observation, len(ids)
        k = len(trajectory.turns)
        sampling = dataclasses.replace(
            request.sampling, stop_token_ids=stops, seed=turn_seed(request.sampling.seed, index, k),
            max_new_tokens=_turn_budget(len(trajectory.context), request.sampling.max_new_tokens, limits))
        [result] = await engine.generate(GenerationRequest(turn_rid(request.rid, index, k),
                                                           tuple(trajectory.context), sampling, 1))


async def _close(env: Environment, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(env.close(), timeout_s)
    except Exception:   # a failed close must not hide the episode's result; its step errors are already recorded
        pass
