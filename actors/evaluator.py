"""EvalActor: held-out accuracy during the run, every ``eval.every_versions`` versions, on that version's weights.

Training never waits for it. It is an actor of its own that nobody sends work to: it asks the parameter
server for the newest version kept for evaluation (every multiple of N, the start version included:
`actors.param_server.kept_for_eval`), bucket by bucket on the bus (:class:`EvalWeightsRequest`), checks the
weights hash against the one the server computed, and answers the first ``eval.max_problems`` problems
of ``data.test`` (spread over the levels) greedily with the embedded engine. Grading and statistics are
`actors.evaluation`'s, the same code as ``tools.eval`` and the launcher's final evaluation. When an
evaluation takes longer than N versions of training, the versions in between are skipped, not queued:
the next one evaluated is the newest kept.

Each evaluation appends one line to ``RUN_DIR/eval.jsonl`` (read by ``tools.plot``) and writes
``eval/accuracy`` (and ``eval/accuracy_L<level>``) at step = version to the run's TensorBoard directory::

    {"kind": "periodic", "version": V, "step": V, "time": ..., "eval/accuracy": 0.6, "newest": 23,
     "eval_seconds": 1.2, "overall": {...}, "by_level": {...}, "n_prompts": 64}

``newest`` is the newest version the parameter server held when the weights were fetched (training's lead).
A restarted evaluator (the supervisor restarts it like any actor) reads the file and does not evaluate a
version twice. Settings: ``eval.every_versions`` (0: off, the actor idles), ``eval.max_problems``
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
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from actors.base import Actor, ActorSpec, handles
from actors.dataset import Layout, Record, load_dataset
from actors.engines.base import EngineError
from actors.engines.checkpoint import assign_weights, load_config, load_model
from actors.engines.model import Qwen2ForCausalLM
from actors.engines.tokenizer import load_tokenizer
from actors.evaluation import EvalSettings, aevaluate_model, aevaluate_with, engine_generator, level_key
from actors.recovery import checkpoint_problem, complete_checkpoints, run_finished
from actors.weights import weights_hash
from topology.settings import EvaluatorSettings
from transport.bulk import PackedBucket, unpack_bucket
from transport.bus import BusError
from transport.protocol import EvalWeights, EvalWeightsRequest, RunFinished

__all__ = ["EvalActor", "EvalConfigError", "spread_over_levels", "evaluated_versions", "eval_entry", "EVAL_FILE"]

EVAL_FILE = "eval.jsonl"
KIND = "periodic"


class EvalConfigError(ValueError):
    """The evaluator's settings are unusable; the message names the key."""


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


def evaluated_versions(path: Path) -> set[int]:
    """Versions a previous incarnation already evaluated (periodic lines of eval.jsonl; a torn last line
    of one killed while writing is ignored, as is the launcher's final evaluation)."""
    if not path.is_file():
        return set()
    done = set()
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("kind") == KIND and isinstance(row.get("version"), int):
            done.add(row["version"])
    return done


def eval_entry(version: int, newest: int, report: dict[str, Any], seconds: float, now: float) -> dict[str, Any]:
    """One eval.jsonl line for a version's report (`actors.evaluation.aevaluate_with`)."""
    return {"kind": KIND, "version": version, "step": version, "time": now, "newest": newest,
            "eval/accuracy": report["overall"]["greedy_accuracy"], "eval_seconds": seconds,
            "n_prompts": report["n_prompts"], "overall": report["overall"], "by_level": report["by_level"]}


class EvalActor(Actor):
    Settings = EvaluatorSettings
    cfg: EvaluatorSettings

    def __init__(self, spec: ActorSpec) -> None:
        super().__init__(spec)
        self.tb: Any = None

    async def on_start(self) -> None:
        cfg = self.cfg
        self.every = cfg.eval.every_versions
        self.wait_s = cfg.eval.wait_s
        self.path = self.run_dir / EVAL_FILE
        self.engine: Any = None
        if self.every <= 0:
            self.log.info("evaluator_off", why="eval.every_versions is 0")
            return
        test, model_dir = cfg.data.test, cfg.model.path
        if not test:
            raise EvalConfigError("data.test: eval.every_versions > 0 needs a held-out file")
        if not model_dir:
            raise EvalConfigError("model.path: the evaluator needs the model's config and tokenizer")
        if cfg.weights_from == "param_server":
            servers = cfg.groups.get("param_server") or []
            if not servers:
                raise EvalConfigError("groups.param_server: weights_from param_server takes the weights from the "
                                      "parameter server (weights_from: checkpoints reads the run's checkpoints)")
            self.param_server = servers[0]
        dataset = await asyncio.to_thread(load_dataset, test, require="answer", on_error=cfg.data.on_bad_line or "fail",
                                          layout=Layout.from_settings(cfg.data, test=True))
        self.records = spread_over_levels(dataset.records, cfg.eval.max_problems)
        self.tokenizer = load_tokenizer(model_dir)
        if cfg.engine == "sglang":
            from actors.engines.sglang import SGLangEngine

            # the server starts on the start weights (version 0); it is started by the evaluation loop
            self.engine = SGLangEngine.from_settings(cfg, 0, model_dir, run_dir=str(self.run_dir))
        else:
            self.model = Qwen2ForCausalLM(load_config(model_dir))
        self.settings_eval = EvalSettings(samples=0, max_new_tokens=cfg.gen.max_new_tokens)
        self.done = evaluated_versions(self.path)
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
        FINISHED mark says it instead, and the evaluator must not wait for a server that has left."""
        if run_finished(self.run_dir):
            self.request_stop("the run has finished")
            return True
        return False

    def on_peer_dead(self, peer: str) -> None:
        if peer == getattr(self, "param_server", None):
            self._stop_if_finished()

    async def on_ready(self) -> None:
        if self.every > 0:
            loop = self._checkpoint_loop() if self.cfg.weights_from == "checkpoints" else self._loop()
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
            after = version
            if version in self.done:
                continue
            if self.engine is not None:
                await self.engine.update_weights(version, [named])
            else:
                await asyncio.to_thread(assign_weights, self.model, named, True, f"eval weights v{version}")
            await self._evaluate(version, newest)

    async def _evaluate(self, version: int, newest: int) -> None:
        """Evaluate the weights loaded as `version` and record it."""
        t0 = time.monotonic()
        if self.engine is not None:
            report = await aevaluate_with(engine_generator(self.engine), self.tokenizer, self.records,
                                          self.settings_eval)
        else:
            report = await aevaluate_model(self.model, self.tokenizer, self.records, self.settings_eval)
        self._write(eval_entry(version, newest, report, time.monotonic() - t0, time.time()))
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
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
        if self.tb is not None:
            self.tb.add_scalar("eval/accuracy", entry["eval/accuracy"], entry["version"])
            for level, summary in entry["by_level"].items():
                self.tb.add_scalar(f"eval/accuracy_L{level}", summary["greedy_accuracy"], entry["version"])
            self.tb.flush()
        self.log.info("evaluated", version=entry["version"], accuracy=round(entry["eval/accuracy"], 4),
                      newest=entry["newest"], seconds=round(entry["eval_seconds"], 3), problems=entry["n_prompts"])
