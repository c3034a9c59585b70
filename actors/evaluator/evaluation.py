"""Held-out evaluation: one implementation for `tools.eval`, the warm start's checks, the launcher's final
evaluation, the periodic `EvalActor` and `tools.filter_data`.

* `aevaluate_with(generate, tokenizer, records, settings)`: greedy accuracy, pass@1, pass@k, maj@k and
  answer lengths per level, with answers from any `generate(prompts, sampling, n)` coroutine: the embedded
  engine on a model in memory (`aevaluate_model`), or a started `GenerationEngine` such as an SGLang server
  (`engine_generator`);
* batched generation: `agenerate` submits every prompt to one `TorchGenerationEngine` at once (continuous
  batching does the rest);
* grading: `grade_records` checks each response against its record: math records (`grade_many`) with the
  math grader, the sympy-free fast path in the caller and the undecided rest in a `RewardPool`; code records
  (``"task": "code"``, `grade_code_many`) by running the program against the record's unit tests in the
  sandbox, in the pool (pass = every test passes). Hard timeouts; a failed check counts as wrong.

It lives in actors/ because an actor (the evaluator) runs it and imports flow tools -> actors.
"""
from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
import dataclasses
import time
from typing import Any

from actors.dataset import Record
from actors.engines.base import GenerationEngine, GenerationRequest, GenerationResult, SamplingParams
from actors.engines.model import Qwen2ForCausalLM
from actors.engines.tokenizer import LoadedTokenizer
from actors.engines.torch_gen import TorchGenerationEngine
from actors.reward.math_grader import POOL_PRELOAD, MathVerdict, grade_math_fast, normalize_answer
from actors.reward.pool import RewardPool, TaskFailure
from algo.eval_stats import greedy_accuracy, maj_at_k, pass_at_k
from topology.experiment import GenSection

MATH_GRADER = "actors.reward.math_grader:grade_math"
CODE_GRADER = "actors.reward.code_grader:grade_code"

# (prompts, sampling per prompt, samples per prompt) -> results per prompt, n each
Generate = Callable[[Sequence[Sequence[int]], Sequence[SamplingParams], int], Awaitable[list[list[GenerationResult]]]]


DEFAULT_MAX_NEW_TOKENS = GenSection.model_fields["max_new_tokens"].default  # the run's gen.max_new_tokens
NO_LEVEL = "-"


