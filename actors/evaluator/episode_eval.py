"""Held-out evaluation of episodes: the one evaluation (actors/evaluator/evaluation.py) with answers that come from
episodes (actors/rollout/episode.py) instead of single generations.

`episode_generator` is a `Generate` whose answers are episodes: each prompt's record names its environment
(`actors.rollout.envs.environment_for`; a record without a tool is a single-turn episode), the model's own tokens
(every turn, observations left out) are the answer graded, and the trajectories are kept for their
statistics. `aevaluate_episodes` runs `aevaluate_with` on it, so grading, pass@k, maj@k and the per-level
report are exactly those of every other evaluation, and adds per level:

    greedy_turns, greedy_tool_calls     mean generations and environment steps per greedy episode
    greedy_ends                         how the greedy episodes ended (counts of actors.rollout.episode.EndReason)
    sample_turns, sample_tool_calls, sample_ends     the same over the sampled episodes

An answer counts as truncated (greedy_truncated, sample_truncated) when its episode did not end "done".
"""
from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from actors.dataset import Record
from actors.engines.base import GenerationEngine, GenerationRequest, GenerationResult, SamplingParams
from actors.engines.model import Qwen2ForCausalLM
from actors.engines.tokenizer import LoadedTokenizer
from actors.engines.torch_gen import TorchGenerationEngine
from actors.rollout.envs import environment_for
from actors.rollout.episode import Environment, EpisodeLimits, Trajectory, run_episodes
from actors.evaluator.evaluation import EvalError, EvalSettings, Generate, aevaluate_with, level_key
from actors.reward.pool import RewardPool

# Turns an episode may take when a tool asks for none: enough for the agent task's longest chain (three
# calculator calls and the answer) and one call more.
DEFAULT_MAX_TURNS = 5


def answer_result(trajectory: Trajectory, rid: str, index: int) -> GenerationResult:
    """The model's own part of an episode as one answer: its generated tokens in order (what the grader
    reads and the length counts), "stop" only when the episode ended "done"."""
    keep = [i for i, m in enumerate(trajectory.loss_mask) if m]
    return GenerationResult(rid, index, [trajectory.output_ids[i] for i in keep],
                            [trajectory.logprobs[i] for i in keep], [trajectory.versions[i] for i in keep],
                            trajectory.answer_finish_reason, len(trajectory.prompt_ids))


def episode_generator(engine: GenerationEngine, codec: LoadedTokenizer,
                      environments: Sequence[Callable[[], Environment]], limits: EpisodeLimits,
                      kept: list[list[list[Trajectory]]] | None = None) -> Generate:
    """`Generate` whose prompt i runs episodes in ``environments[i]``; each call's trajectories (per prompt,
    n each) are appended to ``kept``."""
    async def gen(prompts: Sequence[Sequence[int]], sampling: Sequence[SamplingParams],
                  n: int) -> list[list[GenerationResult]]:
        if not len(prompts) == len(sampling) == len(environments):
            raise EvalError(f"generate: {len(prompts)} prompts, {len(sampling)} sampling settings and "
                            f"{len(environments)} environments")
        runs = await asyncio.gather(*(
            run_episodes(engine, GenerationRequest(f"p{i}", tuple(ids), sp, n), make_env, codec, limits)
            for i, (ids, sp, make_env) in enumerate(zip(prompts, sampling, environments))))
        if kept is not None:
            kept.append(list(runs))
        return [[answer_result(t, f"p{i}", j) for j, t in enumerate(run)] for i, run in enumerate(runs)]
    return gen


def _episode_stats(trajectories: list[Trajectory], prefix: str) -> dict[str, Any]:
    n = max(len(trajectories), 1)
    return {f"{prefix}_turns": sum(len(t.turns) for t in trajectories) / n,
            f"{prefix}_tool_calls": sum(t.tool_calls for t in trajectories) / n,
            f"{prefix}_ends": dict(sorted(Counter(t.end for t in trajectories).items()))}


async def aevaluate_episodes(engine: GenerationEngine, tokenizer: LoadedTokenizer, records: Sequence[Record],
                             settings: EvalSettings = EvalSettings(), limits: EpisodeLimits | None = None,
                             pool: RewardPool | None = None, details: bool = False) -> dict[str, Any]:
    """`aevaluate_with`'s report for episodes on a started engine, with the episode statistics above and
    "max_turns". ``limits`` defaults to DEFAULT_MAX_TURNS turns without a context budget."""
    limits = limits or EpisodeLimits(max_turns=DEFAULT_MAX_TURNS)
    kept: list[list[list[Trajectory]]] = []
    environments = [environment_for(r.extra) for r in records]
    report = await aevaluate_with(episode_generator(engine, tokenizer, environments, limits, kept), tokenizer,
                                  records, settings, pool, details)
    phases = (["greedy"] if settings.greedy else []) + (["sample"] if settings.n_samples else [])
    by_level: dict[str, dict[str, list[Trajectory]]] = defaultdict(lambda: defaultdict(list))
    for phase, runs in zip(phases, kept):
        for record, run in zip(records, runs):
            by_level[level_key(record)][phase].extend(run)
            by_level["overall"][phase].extend(run)
    for key, phases_of in by_level.items():
        target = report["overall"] if key == "overall" else report["by_level"][key]
        for phase, trajectories in phases_of.items():
            target.update(_episode_stats(trajectories, phase))
    if details:
        for row, *runs in zip(report["prompts"], *kept):
            for phase, run in zip(phases, runs):
                row[f"{phase}_transcripts"] = [tokenizer.decode(t.output_ids) for t in run]
                row[f"{phase}_ends"] = [t.end for t in run]
    report["max_turns"] = limits.max_turns
    return report


async def aevaluate_model_episodes(model: Qwen2ForCausalLM, tokenizer: LoadedTokenizer, records: Sequence[Record],
                                   settings: EvalSettings = EvalSettings(), max_turns: int = DEFAULT_MAX_TURNS,
                                   pool: RewardPool | None = None, details: bool = False) -> dict[str, Any]:
    """`aevaluate_episodes` on the embedded engine over ``model`` (used as it is: pass a copy of a model still
    being trained); the context budget is the model's ``max_position_embeddings``."""
    limits = EpisodeLimits(max_turns=max_turns, max_tokens=model.config.max_position_embeddings)
    engine = TorchGenerationEngine(model=model, max_running=settings.max_running)
    await engine.start()
    try:
        return await aevaluate_episodes(engine, tokenizer, records, settings, limits, pool, details)
    finally:
        await engine.stop()


def evaluate_model_episodes(model: Qwen2ForCausalLM, tokenizer: LoadedTokenizer, records: Sequence[Record],
                            settings: EvalSettings = EvalSettings(), max_turns: int = DEFAULT_MAX_TURNS,
                            pool: RewardPool | None = None, details: bool = False) -> dict[str, Any]:
    """Synchronous `aevaluate_model_episodes`."""
    return asyncio.run(aevaluate_model_episodes(model, tokenizer, records, settings, max_turns, pool, details))


__all__ = ["DEFAULT_MAX_TURNS", "aevaluate_episodes", "aevaluate_model_episodes", "answer_result",
           "episode_generator", "evaluate_model_episodes"]
