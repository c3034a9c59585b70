"""LoRA: the settings refused before launch, the adapters on the torch trainer (base frozen, optimizer state
for the adapters only), adapter-only weight versions merged by the generation engine at a step boundary
(replacing, never stacking), checkpoints that hold the adapter and resume it."""
from __future__ import annotations

import asyncio
import functools
import json

import pytest
import torch

from actors.engines.base import GenerationRequest, PackedBatch, SamplingParams
from actors.engines.checkpoint import CheckpointError, hf_state_dict, load_model
from actors.engines.lora import (LoraSpec, adapter_problem, adapter_state, add_lora, is_adapter_name, lora_problem,
                                 merged_weights, read_adapter)
from actors.engines.torch_gen import TorchGenerationEngine
from actors.engines.torch_train import TorchTrainEngine, TrainConfig, token_nll_loss
from actors.weights import weights_hash
from testsupport.bounded import run_bounded
from testsupport.tiny_models import random_sequences, tiny_config, tiny_model, tiny_model_dir

run = functools.partial(run_bounded, timeout=60.0)
SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


def batches(vocab: int = 97, seed: int = 1) -> list[PackedBatch]:
    return [PackedBatch.from_sequences(random_sequences(4, 6, 16, vocab, seed=seed))]


def trained(spec: LoraSpec = SPEC, steps: int = 3, **kwargs) -> TorchTrainEngine:
    engine = TorchTrainEngine(config=TrainConfig(lr=1e-2), model=tiny_model(seed=0), lora=spec, **kwargs)
    for _ in range(steps):
        engine.train_step(batches(), token_nll_loss)
    return engine


def test_settings_that_fit_no_layer_are_refused_with_one_line():
    config = tiny_config()
    assert lora_problem(config, SPEC) is None
    nothing = lora_problem(config, LoraSpec(4, 8.0, target_modules=("query_key_value",)))
    assert nothing.startswith("model.lora.target_modules: ['query_key_value'] match no linear layer of Qwen2ForCausalLM")
    assert "q_proj" in nothing and "\n" not in nothing
    too_big = lora_problem(config, LoraSpec(33, 8.0, target_modules=("k_proj",)))   # k_proj: 64 in, 32 out
    assert too_big == ("model.lora.rank: 33 exceeds layer model.layers.0.self_attn.k_proj (64 in, 32 out): at most 32")
    partly = lora_problem(config, LoraSpec(4, 8.0, target_modules=("q_proj", "qproj")))
    assert partly == "model.lora.target_modules: ['qproj'] match no linear layer of Qwen2ForCausalLM"


def test_trainer_freezes_the_base_and_keeps_optimizer_state_for_adapters_only():
    base = hf_state_dict(tiny_model(seed=0))
    engine = TorchTrainEngine(config=TrainConfig(lr=1e-2), model=tiny_model(seed=0), lora=SPEC)
    first = engine.train_step(batches(), token_nll_loss)["loss"]
    for _ in range(4):
        last = engine.train_step(batches(), token_nll_loss)["loss"]
    assert last < first
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_name(n) for n in trainable)
    assert len(trainable) == 2 * 3 * 2   # A and B of 3 targets in 2 layers
    state = engine.optimizer.state_dict()["state"]
    assert len(state) == len(trainable)   # AdamW moments for the adapters, none for the frozen base
    for name, tensor in base.items():    # the base did not move
        assert torch.equal(dict(engine.model.named_parameters())[name].detach(), tensor), name
    exported = [name for bucket in engine.export_weights(1 << 12) for name, _ in bucket]
    assert sorted(exported) == sorted(trainable)


