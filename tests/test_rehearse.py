"""tools.rehearse: the scaled layout, the cost-model engine the stand-in servers serve, the figures read back
from a run and their comparison with the simulation, and one tiny rehearsal through the node agents."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from pathlib import Path

import pytest

from actors.engines.base import GenerationRequest, SamplingParams
from actors.engines.sglang import sglang_rid
from launch.plan import sizing
from testsupport.bounded import run_bounded
from tools.plan import setup, sim
from tools.rehearse import rehearsal
from tools.rehearse.costs import RehearsalCosts
from tools.rehearse.engine import CostModelEngine, answer_identity
import topology as topo_mod


@pytest.fixture(scope="module")
def sim_64_16() -> sim.SimConfig:
    full = topo_mod.load("topology/64node.yaml", [], check_imports=False)
    layout = rehearsal.scaled_layout(full, 1 / 16)
    plan = topo_mod.load("topology/64node.yaml", rehearsal.simulated_overrides(layout, 31744))
    return setup.sim_config(sizing.read(plan), steps=4, seed=0)


def test_scale_keeps_each_node_s_fan_out_and_scales_nodes_gpus_and_batch() -> None:
    full = topo_mod.load("topology/64node.yaml", [], check_imports=False)
    layout = rehearsal.scaled_layout(full, rehearsal.parse_scale("1/16"))
    assert (layout.rollout_nodes, layout.rollouts, layout.rewards) == (3, 12, 3)
    assert layout.trainer_gpus == 8 and layout.trainer_parallel == {"dp": 2, "tp": 4, "pp": 1}
    assert layout.batch_size == 32 and layout.trainer_nodes == 1
    with pytest.raises(Exception, match="must be in"):
        rehearsal.parse_scale("2")


def test_the_cost_file_round_trips_and_draws_the_same_length_for_every_submission(sim_64_16, tmp_path) -> None:
    costs = RehearsalCosts(sim_64_16, 30.0, 32, {3: 10.0}, (5,))
    back = RehearsalCosts.load(costs.write(tmp_path / "rehearsal.json"))
    assert back.to_json() == costs.to_json()
    assert back.answer_tokens("g7/3") == costs.answer_tokens("g7/3")
    first, again = answer_identity(sglang_rid("0-12/7", 3, 0)), answer_identity(sglang_rid("0-12/7", 3, 2))
    assert first == again and first[2] and first[:2] != answer_identity(sglang_rid("0-12/7", 4, 0))[:2]
    assert not answer_identity("HEALTH_CHECK_1.5")[2]
    with pytest.raises(ValueError, match="not a rehearsal cost file"):
        RehearsalCosts.load(tmp_path / "missing.json")


def _engine(cfg: sim.SimConfig, clock: list[float], k: int = 32) -> CostModelEngine:
    costs = RehearsalCosts(dataclasses.replace(cfg, lengths={"kind": "fixed", "tokens": 3200}), 30.0, k)
    return CostModelEngine(costs, 0, clock=lambda: clock[0])


def test_an_answer_takes_the_modelled_decode_steps_and_carries_one_token_per_k(sim_64_16) -> None:
    clock = [0.0]
    engine = _engine(sim_64_16, clock)
    sampling = SamplingParams(max_new_tokens=engine.max_new_seen, stop_token_ids=(2,))

    async def go() -> None:
        task = asyncio.ensure_future(engine.generate(GenerationRequest(sglang_rid("g0", 0, 0), (5, 6, 7), sampling)))
        await asyncio.sleep(0)
        # A lone answer of 3,200 modelled tokens: its prefill, then 3,200 decode steps of the 7B at tp 2.
        cost = engine.costs.decode_cost(1)
        prompt = engine.costs.sim.prompt_tokens
        modelled = engine.costs.prefill_seconds(prompt, prompt ** 2) + cost.steps(prompt, 1, 3200)
        clock[0] = modelled * 0.999 / 30
        engine._advance()
        assert not task.done()
        clock[0] = modelled * 1.001 / 30
        engine._advance()
        await asyncio.sleep(0)
        [result] = task.result()
        assert result.finish_reason == "stop" and len(result.output_ids) == 3200 // 32
        assert result.output_ids[-1] == 2

    run_bounded(go(), timeout=10)


def test_an_aborted_answer_returns_its_tokens_so_far_and_its_resubmission_ends_at_the_same_length(sim_64_16) -> None:
    clock = [0.0]
    engine = _engine(sim_64_16, clock)
    k = 32

    async def go() -> None:
        full = SamplingParams(max_new_tokens=engine.max_new_seen, stop_token_ids=(2,))
        task = asyncio.ensure_future(engine.generate(GenerationRequest(sglang_rid("g1", 0, 0), (5,), full)))
        await asyncio.sleep(0)
        clock[0] = 20.0 / 30   # 20 modelled seconds: part of the answer
        engine._advance()
        assert await engine.abort(None) == 1
        [first] = await task
        assert first.finish_reason == "abort" and 0 < len(first.output_ids) < 3200 // k
        so_far = len(first.output_ids)
        rest = SamplingParams(max_new_tokens=engine.max_new_seen - so_far, stop_token_ids=(2,))
        task = asyncio.ensure_future(engine.generate(GenerationRequest(sglang_rid("g1", 0, 1), (5,) + (3,) * so_far, rest)))
        await asyncio.sleep(0)
        clock[0] = 10_000.0 / 30
        engine._advance()
        await asyncio.sleep(0)
        [second] = task.result()
        assert second.finish_reason == "stop" and so_far + len(second.output_ids) == 3200 // k

    run_bounded(go(), timeout=10)


def _metrics(steps: int) -> list[dict]:
    return [{"step": s, "time": 100.0 + 4.0 * s, "step_seconds": 4.0, "wait_seconds": 1.0 if s > 1 else 3.0,
             "train_seconds": 2.5, "weight_sync_seconds": 0.5, "n_tokens": 1000.0, "n_seqs": 10.0,
             "reissued": 2 * s, "dropped_stale": s, "rollout_utilisation": 0.9} for s in range(1, steps + 1)]


def test_the_rehearsal_s_figures_are_the_simulation_s_in_modelled_seconds_and_tokens() -> None:
    metrics = _metrics(5)
    ledger = [{"event": "batch", "step": s, "version": s - 1, "start_versions": [s - 1, s - 3]} for s in range(1, 6)]
    ledger.append({"event": "dropped_uniform", "key": [0, 1]})
    f = rehearsal.measured_figures(metrics, ledger, time_scale=30.0, token_scale=32, prompt_tokens=100)
    assert f["step_time_s"] == pytest.approx(4.0 * 30)
    assert f["effective_throughput_tok_s"] == pytest.approx((1000 * 32 + 10 * 100) / 120)
    assert f["trainer_wait_share"] == pytest.approx(0.25)
    assert f["rollout_busy_share"] == pytest.approx(0.9)
    assert f["staleness_mean"] == pytest.approx(1.0)          # (0 + 2) / 2 for every measured step
    assert f["reissued_per_step"] == pytest.approx(3.0) and f["dropped_stale_per_step"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="more than 1"):
        rehearsal.measured_figures(metrics[:1], ledger, time_scale=30.0, token_scale=32, prompt_tokens=100)


def test_the_trainer_s_wait_is_split_by_the_buffer_s_lines_and_the_serve_s_stretch_is_its_own(tmp_path: Path) -> None:
    # Where the trainer's wait went, from the buffer's batch_served lines of the measured steps (step 1 is warm-up);
    # the machine's stretch of the serve is its CPU plus its wait for a core over its CPU, never below 1.
    metrics = _metrics(3)
    (tmp_path / "logs").mkdir()
    lines = [{"event": "batch_served", "step": s, "waited_for_groups_s": 0.1 * s, "serve_s": 0.2 * s,
              "serve_cpu_s": 0.02 * s, "serve_core_wait_s": 0.1 * s} for s in (1, 2, 3)]
    (tmp_path / "logs" / "buffer.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [{"event": "other"}, *lines]))
    served = rehearsal.batches_served(tmp_path, rehearsal.measured_steps(metrics))
    w = rehearsal.trainer_wait(metrics, served)
    assert w["wait_s"] == pytest.approx(sum(m["wait_seconds"] for m in metrics[1:]) / 2)
    assert w["buffer_waited_for_groups_s"] == pytest.approx(0.25) and w["buffer_serve_s"] == pytest.approx(0.5)
    assert w["buffer_serve_cpu_s"] == pytest.approx(0.05) and w["buffer_serve_core_wait_s"] == pytest.approx(0.25)
    assert rehearsal.serve_stretch(served) == pytest.approx(6.0)       # (0.1 + 0.5) / 0.1
    # a kernel that gives no wait: the serve's elapsed over its CPU, the disk's wait included
    blind = [{**e, "serve_core_wait_s": None} for e in served]
    assert rehearsal.serve_stretch(blind) == pytest.approx(10.0)        # 1.0 / 0.1
    assert "buffer_serve_core_wait_s" not in rehearsal.trainer_wait(metrics, blind)
    # an idle machine never shrinks the serve, and a buffer that logs no CPU leaves it as modelled
    assert rehearsal.serve_stretch([{**e, "serve_core_wait_s": 0.0, "serve_s": 0.01} for e in served]) == 1.0
    assert rehearsal.serve_stretch([{"serve_s": 0.5}]) == 1.0 and rehearsal.serve_stretch([]) == 1.0


def test_agreement_is_within_15_percent_figure_by_figure() -> None:
    measured = rehearsal.measured_figures(_metrics(4), [], time_scale=10.0, token_scale=1, prompt_tokens=0)
    same = sim.agreement(dict(measured), measured)
    assert same["all_agree"] and all(r["ratio"] == pytest.approx(1.0) for r in same["rows"].values())
    off = sim.agreement({**measured, "step_time_s": measured["step_time_s"] * 1.2}, measured)
    assert not off["all_agree"] and not off["rows"]["step_time_s"]["agrees"]
    assert off["rows"]["step_time_s"]["ratio"] == pytest.approx(1.2)
    report = {"topology": "t", "scale": 0.25, "time_scale": 10.0, "token_scale": 1, "fault": "none", "steps": 4,
              "trained_steps": 4, "wall_s": 1.0, "actors": 5, "fake_nodes": 2, "processes_peak": 9,
              "rss_peak_bytes": 0, "pss_peak_bytes": 0, "agreement": off, "stopped": None,
              "time_shares": {"rehearsal": {"trainer": {}, "rollout": {}}, "simulation": {"trainer": {}, "rollout": {}}},
              "decisions": {"reissued": 0, "handed_back": 0, "dropped_stale": 0, "overdue_groups": 0,
                            "aborted_requests": 0, "retractions": 0, "groups_per_server": {"mean": 1.0, "max": 1}},
              "ledger": {"issued": 4, "trained": 4, "dropped": 0, "pending": 0, "lost": 0, "twice": 0}}
    report["ok"] = rehearsal.ok(report)
    assert not report["ok"]
    text = rehearsal.render(report)
    assert "step_time_s" in text and "NO" in text and "largest deviation 20.0 %" in text


def test_a_tiny_rehearsal_runs_the_real_actors_through_the_node_agents(tmp_path: Path) -> None:
    """One rollout with its stand-in server, one reward actor, the trainer, buffer, parameter server and the
    topology's evaluator (idle: the rehearsal evaluates nothing) on two fake nodes, two steps of short answers: every step trained, nothing lost or trained twice, the same figures
    on both sides (their values are timings of a shared machine: not asserted)."""
    opts = rehearsal.Options("topology/64node.yaml", ["actors.rollout.count=48", "experiment.gen.max_new_tokens=2048"],
                             1 / 48, 200.0, 32, 2, "none", 3, 0, tmp_path / "run", 240.0, 60.0, False)
    r = rehearsal.rehearse(opts)
    assert r["trained_steps"] == 2 and r["actors"] == 6 and r["fake_nodes"] == 2, r.get("stopped")
    assert r["ledger"]["lost"] == 0 and r["ledger"]["twice"] == 0
    assert set(r["measured"]) == set(r["simulated"]) and r["processes_peak"] >= 7
    assert all(row["ratio"] is None or math.isfinite(row["ratio"]) for row in r["agreement"]["rows"].values())
    # the buffer's serve logs its CPU and its wait for a core, and the simulation's serve is stretched by them
    wait = r["trainer_wait"]
    assert wait["buffer_serve_cpu_s"] > 0 and wait["buffer_serve_core_wait_s"] >= 0 and r["serve_stretch"] >= 1
    assert json.loads((tmp_path / "run" / "rehearsal-report.json").read_text())["trained_steps"] == 2
    # the rehearsal's timeline and its simulation's, in one format (tools.trace)
    from tools.trace.timeline import format_problems
    for which in ("rehearsal", "simulation"):
        doc = json.loads(Path(r["traces"][which]).read_text())
        assert format_problems(doc) == [], which
        assert sum(1 for e in doc["traceEvents"] if e["ph"] == "X" and e["name"].startswith("step ")) == 2, which
