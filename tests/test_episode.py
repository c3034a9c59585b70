"""Episodes (actors/rollout/episode.py): a single-turn task is today's request and answer; several turns continue from
the context with environment tokens masked and marked; turn and token budgets; environment timeouts and
failures end the episode with the cause recorded; versions across a weight update between turns; seeds;
aborts and cancellation."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import re

import pytest

from actors.engines.base import GenerationRequest, SamplingParams
from actors.engines.checkpoint import hf_state_dict
from actors.engines.tokenizer import load_tokenizer
from actors.engines.torch_gen import TorchGenerationEngine
from actors.rollout.envs import UnknownTool, environment_for
from actors.rollout.envs.calculator import Calculator, CalculatorError, calculate, call_of
from actors.rollout.episode import (ENV_VERSION, Environment, EpisodeError, EpisodeLimits, SingleTurn, Trajectory,
                            run_episodes, turn_rid, turn_seed)
from testsupport.bounded import run_bounded
from testsupport.scripted_engine import IntCodec, ScriptedEngine, scripted_logprob
from testsupport.tiny_models import ARITH_TOKENIZER_DIR, tiny_model
from launch.prepare.agent_task import Chain, tool_transcript

run = functools.partial(run_bounded, timeout=60.0)
ARITH = load_tokenizer(str(ARITH_TOKENIZER_DIR))
EOS = ARITH.eos_token_id




class Recording(Environment):
    """Answers every marker-ended turn with a fixed observation; records its calls and whether it closed."""

    def __init__(self, marker: str, observation: str = "7 8", *, hang: bool = False, fail: bool = False,
                 wrong_type: bool = False) -> None:
        self.turn_end = (marker,)
        self.observation, self.hang, self.fail, self.wrong_type = observation, hang, fail, wrong_type
        self.calls: list[tuple[str, str]] = []
        self.closed = False

    async def step(self, turn_text: str, ended_by: str):
        self.calls.append((turn_text, ended_by))
        if self.hang:
            await asyncio.Event().wait()   # a dead tool: never answers
        if self.fail:
            raise RuntimeError("boom")
        if self.wrong_type:
            return 42
        return self.observation if ended_by != "stop" else None

    async def close(self) -> None:
        self.closed = True


def arith_request(expr: str, n: int = 1, max_new_tokens: int = 20, seed: int | None = 5) -> GenerationRequest:
    return GenerationRequest("g", tuple(ARITH.encode(f"Compute: {expr}\n")),
                             SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(EOS,), seed=seed), n)


async def scripted(script, **kwargs) -> ScriptedEngine:
    engine = ScriptedEngine(script, vocab_size=ARITH.vocab_size, **kwargs)
    await engine.start()
    return engine


# --- single turn: the one-turn case is today's generation -------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_single_turn_episode_is_todays_answer_on_the_torch_engine(temperature):
    request = GenerationRequest("g7", (3, 14, 15, 9, 26), SamplingParams(
        temperature=temperature, max_new_tokens=12, stop_token_ids=(5,), seed=11), n=4)

    async def main():
        direct = TorchGenerationEngine(model=tiny_model(seed=0))
        episodic = TorchGenerationEngine(model=tiny_model(seed=0))
        await direct.start()
        await episodic.start()
        try:
            return (await direct.generate(request),
                    await run_episodes(episodic, request, SingleTurn, IntCodec(), EpisodeLimits(max_turns=3)))
        finally:
            await direct.stop()
            await episodic.stop()

    results, trajectories = run(main())
    assert len(trajectories) == 4
    for result, t in zip(results, trajectories):
        t.check()
        assert (t.output_ids, t.logprobs, t.versions) == (result.output_ids, result.logprobs, result.versions)
        assert t.loss_mask == [1] * len(result.output_ids) and t.prompt_ids == list(request.input_ids)
        assert len(t.turns) == 1 and t.turns[0].finish_reason == result.finish_reason
        assert t.end == ("done" if result.finish_reason == "stop" else "tokens") and t.tool_calls == 0
    if temperature:
        assert len({tuple(r.output_ids) for r in results}) > 1   # four different samples, all reproduced


def test_single_turn_episode_sends_the_request_it_was_given():
    engine = run(scripted(lambda ctx, i: [40 + i, EOS]))
    request = arith_request("12*34", n=3)
    trajectories = run(run_episodes(engine, request, SingleTurn, ARITH))
    assert engine.requests == [request]
    assert [t.output_ids for t in trajectories] == [[40, EOS], [41, EOS], [42, EOS]]
    assert [t.end for t in trajectories] == ["done"] * 3


# --- several turns ---------------------------------------------------------------------------------

def test_turns_continue_from_the_context_with_observations_masked_and_marked(careful_agent):
    engine = run(scripted(careful_agent))
    request = arith_request("37*48+56-21", n=2)
    trajectories = run(run_episodes(engine, request, Calculator, ARITH, EpisodeLimits(max_turns=6, max_tokens=256)))
    transcript = tool_transcript(Chain(37, 48, (("+", 56), ("-", 21))))
    want_mask = [m for seg in transcript for m in [int(seg["role"] == "model")] * len(ARITH.encode(seg["text"]))]
    for t in trajectories:
        t.check()
        assert ARITH.decode(t.output_ids) == "".join(s["text"] for s in transcript)
        assert t.loss_mask == want_mask + [1]   # the final eos is the model's
        assert all(v == ENV_VERSION and lp == 0.0 for v, lp, m in zip(t.versions, t.logprobs, t.loss_mask) if not m)
        assert t.end == "done" and t.tool_calls == 3 and len(t.turns) == 4
        assert t.final_text == "\\boxed{1811}" and t.start_version == 0
        assert [turn.ended_by for turn in t.turns] == ["]", "]", "]", "stop"]
        assert [turn.observation for turn in t.turns] == ["=1776\n", "=1832\n", "=1811\n", None]
    # Turn 0 is one request for both samples; every later turn continues from the exact context so far.
    first, *later = engine.requests
    assert first.n == 2 and first.sampling.stop_token_ids == (EOS, ARITH.encode("]")[0])
    assert len(later) == 6 and all(r.n == 1 for r in later)
    for r in later:
        sample, turn = map(int, re.fullmatch(r"g#s(\d)t(\d)", r.rid).groups())
        t = trajectories[sample]
        offset = sum(x.generated + x.observation_tokens for x in t.turns[:turn])
        assert list(r.input_ids) == t.context[:len(request.input_ids) + offset]
        assert r.sampling.seed == turn_seed(5, sample, turn)
        # The behaviour log-probs are the ones the request that sampled each token reported.
        start = offset - t.turns[turn - 1].observation_tokens - t.turns[turn - 1].generated
        assert t.logprobs[offset:offset + t.turns[turn].generated] == [
            scripted_logprob(len(r.input_ids), p) for p in range(t.turns[turn].generated)]
        assert start >= 0


def test_one_turn_never_consults_the_environment(careful_agent):
    env = Recording("]")
    engine = run(scripted(careful_agent))
    [t] = run(run_episodes(engine, arith_request("37*48"), lambda: env, ARITH, EpisodeLimits(max_turns=1)))
    assert env.calls == [] and env.closed
    assert t.end == "turns" and t.tool_calls == 0 and ARITH.decode(t.output_ids) == "[37*48]"
    assert len(engine.requests) == 1


def test_turn_budget_ends_a_tool_loop():
    calls = ARITH.encode("[1+1]")
    engine = run(scripted(lambda ctx, i: calls))
    [t] = run(run_episodes(engine, arith_request("1*1"), Calculator, ARITH, EpisodeLimits(max_turns=3)))
    assert t.end == "turns" and len(t.turns) == 3 and t.tool_calls == 2
    assert ARITH.decode(t.output_ids) == "[1+1]=2\n[1+1]=2\n[1+1]"


def test_token_budget_caps_each_turn_and_refuses_an_observation_that_does_not_fit(careful_agent):
    request = arith_request("37*48+56-21", max_new_tokens=20)
    prompt = len(request.input_ids)                                  # 13 tokens
    engine = run(scripted(careful_agent))
    # Room for turn 1 (7 tokens) and its observation (6) and 4 more tokens: turn 2 is cut at its 4th token.
    limits = EpisodeLimits(max_turns=6, max_tokens=prompt + 7 + 6 + 4)
    [t] = run(run_episodes(engine, request, Calculator, ARITH, limits))
    assert [r.sampling.max_new_tokens for r in engine.requests] == [7 + 6 + 4, 4]
    assert t.end == "tokens" and len(t.context) == limits.max_tokens and t.turns[-1].finish_reason == "length"
    # An observation that leaves no room for one more token is not appended.
    engine = run(scripted(careful_agent))
    [t] = run(run_episodes(engine, request, Calculator, ARITH, EpisodeLimits(max_turns=6, max_tokens=prompt + 7 + 6)))
    assert t.end == "tokens" and t.tool_calls == 0 and ARITH.decode(t.output_ids) == "[37*48]"
    assert "observation of 6 tokens" in t.error
    with pytest.raises(Exception, match="leave no room"):
        run(run_episodes(engine, request, Calculator, ARITH, EpisodeLimits(max_tokens=prompt)))


@pytest.mark.parametrize("kind, cause", [("hang", "environment step timed out after 0.2 s"),
                                         ("fail", "environment step failed: RuntimeError: boom"),
                                         ("wrong_type", "TypeError: step returned int")])
def test_a_slow_dead_or_failing_environment_ends_the_episode_with_the_cause(kind, cause, careful_agent):
    envs: list[Recording] = []

    def make() -> Recording:
        envs.append(Recording("]", **{kind: True}))
        return envs[-1]

    engine = run(scripted(careful_agent))
    trajectories = run(run_episodes(engine, arith_request("37*48", n=2), make, ARITH,
                                    EpisodeLimits(max_turns=4, env_timeout_s=0.2)), timeout=20.0)
    for t in trajectories:
        assert t.end == "env_error" and cause in t.error and t.turns[0].error == t.error
        assert ARITH.decode(t.output_ids) == "[37*48]" and t.tool_calls == 0   # the tokens so far are kept
    assert len(envs) == 2 and all(e.closed for e in envs) and len(engine.requests) == 1


def test_weight_update_between_turns_keeps_each_tokens_version():
    codec = IntCodec()
    prompt = (3, 14, 15, 9, 26)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8, seed=3)

    async def main():
        engine = TorchGenerationEngine(model=tiny_model(seed=0))
        await engine.start()
        try:
            [probe] = await engine.generate(GenerationRequest("probe", prompt, sampling))
            marker = probe.output_ids[2]   # the greedy answer's third token ends the first turn
            new_weights = [list(hf_state_dict(tiny_model(seed=1)).items())]

            class UpdatesWeights(Recording):
                async def step(self, turn_text: str, ended_by: str):
                    await engine.update_weights(1, new_weights)   # the trainer published while the tool ran
                    return "7 8"

            trajectories = await run_episodes(engine, GenerationRequest("g", prompt, sampling),
                                              lambda: UpdatesWeights(str(marker)), codec,
                                              EpisodeLimits(max_turns=2, max_tokens=64))
            return probe, marker, trajectories[0]
        finally:
            await engine.stop()

    probe, marker, t = run(main())
    t.check()
    first = probe.output_ids.index(marker) + 1
    assert t.output_ids[:first] == probe.output_ids[:first] and t.versions[:first] == [0] * first
    assert t.output_ids[first:first + 2] == [7, 8] and t.versions[first:first + 2] == [ENV_VERSION] * 2
    assert set(t.versions[first + 2:]) == {1} and t.start_version == 0
    assert t.end == ("turns" if t.turns[-1].ended_by == str(marker) else "tokens") and t.tool_calls == 1


def test_sampled_episodes_are_reproducible_and_every_turn_has_its_own_seed():
    prompt = (3, 14, 15, 9, 26)
    request = GenerationRequest("g", prompt, SamplingParams(temperature=1.0, max_new_tokens=6, seed=21), n=3)

    class EveryTurnCalls(Recording):
        async def step(self, turn_text: str, ended_by: str):
            return "7 8"

    async def once():
        engine = TorchGenerationEngine(model=tiny_model(seed=0))
        await engine.start()
        try:
            [probe, *_] = await engine.generate(dataclasses.replace(request, rid="probe"))
            # A token the first sample writes early ends a turn: turns are short and several.
            return await run_episodes(engine, request, lambda: EveryTurnCalls(str(probe.output_ids[1])), IntCodec(),
                                      EpisodeLimits(max_turns=4, max_tokens=128))
        finally:
            await engine.stop()

    a, b = run(once()), run(once())
    assert max(len(t.turns) for t in a) > 1 and max(t.tool_calls for t in a) >= 1   # later turns were sampled
    assert [(t.output_ids, t.logprobs, t.versions, t.loss_mask) for t in a] == \
           [(t.output_ids, t.logprobs, t.versions, t.loss_mask) for t in b]
    seeds = {turn_seed(21, s, k) for s in range(3) for k in range(1, 4)}
    assert len(seeds) == 9 and all(0 <= x < 2**31 - 1 for x in seeds)
    assert turn_seed(None, 0, 1) is None and turn_rid("g", 2, 3) == "g#s2t3"


def test_abort_keeps_the_tokens_so_far_and_cancel_closes_the_environments(careful_agent):
    hold = ARITH.encode("9")[0]
    turns = iter([ARITH.encode("[2*3]"), [hold, EOS]])
    engine = run(scripted(lambda ctx, i: next(turns), hold_token=hold))

    async def aborted():
        task = asyncio.ensure_future(run_episodes(engine, arith_request("2*3"), Calculator, ARITH,
                                                  EpisodeLimits(max_turns=3)))
        while len(engine.requests) < 2:    # the second turn is decoding
            await asyncio.sleep(0.01)
        await engine.abort()
        return await task

    [t] = run(aborted())
    assert t.end == "abort" and ARITH.decode(t.output_ids) == "[2*3]=6\n" and t.tool_calls == 1

    env = Recording("]", hang=True)
    engine = run(scripted(careful_agent))

    async def cancelled():
        task = asyncio.ensure_future(run_episodes(engine, arith_request("37*48"), lambda: env, ARITH,
                                                  EpisodeLimits(max_turns=3, env_timeout_s=60)))
        while not env.calls:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(cancelled())
    assert env.closed


def test_bad_limits_and_markers_are_named(careful_agent):
    with pytest.raises(EpisodeError, match="max_turns"):
        EpisodeLimits(max_turns=0)
    with pytest.raises(EpisodeError, match="max_tokens"):
        EpisodeLimits(max_tokens=1)
    with pytest.raises(EpisodeError, match="env_timeout_s"):
        EpisodeLimits(env_timeout_s=0)
    engine = run(scripted(careful_agent))
    with pytest.raises(EpisodeError, match=r"turn_end '\]\]' encodes to 2 tokens"):
        run(run_episodes(engine, arith_request("1*1"), lambda: Recording("]]"), ARITH))
    with pytest.raises(ValueError, match="environment token 0"):
        Trajectory([1], [5], [0], [0.0], [3]).check()


# --- the calculator --------------------------------------------------------------------------------

def test_calculator_evaluates_one_operation_and_refuses_anything_else():
    assert calculate("37*48") == 1776 and calculate("-5-21") == -26 and calculate("1776+56") == 1832
    for bad in ("", "1+2+3", "2**8", "1/2", "(1+2)", "1 + 2", "__import__('os')", "1234567890*2", "+1+2"):
        with pytest.raises(CalculatorError):
            calculate(bad)
    assert call_of("x[12*3]") == "12*3"
    with pytest.raises(CalculatorError):
        call_of("12*3]x")

    async def steps():
        env = Calculator()
        return [await env.step("[12*3]", "]"), await env.step("[1+2+3]", "]"), await env.step("\\boxed{36}", "stop")]

    assert run(steps()) == ["=36\n", "=error\n", None]


def test_a_record_names_its_environment():
    assert environment_for({}) is SingleTurn and environment_for({"tool": "calculator"}) is Calculator
    with pytest.raises(UnknownTool, match="'abacus' is not one of"):
        environment_for({"tool": "abacus"})
