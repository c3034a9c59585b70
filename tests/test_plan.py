"""tools.plan: the memory fit per GPU (and tools.up --dry-run's refusal) and the run's simulation."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from actors.engines.model import Qwen2Config, Qwen2ForCausalLM, param_count
from launch.plan import memory, sizing
from launch.plan.shapes import BUILTIN, ShapeError, from_hf_config, resolve
from tools import up
from tools.plan import setup
import topology

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = sorted((ROOT / "topology").glob("*.yaml"))


def test_shape_from_a_hugging_face_config_counts_the_model_s_parameters():
    path = ROOT / "configs/models/arith-tiny/config.json"
    shape = from_hf_config(path)
    model = Qwen2ForCausalLM(Qwen2Config.from_dict(json.loads(path.read_text())))
    assert shape.params == param_count(model)


def test_builtin_shapes_match_the_published_parameter_counts():
    # Model cards: 1.78B, 7.62B and 32.8B parameters.
    assert [round(BUILTIN[k].params / 1e9, 2) for k in ("1.5B", "7B", "32B")] == [1.78, 7.62, 32.76]
    assert resolve("/storage/models/DeepSeek-R1-Distill-Qwen-7B") is BUILTIN["7B"]


def test_a_model_without_a_shape_is_an_error_naming_model_path():
    with pytest.raises(ShapeError, match="experiment.model.path: '/nowhere/mystery'"):
        resolve("/nowhere/mystery")


def _dry_run(capsys, *overrides: str) -> tuple[int, str]:
    rc = up.main(["topology/64node.yaml", *overrides, "--dry-run", "--no-import-check"])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_dry_run_refuses_7b_at_32k_without_recompute_and_accepts_it_with_recompute(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    # Without sequence parallelism (with it, no recompute comes to 69 GB and fits: the kept buckets, 30 GB,
    # live in host memory).
    rc, text = _dry_run(capsys, "actors.trainer.settings.recompute=none", "actors.trainer.settings.sequence_parallel=false")
    assert rc == up.EXIT_INVALID
    assert "actors.trainer: needs" in text and "largest term: activations" in text
    rc, text = _dry_run(capsys, "actors.trainer.settings.recompute=full", "actors.trainer.settings.sequence_parallel=false")
    assert rc == up.EXIT_OK, text
    assert "memory per GPU" in text and "DOES NOT FIT" not in text


def _trainer_rows(text: str) -> str:
    table = text[text.index("memory per GPU"):]
    return table[table.index("  trainer "):table.index("\n\n")]


def test_the_dry_run_counts_the_publish_transient_the_kept_host_memory_and_with_kl_the_reference(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc, text = _dry_run(capsys)
    assert rc == up.EXIT_OK, text
    rows = _trainer_rows(text)
    # 6 buckets of 64 MiB while a version streams to host memory, not two copies of the weights (30 GB)
    assert "publish transient 0.4" in rows and "reference model" not in rows, rows
    assert "published buckets: 30.5 GB of page-locked host memory (kept versions)" in rows, rows
    rc, with_kl = _dry_run(capsys, "experiment.algo.kl_coef=0.001")
    assert rc == up.EXIT_OK, with_kl
    rows_kl = _trainer_rows(with_kl)
    assert "reference model 11.7" in rows_kl, rows_kl
    total = lambda rows: float(rows.split("/")[0].split()[-1])   # noqa: E731
    assert total(rows_kl) == pytest.approx(total(rows) + 11.7, abs=0.11)
    rc, capped = _dry_run(capsys, "actors.trainer.settings.weights_kept_mb=20000")
    assert "published buckets: 21.0 GB" in _trainer_rows(capped)   # 20,000 MiB: more than one version (15.2 GB)


def test_the_reference_model_is_a_whole_engine_and_the_publish_transient_a_few_buckets():
    shape = BUILTIN["7B"]
    lay = memory.TrainerLayout(tp=4, dp=32, micro_batch_tokens=8192)
    base = memory.trainer_terms(shape, lay)
    ref = memory.trainer_terms(shape, memory.TrainerLayout(**{**lay.__dict__, "reference": True}))
    rank_params = base["weights"] / 2
    assert ref["reference model"] == pytest.approx(rank_params * (2 + 4 + 4 / 32))
    assert base["publish transient"] == memory.PUBLISH_BUCKETS_ON_GPU * (64 << 20)
    # a tiny model publishes at most twice its weights, whatever the bucket size
    tiny = memory.trainer_terms(BUILTIN["1.5B"], memory.TrainerLayout(bucket_bytes=1 << 40))
    assert tiny["publish transient"] <= 2 * tiny["weights"] * 2
    direct = memory.TrainerLayout(tp=4, keeps_weights=True)
    assert memory.kept_bytes(shape, direct) == 2 * memory.kept_bytes(shape, memory.TrainerLayout(tp=4))
    small_cap = memory.TrainerLayout(tp=4, keeps_weights=True, kept_bytes=1)
    assert memory.kept_bytes(shape, small_cap) == memory.kept_bytes(shape, memory.TrainerLayout(tp=4))


def test_the_log_prob_chunk_bounds_the_float32_logits_term():
    shape = BUILTIN["7B"]
    whole = memory.trainer_terms(shape, memory.TrainerLayout(tp=4, micro_batch_tokens=32768))["logits"]
    chunked = memory.trainer_terms(shape, memory.TrainerLayout(tp=4, micro_batch_tokens=32768,
                                                               logprob_chunk_tokens=4096))["logits"]
    bf16_logits = 2 * 2 * 32768 * shape.vocab / 4
    assert chunked - bf16_logits == pytest.approx((whole - bf16_logits) / 8)


def test_sequence_parallelism_and_pipeline_stages_change_the_activation_term_as_they_should():
    shape = BUILTIN["7B"]
    base = memory.TrainerLayout(tp=4, micro_batch_tokens=8192)
    act = lambda **kw: memory.trainer_terms(shape, memory.TrainerLayout(**{**base.__dict__, **kw}))["activations"]
    shared, split = memory.activation_elements_per_token(shape)
    assert act() - act(sequence_parallel=True) == pytest.approx(2 * 8192 * shared * (1 - 1 / 4) * shape.layers)
    # pp=2: half the layers per stage, two micro-batches in flight (1F1B) on the first stage.
    assert act(pp=2) == pytest.approx(act())


def test_a_kv_cache_too_small_for_one_answer_is_named():
    lay = memory.RolloutLayout(tp=1, mem_fraction_static=0.2, answer_tokens=32768)
    m = memory.rollout_memory("rollout", BUILTIN["7B"], lay, 80e9)
    assert not m.fits and m.answers_at_once == 0
    assert "actors.rollout: the KV cache holds" in m.problem()


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.stem)
def test_every_shipped_topology_plans_and_its_gpu_groups_fit(path):
    found = sizing.read(topology.load(path, check_imports=False))
    groups = sizing.group_memory(found)
    gpu_groups = [g for g in found.groups if g.device == "cuda"]
    assert len(groups) == len(gpu_groups)
    for m in groups:
        assert m.fits, m.problem()


# --- simulation ---------------------------------------------------------------------------------------
from actors.buffer.state import BufferState  # noqa: E402
from launch.plan import hardware  # noqa: E402
from tools.plan import costs, engines, microbench, sim  # noqa: E402


def _config(**kw) -> sim.SimConfig:
    base = dict(shape=BUILTIN["1.5B"], gpu=hardware.GPUS["H800"], gpus_per_node=8, servers=2, server_tp=1,
                trainer=costs.TrainerShape(tp=1, pp=1, dp=1, micro_batch_tokens=4096, minibatches=1,
                                           recompute="full", gpus_per_node=8),
                batch_size=2, group_size=2, eta=0, max_new_tokens=1000, max_groups_per_rollout=2,
                kv_tokens_per_server=1 << 20, lengths={"kind": "fixed", "tokens": 100}, prompt_tokens=10,
                reward_latency_s=1.0, steps=3)
    return sim.SimConfig(**{**base, **kw})


def test_fixed_lengths_and_eta_0_give_the_synchronous_step_time_exactly():
    cfg = _config()
    r = sim.simulate(cfg)
    shape, gpu = cfg.shape, cfg.gpu
    # the buffer puts one group on each server: one prefill of its prompt, then 100 steps of 2 answers
    prefill = costs.prefill_seconds(shape, gpu, 1, 10, 10 ** 2)
    decode = costs.decode_cost(shape, gpu, 1, 2).steps(2 * 10, 2, 100)
    train = costs.train_step_seconds(shape, gpu, cfg.trainer, [110] * 4, [0, 0, 1, 1])
    weights = costs.weight_sync(shape, gpu, 1, 1, 8, across_nodes=True)
    serve = cfg.serve.seconds(4 * 100)   # the buffer serves the batch: its 4 answers of 100 tokens
    expected = prefill + decode + cfg.reward_latency_s + serve + train + weights.export_s + weights.push_s
    assert r.step_time == pytest.approx(expected, rel=1e-12)
    assert [s.end for s in r.steps] == pytest.approx([expected, 2 * expected, 3 * expected], rel=1e-12)
    assert r.staleness == {0: 1.0}
    assert r.summary()["wait_weights_s"] == pytest.approx(weights.push_s)
    # identical steps: no spread, no drift between the halves of the measured steps
    st = r.stability()
    assert st["steps"] == 2 and st["step_min_over_mean"] == pytest.approx(1) == st["step_max_over_mean"]
    assert st["drift"] == pytest.approx(0, abs=1e-12)


def test_the_buffer_s_serve_of_each_batch_is_time_the_trainer_waits():
    # The trainer has a batch once the buffer has served it (converted, written and sent it), which costs per
    # batch and per answer token as tools.bench serve measures; a synchronous step pays it in full.
    free = sim.simulate(_config(serve=sim.ServeCost(0.0, 0.0)))
    cost = sim.ServeCost(per_batch_s=0.5, per_token_s=1e-3)
    paid = sim.simulate(_config(serve=cost))
    served = cost.seconds(4 * 100)                                    # 2 groups of 2 answers of 100 tokens
    assert paid.step_time - free.step_time == pytest.approx(served, rel=1e-9)
    assert paid.summary()["wait_batch_s"] == pytest.approx(free.summary()["wait_batch_s"] + served, rel=1e-9)
    assert paid.shares()["trainer"]["wait_batch"] == pytest.approx(
        paid.summary()["wait_batch_s"] / paid.step_time, rel=1e-9)
    assert sim.ServeCost(2.0, 4.0).scaled(15.0, 32) == sim.ServeCost(30.0, 15.0 * 4.0 / 32)


def test_the_evaluator_s_prompts_run_on_the_rollouts_every_n_versions_at_most_k_on_one():
    # eval.every_versions 2 over 8 steps: versions 0, 2, 4 and 6 are evaluated, each with 3 greedy answers sent to
    # the rollouts at most 1 at a time on one (the second server takes the next), beside the groups; the
    # 64-node topology's evaluator (weights_from: rollouts) gives the simulation its settings.
    base = sim.simulate(_config(eta=2, steps=8))
    cfg = _config(eta=2, steps=8, eval_every=2, eval_prompts=3, eval_per_rollout=1)
    r = sim.simulate(cfg)
    assert base.counters["evaluations"] == 0 and r.counters["evaluations"] == 4
    assert 3 * 3 <= r.counters["eval_answers"] <= 4 * 3 and r.counters["eval_answer_tokens"] == 100 * r.counters["eval_answers"]
    assert r.counters["inflight_per_server"]["running_requests_peak"]["max"] <= 2 * 2 + 1
    assert r.step_time >= base.step_time
    found = setup.sim_config(sizing.read(topology.load(ROOT / "topology/64node.yaml", check_imports=False)))
    assert (found.eval_every, found.eval_prompts, found.eval_per_rollout) == (10, 30, 2)
    assert setup.sim_config(sizing.read(topology.load(ROOT / "topology/64node.yaml", ["experiment.eval.every_versions=0"],
                                                     check_imports=False))).eval_every == 0


def test_a_change_to_the_buffer_s_rules_shows_in_the_plan(monkeypatch):
    # One server, two groups a batch, eta 0: after each update the buffer gives a rollout whose newest answers
    # are older than the gate allows one group at a time (BufferState.rollout_cap), so the server generates
    # the batch's two groups one after the other. The simulation has no rule of its own: change the buffer's
    # and the plan follows.
    cfg = _config(servers=1)
    real = sim.simulate(cfg)
    assert real.counters["inflight_groups_per_rollout"]["max"] == 2      # the first batch, before any update
    monkeypatch.setattr(BufferState, "rollout_cap", lambda self, rollout: self.max_per_rollout)
    relaxed = sim.simulate(cfg)
    one_group = costs.prefill_seconds(cfg.shape, cfg.gpu, 1, 10, 100) + \
        costs.decode_cost(cfg.shape, cfg.gpu, 1, 2).steps(20, 2, 100) + cfg.reward_latency_s
    assert real.step_time - relaxed.step_time == pytest.approx(one_group, rel=0.05)
    assert real.counters["inflight_groups_per_rollout"]["mean"] < relaxed.counters["inflight_groups_per_rollout"]["mean"]


def test_an_overdue_group_s_running_copy_is_aborted_before_it_is_issued_again(monkeypatch):
    # group_timeout_s shorter than the longest groups' generation: BufferState.overdue marks them, the simulation
    # aborts their copy on the server (as the buffer actor has the rollout do) and hands them back, and they
    # are issued again. The aborts show in the counters, no copy's result comes back late, and a rule that
    # never finds a group overdue makes them vanish.
    cfg = _config(servers=1, eta=2, group_timeout_s=3.0, max_new_tokens=1000, steps=4,
                  lengths={"kind": "lognormal", "mean_tokens_at_cut": 300, "cut_share": 0.1, "cut": 1000})
    r = sim.simulate(cfg)
    c = r.counters
    assert c["expired"] > 0 and c["reissued"] >= c["expired"]
    assert 0 < c["aborted_before_reissue"] <= c["expired"]
    assert c["aborted_before_reissue"] <= c["aborted_requests"] <= cfg.group_size * c["aborted_before_reissue"]
    assert c["measured"]["aborted_before_reissue"] <= c["aborted_before_reissue"]
    monkeypatch.setattr(BufferState, "overdue", lambda self, now: {})
    quiet = sim.simulate(cfg).counters
    assert quiet["expired"] == quiet["aborted_before_reissue"] == quiet["aborted_requests"] == 0


def test_areal_s_dispatch_never_aborts_or_issues_again_a_group_however_long_it_runs():
    # AReaL sets no timeout on a generation that would issue it again (v0.2 posts /generate with no total
    # timeout and waits for the whole batch), so the published rows' dispatch finds no group overdue, even
    # where the buffer's own timeout (here a fixed 3 s, under the longest groups' generation) would abort
    # and re-issue them. Each group is generated once.
    from tools.plan import published
    cfg = _config(servers=1, eta=2, group_timeout_s=3.0, max_new_tokens=1000, steps=4,
                  lengths={"kind": "lognormal", "mean_tokens_at_cut": 300, "cut_share": 0.1, "cut": 1000})
    ours = sim.simulate(dataclasses.replace(cfg, buffer_rules=BufferState)).counters
    assert ours["expired"] > 0 and ours["aborted_before_reissue"] > 0
    areal = sim.simulate(dataclasses.replace(cfg, buffer_rules=published.AReaLDispatch)).counters
    assert areal["expired"] == areal["aborted_before_reissue"] == areal["aborted_requests"] == 0
    assert areal["reissued"] == areal["late_groups"] == 0
    assert areal["issued"] < ours["issued"]


def test_a_timeout_shorter_than_every_group_is_reported_as_a_run_without_progress():
    cfg = _config(servers=1, eta=2, group_timeout_s=1.0, stall_s=600.0, lengths={"kind": "fixed", "tokens": 800})
    with pytest.raises(RuntimeError, match=r"no training step in 600 s .* buffer\.group_timeout_s"):
        sim.simulate(cfg)


def test_stale_groups_are_dropped_by_the_buffer_s_batch_time_check(monkeypatch):
    # eta 1 and a push (0.26 s) far longer than a training step (3 ms): groups the gate lets in are begun on
    # weights two versions behind by the time a batch takes them. The buffer's drop_stale drops and re-issues
    # them, so nothing staler than eta is trained; without that check, staler samples would be.
    cfg = _config(servers=2, eta=1, batch_size=2, max_groups_per_rollout=4, steps=8,
                  lengths={"kind": "fixed", "tokens": 5})
    r = sim.simulate(cfg)
    assert r.counters["dropped_stale"] > 0 and r.counters["reissued"] >= r.counters["dropped_stale"]
    assert max(r.staleness) <= 1
    monkeypatch.setattr(BufferState, "drop_stale", lambda self: [])
    unchecked = sim.simulate(cfg)
    assert unchecked.counters["dropped_stale"] == 0 and max(unchecked.staleness) > 1


def test_decode_steps_sum_in_closed_form_as_step_by_step():
    c = costs.decode_cost(BUILTIN["7B"], hardware.GPUS["H800"], 2, 128)
    for kv0, n, j in [(1e6, 128, 1000), (0, 128, 3000), (5e7, 1, 10), (3e6, 256, 777)]:
        assert c.steps(kv0, n, j) == pytest.approx(sum(c.step(kv0 + i * n) for i in range(j)), rel=1e-9)


def test_a_decode_step_pays_its_layers_fixed_cost_and_the_tensor_parallel_all_reduces():
    shape, gpu = BUILTIN["7B"], hardware.GPUS["H800"]
    bw = gpu.hbm_bytes_per_s * hardware.HBM_EFFICIENCY
    alone = costs.decode_cost(shape, gpu, 1, 1).step(0)
    weights = (shape.params * 2 + shape.vocab * 4 * costs.SAMPLER_PASSES) / bw
    assert alone == pytest.approx(weights + shape.layers * hardware.DECODE_FIXED_PER_LAYER_S, rel=1e-9)
    # the roofline alone would make a lone answer's step 1.7x too fast (the tail of a synchronous step)
    assert alone / weights > 1.6
    tp2 = costs.decode_cost(shape, gpu, 2, 64).step(0)
    reduce = 2 * shape.layers * costs.allreduce_seconds(gpu, 2, 64 * shape.hidden * 2)
    assert reduce > 2 * shape.layers * hardware.TP_ALLREDUCE_LATENCY_S
    assert tp2 == pytest.approx(shape.layers * hardware.DECODE_FIXED_PER_LAYER_S + reduce +
                                (shape.params * 2 / 2 + 64 * shape.vocab * 4 * costs.SAMPLER_PASSES / 2) / bw)


def test_a_kl_penalty_costs_each_replica_a_reference_pass_over_the_whole_batch():
    # actors/trainer/step.py: with kl_coef > 0 every data-parallel rank computes the reference log-probs of every
    # sequence, so the pass does not shrink with dp
    shape, gpu = BUILTIN["7B"], hardware.GPUS["H800"]
    lengths, groups = [4000] * 64, [i // 16 for i in range(64)]
    for dp in (1, 8):
        lay = costs.TrainerShape(tp=4, pp=1, dp=dp, micro_batch_tokens=32768, minibatches=1, recompute="full",
                                 gpus_per_node=8)
        extra = costs.train_step_seconds(shape, gpu, dataclasses.replace(lay, reference=True), lengths, groups) - \
            costs.train_step_seconds(shape, gpu, lay, lengths, groups)
        assert extra == pytest.approx(costs.forward_flops(shape, 64 * 4000, 64 * 4000 ** 2) /
                                      (gpu.bf16_flops * hardware.TRAIN_MFU * 4))


def test_the_decode_constants_are_the_published_microbenchmark_s_fit():
    fit = microbench.fit()
    assert (hardware.HBM_EFFICIENCY, hardware.DECODE_FIXED_PER_LAYER_S, hardware.TP_ALLREDUCE_LATENCY_S) == \
        (fit.hbm_efficiency, fit.per_layer_s, fit.allreduce_s)
    assert 0.85 < fit.hbm_efficiency < 1 and 50e-6 < fit.per_layer_s < 200e-6 and 5e-6 < fit.allreduce_s < 50e-6
    assert fit.max_rel_error < 0.12
    # the Qwen2.5 shapes give their model cards' parameter counts
    assert [round(microbench.QWEN25[k].params / 1e9, 2) for k in ("0.5B", "1.5B", "7B", "14B", "72B")] == \
        [0.49, 1.54, 7.62, 14.77, 72.71]


@pytest.mark.parametrize("row", microbench.CHECK_ROWS, ids=lambda r: f"{r.model}-{r.prompt}-tp{r.gpus}")
def test_the_cost_model_predicts_the_microbenchmark_s_long_prompt_rows(row):
    # Not fitted: a prompt's prefill at the training utilisation, then 2048 decode steps reading a KV cache
    # that grows from the prompt, on an A100.
    shape, gpu = microbench.QWEN25[row.model], hardware.GPUS["A100"]
    prefill = costs.prefill_seconds(shape, gpu, row.gpus, row.prompt, row.prompt ** 2)
    decode = costs.decode_cost(shape, gpu, row.gpus, 1).steps(row.prompt, 1, microbench.OUTPUT_TOKENS)
    assert (prefill + decode) / row.seconds == pytest.approx(1, abs=0.15)


def test_sglang_admits_under_new_token_ratio_and_marks_the_batch_full():
    # SGLang 0.5.6 PrefillAdder: running requests reserve min(max_new - out, 4096) * new_token_ratio; a new one
    # needs its prompt + min(max_new, 4096) below what is left; the first that does not fit stops admission
    # until the batch shrinks.
    cost = costs.DecodeCost(1e-3, 0.0, 0.0, 0.0)
    done: list[int] = []
    d = engines.Device(0, engines.SGLangAdmission(pool=20_000, max_running=100), lambda n, e: cost,
                       lambda t, sq, k: 0.0, lambda dev, r, t: done.append(r.aid))
    reqs = [engines.Req(aid=i, group=i, engine="rollout.0", prompt=100, origin=100, max_new=8000, left=50 + 10 * i)
            for i in range(6)]
    d.submit(reqs)
    # in one round each admitted request reserves its full 100 + 4096: four fit under 20,000, the fifth not
    assert d.n == 4 and len(d.waiting) == 2 and d.batch_full
    d.advance(d.t + 1e-3 * 50)   # 50 steps: the first request finishes, the batch shrinks, admission runs
    assert done == [0]
    # what the server held: four answers for the 50 steps, five once the first had finished, six waiting at most
    assert d.batch_area == pytest.approx(4 * 50 * 1e-3)
    assert (d.counters["max_running"], d.counters["max_waiting"]) == (5, 6)
    ratio = engines.INIT_NEW_TOKEN_RATIO - 50 * engines.NEW_TOKEN_RATIO_DECAY
    assert d.new_token_ratio() == pytest.approx(ratio)
    # then three run with 100 + 50 tokens each and reserve ratio x 4096 each (not 4096): what is left takes
    # both waiting requests (4,196 each), which a fourth 4,196 would not have fitted beside
    rem = 20_000 - 3 * 150 - ratio * 3 * 4096
    assert 2 * 4196 < rem < 3 * 4196
    assert d.n == 5 and not d.waiting


def test_sglang_retracts_the_fewest_output_first_when_the_pool_overflows():
    cost = costs.DecodeCost(1e-3, 0.0, 0.0, 0.0)
    d = engines.Device(0, engines.SGLangAdmission(pool=2_700, max_running=100), lambda n, e: cost,
                       lambda t, sq, k: 0.0, lambda dev, r, t: None)
    # admitted ten steps apart, under new_token_ratio < 1: together they may grow past the pool
    for i, prompt in enumerate([100, 150, 50]):
        d.submit([engines.Req(aid=i, group=i, engine="rollout.0", prompt=prompt, origin=prompt, max_new=1000,
                              left=1000)])
        if i < 2:
            d.advance(d.t + 1e-3 * 10)
    assert d.n == 3 and d.used() == 120 + 160 + 50
    # each step needs one free token per request: the pool is short after (2700 - 330 - 3) // 3 + 1 steps
    steps = d.steps_to_stop()
    assert steps == (2700 - 330 - 3) // 3 + 1
    d.advance(d.t + 1e-3 * steps)
    # the youngest (fewest output tokens) went back to the queue with its tokens kept
    assert sorted(d.running) == [0, 1] and [r.aid for r in d.waiting] == [2]
    assert d.waiting[0].out0 == steps and d.counters["retractions"] == 1
    # new_token_ratio = (tokens decoded + 20 x requests left) / (their max_new_tokens + 1)
    assert d.new_token_ratio() == pytest.approx((20 + steps + 10 + steps + 20 * 2) / (2 * 1000 + 1))


def test_the_embedded_engine_admits_whole_groups_per_engine_within_its_rows():
    # actors/engines/torch_gen.py _take_waiting: whole groups, while the engine's rows stay within max_running;
    # two engines time-sharing one core admit independently
    cost = costs.DecodeCost(1e-3, 0.0, 0.0, 0.0)
    d = engines.Device(0, engines.EmbeddedAdmission(max_running=4), lambda n, e: cost, lambda t, sq, k: 0.0,
                       lambda dev, r, t: None)

    def group(g: int, engine: str, left: int = 10) -> list[engines.Req]:
        return [engines.Req(aid=10 * g + i, group=g, engine=engine, prompt=5, origin=5, max_new=50, left=left)
                for i in range(2)]
    d.submit(group(0, "rollout.0") + group(1, "rollout.0") + group(2, "rollout.0"))
    assert d.engines_busy == {"rollout.0": 4} and len(d.waiting) == 2     # the third group waits for rows
    d.submit(group(3, "rollout.1"))
    assert d.engines_busy["rollout.1"] == 2                               # the other engine takes its own
    d.advance(d.t + 1e-3 * 10)                                            # rows finish: the waiting group joins
    assert d.engines_busy["rollout.0"] == 2 and not d.waiting


def test_the_push_policy_forms_once_pushes_what_is_behind_and_coalesces(monkeypatch):
    from actors.param_server.push_policy import Form, Idle, Push, PushPolicy, Wait
    from transport.protocol import RolloutWeights
    p = PushPolicy(rollouts={"a": RolloutWeights(hello=True), "b": RolloutWeights()})
    # before the first formation a starting rollout is waited for until a version waits for those that said
    # hello (a server still starting joins late)
    assert p.next_action(0.0, -1, lambda n: False) == Wait(no_hello=["b"], dead=[])
    assert p.next_action(0.0, 1, lambda n: False) == Form(["a"])
    p.rollouts["b"].hello = True
    assert p.next_action(0.0, 1, lambda n: False) == Form(["a", "b"])
    p.formation_done(p.begin_formation(), ["a", "b"])
    assert p.next_action(0.0, 1, lambda n: False) == Push(1, ["a", "b"])
    assert p.next_action(0.0, 1, lambda n: True) == Idle()      # both still receiving
    assert PushPolicy.takes(3, 2) and not PushPolicy.takes(2, 2)
    p.member_changed()
    assert isinstance(p.next_action(0.0, 1, lambda n: False), Form)
    # in the simulation, versions offered while a push runs are pushed once it ends, only the newest
    cfg = _config(servers=1, eta=4, batch_size=1, group_size=2, max_groups_per_rollout=8, steps=6,
                  lengths={"kind": "fixed", "tokens": 5})
    r = sim.simulate(cfg)
    assert r.counters["pushes"] <= len(r.steps)


@pytest.mark.parametrize("servers,dp", [(1, 8), (8, 1)], ids=["rollout-bound", "trainer-bound"])
def test_throughput_never_exceeds_the_slower_side_s_rate(servers, dp):
    cfg = _config(servers=servers, eta=2, batch_size=8, group_size=4, max_groups_per_rollout=4, steps=5,
                  trainer=costs.TrainerShape(tp=1, pp=1, dp=dp, micro_batch_tokens=4096, minibatches=1,
                                             recompute="full", gpus_per_node=8))
    r = sim.simulate(cfg)
    tokens = cfg.batch_size * cfg.group_size * 110
    trainer_rate = tokens / (r.measured[0].train_s + r.measured[0].export_s)
    n = cfg.max_groups_per_rollout * cfg.group_size   # the fullest batch a server runs, at its smallest KV
    rollout_rate = cfg.servers * n * 110 / (100 * costs.decode_cost(cfg.shape, cfg.gpu, 1, n).step(n * 10))
    assert r.throughput <= min(trainer_rate, rollout_rate) * (1 + 1e-9)
    assert max(r.staleness) <= cfg.eta


def test_lognormal_lengths_have_the_cited_mean_and_tail_share():
    mu, sigma = sim.lognormal_for(7692, 0.125, 16384)
    x = np.random.default_rng(0).lognormal(mu, sigma, 400_000)
    assert np.mean(x > 16384) == pytest.approx(0.125, abs=0.003)
    assert np.minimum(x, 16384).mean() == pytest.approx(7692, rel=0.01)
    # cut at 27,648 instead: under 5 % cut, as AReaL's v0.2 notes report for their 27K runs
    assert np.mean(x > 27648) < 0.05


def test_each_built_in_size_draws_the_answer_lengths_of_its_own_source():
    from tools.plan import published
    drawn = {}
    for size in published.LAYOUTS:     # AReaL's sizes (the built-in Qwen3-30B-A3B has no AReaL layout)
        cfg = setup.sim_config(published.cluster(size, 16, 16))
        assert cfg.lengths == sim.LENGTHS_BY_SIZE[size], size
        drawn[size] = cfg.draw_lengths(np.random.default_rng(0), 200_000).mean()
    # the 1.5B answers shorter than the 7B (AReaL's v0.1 1.5B curve against the 7B log); the 32B has no
    # published figure and keeps the 7B's distribution
    assert drawn["1.5B"] == pytest.approx(6948, rel=0.01)
    assert drawn["7B"] == pytest.approx(8491, rel=0.01)
    assert drawn["32B"] == drawn["7B"]


def test_the_1_5b_lengths_have_the_curve_s_mean_at_its_cut_and_the_7b_s_spread():
    spec = sim.LENGTHS_BY_SIZE["1.5B"]
    # AReaL v0.1 blog, Figure 1: mean response length 6,870 over the 24K stage (steps 358-436)
    assert (spec["mean_tokens_at_cut"], spec["cut"]) == (6870, 24576)
    assert spec["sigma"] == pytest.approx(sim.lognormal_for(7692, 0.125, 16384)[1])
    x = np.random.default_rng(0).lognormal(sim.lognormal_mu_for(6870, spec["sigma"], 24576), spec["sigma"], 400_000)
    assert np.minimum(x, 24576).mean() == pytest.approx(6870, rel=0.01)
    assert np.mean(x > 27648) < 0.05      # AReaL's v0.2 notes: under 5 % cut at 27K


def test_a_shape_read_from_a_config_gets_its_size_s_lengths_and_any_other_model_the_7b_s(tmp_path):
    from launch.plan.shapes import builtin_size
    s = BUILTIN["1.5B"]
    cfg = {"num_hidden_layers": s.layers, "hidden_size": s.hidden, "intermediate_size": s.intermediate,
           "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "vocab_size": s.vocab}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert builtin_size(from_hf_config(tmp_path / "config.json")) == "1.5B"
    assert sim.lengths_for(from_hf_config(tmp_path / "config.json")) == sim.LENGTHS_BY_SIZE["1.5B"]
    tiny = from_hf_config(ROOT / "configs/models/arith-tiny/config.json")
    assert builtin_size(tiny) is None and sim.lengths_for(tiny) == sim.DEFAULT_LENGTHS


def test_a_lengths_spec_without_its_fields_is_an_error_naming_them():
    with pytest.raises(ValueError, match="either cut_share or sigma"):
        _config(lengths={"kind": "lognormal", "mean_tokens_at_cut": 300, "cut": 1000}).draw_lengths(
            np.random.default_rng(0), 4)
    with pytest.raises(ValueError, match="must lie between 0 and the cut 1000"):
        sim.lognormal_mu_for(1200, 0.8, 1000)


def test_tools_plan_prints_memory_and_the_comparison_for_a_gpu_topology(capsys, monkeypatch):
    from tools.plan.__main__ import main
    monkeypatch.chdir(ROOT)
    assert main(["topology/1node.yaml", "experiment.algo.batch_size=8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {m["group"] for m in out["memory"]} == {"rollout", "trainer"}
    sims = out["simulation"]
    assert sims["async"]["effective_throughput_tok_s"] > sims["sync (eta=0, same split)"]["effective_throughput_tok_s"]
    assert main(["topology/1node.yaml", "actors.trainer.settings.recompute=none"]) == 2
    assert main(["topology/1node.yaml", "--seeds", "0"]) == 2 and "--seeds: must be >= 1" in capsys.readouterr().err


def test_tools_plan_reports_time_shares_and_the_decisions_counters_for_64_nodes(capsys, monkeypatch):
    from tools.plan.__main__ import main
    monkeypatch.chdir(ROOT)
    assert main(["topology/64node.yaml", "experiment.algo.batch_size=64", "experiment.gen.max_new_tokens=4096",
                 "--steps", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    a = out["simulation"]["async"]
    shares = a["time_shares"]
    assert set(shares) == {"rollout", "trainer", "param_server"}
    assert sum(shares["rollout"].values()) == pytest.approx(1)
    assert set(shares["trainer"]) == {"train", "export", "wait_batch", "wait_weights"}
    c = a["counters"]
    for key in ("issued", "reissued", "expired", "late_groups", "aborted_before_reissue", "dropped_stale",
                "retractions", "interrupted_requests", "inflight_groups_per_rollout", "retractions_per_server"):
        assert key in c, key
    assert 0 < c["inflight_groups_per_rollout"]["mean"] <= c["inflight_groups_per_rollout"]["max"] <= 8
    per_server = c["inflight_per_server"]
    assert set(per_server) == {"groups", "running_requests", "running_requests_peak", "waiting_requests_peak"}
    for figure in per_server.values():
        assert figure["min"] <= figure["mean"] <= figure["max"]
    # a server runs the answers of the groups it holds, at most 8 groups of 16, and at most 2 evaluation prompts
    assert 0 < per_server["running_requests"]["mean"] <= per_server["running_requests_peak"]["max"] <= 8 * 16 + 2
    # the evaluator answers on the rollouts (weights_from: rollouts): version 0's evaluation, 30 prompts
    assert c["evaluations"] == 1 and 0 < c["eval_answers"] <= 30
    assert a["stability"]["steps"] == 2
    assert c["interrupted_requests"] > 0   # asynchronous: every push interrupts what the servers run
    assert set(a["figures"]) >= {"step_time_s", "effective_throughput_tok_s", "staleness_mean"}


def test_simulated_and_measured_figures_are_compared_within_15_percent():
    cmp = sim.agreement({"step_time_s": 10.0, "reissued_per_step": 0.0, "staleness_mean": 1.2},
                        {"step_time_s": 11.0, "reissued_per_step": 0.01, "staleness_mean": 0.9})
    assert cmp["rows"]["step_time_s"]["agrees"] and cmp["rows"]["reissued_per_step"]["agrees"]
    assert not cmp["rows"]["staleness_mean"]["agrees"] and not cmp["all_agree"]
    # near zero on both sides agrees whatever the ratio, which is still shown; a share that is not near zero
    # is held to the tolerance
    assert cmp["rows"]["reissued_per_step"]["near_zero"] and cmp["rows"]["reissued_per_step"]["ratio"] == 0.0
    assert not cmp["rows"]["step_time_s"]["near_zero"]
    shares = sim.agreement({"wait_share": 0.003, "zero": 0.01, "none": 0.0}, {"wait_share": 0.06, "zero": 0.0, "none": 0.0})
    assert not shares["rows"]["wait_share"]["agrees"] and shares["rows"]["wait_share"]["ratio"] == pytest.approx(0.05)
    assert shares["rows"]["zero"]["ratio"] is None and shares["rows"]["zero"]["agrees"]
    assert shares["rows"]["none"] == {"simulated": 0.0, "measured": 0.0, "ratio": 1.0, "near_zero": True, "agrees": True}


def test_tools_plan_plots_the_timeline_and_the_sweep(tmp_path, capsys, monkeypatch):
    from tools.plan import __main__ as cli
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(cli, "SWEEP_ETAS", (0, 2))
    monkeypatch.setattr(cli, "SWEEP_SPLITS", (0.25, 0.75))
    assert cli.main(["topology/1node.yaml", "experiment.algo.batch_size=4", "--sweep", "--seeds", "2",
                     "--steps", "3", "--plot", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "best:" in text and "min-max over 2 seed(s)" in text
    assert text.count("of their run's mean, drift up to") == 4            # every point says how settled it is
    assert "in flight per server (min / mean / max over servers): groups" in text and "stability:" in text
    for name in ("timeline.png", "sweep.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_published_sweep_refuses_splits_that_are_not_shares_before_it_simulates(capsys):
    from tools.plan import published
    assert published.main(["--parts", "sweep", "--splits", "0.5,x"]) == 2
    assert "--splits: '0.5,x' is not a comma-separated list of shares" in capsys.readouterr().err
    assert published.main(["--parts", "sweep", "--splits", "0.5,1.5"]) == 2
    err = capsys.readouterr().err
    assert "every share must be between 0 and 1" in err and "tutorial rows" not in err
    assert published.main(["--parts", "sweep", "--etas", "0,x"]) == 2
    assert "--etas: '0,x' is not a comma-separated list of whole numbers" in capsys.readouterr().err
    assert published.main(["--parts", "sweep", "--etas", "4,-1"]) == 2
    err = capsys.readouterr().err
    assert "every eta must be >= 0" in err and "tutorial rows" not in err


def test_the_sweep_runs_in_parts_by_split_and_by_eta(monkeypatch):
    from tools.plan import __main__ as cli
    monkeypatch.chdir(ROOT)
    found = sizing.read(topology.load("topology/1node.yaml", ["experiment.algo.batch_size=4"], check_imports=False))
    rows = cli.sweep(found, steps=2, seeds=1, splits=(0.5,), etas=(1, 3))
    assert [(r["share"], r["eta"]) for r in rows] == [(0.5, 1), (0.5, 3)]


def test_the_published_comparison_runs_in_parts_by_model_size(capsys):
    from tools.plan import published
    assert published.main(["--models", "1.5B,3B"]) == 2
    assert "--models: 3B not one of 1.5B, 7B, 32B" in capsys.readouterr().err
    # the log is the 7B's: asked for the 1.5B's rows of the log only, nothing is simulated
    assert published.main(["--parts", "log", "--models", "1.5B", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["log"] is None and out["tutorial"] == out["speedup"] == []


def test_a_tutorial_row_compares_tokens_per_second_with_the_published_throughput(monkeypatch):
    from tools.plan import published
    # every tutorial run has its published throughput
    assert {(m, n) for m, n, _, _ in published.TUTORIAL_STEPS} == set(published.TUTORIAL_THROUGHPUT)
    simulated = {"step_s": 2000.0, "throughput": 30_000.0}
    monkeypatch.setattr(published, "run", lambda found, **kw: dict(simulated))
    row, = published.tutorial_rows(steps=2, seeds=1, models=("1.5B",))[:1]
    assert (row["model"], row["nodes"]) == ("1.5B", 1)
    assert row["published_throughput"] == 20_000
    assert row["throughput_ratio"] == pytest.approx(30_000 / 20_000)
    # 20k tokens/s over the published 3,461 s step, 512 prompts x 16 answers: 8,450 tokens a sequence
    assert row["published_tokens_per_sequence"] == pytest.approx(20_000 * 3461 / (512 * 16))
    assert round(row["published_tokens_per_sequence"]) == 8450


def test_every_published_configuration_fits_in_areal_s_own_layout():
    from tools.plan import published
    for model, nodes, group_size, _ in published.TUTORIAL_STEPS:
        found = published.cluster(model, nodes, group_size)
        assert all(m.fits for m in sizing.group_memory(found)), (model, nodes)
        cfg = setup.sim_config(found)
        lay = published.LAYOUTS[model]
        assert (cfg.server_tp, cfg.trainer.tp, cfg.trainer.pp) == (lay.server_tp, lay.tp, lay.pp)
        assert cfg.servers * cfg.server_tp == cfg.trainer.dp * cfg.trainer.tp * cfg.trainer.pp == nodes * 4


# --- CPU topologies: measured costs -------------------------------------------------------------------
#: A synthetic cost file in tools.plan.calibrate's format, with round numbers so the step time can be
#: written down by hand.
COSTS = {"decode": {"a_s": 0.004, "b_row_s": 5e-5, "b_kv_s": 1e-6}, "prefill": {"a_s": 0.002, "b_token_s": 4e-5},
         "train": {"a_s": 0.1, "b_token_s": 3e-4}, "weights": {"seconds": 0.03}, "reward": {"seconds": 0.001},
         "workloads": {"async": {"prompt_tokens": 8.0, "mean_answer_tokens": 20.0, "cut_share": 0.0,
                                 "kept_group_share": 1.0}}}


def _costs(tmp_path: Path, **workload) -> Path:
    data = json.loads(json.dumps(COSTS))
    data["workloads"]["async"].update(workload)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(data))
    return path


def test_a_cpu_topology_s_sync_step_is_the_cost_file_s_sum_exactly(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    found = sizing.read(topology.load("topology/local.yaml", check_imports=False))
    data = json.loads(_costs(tmp_path).read_text())
    cfg = setup.sim_config(found, eta=0, steps=3, measured=costs.MeasuredCosts.from_dict(data),
                           workload=data["workloads"]["async"])
    # topology/local.yaml pins both rollouts to core 0: one simulated server, two engines time-sharing it,
    # each holding up to 8 groups (buffer.max_groups_per_rollout)
    assert (cfg.servers, cfg.engines_per_server, cfg.max_groups_per_rollout, cfg.engine) == (1, 2, 8, "embedded")
    r = sim.simulate(cfg)
    b, g, prompt, answer = 16, 8, 8, 20
    n = b * g
    prefill = b * (0.002 + 4e-5 * prompt)
    # both engines busy every step: each pays its 4 ms; step i reads n * (prompt + i) KV tokens
    decode = sum(2 * 0.004 + 5e-5 * n + 1e-6 * n * (prompt + i) for i in range(answer))
    train = 0.1 + 3e-4 * n * (prompt + answer)
    serve = cfg.serve.seconds(n * answer)   # the buffer serves the batch (tools.bench serve's CPU cost)
    expected = prefill + decode + 0.001 + serve + train + 0.03
    # the first step, from the start: every group issued at once (later steps start with one group per
    # rollout, BufferState.rollout_cap at eta 0, until each rollout shows it holds the new weights)
    assert r.steps[0].end == pytest.approx(expected, rel=1e-12)
    assert r.step_time > expected
    assert r.summary()["weight_sync_s"] == pytest.approx(0.03)


def test_a_cpu_topology_needs_a_cost_file(monkeypatch):
    monkeypatch.chdir(ROOT)
    found = sizing.read(topology.load("topology/local.yaml", check_imports=False))
    with pytest.raises(ValueError, match="measured costs"):
        setup.sim_config(found)


def test_tools_plan_simulates_a_cpu_topology_and_compares_with_a_measured_run(tmp_path, capsys, monkeypatch):
    from tools.plan.__main__ import main
    monkeypatch.chdir(ROOT)
    costs_file = _costs(tmp_path, cut_share=0.05, mean_answer_tokens=18.0, kept_group_share=0.5)
    e2e = tmp_path / "e2e.json"
    e2e.write_text(json.dumps({"steps": 5, "runs": {
        "async": {"effective_throughput": 900.0, "wall_seconds": 10.0, "steps": 5},
        "sync": {"effective_throughput": 450.0, "wall_seconds": 20.0, "steps": 5}}}))
    assert main(["topology/local.yaml", "--costs", str(costs_file), "--against", str(e2e), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workloads"]["async"]["name"] == "async" == out["workloads"]["sync"]["name"]   # the only one
    assert out["costs"] == str(costs_file)
    sims = out["simulation"]
    assert set(sims) == {"async", "sync (eta=0, same split)"}
    assert sims["async"]["effective_throughput_tok_s"] > sims["sync (eta=0, same split)"]["effective_throughput_tok_s"]
    assert max(int(k) for k in sims["async"]["staleness"]) <= 4
    rows = {r["figure"]: r for r in out["comparison"]["rows"]}
    assert set(rows) == {"throughput_ratio", "async_step_s", "sync_step_s"}
    assert rows["throughput_ratio"]["measured"] == pytest.approx(2.0)
    assert rows["sync_step_s"]["measured"] == pytest.approx(4.0)
    for r in rows.values():
        assert r["ratio"] == pytest.approx(r["predicted"] / r["measured"])
        assert r["within_15pct"] == (abs(r["ratio"] - 1) <= 0.15)
    # the text form carries the same table
    assert main(["topology/local.yaml", "--costs", str(costs_file), "--against", str(e2e), "--steps", "4"]) == 0
    text = capsys.readouterr().out
    assert "simulation on CPUs" in text and "against the measured run" in text and "throughput_ratio" in text


@pytest.mark.parametrize("name", ["local", "demo_local", "demo_slurm"])
def test_tools_plan_answers_for_every_shipped_cpu_topology_with_the_committed_costs(name, capsys, monkeypatch):
    from tools.plan.__main__ import main
    monkeypatch.chdir(ROOT)
    assert main([f"topology/{name}.yaml"]) == 0
    text = capsys.readouterr().out
    assert "memory per GPU" in text
    if name == "local":
        assert "simulation on CPUs" in text and "async / sync on the same split" in text
    else:
        assert "nothing to simulate" in text


def test_calibrate_reads_a_run_s_workload_from_its_metrics(tmp_path):
    from tools.plan.calibrate import workload_from_run
    # the buffer's counters are running totals; 4 accepted groups still wait in the buffer at the end
    rows = [{"avg_seq_len": 20.0, "no_eos_ratio": 0.0, "dropped_uniform": 16, "buffer_depth": 2, "accuracy": 0.5},
            {"avg_seq_len": 30.0, "no_eos_ratio": 0.1, "dropped_uniform": 64, "buffer_depth": 4, "accuracy": 0.9}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    w = workload_from_run(tmp_path, batch_size=16, prompt=8.3)
    assert w["mean_answer_tokens"] == 25.0 and w["cut_share"] == pytest.approx(0.05)
    assert w["kept_group_share"] == pytest.approx(36 / (36 + 64))
    assert w["prompt_tokens"] == 8.3 and w["steps"] == 2


def test_each_run_is_simulated_with_its_own_workload_when_the_cost_file_names_them(tmp_path, capsys, monkeypatch):
    from tools.plan.__main__ import main
    monkeypatch.chdir(ROOT)
    data = json.loads(_costs(tmp_path).read_text())
    data["workloads"]["sync"] = dict(data["workloads"]["async"], mean_answer_tokens=40.0)
    path = tmp_path / "two.json"
    path.write_text(json.dumps(data))
    assert main(["topology/local.yaml", "--costs", str(path), "--steps", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["workloads"]["async"]["name"], out["workloads"]["sync"]["name"]) == ("async", "sync")
    sims = out["simulation"]
    # 128 answers of 8 + 20 tokens against 8 + 40 tokens
    assert sims["async"]["tokens_per_step"] == 128 * 28 and sims["sync (eta=0, same split)"]["tokens_per_step"] == 128 * 48
    assert main(["topology/local.yaml", "--costs", str(path), "--steps", "3", "--workload", "sync", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["simulation"]["async"]["tokens_per_step"] == 128 * 48
    assert main(["topology/local.yaml", "--costs", str(path), "--workload", "nope"]) == 2


def test_the_plan_counts_each_rollout_s_issues_aborts_and_groups_in_flight_from_the_buffer_s_state():
    cfg = _config(servers=2, eta=2, group_timeout_s=3.0, max_new_tokens=1000, steps=4, max_groups_per_rollout=4,
                  lengths={"kind": "lognormal", "mean_tokens_at_cut": 300, "cut_share": 0.1, "cut": 1000})
    c = sim.simulate(cfg).counters
    per = c["per_rollout"]
    assert set(per) == set(cfg.rollout_names) and len(per) == 2
    assert sum(p["issued"] for p in per.values()) == c["issued"]
    assert sum(p["handed_back"] for p in per.values()) == c["handed_back"]
    assert sum(p["overdue"] for p in per.values()) == c["expired"] > 0   # each overdue group aborted, handed back
    for p in per.values():
        assert 0 < p["inflight_mean"] <= p["inflight_max"] <= cfg.max_groups_per_rollout