class EvalError(ValueError):
    """An evaluation that cannot run as asked; the message names the setting or file at fault."""


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    k: int = 8
    samples: int | None = None          # answers per prompt for pass@k; None: k; 0: greedy only
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    seed: int = 0
    pass_ks: tuple[int, ...] = ()       # more pass@k values beside k's
    max_running: int = 256
    workers: int = 1                    # grader processes for what the fast path leaves undecided
    grade_timeout_s: float = 10.0

    @property
    def n_samples(self) -> int:
        return self.k if self.samples is None else self.samples

    def check(self) -> None:
        if self.k < 1:
            raise EvalError(f"k must be >= 1, got {self.k}")
        if self.n_samples < 0:
            raise EvalError(f"samples must be >= 0, got {self.n_samples}")
        if 0 < self.n_samples < self.k:
            raise EvalError(f"samples ({self.n_samples}) must be at least k ({self.k}) for pass@{self.k}")
        if not self.greedy and self.n_samples == 0:
            raise EvalError("nothing to evaluate: greedy is off and samples is 0")
        if self.temperature <= 0 and self.n_samples:
            raise EvalError(f"sampled answers need temperature > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise EvalError(f"top_p must be in (0, 1], got {self.top_p}")
        for k in self.pass_ks:
            if not 1 <= k <= self.n_samples:
                raise EvalError(f"pass@{k} needs 1 <= k <= samples ({self.n_samples})")
        if self.max_new_tokens < 1:
            raise EvalError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def level_key(record: Record) -> str:
    return str(record.level) if record.level is not None else NO_LEVEL


def select_records(records: Sequence[Record], levels: Sequence[int] | None = None,
                   max_per_level: int | None = None) -> list[Record]:
    """Records of the given levels, the first max_per_level of each level in file order."""
    counts: dict[str, int] = defaultdict(int)
    out = []
    for rec in records:
        if levels is not None and rec.level not in levels:
            continue
        key = level_key(rec)
        if max_per_level is not None and counts[key] >= max_per_level:
            continue
        counts[key] += 1
        out.append(rec)
    return out


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _summary(rows: list[dict[str, Any]], settings: EvalSettings) -> dict[str, Any]:
    """Statistics of one group of per-prompt rows (see `aevaluate_model` for the row layout)."""
    out: dict[str, Any] = {"n": len(rows)}
    k = settings.k
    if settings.greedy:
        out["greedy_accuracy"] = greedy_accuracy([r["greedy_correct"] for r in rows])
        out["greedy_len"] = _mean([r["greedy_len"] for r in rows])
        out["greedy_truncated"] = _mean([float(r["greedy_truncated"]) for r in rows])
    if settings.n_samples:
        n = [len(r["sample_correct"]) for r in rows]
        c = [sum(r["sample_correct"]) for r in rows]
        out["pass@1"] = pass_at_k(n, c, 1)
        for kk in sorted({k, *settings.pass_ks}):
            out[f"pass@{kk}"] = pass_at_k(n, c, kk)
        out[f"maj@{k}"] = maj_at_k([r["sample_answers"] for r in rows], [r["sample_correct"] for r in rows], k)
        out["sample_len"] = _mean([x for r in rows for x in r["sample_lens"]])
        out["sample_truncated"] = _mean([float(x) for r in rows for x in r["sample_truncated"]])
    return out


def _level_sort(key: str) -> tuple[int, int | str]:
    return (0, int(key)) if key.isdigit() else (1, key)


async def aevaluate_model(model: Qwen2ForCausalLM, tokenizer: LoadedTokenizer, records: Sequence[Record],
                          settings: EvalSettings = EvalSettings(), pool: RewardPool | None = None,
                          details: bool = False) -> dict[str, Any]:
    """Evaluate `model` (used as it is: pass a copy of a model still being trained) on `records` with the
    embedded engine; see `aevaluate_with` for the report."""
    async def gen(prompts: Sequence[Sequence[int]], sampling: Sequence[SamplingParams],
                  n: int) -> list[list[GenerationResult]]:
        return await agenerate(model, prompts, sampling, n, settings.max_running)
    return await aevaluate_with(gen, tokenizer, records, settings, pool, details)


def engine_generator(*engines: GenerationEngine) -> Generate:
    """`Generate` on started engines (SGLang servers, the embedded engine): every prompt submitted at once, prompt
    i to engine i mod len(engines) (each server batches what it is given)."""
    if not engines:
        raise EvalError("engine_generator: no engine")

    async def gen(prompts: Sequence[Sequence[int]], sampling: Sequence[SamplingParams],
                  n: int) -> list[list[GenerationResult]]:
        if len(sampling) != len(prompts):
            raise EvalError(f"generate: {len(sampling)} sampling settings for {len(prompts)} prompts")
        return list(await asyncio.gather(*(
            engines[i % len(engines)].generate(GenerationRequest(f"p{i}", tuple(ids), sp, n))
            for i, (ids, sp) in enumerate(zip(prompts, sampling)))))
    return gen


async def aevaluate_with(generate: Generate, tokenizer: LoadedTokenizer, records: Sequence[Record],
                         settings: EvalSettings = EvalSettings(), pool: RewardPool | None = None,
                         details: bool = False) -> dict[str, Any]:
    """Evaluate the answers `generate` gives on `records`.

    Returns {"n_prompts", "k", "samples", "temperature", "max_new_tokens", "overall": {...},
    "by_level": {level: {...}}, "seconds": {...}} where each summary holds n, greedy_accuracy,
    greedy_len, greedy_truncated, pass@1, pass@k, maj@k, sample_len, sample_truncated (the sampled
    keys only when samples > 0). With details, "prompts" lists per-prompt rows.
    """
    settings.check()
    if not records:
        raise EvalError("no records to evaluate")
    if any(r.answer is None for r in records):
        bad = next(r for r in records if r.answer is None)
        raise EvalError(f"record {bad.query_id!r} has no answer to check against")
    eos = tokenizer.eos_token_ids
    prompts = [tokenizer.encode(r.prompt) for r in records]
    rows: list[dict[str, Any]] = [{"query_id": r.query_id, "level": level_key(r)} for r in records]
    seconds: dict[str, float] = {}

    async def grade(texts: list[str], refs: list[Record]) -> list[Any]:
        return await asyncio.to_thread(grade_records, texts, refs, pool, settings.workers, settings.grade_timeout_s)

    if settings.greedy:
        t0 = time.perf_counter()
        greedy = SamplingParams(temperature=0.0, max_new_tokens=settings.max_new_tokens, stop_token_ids=eos)
        results = await generate(prompts, [greedy] * len(prompts), 1)
        t1 = time.perf_counter()
        texts = [response_text(tokenizer, res[0]) for res in results]
        verdicts = await grade(texts, list(records))
        seconds["greedy_generate"] = t1 - t0
        seconds["greedy_grade"] = time.perf_counter() - t1
        for row, res, text, v in zip(rows, results, texts, verdicts):
            row.update(greedy_correct=bool(v and v.correct), greedy_len=answer_length(res[0], eos),
                       greedy_truncated=res[0].finish_reason != "stop")
            if details:
                row["greedy_response"] = text
    n = settings.n_samples
    if n:
        t0 = time.perf_counter()
        # Seeded per prompt: the samples do not depend on batching or on the other prompts.
        sampling = [SamplingParams(temperature=settings.temperature, top_p=settings.top_p,
                                   max_new_tokens=settings.max_new_tokens, stop_token_ids=eos,
                                   seed=settings.seed * 1_000_003 + i) for i in range(len(prompts))]
        results = await generate(prompts, sampling, n)
        t1 = time.perf_counter()
        texts = [response_text(tokenizer, r) for res in results for r in res]
        verdicts = await grade(texts, [r for r in records for _ in range(n)])
        seconds["sample_generate"] = t1 - t0
        seconds["sample_grade"] = time.perf_counter() - t1
        for i, (row, res) in enumerate(zip(rows, results)):
            vs = verdicts[i * n:(i + 1) * n]
            row.update(sample_correct=[bool(v and v.correct) for v in vs],
                       sample_answers=[answer_key(v) for v in vs],
                       sample_lens=[answer_length(r, eos) for r in res],
                       sample_truncated=[r.finish_reason != "stop" for r in res])
            if details:
                row["sample_responses"] = texts[i * n:(i + 1) * n]
    by_level: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_level[row["level"]].append(row)
    report: dict[str, Any] = {
        "n_prompts": len(records), "k": settings.k, "samples": n, "temperature": settings.temperature,
        "top_p": settings.top_p, "pass_ks": sorted({settings.k, *settings.pass_ks}) if n else [],
        "max_new_tokens": settings.max_new_tokens, "seed": settings.seed,
        "overall": _summary(rows, settings),
        "by_level": {key: _summary(by_level[key], settings) for key in sorted(by_level, key=_level_sort)},
        "seconds": seconds,
    }
    if details:
        report["prompts"] = rows
    return report


def evaluate_model(model: Qwen2ForCausalLM, tokenizer: LoadedTokenizer, records: Sequence[Record],
                   settings: EvalSettings = EvalSettings(), pool: RewardPool | None = None,
                   details: bool = False) -> dict[str, Any]:
    """Synchronous `aevaluate_model`."""
    return asyncio.run(aevaluate_model(model, tokenizer, records, settings, pool, details))


# --- generation ----------------------------------------------------------------------------------

async def agenerate(model: Qwen2ForCausalLM, prompts: Sequence[Sequence[int]], sampling: Sequence[SamplingParams],
                    n: int = 1, max_running: int = 256) -> list[list[GenerationResult]]:
    """All prompts submitted at once to one engine on `model` (which it puts in eval mode without
    gradients: pass a copy of a model that is being trained). Results per prompt, n each."""
    if len(sampling) != len(prompts):
        raise EvalError(f"agenerate: {len(sampling)} sampling settings for {len(prompts)} prompts")
    engine = TorchGenerationEngine(model=model, max_running=max_running)
    await engine.start()
    try:
        return await engine_generator(engine)(prompts, sampling, n)
    finally:
        await engine.stop()


def generate(model: Qwen2ForCausalLM, prompts: Sequence[Sequence[int]], sampling: Sequence[SamplingParams],
             n: int = 1, max_running: int = 256) -> list[list[GenerationResult]]:
    """Synchronous `agenerate` (for tools; from a running event loop await `agenerate` instead)."""
    return asyncio.run(agenerate(model, prompts, sampling, n, max_running))


def response_text(tokenizer: LoadedTokenizer, result: GenerationResult) -> str:
    return tokenizer.decode(result.output_ids, skip_special_tokens=True)


def answer_length(result: GenerationResult, eos_ids: Sequence[int]) -> int:
    """Generated tokens without the final stop token."""
    n = len(result.output_ids)
    return n - 1 if n and result.finish_reason == "stop" and result.output_ids[-1] in eos_ids else n


# --- grading -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CodeCheck:
    """A code record's verdict in the shape evaluation reads: passed every test, and the program run."""

    correct: bool
    extracted: str
    detail: str = ""


def is_code(record: Record) -> bool:
    return record.extra.get("task") == "code"


def answer_key(verdict: MathVerdict | CodeCheck | None) -> str | None:
    """What maj@k counts votes on: the normalised math answer, or the program text as run."""
    if verdict is None or verdict.extracted is None:
        return None
    return verdict.extracted.strip() if isinstance(verdict, CodeCheck) else normalize_answer(verdict.extracted)


def grade_records(responses: Sequence[str], records: Sequence[Record], pool: RewardPool | None = None,
                  workers: int = 1, timeout_s: float = 10.0) -> list[MathVerdict | CodeCheck | None]:
    """Verdict per response against its record: code records through `grade_code_many`, the rest through
    `grade_many` (None: the check timed out or crashed, which scores as wrong)."""
    if len(responses) != len(records):
        raise EvalError(f"grade_records: {len(records)} records for {len(responses)} responses")
    code = [i for i, r in enumerate(records) if is_code(r)]
    math = [i for i, r in enumerate(records) if not is_code(r)]
    verdicts: list[MathVerdict | CodeCheck | None] = [None] * len(responses)
    if math:
        for i, v in zip(math, grade_many([responses[i] for i in math], [_reference(records[i]) for i in math],
                                         pool, workers, timeout_s)):
            verdicts[i] = v
    if code:
        for i, v in zip(code, grade_code_many([responses[i] for i in code], [records[i] for i in code],
                                              pool, workers)):
            verdicts[i] = v
    return verdicts


def _reference(record: Record) -> str | list[str]:
    """What a math record's responses are graded against: its answer, or all its answers when there are several
    (a response matching any of them is correct)."""
    refs = record.references
    return refs[0] if len(refs) == 1 else list(refs)


def grade_code_many(responses: Sequence[str], records: Sequence[Record], pool: RewardPool | None = None,
                    workers: int = 1) -> list[CodeCheck | None]:
    """Run each response's program (`actors.reward.code.extract_program`) against its record's ``tests`` in
    the sandbox, in `pool` or a pool of `workers` processes made for this call; the per-item deadline is the
    reward actor's, (wall time + 1 s) per test + 10 s. Without a working sandbox every program is refused
    and scores as wrong (detail "blocked")."""
    from actors.reward.code import extract_program
    from actors.reward.sandbox import SandboxLimits

    wall = SandboxLimits().wall_time_s
    programs = [extract_program(text) for text in responses]
    own = pool is None
    if pool is None:
        pool = RewardPool(max(1, min(workers, len(records))), timeout=60.0, preload=["actors.reward.code_grader"])
    try:
        futures = []
        for program, rec in zip(programs, records):
            tests = rec.extra.get("tests")
            if not tests:
                raise EvalError(f"record {rec.query_id!r} is a code task without tests")
            futures.append(pool.submit(CODE_GRADER, program, tests, rec.extra.get("mode") or None,
                                       timeout=len(tests) * (wall + 1.0) + 10.0))
        out: list[CodeCheck | None] = []
        for program, future in zip(programs, futures):
            result = future.result()
            out.append(None if isinstance(result, TaskFailure)
                       else CodeCheck(bool(result.passed), program, result.detail))
        return out
    finally:
        if own:
            pool.close()

def grade_many(responses: Sequence[str], answers: Sequence[str | list[str]], pool: RewardPool | None = None,
               workers: int = 1, timeout_s: float = 10.0) -> list[MathVerdict | None]:
    """Verdict per response (None: the check timed out or crashed, which scores as wrong).

    The grader's bounded sympy-free path settles most answers in the caller; the rest go to `pool`,
    or to a pool of `workers` processes made for this call.
    """
    if len(responses) != len(answers):
        raise EvalError(f"grade_many: {len(answers)} answers for {len(responses)} responses")
    verdicts: list[MathVerdict | None] = [grade_math_fast(r, a) for r, a in zip(responses, answers)]
    undecided = [i for i, v in enumerate(verdicts) if v is None]
    if not undecided:
        return verdicts
    own = pool is None
    if pool is None:
        pool = RewardPool(max(1, min(workers, len(undecided))), timeout=timeout_s,
                          preload=POOL_PRELOAD)
    try:
        futures = [pool.submit(MATH_GRADER, responses[i], answers[i], timeout=timeout_s) for i in undecided]
        for i, future in zip(undecided, futures):
            result = future.result()
            verdicts[i] = None if isinstance(result, TaskFailure) else result
    finally:
        if own:
            pool.close()
    return verdicts