def test_engine_merges_each_adapter_into_the_kept_base_at_a_step_boundary():
    trainer = trained()
    first = list(trainer.export_weights(1 << 12))
    second_trainer = trained(steps=6)
    second = list(second_trainer.export_weights(1 << 12))
    prompts = random_sequences(3, 4, 10, 97, seed=3)
    reference = torch.tensor(prompts[0])[None]

    async def main():
        engine = TorchGenerationEngine(model=tiny_model(seed=0), lora=SPEC)
        await engine.start()
        try:
            await engine.update_weights(1, iter(first))
            assert engine.version == 1
            with torch.no_grad():
                got = engine.model(reference)
                want = trainer.model.eval()(reference)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            digest, how = await engine.verify_weights(1)
            assert how == "hash" and digest == weights_hash(kv for b in first for kv in b)
            # a second adapter replaces the first: equal to the second trainer's model, not to both added
            await engine.update_weights(2, iter(second))
            with torch.no_grad():
                torch.testing.assert_close(engine.model(reference), second_trainer.model.eval()(reference),
                                           rtol=1e-4, atol=1e-4)
            # all or nothing: an adapter missing a module is refused and the engine keeps version 2
            partial = [[(n, t) for n, t in b if ".0.self_attn.q_proj." not in n] for b in second]
            with pytest.raises(CheckpointError, match="covers other layers than the targets"):
                await engine.update_weights(3, iter(partial))
            assert engine.version == 2
            # generation goes on and every token carries the version it was sampled under
            results = await engine.generate(GenerationRequest("r", prompts[1], SamplingParams(max_new_tokens=5,
                                                                                               temperature=0.0)))
            assert set(results[0].versions) == {2}
        finally:
            await engine.stop()

    run(main())


def test_engine_without_lora_refuses_adapter_tensors():
    buckets = list(trained(steps=1).export_weights(1 << 12))

    async def main():
        engine = TorchGenerationEngine(model=tiny_model(seed=0))
        await engine.start()
        try:
            with pytest.raises(CheckpointError, match="unexpected tensor"):
                await engine.update_weights(1, iter(buckets))
        finally:
            await engine.stop()

    run(main())


def test_checkpoint_holds_adapter_and_optimizer_and_resumes(tmp_path):
    base_dir = str(tiny_model_dir(tmp_path / "base"))
    engine = TorchTrainEngine(base_dir, TrainConfig(lr=1e-2), lora=SPEC)
    for _ in range(2):
        engine.train_step(batches(14), token_nll_loss)
    ckpt = tmp_path / "ckpt"
    engine.save(str(ckpt))
    assert not (ckpt / "model.safetensors").exists()   # the base stays at base_dir
    assert json.loads((ckpt / "lora_base.json").read_text())["base_model"] == base_dir
    resumed = TorchTrainEngine(str(ckpt), TrainConfig(lr=1e-2), lora=SPEC, version=2)
    resumed.load(str(ckpt))
    assert resumed.step == engine.step
    for name, tensor in adapter_state(engine.model).items():
        assert torch.equal(adapter_state(resumed.model)[name], tensor)
    # both continue identically: the optimizer state came back too
    a = engine.train_step(batches(14, seed=5), token_nll_loss)["loss"]
    b = resumed.train_step(batches(14, seed=5), token_nll_loss)["loss"]
    assert a == pytest.approx(b, rel=1e-6)
    # a restarted rollout gets the base and the checkpoint's adapter
    reference = torch.tensor(random_sequences(1, 6, 7, 14, seed=2)[0])[None]

    async def main():
        gen = TorchGenerationEngine(str(ckpt), lora=SPEC)
        await gen.start()
        try:
            with torch.no_grad():
                torch.testing.assert_close(gen.model(reference), resumed_logits, rtol=1e-4, atol=1e-4)
            digest, _ = await gen.verify_weights(2)
            assert digest == weights_hash(read_adapter(str(ckpt))[1].items())
        finally:
            await gen.stop()

    again = TorchTrainEngine(str(ckpt), TrainConfig(lr=1e-2), lora=SPEC, version=2)
    again.load(str(ckpt))
    with torch.no_grad():
        resumed_logits = again.model.eval()(reference)
    run(main())


def test_adapter_of_another_base_model_is_refused(tmp_path):
    base_dir = str(tiny_model_dir(tmp_path / "base"))
    engine = TorchTrainEngine(base_dir, TrainConfig(), lora=SPEC)
    engine.save(str(tmp_path / "ckpt"))
    assert adapter_problem(str(tmp_path / "ckpt"), load_model(base_dir).config, SPEC) is None
    other = tiny_config(hidden_size=32, intermediate_size=64)
    problem = adapter_problem(str(tmp_path / "ckpt"), other, SPEC)
    assert problem.startswith(f"{tmp_path / 'ckpt'}: the adapter belongs to another base model ({base_dir}")
    with pytest.raises(CheckpointError, match="asks for rank 8"):
        TorchTrainEngine(base_dir, TrainConfig(), lora=LoraSpec(8, 8.0, target_modules=SPEC.target_modules),
                         start_adapter=str(tmp_path / "ckpt"))


