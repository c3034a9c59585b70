"""EvalActor: held-out accuracy during the run, every ``eval.every_versions`` versions, on that version's weights.

Training never waits for it. It is an actor of its own that nobody sends work to: it asks the parameter
server for the newest version kept for evaluation (every multiple of N, the start version included:
`actors.param_server.eval_store.kept_for_eval`), bucket by bucket on the bus (:class:`EvalWeightsRequest`), checks the
weights hash against the one the server computed, and answers the first ``eval.max_problems`` problems
of ``data.test`` (spread over the levels) greedily with the embedded engine. Grading and statistics are
`actors.evaluator.evaluation`'s, the same code as ``tools.eval`` and the launcher's final evaluation. When an
evaluation takes longer than N versions of training, the versions in between are skipped, not queued:
the next one evaluated is the newest kept.

Each evaluation appends one line to ``RUN_DIR/eval.jsonl`` (read by ``tools.plot``) and writes
``eval/accuracy`` (and ``eval/accuracy_L<level>``) at step = version to the run's TensorBoard directory::

    {"kind": "periodic", "version": V, "step": V, "time": ..., "eval/accuracy": 0.6, "newest": 23,
     "eval_seconds": 1.2, "overall": {...}, "by_level": {...}, "n_prompts": 64}

``newest`` is the newest version the parameter server held when the weights were fetched (training's lead).
A restarted evaluator (the supervisor restarts it like any actor) reads the file and does not evaluate a
version twice.

Versions missed (the evaluator was down, or an evaluation took longer than N versions) are caught up where
their weights are still on disk: version 0's in ``model.path``, the others in a sound checkpoint of that step
(``"source": "checkpoint"`` on their line); the rest are named in a line of their own,
``{"kind": "skipped", "versions": [...], "reason": ...}``, so a gap in the curve is explained. A run that ended
while the evaluator was away is caught up by the launcher (`catch_up`, launch/evaluation.py) from the
checkpoints left.

Settings: ``eval.every_versions`` (0: off, the actor idles), ``eval.max_problems``
(default 64), ``eval.wait_s`` (how long one request waits for a new version, default 30),
``gen.max_new_tokens``, ``data.test`` and its layout, ``model.path`` (config and tokenizer).

On a GPU run (``engine: sglang``, ``weights_from: checkpoints``): the answers come from an SGLang server of its
own (the rollouts' engine, `SGLangEngine.from_settings`, started in the background so the run does not wait for
it), and the versions evaluated are the run's checkpoints: the start weights (version 0), then the newest
complete checkpoint at least N versions after the last one evaluated, loaded into the server from the shared
file system (``/update_weights_from_disk``); ``newest`` is then the newest complete checkpoint. The direct
weights of a GPU run keep no copy in the parameter server, so a checkpoint is the one version it can read.
Either source works with either engine (``weights_from: param_server`` with SGLang loads the fetched buckets
through the server's disk path; ``checkpoints`` with the embedded engine loads each checkpoint here).

The shipped GPU topologies (``weights_from: rollouts``, no GPU of its own): the rollouts answer, as AReaL-lite's
evaluation runs on the rollouts' own SGLang servers through a second client every ``freq_steps`` steps
(inclusionAI/AReaL examples/arealite/gsm8k_grpo.py: ``eval_rollout = RemoteSGLangEngine(config.rollout)`` beside
``rollout``; arealite/utils/evaluator.py). Every ``eval.wait_s`` the evaluator asks each rollout for its engine's
version (an :class:`EvalGenerate` without a prompt); once the newest reaches the next multiple of N, it sends the
problems to the rollouts that answered, one prompt per :class:`EvalGenerate`, at most ``rollout_concurrency`` in
flight on one rollout (`answer_on_rollouts`). A rollout answers greedily on its engine beside its groups, by the
same generation path, so a weight update can land mid-answer: each token carries the version that sampled it, and
the line says the oldest (``version``) and the newest (``version_max``) of them (``"source": "rollouts"``). A
rollout that fails or does not answer within ``rollout_timeout_s`` is left out of that evaluation and its prompt
goes to another; when none is left the evaluation is tried again at the next look. The next evaluation is due at
the first multiple of N above ``version``. Nothing is caught up from checkpoints: the weights a rollout held are not
kept, and the curve's points are where the rollouts were.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from actors.runtime.base import Actor, ActorSpec, handles
from actors.dataset import Layout, Record, load_dataset
from actors.engines.base import EngineError, GenerationResult, SamplingParams
from actors.engines.checkpoint import assign_weights, has_weights, iter_checkpoint_tensors, load_config, load_model
from actors.engines.lora import LoraSpec, is_adapter_name, merged_weights, resolve_start, start_tensors, target_linears
from actors.engines.model import Qwen2ForCausalLM
from actors.engines.tokenizer import load_tokenizer
from actors.evaluator.evaluation import (EvalError, EvalSettings, Generate, aevaluate_model, aevaluate_with, engine_generator,
                               level_key)
from actors.runtime.recovery import COMPLETE, FINISHED, checkpoint_dir, checkpoint_problem, complete_checkpoints, run_finished
from actors.weights import weights_hash
from topology.settings import EvaluatorSettings
from transport.bulk import PackedBucket, unpack_bucket
from transport.bus import BusError
from transport.protocol import EvalGenerate, EvalGenerated, EvalWeights, EvalWeightsRequest, RunFinished

__all__ = ["EvalActor", "EvalConfigError", "spread_over_levels", "evaluated_versions", "skipped_versions", "eval_entry",
           "skipped_entry", "missed_versions", "weights_on_disk", "catch_up", "EVAL_FILE", "answer_on_rollouts",
           "rollout_generator", "RolloutsUnavailable"]

EVAL_FILE = "eval.jsonl"
KIND = "periodic"
SKIPPED = "skipped"


class EvalConfigError(ValueError):
    """The evaluator's settings are unusable; the message names the key."""


