"""The Qwen2 model and its checkpoints against transformers' Qwen2ForCausalLM (float32)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from actors.engines.checkpoint import CheckpointError, load_model, save_model
from actors.engines.model import ConfigError, Qwen2Config, Qwen2ForCausalLM, block_diagonal_mask
from testsupport.tiny_models import random_sequences, tiny_model

transformers = pytest.importorskip("transformers")

ATOL = 2e-5


def hf_load(path: str):
    return transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("tied,kv_heads", [(False, 2), (True, 4)])
def test_logits_match_transformers_without_and_with_kv_cache(tmp_path, tied, kv_heads):
    ours = tiny_model(seed=3, tie_word_embeddings=tied, num_key_value_heads=kv_heads)
    save_model(ours, str(tmp_path))
    hf = hf_load(str(tmp_path))
    ids = torch.tensor(random_sequences(2, 17, 17, 97, seed=1))
    with torch.no_grad():
        reference = hf(ids).logits
        torch.testing.assert_close(ours(ids), reference, atol=ATOL, rtol=0)
        # Our KV-cache path: prefill 6 tokens, then decode one token at a time.
        cache = ours.new_cache(2, 4)
        logits = ours.prefill(ids[:, :6], torch.tensor([6, 6]), cache)
        torch.testing.assert_close(logits, reference[:, 5], atol=ATOL, rtol=0)
        for t in range(6, ids.shape[1]):
            logits = ours.decode(ids[:, t], torch.tensor([t, t]), cache)
            torch.testing.assert_close(logits, reference[:, t], atol=ATOL, rtol=0)
        # transformers' own KV cache agrees with the same numbers.
        out = hf(ids[:, :6], use_cache=True)
        past = out.past_key_values
        for t in range(6, ids.shape[1]):
            out = hf(ids[:, t:t + 1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            torch.testing.assert_close(out.logits[:, -1], reference[:, t], atol=ATOL, rtol=0)


def test_loads_a_directory_written_by_transformers_save_pretrained(tmp_path):
    cfg = transformers.Qwen2Config(vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                                   rope_theta=50000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    hf.save_pretrained(str(tmp_path), max_shard_size="20KB")  # forces shards + index
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    ours = load_model(str(tmp_path))
    assert ours.config.rope_theta == 50000.0 and ours.config.head_dim == 8
    ids = torch.tensor(random_sequences(3, 11, 11, 101, seed=2))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=ATOL, rtol=0)


def test_sharded_save_round_trips_and_loads_in_transformers(tmp_path):
    ours = tiny_model(seed=5)
    files = save_model(ours, str(tmp_path), max_shard_bytes=30_000)
    assert "model.safetensors.index.json" in files and len(files) > 3
    again = load_model(str(tmp_path))
    for (name, a), (_, b) in zip(ours.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name
    # Saving again unsharded removes the old shards.
    save_model(ours, str(tmp_path))
    assert not any(f.startswith("model-") for f in os.listdir(tmp_path))
    ids = torch.tensor(random_sequences(1, 9, 9, 97, seed=4))
    with torch.no_grad():
        torch.testing.assert_close(hf_load(str(tmp_path))(ids).logits, ours(ids), atol=ATOL, rtol=0)


def test_packed_attention_mask_and_loop_agree_and_match_separate_sequences():
    model = tiny_model(seed=7)
    seqs = random_sequences(4, 3, 20, 97, seed=8)
    ids = torch.tensor([t for s in seqs for t in s])
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    with torch.no_grad():
        loop = model(ids, cu_seqlens=cu, packed_attn="loop")
        mask = model(ids, cu_seqlens=cu, packed_attn="mask")
        torch.testing.assert_close(loop, mask, atol=1e-5, rtol=0)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(loop[cu[i]:cu[i + 1]], model(torch.tensor([s]))[0], atol=1e-5, rtol=0)
    m = block_diagonal_mask([0, 2, 5])
    assert m.tolist()[2] == [False, False, True, False, False] and m.tolist()[4] == [False, False, True, True, True]


def test_config_errors_name_the_key_and_file(tmp_path):
    good = tiny_model().config.to_dict()
    with pytest.raises(ConfigError, match="missing key 'hidden_size'"):
        Qwen2Config.from_dict({k: v for k, v in good.items() if k != "hidden_size"})
    with pytest.raises(ConfigError, match="'num_hidden_layers' must be a positive integer"):
        Qwen2Config.from_dict({**good, "num_hidden_layers": 0})
    with pytest.raises(ConfigError, match="'num_key_value_heads'"):
        Qwen2Config.from_dict({**good, "num_key_value_heads": 3})
    with pytest.raises(ConfigError, match="rope_type 'yarn'"):
        Qwen2Config.from_dict({**good, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ConfigError, match="model_type"):
        Qwen2Config.from_dict({**good, "model_type": "llama"})
    path = tmp_path / "config.json"
    path.write_text('{\n  "vocab_size": 10,\n  oops\n}')
    with pytest.raises(ConfigError, match=r"config.json: invalid JSON at line 3"):
        Qwen2Config.from_json_file(str(path))
    # transformers >= 5 writes rope_parameters instead of rope_theta; both are read.
    cfg = Qwen2Config.from_dict({**{k: v for k, v in good.items() if k != "rope_theta"},
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}})
    assert cfg.rope_theta == 1234.0


def test_checkpoint_errors_name_the_tensor(tmp_path):
    model = tiny_model()
    save_model(model, str(tmp_path))
    with pytest.raises(ConfigError, match="nowhere/config.json: no such file"):
        load_model(str(tmp_path / "nowhere"))
    os.rename(tmp_path / "model.safetensors", tmp_path / "elsewhere.safetensors")
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load_model(str(tmp_path))
    os.rename(tmp_path / "elsewhere.safetensors", tmp_path / "model.safetensors")
    with open(tmp_path / "config.json") as f:
        raw = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "intermediate_size": 64}))
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.mlp.\w+_proj.weight' has shape .*the config expects"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match=r"missing tensors \['model.layers.2"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 1}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.1"):
        load_model(str(tmp_path))


def test_parameter_count_formula_matches_the_module():
    for tied in (False, True):
        model = Qwen2ForCausalLM(tiny_model(tie_word_embeddings=tied).config)
        assert model.config.num_parameters() == sum(p.numel() for p in model.parameters())


HOST_READS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")


def test_a_decode_step_with_its_span_reads_nothing_back_to_the_host(monkeypatch):
    """A CUDA graph's capture refuses a host sync (a device tensor read back: int(), .item(), a data-dependent
    branch). On CPU no sync exists to observe, so every way a tensor's value reaches Python is made to fail
    while a decode step given its span runs; the rotary table's int(max(positions)) once did exactly that."""
    model = tiny_model(seed=3).eval()
    cache = model.new_cache(2, 8)
    with torch.no_grad():
        model.prefill(torch.tensor([[5, 6, 7], [8, 9, 0]]), torch.tensor([3, 2]), cache)
        expected = model.decode(torch.tensor([11, 12]), torch.tensor([3, 2]), cache)

        def read_back(self, *args, **kwargs):
            raise AssertionError("a decode step read a tensor's value back to the host")

        with monkeypatch.context() as patch:
            for name in HOST_READS:
                patch.setattr(torch.Tensor, name, read_back)
            got = model.decode(torch.tensor([11, 12]), torch.tensor([3, 2]), cache, span=8)
            with pytest.raises(AssertionError, match="read a tensor's value back"):
                model.decode(torch.tensor([11, 12]), torch.tensor([3, 2]), cache)   # the check can fail
    torch.testing.assert_close(got, expected)


def test_a_model_on_the_meta_device_has_every_name_and_shape_and_loads_no_meta_kernels():
    # on_meta serves every shape check (the launcher's, the LoRA checks) and every load: it must describe the
    # model exactly, and must not make torch import torch._dynamo and sympy for its meta kernels (2 s of CPU in each process)
    import subprocess
    import sys

    from actors.engines.model import Qwen3MoeConfig

    for config in (Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
                   Qwen3MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=16)):
        meta, real = Qwen2ForCausalLM.on_meta(config), Qwen2ForCausalLM(config)
        assert all(p.is_meta for p in meta.parameters())
        assert {n: p.shape for n, p in meta.named_parameters()} == {n: p.shape for n, p in real.named_parameters()}
    assert real.lm_head.weight.abs().sum() > 0   # a model built off the meta device is initialised as before
    probe = ("import sys; from actors.engines.model import Qwen2Config, Qwen2ForCausalLM; "
             "Qwen2ForCausalLM.on_meta(Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, "
             "num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)); print('torch._dynamo' in sys.modules or 'sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}).stdout
    assert out.strip() == "False"
