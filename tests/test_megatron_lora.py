"""LoRA on the Megatron-core trainer (actors/engines/megatron_lora.py) against the torch trainer's LoRA, on CPU
with gloo, in child processes as tests/test_engine_megatron.py runs Megatron.

Both trainers start from the same base and the same non-zero adapter (a PEFT-layout directory): the log-probs,
the training step (loss, gradient norm) and the adapter after it agree; only the adapters get gradients and
optimizer state, the base does not move, and the adapter version the Megatron trainer publishes has the torch
trainer's names and shapes. World size 1 (with a checkpoint that resumes), TP=2 (fused QKV and [gate; up] adapters
split across ranks), TP=2 with sequence parallelism, full recompute, DP=2 and PP=2.
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from actors.engines import megatron as mg
from actors.engines.checkpoint import load_model
from actors.engines.lora import LoraSpec, initial_adapter, is_adapter_dir, write_adapter
from actors.engines.megatron_lora import megatron_lora_problem
from actors.engines.torch_train import TorchTrainEngine, TrainConfig, token_nll_loss
from testsupport.tiny_models import tiny_config
from tests.test_engine_megatron import (LR, _batches, _max_diff, _model_dir, _run, _save_step_load_step, _whole,
                                        needs_megatron)

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=ALL)


def _random_adapter(config: Any, spec: LoraSpec, out_dir: str, base_dir: str) -> str:
    """An adapter with A and B both non-zero (a new one has B = 0 and changes nothing), in PEFT's layout."""
    gen = torch.Generator().manual_seed(5)
    tensors = {n: torch.randn(t.shape, generator=gen) * 0.1 for n, t in initial_adapter(config, spec).items()}
    write_adapter(out_dir, tensors, spec, base_dir, config)
    return out_dir


# --- conversion and refusal (no megatron needed) ---------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2])
def test_adapter_names_and_shards_round_trip_under_tp(tp: int) -> None:
    cfg = tiny_config(num_attention_heads=4, num_key_value_heads=2)
    hf = initial_adapter(cfg, SPEC)
    back: dict[str, torch.Tensor] = {}
    for layer in range(cfg.num_hidden_layers):
        for linear, projections in (("self_attention.linear_qkv", ("q_proj", "k_proj", "v_proj")),
                                    ("self_attention.linear_proj", ("o_proj",)),
                                    ("mlp.linear_fc1", ("gate_proj", "up_proj")), ("mlp.linear_fc2", ("down_proj",))):
            for p in projections:
                for m in ("lora_A", "lora_B"):
                    pm = mg.param_map(f"decoder.layers.{layer}.{linear}.lora.adapters.{p}.{m}.weight", 0)
                    shards = [mg.hf_to_megatron_shard(pm, [hf[n] for n in pm.hf_names], cfg, r, tp, 128)
                              for r in range(tp)]
                    split = pm.kind != "rep"
                    # column-parallel layers split B on its rows, row-parallel ones A on its columns
                    assert split == ((m == "lora_B") == (linear in ("self_attention.linear_qkv", "mlp.linear_fc1")))
                    if tp > 1:
                        assert (shards[0].shape != hf[pm.hf_names[0]].shape) == split
                    back.update(mg.megatron_shards_to_hf(pm, shards, cfg))
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[n], hf[n]) for n in hf)


def test_targets_outside_the_decoder_layers_are_refused() -> None:
    cfg = tiny_config()
    assert megatron_lora_problem(cfg, SPEC) is None
    assert "not adapted on the megatron trainer" in megatron_lora_problem(cfg, LoraSpec(4, 8.0, 0.0, ("lm_head",)))
    assert "match no linear layer" in megatron_lora_problem(cfg, LoraSpec(4, 8.0, 0.0, ("qkv_proj",)))
    assert "exceeds layer" in megatron_lora_problem(cfg, LoraSpec(1000, 8.0, 0.0, ("q_proj",)))


# --- against the torch trainer ------------------------------------------------------------------------------------
def _lora_checks(engine: Any, out_dir: str, settings: dict[str, Any]) -> dict[str, Any]:
    batches = _batches(engine.hf_config.vocab_size)
    whole = _whole(batches)
    params = dict(engine.model.named_parameters())
    out: dict[str, Any] = {"trainable": sorted(n for n, p in params.items() if p.requires_grad),
                           "layers": len(engine.model.decoder.layers), "dp_size": engine.dp_size}
    out["adapter_numel"] = sum(p.numel() for p in params.values() if p.requires_grad)
    out["optimizer_numel"] = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
    base_before = {n: p.detach().clone() for n, p in params.items() if not p.requires_grad}
    res = engine.compute_logprobs(whole, with_entropy=True)
    out["logprobs"], out["entropy"] = res.logprobs, res.entropy
    out["stats"] = engine.train_step(batches if engine.dp_size == 1 else [batches[engine.dp_rank]], token_nll_loss)
    out["base_moved"] = max(float((params[n] - t).abs().max()) for n, t in base_before.items())
    out["base_has_grad"] = [n for n in base_before if getattr(params[n], "main_grad", None) is not None
                            or params[n].grad is not None]
    out["adapter"] = {k: v for bucket in engine.export_weights(4096) for k, v in bucket}
    out["after_step_logprobs"] = engine.compute_logprobs(whole).logprobs
    if settings.get("checkpoint"):
        out.update(_save_step_load_step(engine, out_dir, batches))
    return out