class RolloutsUnavailable(RuntimeError):
    """No rollout answered some of an evaluation's prompts (each failed, or timed out, in turn)."""


# (rollout, request, seconds) -> its reply: the bus's request in the actor, a stand-in in tests
Ask = Callable[[str, EvalGenerate, float], Awaitable[Any]]


async def answer_on_rollouts(ask: Ask, rollouts: Sequence[str], requests: Sequence[EvalGenerate], per_rollout: int,
                             timeout_s: float) -> tuple[list[EvalGenerated], dict[str, str]]:
    """Each request answered by one of ``rollouts``, at most ``per_rollout`` in flight on one rollout. A rollout
    that fails (an error, an error reply, no reply within ``timeout_s``) is left out for the rest of the call and
    its prompt goes back to the queue for another. Returns (replies in request order, {rollout left out: why}).
    Raises EvalError when a reply says the prompt itself is invalid (no rollout can answer it), and
    RolloutsUnavailable when every rollout was left out with prompts unanswered."""
    todo = deque(range(len(requests)))
    replies: list[EvalGenerated | None] = [None] * len(requests)
    left_out: dict[str, str] = {}
    invalid: list[str] = []
    in_flight = 0
    changed = asyncio.Condition()

    def finished_for(rollout: str) -> bool:
        return rollout in left_out or bool(invalid) or (not todo and not in_flight)

    async def worker(rollout: str) -> None:
        nonlocal in_flight
        while True:
            async with changed:   # wait for a prompt, or for the prompts in flight elsewhere to settle
                await changed.wait_for(lambda: bool(todo) or finished_for(rollout))
                if finished_for(rollout):
                    return
                i = todo.popleft()
                in_flight += 1
            try:
                async with asyncio.timeout(timeout_s):
                    reply = await ask(rollout, requests[i], timeout_s)
                error = reply.error if isinstance(reply, EvalGenerated) else f"answered {type(reply).__name__}"
            except (BusError, TimeoutError) as exc:
                error = f"{type(exc).__name__}: {exc}" if str(exc) else f"no answer within {timeout_s:g} s"
            async with changed:
                in_flight -= 1
                if not error:
                    replies[i] = reply
                elif error.startswith("invalid:"):
                    invalid.append(f"prompt {i}: {error}")
                else:
                    todo.appendleft(i)
                    left_out[rollout] = error[:300]
                changed.notify_all()

    await asyncio.gather(*(worker(r) for _ in range(per_rollout) for r in rollouts))
    if invalid:
        raise EvalError(invalid[0])
    missing = [i for i, r in enumerate(replies) if r is None]
    if missing:
        raise RolloutsUnavailable(f"{len(missing)} of {len(requests)} prompts unanswered: every rollout was left "
                                  f"out ({'; '.join(f'{r}: {why}' for r, why in sorted(left_out.items())) or 'none given'})")
    return [r for r in replies if r is not None], left_out


