"""The planner with model.lora: the adapters' parameter count (checked against the LoraLinear layers the trainer
builds), the training FLOPs of a frozen base, and a published version that is the adapters alone."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from actors.engines.lora import LoraSpec, add_lora, trainable_bytes
from launch.plan import hardware, memory, sizing
from launch.plan.shapes import BUILTIN, from_hf_config
from testsupport.tiny_models import tiny_config, tiny_model
from tools.plan import costs, setup, sim
import topology

ROOT = Path(__file__).resolve().parent.parent
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPE, GPU = BUILTIN["7B"], hardware.GPUS["H800"]


@pytest.mark.parametrize("targets", [ALL, ("q_proj", "v_proj"), ("k_proj", "down_proj", "lm_head")],
                         ids=["all", "qv", "k-down-head"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_the_planner_s_adapter_count_is_the_lora_layers_the_trainer_builds(tmp_path, family, targets):
    config = tiny_config(family)
    model = tiny_model(seed=0, family=family)
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=targets)
    add_lora(model, spec, seed=0)
    built = sum(p.numel() for name, p in model.named_parameters() if ".lora_A." in name or ".lora_B." in name)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    shape = from_hf_config(tmp_path / "config.json")
    assert built > 0
    assert memory.lora_params(shape, 4, targets) == built == trainable_bytes(config, spec) // 4


def _train(lora_params: int, recompute: str = "full", dp: int = 8) -> float:
    lay = costs.TrainerShape(tp=4, pp=1, dp=dp, micro_batch_tokens=32768, minibatches=2, recompute=recompute,
                             gpus_per_node=8, lora_params=lora_params)
    lengths = [3000 + 500 * (i % 7) for i in range(128)]
    return costs.train_step_seconds(SHAPE, GPU, lay, lengths, [i // 16 for i in range(128)])


def test_a_frozen_base_drops_the_weight_gradient_pass_and_nothing_else():
    adapters = memory.lora_params(SHAPE, 32, ALL)
    tokens, sum_sq = 1e6, 1e6 * 8000
    for passes in (4, 5):   # forward+backward and the proximal log-probs, with and without full recompute
        full = costs.train_flops(SHAPE, tokens, sum_sq, passes)
        lora = costs.train_flops(SHAPE, tokens, sum_sq, passes, adapters)
        assert full - lora == pytest.approx(2 * SHAPE.active_params * tokens - passes * 2 * adapters * tokens)
        # attention's products have no weights: they cost what they did
        assert costs.train_flops(SHAPE, 0.0, sum_sq, passes, adapters) == costs.train_flops(SHAPE, 0.0, sum_sq, passes)
    # the step: at most full fine-tuning's, and more than the 3/5 of it that dropping the backward pass would give
    for recompute in ("full", "none"):
        full, lora = _train(0, recompute), _train(adapters, recompute)
        assert 0.6 * full < lora < full


def test_the_data_parallel_reduction_is_of_the_adapters_alone():
    adapters = memory.lora_params(SHAPE, 32, ALL)
    lay = costs.TrainerShape(tp=4, pp=1, dp=32, micro_batch_tokens=32768, minibatches=1, recompute="full",
                             gpus_per_node=8)
    full = costs.dp_sync_seconds(SHAPE, GPU, lay)
    lora = costs.dp_sync_seconds(SHAPE, GPU, dataclasses.replace(lay, lora_params=adapters))
    assert lora == pytest.approx(full * adapters / SHAPE.dense_params)


def test_a_lora_version_s_sync_time_scales_with_the_adapter_s_bytes():
    def sync(lora_params: int) -> costs.WeightSync:
        return costs.weight_sync(SHAPE, GPU, tp=4, pp=1, gpus_per_node=8, across_nodes=True,
                                 lora_params=lora_params)
    r4, r8 = (memory.lora_params(SHAPE, r, ALL) for r in (4, 8))
    assert r8 == 2 * r4
    small, large, full = sync(r4), sync(r8), sync(0)
    assert large.export_s == pytest.approx(2 * small.export_s)
    assert large.load_s == pytest.approx(2 * small.load_s) and small.load_s > 0 and full.load_s == 0
    # the broadcast: bytes over the slowest link plus a fixed cost per bucket (one bucket each here)
    assert r8 * 2 < 64 << 20
    assert large.push_s - hardware.BUCKET_LATENCY_S == pytest.approx(2 * (small.push_s - hardware.BUCKET_LATENCY_S))
    # against the whole model's bf16 weights
    assert full.total_s > 50 * large.total_s


def _found(*overrides: str) -> sizing.Setup:
    return sizing.read(topology.load(ROOT / "topology/64node.yaml", list(overrides), check_imports=False))


def test_the_7b_lora_config_plans_on_the_64_node_topology_with_adapter_only_versions():
    full, lora = _found(), _found("config=configs/7b_math_lora.yaml")
    full_cfg, lora_cfg = setup.sim_config(full), setup.sim_config(lora)
    assert full_cfg.trainer.lora_params == 0
    assert lora_cfg.trainer.lora_params == memory.lora_params(SHAPE, 32, ALL) == 80_740_352
    assert dataclasses.replace(lora_cfg, trainer=full_cfg.trainer) == full_cfg   # the rest is the same run
    # memory: no gradients or Adam moments for the base, the published version and its host copy the adapters'
    (full_mem,), (lora_mem,) = ([m for m in sizing.group_memory(f) if m.kind == "trainer"] for f in (full, lora))
    assert lora_mem.terms["gradients"] < full_mem.terms["gradients"] / 50 and lora_mem.total < full_mem.total
    (trainer,) = lora.of_kind("trainer")
    lay = memory.trainer_layout(trainer.settings, keeps_weights=True)
    assert memory.kept_bytes(SHAPE, lay) == memory.KEPT_VERSIONS * 2 * memory.lora_params(SHAPE, 32, ALL)


def test_a_lora_run_s_simulated_step_is_no_longer_than_full_fine_tuning_s_and_its_sync_far_shorter():
    def run(lora_params: int) -> sim.Result:
        trainer = costs.TrainerShape(tp=1, pp=1, dp=2, micro_batch_tokens=8192, minibatches=1, recompute="full",
                                     gpus_per_node=8, lora_params=lora_params)
        return sim.simulate(sim.SimConfig(
            shape=BUILTIN["1.5B"], gpu=GPU, gpus_per_node=8, servers=2, server_tp=1, trainer=trainer, batch_size=4,
            group_size=4, eta=0, max_new_tokens=2000, max_groups_per_rollout=4, kv_tokens_per_server=1 << 20,
            lengths={"kind": "fixed", "tokens": 1500}, prompt_tokens=100, reward_latency_s=1.0, steps=4))
    full, lora = run(0), run(memory.lora_params(BUILTIN["1.5B"], 8, ALL))
    assert lora.step_time <= full.step_time
    assert lora.summary()["train_s"] < full.summary()["train_s"]
    assert lora.summary()["weight_sync_s"] < full.summary()["weight_sync_s"] / 20
