"""Evaluation during the run (actors/evaluator/actor.py): its bookkeeping, and a short run through the real launcher
in which the evaluator is frozen and then killed while training goes on."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from actors.dataset import Record
from actors.engines.base import SamplingParams
from actors.evaluator.evaluation import EvalError
from actors.evaluator.actor import (EVAL_FILE, RolloutsUnavailable, answer_on_rollouts, eval_entry, evaluated_versions,
                              rollout_generator, skipped_versions, spread_over_levels, weights_on_disk)
from actors.param_server.eval_store import kept_for_eval
from tools.bench.chaos import finish_run, launch, make_assets, ready_info, run_guard, step_records, wait_for_step
from testsupport.bounded import run_bounded
from tools.plot import _plot_evals, eval_accuracy, plot_run
from transport.bus import RequestTimeout
from transport.protocol import EvalGenerate, EvalGenerated

STEPS, EVERY = 24, 2


def _rec(i: int, level: int | None) -> Record:
    return Record(query_id=f"q{i}", prompt=f"p{i}", answer="1", level=level)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One dataset and model for the module's runs (each writes only to its own run directory)."""
    return make_assets(tmp_path_factory.mktemp("eval-assets"), train_per_level=40)


def test_problems_are_spread_over_the_levels_in_file_order() -> None:
    records = [_rec(i, 1) for i in range(5)] + [_rec(10 + i, 2) for i in range(2)] + [_rec(20 + i, 3) for i in range(5)]
    picked = spread_over_levels(records, 7)
    assert [r.query_id for r in picked] == ["q0", "q10", "q20", "q1", "q11", "q21", "q2"]
    assert len(spread_over_levels(records, 100)) == len(records)   # fewer than asked: all of them
    assert [r.query_id for r in spread_over_levels([_rec(0, None), _rec(1, None)], 1)] == ["q0"]


def test_kept_versions_are_the_multiples_and_zero_is_off() -> None:
    assert [v for v in range(9) if kept_for_eval(v, 3)] == [0, 3, 6]
    assert not any(kept_for_eval(v, 0) for v in range(9))


def test_a_restarted_evaluator_knows_what_it_evaluated(tmp_path: Path) -> None:
    path = tmp_path / EVAL_FILE
    assert evaluated_versions(path) == set()
    report = {"n_prompts": 3, "overall": {"n": 3, "greedy_accuracy": 2 / 3},
              "by_level": {"1": {"n": 2, "greedy_accuracy": 1.0}, "2": {"n": 1, "greedy_accuracy": 0.0}}}
    lines = [json.dumps(eval_entry(v, v + 3, report, 0.5, 100.0 + v)) for v in (0, 4)]
    final = json.dumps({"model": "final", "step": 8, "overall": report["overall"], "by_level": report["by_level"]})
    path.write_text("\n".join([*lines, final, '{"kind": "periodic", "version": 8, "st']))   # torn by a kill
    assert evaluated_versions(path) == {0, 4}
    entry = json.loads(lines[1])
    assert entry["eval/accuracy"] == pytest.approx(2 / 3) and entry["step"] == 4 and entry["newest"] == 7
    assert eval_accuracy(entry) == (pytest.approx(2 / 3), {"1": 1.0, "2": 0.0})   # what tools.plot reads


def periodic(run_dir: Path) -> list[dict]:
    path = run_dir / EVAL_FILE
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [r for r in rows if r.get("kind") == "periodic"]