def rollout_generator(ask: Ask, rollouts: Sequence[str], per_rollout: int, timeout_s: float,
                      answered: list[EvalGenerated]) -> Generate:
    """`actors.evaluator.evaluation.Generate` on the rollouts' engines (greedy, one answer per prompt: what they offer the
    evaluator); every reply is appended to ``answered`` (its token versions label the evaluation)."""
    async def gen(prompts: Sequence[Sequence[int]], sampling: Sequence[SamplingParams],
                  n: int) -> list[list[GenerationResult]]:
        if n != 1 or any(sp.temperature > 0 for sp in sampling):
            raise EvalError("the rollouts answer the evaluator greedily, one answer per prompt (eval samples 0)")
        requests = [EvalGenerate(prompt_ids=list(ids), max_new_tokens=sp.max_new_tokens,
                                 stop_token_ids=list(sp.stop_token_ids)) for ids, sp in zip(prompts, sampling)]
        replies, _ = await answer_on_rollouts(ask, rollouts, requests, per_rollout, timeout_s)
        answered.extend(replies)
        return [[GenerationResult(rid=f"p{i}", index=0, output_ids=r.output_ids, logprobs=r.logprobs,
                                  versions=r.versions, finish_reason=r.finish_reason,  # type: ignore[arg-type]
                                  prompt_len=len(prompts[i]))] for i, r in enumerate(replies)]
    return gen


def spread_over_levels(records: Sequence[Record], n: int) -> list[Record]:
    """The first ``n`` records taken round-robin over the levels (file order within a level), so a small
    evaluation still sees every level rather than only the first one of a file sorted by level."""
    by_level: dict[str, list[Record]] = defaultdict(list)
    for rec in records:
        by_level[level_key(rec)].append(rec)
    queues = [list(reversed(v)) for _, v in sorted(by_level.items())]
    out: list[Record] = []
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop())
    return out


def _rows(path: Path) -> Iterator[dict[str, Any]]:
    """eval.jsonl's lines as objects; a torn last line (a process killed while writing) is skipped."""
    if not path.is_file():
        return
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            yield row


def evaluated_versions(path: Path) -> set[int]:
    """Versions a previous incarnation already evaluated (periodic lines of eval.jsonl; a torn last line
    of one killed while writing is ignored, as is the launcher's final evaluation)."""
    return {row["version"] for row in _rows(path) if row.get("kind") == KIND and isinstance(row.get("version"), int)}


def skipped_versions(path: Path) -> set[int]:
    """Versions named as skipped in eval.jsonl (and not evaluated since)."""
    named = {v for row in _rows(path) if row.get("kind") == SKIPPED and isinstance(row.get("versions"), list)
             for v in row["versions"] if isinstance(v, int)}
    return named - evaluated_versions(path)