def test_merge_equals_the_adapted_forward():
    model = tiny_model(seed=0)
    add_lora(model, SPEC, seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape) * 0.1)
    x = torch.tensor(random_sequences(1, 8, 9, 97, seed=4)[0])[None]
    base = {n + ".weight": dict(model.named_parameters())[n + ".weight"].detach() for n in
            {n.rsplit(".", 2)[0] for n in adapter_state(model)}}
    plain = tiny_model(seed=0)
    params = dict(plain.named_parameters())
    with torch.no_grad():
        for name, tensor in merged_weights(base, adapter_state(model), SPEC.scaling).items():
            params[name].copy_(tensor)
        torch.testing.assert_close(plain(x), model.eval()(x), rtol=1e-4, atol=1e-4)


def test_planner_memory_counts_adapters_not_the_frozen_base():
    from launch.plan.memory import TrainerLayout, lora_params, trainer_terms
    from launch.plan.shapes import BUILTIN

    shape = BUILTIN["7B"]
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    # per layer: q (3584 + 3584), k and v (3584 + 512 each), o (3584 + 3584), times rank 16, over 28 layers
    assert lora_params(shape, 16, targets) == 28 * 16 * (4 * 3584 + 2 * (3584 + 512))
    full = trainer_terms(shape, TrainerLayout())
    lora = trainer_terms(shape, TrainerLayout(lora_rank=16, lora_targets=targets))
    adapters = lora_params(shape, 16, targets)
    assert lora["optimizer"] == adapters * 8 and lora["gradients"] == adapters * 4
    assert lora["weights"] == full["weights"] and lora["activations"] == full["activations"]
    assert sum(lora.values()) < sum(full.values()) - 0.9 * (full["optimizer"] + full["gradients"])
    # tensor parallelism (the megatron trainer) splits B of q, k, v and A of o; A of q, k, v and B of o replicated
    assert lora_params(shape, 16, targets, tp=2) == 28 * 16 * ((3584 + 1792) + 2 * (3584 + 256) + (1792 + 3584))
    tp2 = trainer_terms(shape, TrainerLayout(tp=2, lora_rank=16, lora_targets=targets))
    assert tp2["optimizer"] == lora_params(shape, 16, targets, tp=2) * 8


def test_launch_check_refuses_lora_that_fits_nothing(tmp_path):
    from launch.inputs import _check_lora
    from topology.experiment import ExperimentConfig

    config = ExperimentConfig.model_validate({"model": {"path": "m", "lora": {"rank": 4, "target_modules": ["qkv"]}}})
    problems: list[str] = []
    _check_lora(config, tiny_config(), set(), problems)
    assert problems == ["experiment.model.lora.target_modules: ['qkv'] match no linear layer of Qwen2ForCausalLM "
                        "(its linear layers: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj)"]
    base_dir = str(tiny_model_dir(tmp_path / "base"))
    TorchTrainEngine(base_dir, TrainConfig(), lora=SPEC).save(str(tmp_path / "adapter"))
    config = ExperimentConfig.model_validate({"model": {"path": "m", "lora": {
        "rank": 4, "alpha": 8.0, "target_modules": list(SPEC.target_modules), "adapter": str(tmp_path / "adapter")}}})
    problems = []
    _check_lora(config, tiny_config(hidden_size=32, intermediate_size=64), {"megatron", "sglang"}, problems)
    assert len(problems) == 1   # the megatron trainer trains LoRA too: only the adapter made for another base
    assert problems[0].startswith("experiment.model.lora.adapter: ") and "belongs to another base model" in problems[0]
    # lm_head: an adapter on the torch trainer, refused before launch on the megatron trainer
    config = ExperimentConfig.model_validate({"model": {"path": "m", "lora": {"rank": 4, "target_modules": ["lm_head"]}}})
    problems = []
    _check_lora(config, tiny_config(), {"torch"}, problems)
    assert problems == []
    _check_lora(config, tiny_config(), {"megatron"}, problems)
    assert problems == ["experiment.model.lora.target_modules: ['lm_head'] are not adapted on the megatron trainer (it "
                        "adapts the decoder layers' down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj); "
                        "adapt those, or train on backend: torch"]