def wait_for_evals(proc: subprocess.Popen, run_dir: Path, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(periodic(run_dir)) < n:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"fewer than {n} periodic evaluations written"
        time.sleep(0.2)   # polling a file another process writes


def test_a_run_evaluates_every_n_versions_without_waiting_for_the_evaluator(assets: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch(assets, run_dir, steps=STEPS, ckpt_every=8,
                  extra=(f"experiment.eval.every_versions={EVERY}", "experiment.eval.max_problems=12"))
    with run_guard(proc, run_dir):
        wait_for_evals(proc, run_dir, 3)
        pid = int(ready_info(run_dir, "evaluator")["pid"])
        os.kill(pid, signal.SIGSTOP)
        frozen_at = max((r["step"] for r in step_records(run_dir)), default=0)
        # Training goes on while the evaluator cannot run at all ...
        wait_for_step(proc, run_dir, frozen_at + 3)
        # ... and after it is killed; the supervisor restarts it and it takes up from where it was (or, if the
        # run ended meanwhile, sees the run's FINISHED mark and leaves).
        os.kill(pid, signal.SIGKILL)
        out = finish_run(proc, run_dir, timeout=300)
        assert proc.returncode == 0, out[-4000:]
    restarts = {line.split()[0]: int(line.split()[-1]) for line in out.splitlines()
                if line.split()[:1] == ["evaluator"]}
    assert restarts == {"evaluator": 1}, out[-3000:]
    steps = [r["step"] for r in step_records(run_dir)]
    assert sorted(set(steps)) == list(range(1, STEPS + 1))
    evals = periodic(run_dir)
    versions = [e["version"] for e in evals]
    assert len(versions) == len(set(versions)), versions          # no version evaluated twice across the restart
    assert len(versions) >= 3 and all(v % EVERY == 0 for v in versions), versions
    assert all(v <= frozen_at for v in versions[:3]), (versions, frozen_at)
    started = [json.loads(line) for line in (run_dir / "logs" / "evaluator.jsonl").read_text().splitlines()]
    started = [e for e in started if e.get("event") == "evaluator_started"]
    # restarted (the supervisor does not restart it if the run ended during its backoff)
    assert len(started) in (1, 2), started
    if len(started) == 2:
        assert set(versions[:3]) <= set(started[1]["already_done"]), started
    for e in evals:
        assert e["n_prompts"] == 12 and 0.0 <= e["eval/accuracy"] <= 1.0
        assert set(e["by_level"]) == {"1", "2", "3"}
        assert e["newest"] >= e["version"]
    # Every kept version is evaluated, caught up from its checkpoint, or named as skipped (its weights gone):
    # the versions passed over while the evaluator was frozen left a silent gap in the curve.
    skipped = skipped_versions(run_dir / EVAL_FILE)
    assert set(range(0, STEPS + 1, EVERY)) <= set(versions) | skipped, (versions, skipped)
    assert not [v for v in skipped if weights_on_disk(v, run_dir, str(assets["model"])) is not None], skipped
    written, notes = plot_run(run_dir)
    assert run_dir / "plots" / "reward.png" in written
    assert not [n for n in notes if EVAL_FILE in n], notes
    # the periodic points are a series of their own on the accuracy panel, one point per evaluated version
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    rows = step_records(run_dir)
    assert _plot_evals(ax, evals, rows, "time", min(r["time"] for r in rows), []) == 1
    (line,) = [ln for ln in ax.get_lines() if "during the run" in str(ln.get_label())]
    assert list(line.get_ydata()) == [e["eval/accuracy"] for e in evals]
    plt.close(fig)


def test_a_gpu_style_evaluator_reads_checkpoints_into_its_own_sglang_server(assets: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    # engine: sglang with weights_from: checkpoints, as a GPU run has it (its direct weights keep no copy in the
    # parameter server): the stand-in server answers, each checkpoint is loaded into it from disk.
    import sys

    run_dir = tmp_path / "run"
    steps, every = 12, 2
    proc = launch(assets, run_dir, steps=steps, ckpt_every=every, extra=(
        f"experiment.eval.every_versions={every}", "experiment.eval.max_problems=6", "experiment.eval.wait_s=0.5",
        "actors.evaluator.settings.engine=sglang", "actors.evaluator.settings.weights_from=checkpoints",
        f"actors.evaluator.settings.sglang.command=[{sys.executable}, -m, testsupport.sglang_standin]",
        # and AReaL's prompt-length cap: the buffer leaves the longer prompts out of training
        "experiment.data.max_prompt_tokens=9"))
    with run_guard(proc, run_dir):
        wait_for_step(proc, run_dir, 4)
        # training held (the trainer frozen) until the evaluator's server is up and has read a checkpoint: the run
        # must not end before the evaluator starts, whatever the machine's load
        trainer = int(ready_info(run_dir, "trainer")["pid"])
        os.kill(trainer, signal.SIGSTOP)
        try:
            wait_for_evals(proc, run_dir, 2)
        finally:
            os.kill(trainer, signal.SIGCONT)
        out = finish_run(proc, run_dir, timeout=300)
        assert proc.returncode == 0, out[-4000:]
    evals = periodic(run_dir)
    versions = [e["version"] for e in evals]
    assert versions[0] == 0 and len(versions) == len(set(versions)) >= 2, versions
    assert all(v % every == 0 and v <= steps for v in versions), versions
    assert all(e["n_prompts"] == 6 and e["newest"] >= e["version"] for e in evals)
    started = [json.loads(line) for line in (run_dir / "logs" / "evaluator.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "evaluator_started" and e.get("engine") == "sglang" for e in started)
    log = (run_dir / "logs" / "evaluator.0.sglang.log").read_text()
    assert log.count("update_weights_from_disk") >= len(versions) - 1, log[-2000:]   # each checkpoint via the server
    buffer = [json.loads(line) for line in (run_dir / "logs" / "buffer.jsonl").read_text().splitlines()]
    capped = [e for e in buffer if e.get("event") == "prompts_over_length_left_out"]
    started = [e for e in buffer if e.get("event") == "buffer_started"]
    assert capped and capped[0]["max_prompt_tokens"] == 9 and capped[0]["prompts"] > 0, capped
    assert started[0]["prompts"] == capped[0]["kept"] == 120 - capped[0]["prompts"]


class Rollouts:
    """Stand-in rollouts for `answer_on_rollouts`: "ok.*" answer (echoing the prompt, at their version), "dead.*"
    fail at once as the bus does for a peer that is gone, "hung.*" never answer; the most prompts each held at once
    is recorded."""

    def __init__(self, version: int = 7) -> None:
        self.version = version
        self.held: dict[str, int] = {}
        self.most: dict[str, int] = {}
        self.answered: dict[str, list[int]] = {}
        self.release = asyncio.Event()

    async def ask(self, rollout: str, request: EvalGenerate, timeout_s: float) -> EvalGenerated:
        self.held[rollout] = self.held.get(rollout, 0) + 1
        self.most[rollout] = max(self.most.get(rollout, 0), self.held[rollout])
        try:
            if rollout.startswith("dead"):
                raise RequestTimeout(f"no reply from {rollout}")
            if rollout.startswith("hung"):
                await asyncio.Event().wait()
            if rollout.startswith("invalid"):
                return EvalGenerated(version=self.version, error="invalid: prompt longer than the context")
            await asyncio.sleep(0)   # let the other workers take their prompts
            self.answered.setdefault(rollout, []).append(request.prompt_ids[0])
            return EvalGenerated(version=self.version, output_ids=list(request.prompt_ids), logprobs=[-0.5],
                                 versions=[self.version, self.version + 1], finish_reason="stop")
        finally:
            self.held[rollout] -= 1


def _requests(n: int) -> list[EvalGenerate]:
    return [EvalGenerate(prompt_ids=[i], max_new_tokens=4) for i in range(n)]


def test_prompts_are_spread_over_the_rollouts_a_few_at_a_time() -> None:
    fake = Rollouts()

    async def main() -> None:
        replies, left_out = await answer_on_rollouts(fake.ask, ["ok.0", "ok.1", "ok.2"], _requests(20), 2, 5.0)
        assert [r.output_ids for r in replies] == [[i] for i in range(20)]   # in request order
        assert left_out == {}
        assert fake.most == {"ok.0": 2, "ok.1": 2, "ok.2": 2}   # bounded, and every rollout took its share
        assert sorted(p for got in fake.answered.values() for p in got) == list(range(20))

    run_bounded(main(), timeout=30)


def test_a_dead_or_hung_rollout_never_holds_the_evaluation_its_prompts_go_to_another() -> None:
    fake = Rollouts()

    async def main() -> None:
        replies, left_out = await answer_on_rollouts(fake.ask, ["hung.0", "dead.1", "ok.2"], _requests(6), 1, 0.3)
        assert [r.output_ids for r in replies] == [[i] for i in range(6)]
        assert set(left_out) == {"hung.0", "dead.1"} and "no reply from dead.1" in left_out["dead.1"]
        assert "no answer within 0.3 s" in left_out["hung.0"]
        assert sorted(fake.answered["ok.2"]) == list(range(6))
        with pytest.raises(RolloutsUnavailable, match=r"6 of 6 prompts unanswered: every rollout was left out "
                                                      r"\(dead.1: RequestTimeout: no reply from dead.1; hung.0: no answer within 0.3 s\)"):
            await answer_on_rollouts(fake.ask, ["hung.0", "dead.1"], _requests(6), 2, 0.3)
        with pytest.raises(EvalError, match="invalid: prompt longer than the context"):   # no rollout can answer it
            await answer_on_rollouts(fake.ask, ["invalid.0", "ok.1"], _requests(3), 1, 5.0)

    run_bounded(main(), timeout=30)


def test_the_rollout_generator_answers_greedily_and_keeps_the_replies_for_their_versions() -> None:
    fake = Rollouts(version=3)
    answered: list[EvalGenerated] = []
    gen = rollout_generator(fake.ask, ["ok.0"], 2, 5.0, answered)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, stop_token_ids=(2,))

    async def main() -> None:
        results = await gen([[5], [6]], [greedy, greedy], 1)
        assert [r[0].output_ids for r in results] == [[5], [6]] and results[0][0].versions == [3, 4]
        assert len(answered) == 2
        with pytest.raises(EvalError, match="greedily, one answer per prompt"):
            await gen([[5]], [SamplingParams(temperature=1.0, max_new_tokens=4)], 1)

    run_bounded(main(), timeout=30)


def test_a_run_evaluates_on_the_rollouts_engines_labelled_with_the_versions_of_their_tokens(assets: dict[str, Path],
                                                                                            tmp_path: Path) -> None:
    # weights_from: rollouts, as the shipped GPU topologies have it, here on the embedded engines of the CPU run
    run_dir = tmp_path / "run"
    steps, every = 8, 2
    proc = launch(assets, run_dir, steps=steps, ckpt_every=steps, extra=(
        f"experiment.eval.every_versions={every}", "experiment.eval.max_problems=6", "experiment.eval.wait_s=0.3",
        "actors.evaluator.settings.weights_from=rollouts", "experiment.run.final_eval=false"))
    with run_guard(proc, run_dir):
        out = finish_run(proc, run_dir, timeout=300)
        assert proc.returncode == 0, out[-4000:]
    assert "in evaluator: answered greedily by the rollouts' own engines" in out
    evals = periodic(run_dir)
    assert evals, (run_dir / "logs" / "evaluator.jsonl").read_text()[-3000:]
    # the first evaluation is on the weights the rollouts hold when it first looks (the start weights unless a
    # loaded machine started the evaluator after training had begun), without waiting for a multiple of N
    assert evals[0]["version"] <= evals[0]["newest"]
    for e in evals:
        assert e["source"] == "rollouts" and e["n_prompts"] == 6 and 0.0 <= e["eval/accuracy"] <= 1.0
        assert 0 <= e["version"] <= e["version_max"] <= e["newest"] <= steps, e
    lows = [e["version"] for e in evals]
    # one evaluation per multiple of N reached: each after the first starts at or beyond the next multiple
    assert all(b >= (a // every + 1) * every for a, b in zip(lows, lows[1:])), lows
    rollouts = [json.loads(line) for name in ("rollout.0", "rollout.1")
                for line in (run_dir / "logs" / f"{name}.jsonl").read_text().splitlines()]
    # the answers came from the rollouts' engines (their counters, logged as they stop)
    answered = sum(e.get("counters", {}).get("eval_prompts_answered", 0) for e in rollouts
                   if e.get("event") == "stopped")
    assert answered >= 6 * len(evals), answered