def eval_entry(version: int, newest: int, report: dict[str, Any], seconds: float, now: float,
               source: str = "param_server", version_max: int | None = None) -> dict[str, Any]:
    """One eval.jsonl line for a version's report (`actors.evaluator.evaluation.aevaluate_with`). ``source``: where its
    weights came from (the parameter server during the run, a checkpoint when caught up, or the rollouts'
    engines, whose tokens span versions ``version`` to ``version_max``)."""
    entry = {"kind": KIND, "version": version, "step": version, "time": now, "newest": newest,
             "eval/accuracy": report["overall"]["greedy_accuracy"], "eval_seconds": seconds,
             "n_prompts": report["n_prompts"], "overall": report["overall"], "by_level": report["by_level"]}
    if source != "param_server":
        entry["source"] = source
    if version_max is not None:
        entry["version_max"] = version_max
    return entry


def skipped_entry(versions: list[int], reason: str, now: float) -> dict[str, Any]:
    return {"kind": SKIPPED, "versions": versions, "reason": reason, "time": now}


def weights_on_disk(version: int, run_dir: Path, start_model: str | None) -> Path | None:
    """Where a version's weights still are: the starting model for version 0, else the model of a sound
    checkpoint of that step; None when they are gone (never checkpointed, or removed)."""
    if version == 0:
        return Path(start_model) if start_model and has_weights(start_model) else None
    ckpt = checkpoint_dir(run_dir, version)
    if (ckpt / COMPLETE).exists() and checkpoint_problem(ckpt) is None:
        return ckpt / "model"
    return None


def missed_versions(every: int, after: int, upto: int, accounted: set[int]) -> list[int]:
    """The multiples of ``every`` after ``after`` and before ``upto`` that are not yet accounted for."""
    return [v for v in range(max(after + 1, 0), upto) if v % every == 0 and v not in accounted]


def catch_up(cfg: Any, run_dir: Path, final_version: int) -> tuple[list[int], list[int]]:
    """After the run: evaluate every kept version (multiple of eval.every_versions up to ``final_version``)
    that eval.jsonl lacks, from its weights on disk, and name the rest as skipped. Returns (caught up,
    skipped). Blocking: the launcher calls it once the actors have stopped."""
    every = cfg.eval.every_versions
    path = Path(run_dir) / EVAL_FILE
    if every <= 0 or not cfg.data.test or not cfg.model.path:
        return [], []
    missing = missed_versions(every, -1, final_version + 1, evaluated_versions(path))
    if not missing:
        return [], []
    dataset = load_dataset(cfg.data.test, require="answer", on_error=cfg.data.on_bad_line or "fail",
                           layout=Layout.from_settings(cfg.data, test=True), max_bad_share=cfg.data.max_bad_share)
    records = spread_over_levels(dataset.records, cfg.eval.max_problems)
    tokenizer = load_tokenizer(cfg.model.path)
    settings = EvalSettings(samples=0, max_new_tokens=cfg.gen.max_new_tokens)
    caught, gone = [], []
    for version in missing:
        where = weights_on_disk(version, Path(run_dir), cfg.model.path)
        if where is None:
            gone.append(version)
            continue
        model = load_model(str(where))   # a LoRA checkpoint: its base with the adapter merged
        t0 = time.monotonic()
        report = asyncio.run(aevaluate_model(model, tokenizer, records, settings))
        _append(path, eval_entry(version, final_version, report, time.monotonic() - t0, time.time(), "checkpoint"))
        caught.append(version)
    if gone := [v for v in gone if v not in skipped_versions(path)]:
        _append(path, skipped_entry(gone, "the evaluator was away, and these versions' weights are no longer kept "
                                          "(not a checkpoint step, or its checkpoint was removed)", time.time()))
    return caught, gone


