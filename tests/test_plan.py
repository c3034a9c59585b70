"""tools.plan: the memory fit per GPU (and tools.up --dry-run's refusal) and the run's simulation."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from actors.engines.model import Qwen2Config, Qwen2ForCausalLM, param_count
import topology
from tools import up
from tools.plan import memory, setup
from tools.plan.shapes import BUILTIN, ShapeError, from_hf_config, resolve

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
    found = setup.read(topology.load(path, check_imports=False))
    groups = setup.group_memory(found)
    gpu_groups = [g for g in found.groups if g.device == "cuda"]
    assert len(groups) == len(gpu_groups)
    for m in groups:
        assert m.fits, m.problem()


# --- simulation ---------------------------------------------------------------------------------------
from tools.plan import costs, hardware, sim  # noqa: E402


def _config(**kw) -> sim.SimConfig:
    base = dict(shape=BUILTIN["1.5B"], gpu=hardware.GPUS["H800"], gpus_per_node=8, servers=1, server_tp=1,
                trainer=costs.TrainerShape(tp=1, pp=1, dp=1, micro_batch_tokens=4096, minibatches=1,
                                           recompute="full", gpus_per_node=8),
                batch_size=2, group_size=2, eta=0, max_new_tokens=1000, max_groups_per_server=2,
                lengths={"kind": "fixed", "tokens": 100}, prompt_tokens=10, reward_latency_s=1.0, steps=3)
    return sim.SimConfig(**{**base, **kw})


def test_one_server_fixed_lengths_and_eta_0_give_the_synchronous_step_time_exactly():
    cfg = _config()
    r = sim.simulate(cfg)
    shape, gpu = cfg.shape, cfg.gpu
    prefill = costs.prefill_seconds(shape, gpu, 1, 10, 10 ** 2)
    n = cfg.batch_size * cfg.group_size
    decode = costs.decode_cost(shape, gpu, 1, n).steps(n * 10, n, 100)
    train = costs.train_step_seconds(shape, gpu, cfg.trainer, [110] * n, [0, 0, 1, 1])
    sync = costs.weight_sync_seconds(shape, gpu, 1, 1, 8, across_nodes=True)
    expected = cfg.batch_size * prefill + decode + cfg.reward_latency_s + train + sync
    assert r.step_time == pytest.approx(expected, rel=1e-12)
    assert [s.end for s in r.steps] == pytest.approx([expected, 2 * expected, 3 * expected], rel=1e-12)
    assert r.staleness == {0: 1.0}


def test_decode_steps_sum_in_closed_form_as_step_by_step():
    c = costs.decode_cost(BUILTIN["7B"], hardware.GPUS["H800"], 2, 128)
    for kv0, n, j in [(1e6, 128, 1000), (0, 128, 3000), (5e7, 1, 10), (3e6, 256, 777)]:
        assert c.steps(kv0, n, j) == pytest.approx(sum(c.step(kv0 + i * n) for i in range(j)), rel=1e-9)


@pytest.mark.parametrize("servers,dp", [(1, 8), (8, 1)], ids=["rollout-bound", "trainer-bound"])
def test_throughput_never_exceeds_the_slower_side_s_rate(servers, dp):
    cfg = _config(servers=servers, eta=2, batch_size=8, group_size=4, max_groups_per_server=4, steps=5,
                  trainer=costs.TrainerShape(tp=1, pp=1, dp=dp, micro_batch_tokens=4096, minibatches=1,
                                             recompute="full", gpus_per_node=8))
    r = sim.simulate(cfg)
    tokens = cfg.batch_size * cfg.group_size * 110
    trainer_rate = tokens / (r.measured[0].train_s + r.measured[0].sync_s)
    n = cfg.max_groups_per_server * cfg.group_size   # the fullest batch a server runs, at its smallest KV
    rollout_rate = cfg.servers * n * 110 / (100 * costs.decode_cost(cfg.shape, cfg.gpu, 1, n).step(n * 10))
    assert r.throughput <= min(trainer_rate, rollout_rate) * (1 + 1e-9)
    assert max(r.staleness) <= cfg.eta


def test_lognormal_lengths_have_the_cited_mean_and_tail_share():
    mu, sigma = sim.lognormal_for(7692, 0.125, 16384)
    x = np.random.default_rng(0).lognormal(mu, sigma, 400_000)
    assert np.mean(x > 16384) == pytest.approx(0.125, abs=0.003)
    assert np.minimum(x, 16384).mean() == pytest.approx(7692, rel=0.01)


def test_tools_plan_prints_memory_and_the_comparison_for_a_gpu_topology(capsys, monkeypatch):
    from tools.plan.__main__ import main
    monkeypatch.chdir(ROOT)
    assert main(["topology/1node.yaml", "experiment.algo.batch_size=8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {m["group"] for m in out["memory"]} == {"rollout", "trainer"}
    sims = out["simulation"]
    assert sims["async"]["effective_throughput_tok_s"] > sims["sync (eta=0, same split)"]["effective_throughput_tok_s"]
    assert main(["topology/1node.yaml", "actors.trainer.settings.recompute=none"]) == 2


def test_tools_plan_plots_the_timeline_and_the_sweep(tmp_path, capsys, monkeypatch):
    from tools.plan import __main__ as cli
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(cli, "SWEEP_ETAS", (0, 2))
    monkeypatch.setattr(cli, "SWEEP_SPLITS", (0.5, 0.75))
    assert cli.main(["topology/1node.yaml", "experiment.algo.batch_size=4", "--sweep", "--plot", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "best:" in text
    for name in ("timeline.png", "sweep.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_published_configuration_fits_and_splits_75_25():
    from tools.plan import published
    for model, nodes, group_size, _ in published.TUTORIAL_STEPS:
        found = published.cluster(model, nodes, group_size)
        assert all(m.fits for m in setup.group_memory(found)), (model, nodes)
        cfg = setup.sim_config(found)
        infer = cfg.servers * cfg.server_tp
        assert infer == 0.75 * nodes * 8, (model, nodes)


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
    found = setup.read(topology.load("topology/local.yaml", check_imports=False))
    data = json.loads(_costs(tmp_path).read_text())
    cfg = setup.sim_config(found, eta=0, steps=3, measured=costs.MeasuredCosts.from_dict(data),
                           workload=data["workloads"]["async"])
    # topology/local.yaml pins both rollouts to core 0: one simulated server, two engines time-sharing it
    assert (cfg.servers, cfg.engines_per_server, cfg.max_groups_per_server) == (1, 2, 16)
    r = sim.simulate(cfg)
    b, g, prompt, answer = 16, 8, 8, 20
    n = b * g
    prefill = b * (0.002 + 4e-5 * prompt)
    # both engines busy every step: each pays its 4 ms; step i reads n * (prompt + i) KV tokens
    decode = sum(2 * 0.004 + 5e-5 * n + 1e-6 * n * (prompt + i) for i in range(answer))
    train = 0.1 + 3e-4 * n * (prompt + answer)
    expected = prefill + decode + 0.001 + train + 0.03
    assert r.step_time == pytest.approx(expected, rel=1e-12)
    assert r.summary()["weight_sync_s"] == pytest.approx(0.03)


def test_a_cpu_topology_needs_a_cost_file(monkeypatch):
    monkeypatch.chdir(ROOT)
    found = setup.read(topology.load("topology/local.yaml", check_imports=False))
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