def test_export_writes_a_merged_checkpoint_and_an_adapter_peft_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from tools.export_lora import main as export_main

    base_dir = str(tiny_model_dir(tmp_path / "base"))
    engine = TorchTrainEngine(base_dir, TrainConfig(lr=1e-2), lora=SPEC)
    for _ in range(3):
        engine.train_step(batches(14), token_nll_loss)
    engine.save(str(tmp_path / "ckpt"))
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert export_main([str(tmp_path / "ckpt"), "--merged", str(merged), "--adapter", str(adapter)]) == 0
    ids = torch.tensor(random_sequences(2, 9, 9, 14, seed=6))
    with torch.no_grad():
        ours = engine.model.eval()(ids)
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
        with_adapter = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
        theirs = with_adapter(input_ids=ids).logits
        torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
        hf_merged = transformers.AutoModelForCausalLM.from_pretrained(str(merged), torch_dtype=torch.float32).eval()
        torch.testing.assert_close(hf_merged(input_ids=ids).logits, ours, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(load_model(str(merged))(ids), ours, rtol=1e-4, atol=1e-4)
    # an adapter directory that names no base (PEFT's own) needs --base; another base is refused with one line
    (adapter / "lora_base.json").unlink()
    assert export_main([str(adapter), "--merged", str(tmp_path / "again")]) == 2
    assert export_main([str(adapter), "--merged", str(tmp_path / "again"), "--base", base_dir]) == 0
    other = tiny_model_dir(tmp_path / "other")
    (other / "config.json").write_text(json.dumps({**json.loads((other / "config.json").read_text()), "num_hidden_layers": 1}))
    assert export_main([str(tmp_path / "ckpt"), "--merged", str(tmp_path / "x"), "--base", str(other)]) == 2


def test_bench_lora_sync_moves_fewer_bytes_than_full_weights(tmp_path):
    from tools.bench.lora_sync import run as bench

    result = run(bench(str(tiny_model_dir(tmp_path / "base")), SPEC, reps=1))
    assert result["lora"]["bytes"] == 4 * sum(4 * (i + o) for i, o in [(64, 64), (64, 32), (128, 64)]) * 2
    assert result["ratio_bytes"] > 10


def test_sglang_server_loads_each_adapter_by_name_and_comes_back_with_it_after_a_kill(tmp_path):
    """A launched stand-in SGLang server (testsupport/sglang_standin.py, as strict as SGLang 0.5.6's LoRA API):
    each adapter version is loaded by /load_lora_adapter as v<version> and named by every /generate; the previous
    one is unloaded; a server killed -9 is restarted with the current adapter (--lora-paths)."""
    import os
    import signal
    import sys
    import urllib.error
    import urllib.request

    from actors.engines.sglang import SGLangEngine
    from actors.engines.sglang_server import LaunchConfig

    base_dir = tiny_model_dir(tmp_path / "base")
    trainer = TorchTrainEngine(str(base_dir), TrainConfig(lr=1e-2), lora=SPEC)
    versions = []
    for steps in (6, 6):   # enough that base, v1 and v2 answer the prompt differently
        for _ in range(steps):
            trainer.train_step(batches(14), token_nll_loss)
        merged = load_model(str(base_dir))
        base = {n: p.detach() for n, p in merged.named_parameters()}
        with torch.no_grad():
            for name, tensor in merged_weights({m.rsplit(".", 2)[0] + ".weight": base[m.rsplit(".", 2)[0] + ".weight"]
                                                for m in adapter_state(trainer.model)},
                                               adapter_state(trainer.model), SPEC.scaling).items():
                dict(merged.named_parameters())[name].copy_(tensor)
        versions.append((list(trainer.export_weights(1 << 12)), merged.eval()))
    prompt = [1, 2, 3, 4]
    config = LaunchConfig(model_path=str(base_dir), command=[sys.executable, "-m", "testsupport.sglang_standin"],
                          lora_rank=SPEC.rank, lora_targets=SPEC.target_modules, log_path=str(tmp_path / "server.log"),
                          health_timeout_s=120.0, backoff_s=0.1)

    def post(url: str, route: str, body: dict) -> tuple[int, dict]:
        request = urllib.request.Request(url + route, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60.0) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    async def greedy(engine: SGLangEngine, rid: str):
        [r] = await engine.generate(GenerationRequest(rid, prompt, SamplingParams(temperature=0.0, max_new_tokens=5)))
        return r

    async def main():
        engine = SGLangEngine(launch=config, weights_dir=str(tmp_path / "w"), lora=SPEC)
        await engine.start()
        try:
            out = [await greedy(engine, "base")]
            for version, (buckets, _) in enumerate(versions, start=1):
                await engine.update_weights(version, iter(buckets))
                out.append(await greedy(engine, f"v{version}"))
            url = engine.url
            # as strict as SGLang: a name loaded twice, an adapter the memory pool cannot hold, an unloaded name
            again = await asyncio.to_thread(post, url, "/load_lora_adapter",
                                            {"lora_name": "v2", "lora_path": str(tmp_path / "w" / "lora-v2")})
            big = tmp_path / "big"
            TorchTrainEngine(str(base_dir), TrainConfig(), lora=LoraSpec(16, 8.0, target_modules=("q_proj",))).save(str(big))
            too_big = await asyncio.to_thread(post, url, "/load_lora_adapter", {"lora_name": "big", "lora_path": str(big)})
            unloaded = await asyncio.to_thread(post, url, "/generate", {"input_ids": prompt, "lora_path": "v1",
                                                                        "sampling_params": {"max_new_tokens": 1}})
            # killed -9: restarted with the current adapter, and labelled with its version
            server = engine.server
            os.kill(server.proc.pid, signal.SIGKILL)
            async with server.changed:
                await server.changed.wait_for(lambda: server.restarts >= 1 and server.healthy.is_set())
            out.append(await greedy(engine, "after-restart"))
            return out, again, too_big, unloaded
        finally:
            await engine.stop()

    out, again, too_big, unloaded = run_bounded(main(), timeout=240.0)
    base_model = load_model(str(base_dir)).eval()
    from testsupport.tiny_models import greedy_reference

    assert out[0].versions == [0] * 5 and out[0].output_ids == greedy_reference(base_model, prompt, 5)
    for version, (_, merged) in enumerate(versions, start=1):
        assert out[version].versions == [version] * 5
        assert out[version].output_ids == greedy_reference(merged, prompt, 5)
    assert out[3].versions == [2] * 5 and out[3].output_ids == out[2].output_ids
    assert len({tuple(r.output_ids) for r in out[:3]}) == 3   # each adapter changed the answers, none stacked
    assert again[0] == 400 and "because it is already loaded" in again[1]["error_message"]
    assert too_big[0] == 400 and "incompatible with the current LoRA memory pool" in too_big[1]["error_message"]
    assert unloaded[0] == 400 and "never been loaded: v1" in unloaded[1]["error"]["message"]


def test_the_final_evaluation_scores_a_lora_run_s_adapter_checkpoint(tmp_path):
    # A LoRA run's last checkpoint holds the adapter alone (no model.safetensors): the final evaluation once
    # skipped it as "no weights" and reported the start model only.
    from actors.runtime.recovery import checkpoint_dir, mark_complete
    from launch.evaluation import final_evaluation
    from topology.experiment import ExperimentConfig

    base_dir = str(tiny_model_dir(tmp_path / "base"))
    engine = TorchTrainEngine(base_dir, TrainConfig(lr=1e-2), lora=SPEC)
    engine.train_step(batches(), token_nll_loss)
    run_dir = tmp_path / "run"
    ckpt = checkpoint_dir(run_dir, 1)
    engine.save(str(ckpt / "model"))
    assert not (ckpt / "model" / "model.safetensors").exists()
    (ckpt / "buffer.json").write_text("{}")
    mark_complete(ckpt, {"step": 1})
    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps({"query_id": str(i), "prompt": f"{i}+1=", "answer": str(i + 1), "level": 1})
                            + "\n" for i in range(2)))
    config = ExperimentConfig.model_validate({
        "data": {"test": str(test)}, "gen": {"max_new_tokens": 4}, "eval": {"samples": 0},
        "model": {"path": base_dir, "lora": {"rank": SPEC.rank, "alpha": SPEC.alpha,
                                             "target_modules": list(SPEC.target_modules)}}})
    summary = final_evaluation(config, run_dir)
    assert summary is not None and set(summary["greedy_accuracy"]) == {"start", "final"}, summary
    assert summary["final_model"] == str(ckpt / "model") and "gain_points" in summary
    lines = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["model"] for e in lines] == ["start", "final"] and lines[1]["step"] == 1