def _append(path: Path, entry: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


class EvalActor(Actor):
    Settings = EvaluatorSettings
    cfg: EvaluatorSettings

    def __init__(self, spec: ActorSpec) -> None:
        super().__init__(spec)
        self.tb: Any = None
        self.lora_base: dict[str, Any] = {}   # model.lora: the targeted layers' base weights

    @classmethod
    def check_settings(cls, cfg: EvaluatorSettings) -> list[str]:
        if cfg.eval.every_versions <= 0 or not cfg.data.test:
            return []   # the evaluator idles, as the launch's report says ("evaluation: none")
        out = []
        if not cfg.model.path:
            out.append("model.path: the evaluator needs the model's config and tokenizer")
        if cfg.weights_from == "rollouts" and not cfg.groups.get("rollout"):
            out.append("groups.rollout: weights_from rollouts asks the rollouts to answer, and the run has none")
        if cfg.weights_from == "param_server" and not cfg.groups.get("param_server"):
            out.append("groups.param_server: weights_from param_server takes the weights from the parameter server "
                       "(weights_from: checkpoints reads the run's checkpoints)")
        return out

    async def on_start(self) -> None:
        cfg = self.cfg
        self.every = cfg.eval.every_versions if cfg.data.test else 0   # no held-out file: nothing to evaluate
        self.wait_s = cfg.eval.wait_s
        self.path = self.run_dir / EVAL_FILE
        self.engine: Any = None
        if self.every <= 0:
            self.log.info("evaluator_off", why="data.test is not set" if not cfg.data.test else "eval.every_versions is 0")
            return
        if problems := self.check_settings(cfg):
            raise EvalConfigError("; ".join(problems))
        test, model_dir = cfg.data.test, cfg.model.path
        if cfg.weights_from == "rollouts":
            self.rollouts = list(cfg.groups["rollout"])
        if cfg.weights_from == "param_server":
            self.param_server = cfg.groups["param_server"][0]
        dataset = await asyncio.to_thread(load_dataset, test, require="answer", on_error=cfg.data.on_bad_line or "fail",
                                          layout=Layout.from_settings(cfg.data, test=True),
                                          max_bad_share=cfg.data.max_bad_share)
        self.records = spread_over_levels(dataset.records, cfg.eval.max_problems)
        self.tokenizer = load_tokenizer(model_dir)
        if cfg.weights_from == "rollouts":
            pass   # the rollouts' engines answer: nothing to load here
        elif cfg.engine == "sglang":
            from actors.engines.sglang import SGLangEngine

            # the server starts on the start weights (version 0); it is started by the evaluation loop
            self.engine = SGLangEngine.from_settings(cfg, 0, model_dir, run_dir=str(self.run_dir))
        elif cfg.model.lora is not None:   # adapter versions are merged into the base, kept aside (lora.py)
            self.model = await asyncio.to_thread(load_model, resolve_start(model_dir, cfg.model.lora.adapter)[0])
            targets = target_linears(self.model, LoraSpec.from_settings(cfg.model.lora))
            self.lora_base = {name + ".weight": m.weight.detach().clone() for name, m in targets}
        else:
            self.model = Qwen2ForCausalLM(load_config(model_dir))
        self.settings_eval = EvalSettings(samples=0, max_new_tokens=cfg.gen.max_new_tokens)
        self.done = evaluated_versions(self.path)
        self.skipped = skipped_versions(self.path)
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        except ImportError as e:
            self.log.warning("tensorboard_unavailable", error=str(e))
        self.log.info("evaluator_started", every=self.every, problems=len(self.records), data=test,
                      engine=cfg.engine, weights_from=cfg.weights_from, already_done=sorted(self.done))
        self._stop_if_finished()

    def _stop_if_finished(self) -> bool:
        """A restart can miss the trainer's RunFinished (sent while this process was down): the run's
        FINISHED mark says it instead, and the evaluator must not wait for a server that has left. The
        versions it did not evaluate are named as skipped first (the launcher evaluates those whose
        checkpoints are left, `catch_up`)."""
        if run_finished(self.run_dir):
            try:
                final = int(json.loads((self.run_dir / FINISHED).read_text())["step"])
            except (OSError, ValueError, KeyError, TypeError):
                final = -1
            missed = missed_versions(self.every, -1, final + 1, self.done | self.skipped)
            # (none evaluated: this run's weights never reach it, as with direct weights; from checkpoints, only
            # checkpoints are evaluated by design)
            if missed and self.done and self.cfg.weights_from == "param_server":
                self._skip(missed, "the run ended while the evaluator was away")
            self.request_stop("the run has finished")
            return True
        return False

    def _skip(self, versions: list[int], reason: str) -> None:
        _append(self.path, skipped_entry(versions, reason, time.time()))
        self.skipped.update(versions)
        self.log.warning("evaluations_skipped", versions=versions, reason=reason)

    def on_peer_dead(self, peer: str) -> None:
        if peer == getattr(self, "param_server", None):
            self._stop_if_finished()

    async def on_ready(self) -> None:
        if self.every > 0:
            loop = {"checkpoints": self._checkpoint_loop, "rollouts": self._rollouts_loop}.get(
                self.cfg.weights_from, self._loop)()
            self.spawn(loop, name="eval_loop")

    async def on_stop(self) -> None:
        if self.engine is not None:
            await self.engine.stop()
        if self.tb is not None:
            self.tb.close()

    @handles(RunFinished)
    def on_run_finished(self, msg: RunFinished) -> None:
        self.request_stop(f"run finished at step {msg.step}: {msg.reason}")

    async def _loop(self) -> None:
        """Fetch and evaluate kept versions until the run ends (the actor is stopped). Each request waits at
        most wait_s on the server, and a server that is away is retried after a pause of that order."""
        after = max(self.done, default=-1)
        if self.engine is not None:
            await self.engine.start()
        while not self._stop_if_finished():
            try:
                got = await self._fetch(after)
            except (BusError, TimeoutError) as exc:   # the server restarts: ask again once it is back
                self.counters["fetch_failures"] += 1
                self.log.warning("eval_weights_unavailable", error=str(exc)[:300])
                await asyncio.sleep(min(self.wait_s, 5.0))
                continue
            if isinstance(got, str):   # this run's parameter server can never give weights: say so once, idle
                self.log.error("evaluation_unavailable", why=got,
                               hint="weights_from: checkpoints evaluates the run's checkpoints instead")
                return
            if got is None:
                continue
            version, newest, named = got
            missed = missed_versions(self.every, after, version, self.done | self.skipped)
            after = version
            if version not in self.done:
                if self.engine is not None:
                    await self.engine.update_weights(version, [named])
                else:
                    await asyncio.to_thread(self._assign, named, f"eval weights v{version}")
                await self._evaluate(version, newest)
            if missed:
                await self._catch_up(missed, newest)

    async def _catch_up(self, missed: list[int], newest: int) -> None:
        """Versions passed over (the evaluator was down, or slower than N versions of training): evaluated from
        their weights on disk where those are left, named as skipped otherwise."""
        gone = []
        for version in missed:
            where = weights_on_disk(version, self.run_dir, self.cfg.model.path)
            if where is None:
                gone.append(version)
                continue
            try:
                if self.engine is not None:
                    await self.engine.update_weights_from_disk(version, str(where))
                else:
                    await asyncio.to_thread(lambda: self._assign(start_tensors(str(where))
                                                                 or list(iter_checkpoint_tensors(str(where))), str(where)))
            except Exception as exc:   # removed (keep_checkpoints) while being read: named as skipped
                self.log.warning("catch_up_weights_unreadable", version=version, path=str(where), error=str(exc)[:200])
                gone.append(version)
                continue
            await self._evaluate(version, newest, "checkpoint")
        if gone:
            self._skip(gone, "passed over (the evaluator was away or slower than eval.every_versions versions of "
                             "training), and their weights are no longer kept")

    async def _evaluate(self, version: int, newest: int, source: str = "param_server") -> None:
        """Evaluate the weights loaded as `version` and record it (``source``: see `eval_entry`)."""
        t0 = time.monotonic()
        if self.engine is not None:
            report = await aevaluate_with(engine_generator(self.engine), self.tokenizer, self.records,
                                          self.settings_eval)
        else:
            report = await aevaluate_model(self.model, self.tokenizer, self.records, self.settings_eval)
        self._write(eval_entry(version, newest, report, time.monotonic() - t0, time.time(), source))
        self.done.add(version)

    def _next_checkpoint(self) -> tuple[int, Path, int] | None:
        """(step, model directory, newest complete step) of the checkpoint to evaluate next: the newest complete,
        sound one at least `every` versions after the last evaluated (the ones in between are skipped, as the
        parameter server's kept versions are); None when there is none yet."""
        found = complete_checkpoints(self.run_dir)
        last = max(self.done, default=None)
        for step, path in found:
            if step in self.done or (last is not None and step < last + self.every):
                continue
            if checkpoint_problem(path) is None:
                return step, path / "model", found[0][0]
        return None

    async def _checkpoint_loop(self) -> None:
        """Evaluate the start weights, then the run's checkpoints as they appear, until the run ends."""
        if self.engine is not None:
            await self.engine.start()   # on the start weights: version 0
        if 0 not in self.done:
            if self.engine is None:
                self.model = await asyncio.to_thread(load_model, self.cfg.model.path)
            await self._evaluate(0, 0)
        while not self._stop_if_finished():
            todo = self._next_checkpoint()
            if todo is None:
                await asyncio.sleep(self.wait_s)   # checkpoints are files on a shared disk: looked for every wait_s
                continue
            step, model_dir, newest = todo
            try:
                if self.engine is not None:
                    await self.engine.update_weights_from_disk(step, str(model_dir))
                else:
                    self.model = await asyncio.to_thread(load_model, str(model_dir))
            except (EngineError, OSError, ValueError) as exc:   # rotated away meanwhile (run.keep_checkpoints)
                self.counters["checkpoint_load_failures"] += 1
                self.log.warning("eval_checkpoint_unreadable", step=step, path=str(model_dir), error=str(exc)[:300])
                self.done.add(step)   # not again; the next one will do
                continue
            await self._evaluate(step, newest)

    async def _ask(self, rollout: str, request: EvalGenerate, timeout_s: float) -> Any:
        return await self.bus.request(rollout, request, timeout=timeout_s)

    async def _rollout_versions(self) -> dict[str, int]:
        """{rollout: its engine's version} of the rollouts that answer within wait_s (the others are left out)."""
        timeout = min(self.wait_s, self.cfg.rollout_timeout_s)

        async def version(rollout: str) -> int | None:
            try:
                reply = await self._ask(rollout, EvalGenerate(), timeout)
            except (BusError, TimeoutError):
                return None
            return reply.version if isinstance(reply, EvalGenerated) and not reply.error else None
        found = await asyncio.gather(*(version(r) for r in self.rollouts))
        return {r: v for r, v in zip(self.rollouts, found) if v is not None}

    async def _rollouts_loop(self) -> None:
        """Evaluate on the rollouts' engines whenever their newest version reaches the next multiple of N (the first
        at once), looking every wait_s, until the run ends."""
        due = (max(self.done) // self.every + 1) * self.every if self.done else 0
        cfg = self.cfg
        while not self._stop_if_finished():
            versions = await self._rollout_versions()
            if not versions or max(versions.values()) < due:
                await asyncio.sleep(self.wait_s)   # the rollouts are asked for their version every wait_s
                continue
            live = sorted(versions, key=lambda r: (versions[r], r), reverse=True)   # the newest weights first
            answered: list[EvalGenerated] = []
            generate = rollout_generator(self._ask, live, cfg.rollout_concurrency, cfg.rollout_timeout_s, answered)
            t0 = time.monotonic()
            try:
                report = await aevaluate_with(generate, self.tokenizer, self.records, self.settings_eval)
            except RolloutsUnavailable as exc:
                self.counters["evaluations_failed"] += 1
                self.log.warning("evaluation_failed", due=due, error=str(exc)[:500])
                await asyncio.sleep(self.wait_s)
                continue
            except EvalError as exc:   # a prompt no engine can take (longer than its context): say so once, idle
                self.log.error("evaluation_unavailable", why=str(exc)[:500],
                               hint="data.test's prompts must fit the rollouts' context")
                return
            tokens = [v for r in answered for v in r.versions] or [max(versions.values())]
            low, high = min(tokens), max(tokens)
            newest = max([r.version for r in answered] + list(versions.values()))
            self._write(eval_entry(low, newest, report, time.monotonic() - t0, time.time(), "rollouts", high))
            self.done.add(low)
            due = (low // self.every + 1) * self.every

    def _assign(self, named: list[tuple[str, Any]], source: str) -> None:
        """Put a version's tensors into the model: full weights, or a LoRA adapter merged into the kept base."""
        if named and all(is_adapter_name(name) for name, _ in named):
            scaling = LoraSpec.from_settings(self.cfg.model.lora).scaling if self.cfg.model.lora else 0.0
            named = list(merged_weights(self.lora_base, dict(named), scaling).items())
            assign_weights(self.model, named, False, source)
        else:
            assign_weights(self.model, named, True, source)

    async def _fetch(self, after: int) -> tuple[int, int, list[tuple[str, Any]]] | str | None:
        """The newest kept version after ``after``: (version, server's newest, its named tensors), None when
        there was none within wait_s or it was replaced while being fetched, or why the server can never give
        one."""
        first = await self.bus.request(self.param_server, EvalWeightsRequest(after=after, timeout_s=self.wait_s),
                                       timeout=self.wait_s + 30)
        if not isinstance(first, EvalWeights):
            raise BusError(f"{self.param_server} answered {type(first).__name__} to an eval weights request")
        if first.unavailable:
            return first.unavailable
        if first.version < 0:
            return None
        replies = [first]
        for b in range(1, first.n_buckets):
            reply = await self.bus.request(self.param_server, EvalWeightsRequest(version=first.version, bucket=b),
                                           timeout=60)
            if not isinstance(reply, EvalWeights) or reply.version != first.version:
                self.counters["replaced_while_fetching"] += 1
                return None
            replies.append(reply)
        named = await asyncio.to_thread(
            lambda: [kv for r in replies for kv in unpack_bucket(PackedBucket(r.header, r.flat), "eval")])
        digest = await asyncio.to_thread(weights_hash, named)
        if digest != first.weights_hash:   # a transfer error must not become a plotted accuracy
            self.counters["hash_mismatches"] += 1
            self.log.error("eval_weights_hash_mismatch", version=first.version, got=digest,
                           expected=first.weights_hash)
            return None
        return first.version, first.newest, named

    def _write(self, entry: dict[str, Any]) -> None:
        _append(self.path, entry)
        if self.tb is not None:
            self.tb.add_scalar("eval/accuracy", entry["eval/accuracy"], entry["version"])
            for level, summary in entry["by_level"].items():
                self.tb.add_scalar(f"eval/accuracy_L{level}", summary["greedy_accuracy"], entry["version"])
            self.tb.flush()
        self.log.info("evaluated", version=entry["version"], version_max=entry.get("version_max", entry["version"]),
                      accuracy=round(entry["eval/accuracy"], 4),
                      newest=entry["newest"], seconds=round(entry["eval_seconds"], 3), problems=entry["n_prompts"])
