"""The Megatron-core trainer backend against the embedded torch backend, on CPU with gloo.

Every Megatron run happens in child processes (one per rank; torch.distributed and megatron's
parallel_state are process-global), with the test-only CPU shim (tests/megatron_cpu_shim.py) installed in
the child. The parent computes the torch backend's reference on the same weights and compares:
log-probs and entropies to 1e-5, the training step's loss, and the updated weights exported as
Hugging Face buckets. World size 1, TP=2 (fused QKV split across ranks, padded vocabulary shards) and
DP=2 (distributed optimizer, gradients summed across ranks); Qwen3 (q/k norms) and Qwen3-MoE (router, experts,
expert parallelism over the alltoall dispatcher, routing replay).

Needs megatron-core 0.11: `pip install --no-deps megatron-core==0.11.0 einops`; skipped without it.
"""
from __future__ import annotations

import os
import time
import traceback
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from actors.engines import megatron as mg
from actors.engines.base import PackedBatch
from actors.engines.checkpoint import hf_state_dict, load_model, save_model
from actors.engines.model import Qwen2Config
from actors.engines.torch_train import TorchTrainEngine, TrainConfig, token_nll_loss
from testsupport.tiny_models import random_sequences, tiny_model
from transport.ports import free_port

needs_megatron = pytest.mark.skipif(not mg.is_available(),
                                    reason=f"megatron-core not importable ({mg.MEGATRON_IMPORT_ERROR}); "
                                           "pip install --no-deps megatron-core==0.11.0 einops")
CTX = mp.get_context("fork")  # torch (and megatron) are imported already: fork is far cheaper than spawn
LR = 1e-3                      # large enough that a wrong update would show in the weights
RUN_TIMEOUT_S = 120.0


def _batches(vocab: int) -> list[PackedBatch]:
    seqs = random_sequences(6, 3, 14, vocab, seed=11)
    masks = [[0.0] * 2 + [1.0] * (len(s) - 2) for s in seqs]  # a prompt of 2 tokens, then the answer
    return [PackedBatch.from_sequences(seqs[i:i + 3], {"loss_mask": masks[i:i + 3]}) for i in (0, 3)]


def _whole(batches: list[PackedBatch]) -> PackedBatch:
    """All micro-batches' sequences packed into one stream."""
    a, b = batches
    return PackedBatch(torch.cat([a.input_ids, b.input_ids]), torch.cat([a.cu_seqlens, b.cu_seqlens[1:] + a.num_tokens]),
                       torch.cat([a.position_ids, b.position_ids]))