def _torch_reference(model_dir: str, adapter_dir: str) -> dict[str, Any]:
    engine = TorchTrainEngine(model_dir, TrainConfig(lr=LR), lora=SPEC, start_adapter=adapter_dir)
    batches = _batches(engine.model.config.vocab_size)
    whole = _whole(batches)
    res = engine.compute_logprobs(whole, with_entropy=True)
    out = {"logprobs": res.logprobs, "entropy": res.entropy,
           "initial": {k: v.clone() for b in engine.export_weights() for k, v in b}}
    out["stats"] = engine.train_step(batches, token_nll_loss)
    out["adapter"] = {k: v for b in engine.export_weights() for k, v in b}
    out["after_step_logprobs"] = engine.compute_logprobs(whole).logprobs
    return out


@needs_megatron
@pytest.mark.parametrize("world,config,checkpoint", [
    (1, {}, True),
    (2, {"tensor_parallel": 2, "vocab_pad_multiple": 1}, False),
    (2, {"tensor_parallel": 2, "vocab_pad_multiple": 1, "sequence_parallel": True, "recompute": "selective"}, False),
    (1, {"recompute": "full"}, False),
    (2, {}, False),
    (2, {"pipeline_parallel": 2}, False),
], ids=["ws1-checkpoint", "tp2", "tp2-sp", "recompute-full", "dp2", "pp2"])
def test_megatron_lora_matches_the_torch_trainers_lora(tmp_path, world, config, checkpoint) -> None:
    model_dir = _model_dir(tmp_path, num_attention_heads=4, num_key_value_heads=2)
    adapter_dir = _random_adapter(load_model(model_dir).config, SPEC, str(tmp_path / "adapter"), model_dir)
    ref = _torch_reference(model_dir, adapter_dir)
    (tmp_path / "out").mkdir()
    ranks = _run(world, model_dir, str(tmp_path / "out"), {
        "config": config, "engine": {"lora": SPEC, "start_adapter": adapter_dir}, "body": _lora_checks,
        "checkpoint": checkpoint})
    # the version published is the torch trainer's: the same adapter tensors, names and shapes (each pipeline
    # stage's export sender sends its layers' adapters; the other ranks send nothing)
    published = {k: v for r in ranks for k, v in r["adapter"].items()}
    assert sum(len(r["adapter"]) for r in ranks) == len(published)
    assert {k: tuple(v.shape) for k, v in published.items()} == {k: tuple(v.shape) for k, v in ref["adapter"].items()}
    moved = _max_diff(ref["adapter"], ref["initial"])
    d_adapter = _max_diff(published, ref["adapter"])
    assert d_adapter < 1e-5 and moved > 100 * d_adapter, (d_adapter, moved)
    # optimizer state for the adapters alone (the distributed optimizer shards it over the data-parallel ranks)
    assert sum(r["optimizer_numel"] for r in ranks) * ranks[0]["dp_size"] == sum(r["adapter_numel"] for r in ranks)
    for got in ranks:
        assert all(".lora.adapters." in n for n in got["trainable"])
        assert len(got["trainable"]) == 2 * len(ALL) * got["layers"]   # A and B of 7 projections a layer
        assert got["base_moved"] == 0.0 and got["base_has_grad"] == []
        assert float((got["logprobs"] - ref["logprobs"]).abs().max()) < 1e-5
        assert float((got["entropy"] - ref["entropy"]).abs().max()) < 1e-5
        assert got["stats"]["loss"] == pytest.approx(ref["stats"]["loss"], abs=1e-5)
        assert got["stats"]["grad_norm"] == pytest.approx(ref["stats"]["grad_norm"], rel=1e-5)
        assert float((got["after_step_logprobs"] - ref["after_step_logprobs"]).abs().max()) < 1e-4
    print(f"megatron lora world={world} {config} vs torch lora: logprobs "
          f"{max(float((g['logprobs'] - ref['logprobs']).abs().max()) for g in ranks):.1e}, adapter after the step "
          f"{d_adapter:.1e} (the step moved it {moved:.1e}), log-probs after the step "
          f"{max(float((g['after_step_logprobs'] - ref['after_step_logprobs']).abs().max()) for g in ranks):.1e}")
    if checkpoint:
        ckpt = str(tmp_path / "out" / "ckpt")
        assert is_adapter_dir(ckpt) and not any(f.endswith("model.safetensors") and f != "adapter_model.safetensors"
                                                for f in os.listdir(ckpt))   # no base weights in it
        resumed = TorchTrainEngine(ckpt, TrainConfig(), lora=SPEC)   # the torch trainer resumes from it too
        assert _max_diff({k: v for b in resumed.export_weights() for k, v in b}, published) == 0.0
        got = ranks[0]
        assert got["version_after_load"] == 1 and got["replayed_step"] == got["second_step"]
        assert _max_diff(got["replayed_weights"], got["second_weights"]) == 0.0