def _worker(rank: int, world: int, port: int, model_dir: str, out_dir: str, settings: dict[str, Any]) -> None:
    """One Megatron rank: joins the world, builds the engine, runs settings["body"] (default: the engine
    checks below) and leaves what it returns in out_dir/rank{rank}.pt (a traceback in rank{rank}.err)."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank))
        torch.set_num_threads(1)
        from tests import megatron_cpu_shim
        megatron_cpu_shim.install()
        config = mg.MegatronConfig(lr=LR, **settings["config"])
        engine = mg.MegatronTrainEngine(model_dir, config, **settings.get("engine", {}))
        if engine.device.type == "cpu":
            # On a GPU, init_distributed seeds Megatron's CUDA RNG tracker (sequence parallelism and full
            # recompute fork it); the shim runs that tracker on the CPU generator, seeded the same way here.
            mg.tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
        out = settings.get("body", _engine_checks)(engine, out_dir, settings)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _engine_checks(engine: Any, out_dir: str, settings: dict[str, Any]) -> dict[str, Any]:
    batches = _batches(engine.hf_config.vocab_size)
    out: dict[str, Any] = {"dp_rank": engine.dp_rank, "tp_rank": engine.tp_rank,
                           "experts": (engine.ep_size, engine.etp_size, engine.local_experts)}
    whole = _whole(batches)
    for temperature in (1.0, 0.7):
        res = engine.compute_logprobs(whole, temperature=temperature, with_entropy=True)
        out[f"logprobs_{temperature}"], out[f"entropy_{temperature}"] = res.logprobs, res.entropy
    mine = batches if engine.dp_size == 1 else [batches[engine.dp_rank]]
    out["stats"] = engine.train_step(mine, token_nll_loss)
    out["weights"] = {k: v for bucket in engine.export_weights(settings.get("bucket_bytes", 8192))
                      for k, v in bucket}
    out["after_step_logprobs"] = engine.compute_logprobs(whole).logprobs
    if settings.get("checkpoint"):
        out.update(_save_step_load_step(engine, out_dir, batches))
    return out


def _save_step_load_step(engine: Any, out_dir: str, batches: list[PackedBatch]) -> dict[str, Any]:
    """Save to out_dir/ckpt, take a step, load the checkpoint and take the same step again: both steps' stats
    and exported weights."""
    ckpt = os.path.join(out_dir, "ckpt")
    engine.save(ckpt)
    out: dict[str, Any] = {"second_step": engine.train_step(batches, token_nll_loss),
                           "second_weights": {k: v for b in engine.export_weights() for k, v in b}}
    engine.load(ckpt)
    out["version_after_load"] = engine.version
    out["replayed_step"] = engine.train_step(batches, token_nll_loss)
    out["replayed_weights"] = {k: v for b in engine.export_weights() for k, v in b}
    return out


def _run(world: int, model_dir: str, out_dir: str, settings: dict[str, Any]) -> list[dict[str, Any]]:
    port = free_port()
    procs = [CTX.Process(target=_worker, args=(r, world, port, model_dir, out_dir, settings), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join(5)
    errors = [open(os.path.join(out_dir, f)).read() for f in sorted(os.listdir(out_dir)) if f.endswith(".err")]
    assert not errors, "rank failed:\n" + "\n".join(errors)
    assert not alive, f"{len(alive)} rank(s) still running after {RUN_TIMEOUT_S} s"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _reference(model_dir: str) -> dict[str, Any]:
    """The torch backend on the same weights: log-probs, one step on all micro-batches, exported weights."""
    engine = TorchTrainEngine(model_dir, TrainConfig(lr=LR))
    batches = _batches(engine.model.config.vocab_size)
    whole = _whole(batches)
    out: dict[str, Any] = {}
    for temperature in (1.0, 0.7):
        res = engine.compute_logprobs(whole, temperature=temperature, with_entropy=True)
        out[f"logprobs_{temperature}"], out[f"entropy_{temperature}"] = res.logprobs, res.entropy
    out["stats"] = engine.train_step(batches, token_nll_loss)
    out["weights"] = {k: v for bucket in engine.export_weights() for k, v in bucket}
    out["after_step_logprobs"] = engine.compute_logprobs(whole).logprobs
    out["initial"] = hf_state_dict(load_model(model_dir))
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _check_against_reference(ref: dict[str, Any], got: dict[str, Any], report: dict[str, float]) -> None:
    for temperature in (1.0, 0.7):
        d_lp = float((got[f"logprobs_{temperature}"] - ref[f"logprobs_{temperature}"]).abs().max())
        d_ent = float((got[f"entropy_{temperature}"] - ref[f"entropy_{temperature}"]).abs().max())
        assert d_lp < 1e-5 and d_ent < 1e-5, (temperature, d_lp, d_ent)
        report[f"logprob_diff_T{temperature}"] = max(d_lp, report.get(f"logprob_diff_T{temperature}", 0.0))
    assert got["stats"]["loss"] == pytest.approx(ref["stats"]["loss"], abs=1e-5)
    assert got["stats"]["tokens"] == ref["stats"]["tokens"] and got["stats"]["nll"] == pytest.approx(
        ref["stats"]["nll"], abs=1e-5)
    assert got["stats"]["grad_norm"] == pytest.approx(ref["stats"]["grad_norm"], rel=1e-5)
    d_w = _max_diff(got["weights"], ref["weights"])
    moved = _max_diff(ref["weights"], ref["initial"])
    assert d_w < 1e-5 and moved > 100 * d_w, (d_w, moved)  # the step moved the weights, identically
    d_after = float((got["after_step_logprobs"] - ref["after_step_logprobs"]).abs().max())
    assert d_after < 1e-4, d_after
    report.update(loss_diff=abs(got["stats"]["loss"] - ref["stats"]["loss"]), weight_diff=d_w, weight_moved=moved,
                  after_step_logprob_diff=d_after)


def _model_dir(tmp_path, **overrides: Any) -> str:
    d = str(tmp_path / "model")
    save_model(tiny_model(0, **overrides), d)
    return d


# --- conversion (pure functions; no megatron needed) -----------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_hf_megatron_conversion_round_trips_under_tp(tp: int) -> None:
    model = tiny_model(3, num_attention_heads=8, num_key_value_heads=4, hidden_size=64)
    cfg: Qwen2Config = model.config
    hf = hf_state_dict(model)
    mc_names = ["embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"]
    for rest in ("input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                 "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight",
                 "mlp.linear_fc2.weight"):
        mc_names += [f"decoder.layers.{i}.{rest}" for i in range(cfg.num_hidden_layers)]
    padded = 104  # 97 rounded up to a multiple of 8
    back: dict[str, torch.Tensor] = {}
    for name in mc_names:
        pm = mg.param_map(name, 0)
        shards = [mg.hf_to_megatron_shard(pm, [hf[n] for n in pm.hf_names], cfg, r, tp, padded) for r in range(tp)]
        back.update(mg.megatron_shards_to_hf(pm, shards, cfg))
    assert sorted(back) == sorted(hf)
    for name in hf:
        assert torch.equal(back[name], hf[name]), name


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2), (2, 4)])
def test_qwen3_moe_conversion_round_trips_under_tp_and_ep(tp: int, ep: int) -> None:
    # Layer 0 dense (mlp_only_layers), layer 1 sparse: q/k norms, router, 8 experts split 8 / ep per EP rank.
    model = tiny_model(3, family="qwen3_moe", mlp_only_layers=[0])
    cfg, hf = model.config, hf_state_dict(model)
    local = cfg.num_experts // ep
    layer = ["input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
             "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight", "pre_mlp_layernorm.weight"]
    mc_names = ["embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"]
    mc_names += [f"decoder.layers.{i}.{rest}" for i in range(2) for rest in layer]
    mc_names += ["decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight",
                 "decoder.layers.1.mlp.router.weight"]
    experts = [f"decoder.layers.1.mlp.experts.local_experts.{j}.linear_fc{f}.weight" for j in range(local) for f in (1, 2)]
    back: dict[str, torch.Tensor] = {}
    for name, ep_rank in [(n, 0) for n in mc_names] + [(n, r) for n in experts for r in range(ep)]:
        pm = mg.param_map(name, 0, ep_rank * local)
        assert pm.expert == (name in experts)
        shards = [mg.hf_to_megatron_shard(pm, [hf[n] for n in pm.hf_names], cfg, r, tp, 104) for r in range(tp)]
        for hf_name, tensor in mg.megatron_shards_to_hf(pm, shards, cfg):
            assert hf_name not in back, hf_name        # every Hugging Face tensor comes from one place
            back[hf_name] = tensor
    assert sorted(back) == sorted(hf)
    for name in hf:
        assert torch.equal(back[name], hf[name]), name
    assert mg.param_map("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", 1, 4).hf_names == (
        "model.layers.1.mlp.experts.5.gate_proj.weight", "model.layers.1.mlp.experts.5.up_proj.weight")


def test_fused_qkv_shard_holds_whole_query_groups() -> None:
    """TP rank r's fused QKV rows: for each of its query groups, that group's query heads, key, value."""
    model = tiny_model(0, num_attention_heads=4, num_key_value_heads=2)
    cfg, hf, d = model.config, hf_state_dict(model), model.config.head_dim
    names = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.self_attn.v_proj.weight")
    pm = mg.param_map("decoder.layers.0.self_attention.linear_qkv.weight", 0)
    assert pm.hf_names == names
    shard1 = mg.hf_to_megatron_shard(pm, [hf[n] for n in names], cfg, 1, 2, 128)
    q, k, v = (hf[n] for n in names)
    expected = torch.cat([q[2 * d:4 * d], k[d:2 * d], v[d:2 * d]])  # group 1: query heads 2, 3; kv head 1
    assert torch.equal(shard1, expected)
    assert mg.param_map("decoder.layers.1.mlp.linear_fc1.weight", 2).hf_names == (
        "model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight")  # pipeline layer offset


def _run_on_new_model(tmp_path, world: int, settings: dict[str, Any], **overrides: Any) -> tuple[Any, list[dict]]:
    """A fresh model directory; the torch backend's reference on it and the outputs of `world` Megatron ranks
    (a checkpoint, when asked for, lands in tmp_path/out/ckpt)."""
    model_dir = _model_dir(tmp_path, **overrides)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    return _reference(model_dir), _run(world, model_dir, str(out_dir), settings)


# --- against the torch backend ------------------------------------------------------------------------------
@needs_megatron
def test_world_size_1_matches_torch_backend_and_checkpoint_resumes(tmp_path) -> None:
    ref, [got] = _run_on_new_model(tmp_path, 1, {"config": {}, "checkpoint": True})
    report: dict[str, float] = {}
    _check_against_reference(ref, got, report)
    print("megatron ws=1 vs torch:", report)
    # The checkpoint is a Hugging Face model directory holding the weights after the first step ...
    saved = hf_state_dict(load_model(str(tmp_path / "out" / "ckpt")))
    assert _max_diff(saved, got["weights"]) == 0.0
    # ... and resuming from it replays the second step bit for bit.
    assert got["version_after_load"] == 1
    assert got["replayed_step"] == got["second_step"]
    assert _max_diff(got["replayed_weights"], got["second_weights"]) == 0.0


@needs_megatron
def test_tensor_parallel_2_matches_torch_backend(tmp_path) -> None:
    # vocab 97 padded to 98: rank 1's shard mixes real columns with one padding column.
    ref, ranks = _run_on_new_model(tmp_path, 2, {"config": {"tensor_parallel": 2, "vocab_pad_multiple": 1}})
    report: dict[str, float] = {}
    for got in ranks:  # every TP rank has the full log-probs and the same stats
        _check_against_reference(ref, {**got, "weights": ranks[0]["weights"]}, report)
    assert ranks[1]["weights"] == {}  # buckets come out on TP rank 0 only
    print("megatron tp=2 vs torch:", report)


@needs_megatron
@pytest.mark.parametrize("memory", [
    {"sequence_parallel": True, "recompute": "selective", "logprob_chunk_tokens": 7},
    {"sequence_parallel": False, "recompute": "full", "logprob_chunk_tokens": 5},
], ids=["sp-selective-chunk7", "full-chunk5"])
def test_memory_savers_at_tensor_parallel_2_give_the_same_step(tmp_path, memory) -> None:
    # Sequence parallelism (the 2 x 3-sequence micro-batches have odd token counts: padded for the split),
    # activation recompute and chunked log-probs change where memory goes, not one number of the step.
    ref, ranks = _run_on_new_model(tmp_path, 2, {"config": {"tensor_parallel": 2, "vocab_pad_multiple": 1, **memory}})
    report: dict[str, float] = {}
    for got in ranks:
        _check_against_reference(ref, {**got, "weights": ranks[0]["weights"]}, report)
    print("megatron tp=2", memory, "vs torch:", report)


def _largest_float32_intermediates(engine: Any, out_dir: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The largest float32 tensor any op makes while computing log-probs and entropy of bf16 logits and their
    gradient, chunked and not (bf16 logits, as on a GPU: the float32 ones are the computation's own)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.numel = max(self.numel, t.numel())
            return out

    n, vocab = settings["tokens"], 1000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(n, vocab, generator=gen).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    out: dict[str, Any] = {}
    for chunk in (0, settings["chunk"]):
        x = logits.clone().requires_grad_()
        with Largest() as largest:
            lp, ent = mg.chunked_vocab_parallel_logprobs(x, targets, 0, vocab, 1.0, True, chunk)
            (lp.sum() + ent.sum()).backward()
        out[chunk] = {"largest": largest.numel, "logprobs": lp.detach(), "grad": x.grad.float()}
    return out


@needs_megatron
def test_chunked_logprobs_peak_is_bounded_by_the_chunk_not_the_sequence(tmp_path) -> None:
    model_dir = _model_dir(tmp_path)
    (tmp_path / "out").mkdir()
    tokens, chunk = 512, 64
    [got] = _run(1, model_dir, str(tmp_path / "out"), {"config": {}, "body": _largest_float32_intermediates,
                                                        "tokens": tokens, "chunk": chunk})
    whole, chunked = got[0], got[chunk]
    assert whole["largest"] >= tokens * 1000                  # unchunked: float32 tensors as large as the logits
    assert chunked["largest"] <= chunk * 1000                 # chunked: never more than one chunk's worth
    assert torch.equal(chunked["logprobs"], whole["logprobs"])
    torch.testing.assert_close(chunked["grad"], whole["grad"], atol=0, rtol=0)
    print(f"largest float32 intermediate: {whole['largest'] * 4 / 2**20:.2f} MiB for {tokens} tokens, "
          f"{chunked['largest'] * 4 / 2**20:.2f} MiB in chunks of {chunk}")


@needs_megatron
def test_data_parallel_2_matches_torch_backend(tmp_path) -> None:
    # Each DP rank trains on its own micro-batch; the default denominator is the global token count.
    ref, ranks = _run_on_new_model(tmp_path, 2, {"config": {}}, tie_word_embeddings=True)
    report: dict[str, float] = {}
    for got in ranks:
        _check_against_reference(ref, {**got, "weights": ranks[0]["weights"]}, report)
    assert ranks[1]["weights"] == {}  # buckets come out on data-parallel rank 0 only
    assert "lm_head.weight" not in ranks[0]["weights"]  # tied: stored once, as Hugging Face does
    print("megatron dp=2 vs torch:", report)


@needs_megatron
def test_pipeline_parallel_2_matches_torch_backend_and_checkpoint_resumes(tmp_path) -> None:
    # Tied embeddings across stages (Megatron all-reduces the embedding and output-layer gradients).
    ref, ranks = _run_on_new_model(tmp_path, 2, {"config": {"pipeline_parallel": 2}, "checkpoint": True},
                                   tie_word_embeddings=True)
    # Each stage exports its own layers; together they are the whole model.
    first, last = ranks[0]["weights"], ranks[1]["weights"]
    assert "model.embed_tokens.weight" in first and "model.norm.weight" in last
    assert all(".layers.0." in k for k in first if ".layers." in k) and all(".layers.1." in k for k in last
                                                                             if ".layers." in k)
    both = {**first, **last}
    report: dict[str, float] = {}
    for got in ranks:
        _check_against_reference(ref, {**got, "weights": both}, report)
    print("megatron pp=2 vs torch:", report)
    # One safetensors file per stage with an index: a Hugging Face model directory.
    assert _max_diff(hf_state_dict(load_model(str(tmp_path / "out" / "ckpt"))), both) == 0.0
    for got in ranks:
        assert got["replayed_step"] == got["second_step"]
        assert _max_diff(got["replayed_weights"], got["second_weights"]) == 0.0  # each stage: its own layers


@needs_megatron
def test_config_errors_name_the_cause() -> None:
    cfg = tiny_model(0).config  # 2 key/value heads, 2 layers
    with pytest.raises(ValueError, match="num_key_value_heads"):
        mg.transformer_config(cfg, mg.MegatronConfig(tensor_parallel=4))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        mg.transformer_config(cfg, mg.MegatronConfig(pipeline_parallel=3))
    with pytest.raises(ValueError, match="tensor_parallel"):
        mg.MegatronConfig(tensor_parallel=0)
    with pytest.raises(ValueError, match="attention"):
        mg.MegatronConfig(attention="flash")
    with pytest.raises(ValueError, match="expert_parallel"):
        mg.MegatronConfig(expert_parallel=0)
    moe = tiny_model(0, family="qwen3_moe").config   # 8 experts, moe_intermediate_size 32
    with pytest.raises(ValueError, match=r"expert_parallel \(3\) must divide num_experts \(8\)"):
        mg.transformer_config(moe, mg.MegatronConfig(expert_parallel=3))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        mg.transformer_config(cfg, mg.MegatronConfig(expert_parallel=2))
    with pytest.raises(ValueError, match="expert_tensor_parallel 2 together with expert_parallel > 1 is not supported"):
        mg.transformer_config(moe, mg.MegatronConfig(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=2,
                                                     sequence_parallel=True))
    with pytest.raises(ValueError, match="expert_tensor_parallel must be 1 or tensor_parallel"):
        mg.MegatronConfig(tensor_parallel=4, expert_tensor_parallel=2)
    # the default: experts whole with expert parallelism (MoE parallel folding), split as the dense layers without
    assert mg.MegatronConfig(tensor_parallel=2, expert_parallel=2).expert_tensor_parallel == 1
    assert mg.MegatronConfig(tensor_parallel=2).expert_tensor_parallel == 2
    assert mg.transformer_config(moe, mg.MegatronConfig(tensor_parallel=2, expert_parallel=2, sequence_parallel=True)
                                 ).expert_tensor_parallel_size == 1
    with pytest.raises(ValueError, match="needs sequence_parallel: true"):
        mg.transformer_config(moe, mg.MegatronConfig(tensor_parallel=2))
    with pytest.raises(mg.MegatronUnavailableError, match="mixture-of-experts"):
        mg.layer_spec(mg.MegatronConfig(attention="te"), torch.device("cpu"), mg.transformer_config(moe, mg.MegatronConfig()))
    # norm_topk_prob false: softmax over all experts, then the top k as they are (megatron's pre-softmax)
    assert mg.transformer_config(moe, mg.MegatronConfig()).moe_router_pre_softmax is False
    unnormalised = tiny_model(0, family="qwen3_moe", norm_topk_prob=False).config
    assert mg.transformer_config(unnormalised, mg.MegatronConfig()).moe_router_pre_softmax is True


# --- the trainer's step over a data-parallel world ----------------------------------------------------------
def _trainer_share(engine: Any, out_dir: str, settings: dict[str, Any]) -> dict[str, Any]:
    from actors.trainer.actor import StepConfig, train_share
    batch = torch.load(settings["batch"], weights_only=False)
    share = train_share(engine, batch, StepConfig.defaults(minibatches=2), version=0)
    return {"share": share, "data_parallel": engine.data_parallel,
            "weights": {k: v for b in engine.export_weights() for k, v in b}}


@needs_megatron
def test_trainer_step_over_two_data_parallel_ranks_matches_one_torch_process(tmp_path) -> None:
    # What trainer ranks > 0 do in a multi-rank trainer: the same train_share on the same batch, each
    # replica on its own micro-batches of every PPO minibatch; rank 0 merges the shares' statistics.
    from testsupport.tiny_models import sampled_batch
    from actors.trainer.actor import StepConfig, step_metrics, train_on_batch
    model_dir = _model_dir(tmp_path)
    batch = sampled_batch(load_model(model_dir), groups=4, n=4)
    torch.save(batch, tmp_path / "batch.pt")
    reference = TorchTrainEngine(model_dir, TrainConfig(lr=LR))
    expected = train_on_batch(reference, batch, StepConfig.defaults(minibatches=2), version=0)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    ranks = _run(2, model_dir, str(out_dir), {"config": {}, "body": _trainer_share, "batch": str(tmp_path / "batch.pt")})
    assert [r["data_parallel"] for r in ranks] == [(0, 2), (1, 2)]
    shares = [r["share"] for r in ranks]
    assert all(s.ppo.n_tokens > 0 for s in shares)              # both replicas trained on part of the batch
    assert sum(s.ppo.n_tokens for s in shares) == expected["n_tokens"]
    got = step_metrics(batch, 0, shares)
    for key in ("loss", "grad_norm", "importance_weight", "importance_weight_max", "ppo_approx_kl",
                "actor_clip_ratio", "entropy", "behav_masked_frac", "lr"):
        assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-5), key
    assert got["logprob_gap_max"] < 1e-4 and expected["logprob_gap_max"] < 1e-4
    torch_weights = {k: v for b in reference.export_weights() for k, v in b}
    d_w = _max_diff(ranks[0]["weights"], torch_weights)
    moved = _max_diff(torch_weights, hf_state_dict(load_model(model_dir)))
    assert d_w < 1e-5 and moved > 100 * d_w, (d_w, moved)
    assert ranks[1]["weights"] == {}                             # buckets come out on rank 0 only


def _store_reachable_on(engine: Any, out_dir: str, settings: dict[str, Any]) -> dict[str, Any]:
    import socket

    import torch.distributed as dist

    port = int(os.environ["MASTER_PORT"])
    out = {}
    for addr in ("127.0.0.1", "127.0.0.2"):    # MASTER_ADDR, and another address of this machine
        try:
            socket.create_connection((addr, port), timeout=5).close()
            out[addr] = True
        except ConnectionRefusedError:
            out[addr] = False
    out["world"] = dist.get_world_size()
    return out


@needs_megatron
def test_the_trainer_worlds_rendezvous_listens_on_master_addr_only(tmp_path) -> None:
    # env:// has rank 0's store listen on every interface: a one-node trainer world was open to the network.
    model_dir = _model_dir(tmp_path)
    (tmp_path / "out").mkdir()
    [got] = _run(1, model_dir, str(tmp_path / "out"), {"config": {}, "body": _store_reachable_on})
    assert got == {"127.0.0.1": True, "127.0.0.2": False, "world": 1}


# --- Qwen3 and Qwen3-MoE ---------------------------------------------------------------------------------------
@needs_megatron
@pytest.mark.parametrize("world,config", [(1, {}), (2, {"tensor_parallel": 2, "vocab_pad_multiple": 1})],
                         ids=["ws1", "tp2"])
def test_qwen3_matches_torch_backend(tmp_path, world, config) -> None:
    # q/k RMSNorm per head (q_layernorm/k_layernorm, gradients summed over TP ranks), no q/k/v bias, head_dim 16
    # beside hidden 64 / 4 heads (kv_channels).
    ref, ranks = _run_on_new_model(tmp_path, world, {"config": config}, family="qwen3")
    report: dict[str, float] = {}
    for got in ranks:
        _check_against_reference(ref, {**got, "weights": ranks[0]["weights"]}, report)
    assert "model.layers.1.self_attn.k_norm.weight" in ranks[0]["weights"]
    print(f"megatron qwen3 {config} vs torch:", report)


@needs_megatron
@pytest.mark.parametrize("world,config", [
    (1, {}),
    (2, {"expert_parallel": 2}),                                   # the alltoall dispatcher over gloo
    (2, {"tensor_parallel": 2, "vocab_pad_multiple": 1, "sequence_parallel": True}),  # experts split over TP
    # MoE parallel folding: attention split over TP=2 with sequence parallelism, the experts whole (ETP=1) and
    # split over EP=2 on the same two ranks (dp 1, expert dp 1)
    (2, {"tensor_parallel": 2, "expert_parallel": 2, "vocab_pad_multiple": 1, "sequence_parallel": True}),
], ids=["ws1", "ep2", "tp2", "tp2ep2etp1"])
def test_qwen3_moe_matches_torch_backend(tmp_path, world, config) -> None:
    # 8 experts, top 2 renormalised (norm_topk_prob); layer 0 dense (mlp_only_layers) at intermediate_size 128,
    # layer 1 sparse at moe_intermediate_size 32. EP=2: each rank holds 4 experts and trains on its own
    # micro-batch (dp=2); the export publishes all 8 experts of layer 1 once, under their Hugging Face numbers.
    checkpoint = "expert_parallel" in config or world == 1
    ref, ranks = _run_on_new_model(tmp_path, world, {"config": config, "checkpoint": checkpoint},
                                   family="qwen3_moe", mlp_only_layers=[0])
    report: dict[str, float] = {}
    for got in ranks:
        _check_against_reference(ref, {**got, "weights": ranks[0]["weights"]}, report)
    assert all(r["weights"] == {} for r in ranks[1:])
    if config.get("expert_parallel") and config.get("tensor_parallel"):   # folded: 4 whole experts a rank
        assert [r["experts"] for r in ranks] == [(2, 1, 4)] * 2
    experts = {k for k in ranks[0]["weights"] if ".mlp.experts." in k}
    assert experts == {f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in range(8) for p in ("gate", "up", "down")}
    if checkpoint:   # a Hugging Face directory with every expert; resuming replays the next step bit for bit
        assert _max_diff(hf_state_dict(load_model(str(tmp_path / "out" / "ckpt"))), ranks[0]["weights"]) == 0.0
        for got in ranks:
            assert got["replayed_step"] == got["second_step"]
        assert _max_diff(ranks[0]["replayed_weights"], ranks[0]["second_weights"]) == 0.0
    print(f"megatron qwen3_moe {config} vs torch:", report)


def _with_routes(batch: PackedBatch, layers: int, experts: int, top_k: int, seed: int) -> PackedBatch:
    """The batch with fields['routed_experts']: each token's top_k distinct random experts per sparse layer, every
    third token routed natively (ROUTE_NATIVE)."""
    from actors.engines.moe import ROUTE_NATIVE
    gen = torch.Generator().manual_seed(seed)
    routes = torch.stack([torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(layers)])
                          for _ in range(batch.num_tokens)])
    routes[::3] = ROUTE_NATIVE
    return PackedBatch(batch.input_ids, batch.cu_seqlens, batch.position_ids, {**batch.fields, "routed_experts": routes})


def _replay_batches(cfg: Any) -> tuple[PackedBatch, list[PackedBatch]]:
    shape = (len(cfg.sparse_layers), cfg.num_experts, cfg.num_experts_per_tok)
    batches = _batches(cfg.vocab_size)
    return (_with_routes(_whole(batches), *shape, seed=5),
            [_with_routes(b, *shape, seed=6 + i) for i, b in enumerate(batches)])


def _replay_checks(engine: Any, out_dir: str, settings: dict[str, Any]) -> dict[str, Any]:
    whole, batches = _replay_batches(engine.hf_config)
    mine = batches if engine.dp_size == 1 else [batches[engine.dp_rank]]
    return {"native": engine.compute_logprobs(_whole(_batches(engine.hf_config.vocab_size))).logprobs,
            "replayed": engine.compute_logprobs(whole).logprobs,
            "stats": engine.train_step(mine, token_nll_loss),
            "weights": {k: v for b in engine.export_weights() for k, v in b}}


@needs_megatron
@pytest.mark.parametrize("world,config", [
    (1, {}), (2, {"expert_parallel": 2}), (2, {"pipeline_parallel": 2}),
    (2, {"tensor_parallel": 2, "expert_parallel": 2, "vocab_pad_multiple": 1, "sequence_parallel": True}),
], ids=["ws1", "ep2", "pp2", "tp2ep2etp1"])
def test_qwen3_moe_routing_replay_matches_torch_backend(tmp_path, world, config) -> None:
    # algo.routing_replay r3: the batch's fields['routed_experts'] replace each router's top-k (rows of
    # ROUTE_NATIVE keep their own); both sparse layers replayed, on one stage each under PP=2; under TP=2 with
    # sequence parallelism each rank's routers replay its half of the tokens.
    model_dir = _model_dir(tmp_path, family="qwen3_moe")
    reference = TorchTrainEngine(model_dir, TrainConfig(lr=LR))
    whole, batches = _replay_batches(reference.model.config)
    native = reference.compute_logprobs(_whole(_batches(reference.model.config.vocab_size))).logprobs
    replayed = reference.compute_logprobs(whole).logprobs
    stats = reference.train_step(batches, token_nll_loss)
    weights = {k: v for b in reference.export_weights() for k, v in b}
    (tmp_path / "out").mkdir()
    ranks = _run(world, model_dir, str(tmp_path / "out"), {"config": config, "body": _replay_checks})
    exported = {k: v for r in ranks for k, v in r["weights"].items()}
    assert float((replayed - native).abs().max()) > 1e-2    # the replayed routes change the log-probs (1000x the tolerance)
    for got in ranks:
        assert float((got["native"] - native).abs().max()) < 1e-5
        assert float((got["replayed"] - replayed).abs().max()) < 1e-5
        assert got["stats"]["loss"] == pytest.approx(stats["loss"], abs=1e-5)
    d_w = _max_diff(exported, weights)
    assert d_w < 1e-5, d_w
    print(f"megatron qwen3_moe replay {config}: replayed logprob diff "
          f"{max(float((g['replayed'] - replayed).abs().max()) for g in ranks):.2e}, weight diff {d_w:.2e}")
