"""Qwen3 and Qwen3-MoE against transformers' Qwen3ForCausalLM and Qwen3MoeForCausalLM (float32): logits,
gradients, checkpoints both ways, the KV-cache path, routing replay and the load-balancing loss."""
from __future__ import annotations

import json

import pytest
import torch

from actors.engines.checkpoint import CheckpointError, load_model, save_model
from actors.engines.model import ConfigError, Qwen3MoeConfig, config_from_dict
from actors.engines.moe import ROUTE_NATIVE, RoutingTrace, load_balancing_loss
from testsupport.tiny_models import random_sequences, tiny_model

transformers = pytest.importorskip("transformers")

ATOL = 2e-5
HF_CLASSES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def hf_load(path: str, family: str):
    return getattr(transformers, HF_CLASSES[family]).from_pretrained(path, dtype=torch.float32).eval()


def hf_gradients(hf, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of the mean next-token loss, under the checkpoint's names (transformers keeps a Qwen3-MoE
    layer's experts as two stacked tensors; split back into the per-expert names a checkpoint uses)."""
    hf.zero_grad()
    hf(ids, labels=ids).loss.backward()
    grads = {}
    for name, p in hf.named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = p.grad.chunk(2, dim=1)
            for e in range(p.shape[0]):
                grads[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate[e]
                grads[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up[e]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(p.shape[0]):
                grads[name.replace("down_proj", f"{e}.down_proj.weight")] = p.grad[e]
        else:
            grads[name] = p.grad
    return grads


@pytest.mark.parametrize("family,overrides", [("qwen3", {}), ("qwen3", {"tie_word_embeddings": True}),
                                              ("qwen3_moe", {}), ("qwen3_moe", {"norm_topk_prob": False}),
                                              ("qwen3_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 3}),
                                              ("qwen3_moe", {"mlp_only_layers": [0]})])
def test_logits_and_gradients_match_transformers(tmp_path, family, overrides):
    ours = tiny_model(seed=3, family=family, **overrides)
    save_model(ours, str(tmp_path))
    hf = hf_load(str(tmp_path), family)
    ids = torch.tensor(random_sequences(2, 15, 15, 97, seed=1))
    with torch.no_grad():
        reference = hf(ids).logits
    torch.testing.assert_close(ours(ids), reference, atol=ATOL, rtol=0)
    ours.zero_grad()
    logits = ours(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    theirs = hf_gradients(hf, ids)
    mine = dict(ours.named_parameters())
    assert set(theirs) == set(mine) - ({"lm_head.weight"} if ours.config.tie_word_embeddings else set())
    for name, grad in theirs.items():  # an expert no token chose has no gradient here, a zero one there
        got = mine[name].grad if mine[name].grad is not None else torch.zeros_like(grad)
        torch.testing.assert_close(got, grad, atol=1e-5, rtol=1e-4, msg=name)
    # The KV-cache path (prefill, then one token at a time) gives the same logits.
    with torch.no_grad():
        cache = ours.new_cache(2, 4)
        torch.testing.assert_close(ours.prefill(ids[:, :6], torch.tensor([6, 6]), cache), reference[:, 5],
                                   atol=ATOL, rtol=0)
        for t in range(6, ids.shape[1]):
            torch.testing.assert_close(ours.decode(ids[:, t], torch.tensor([t, t]), cache), reference[:, t],
                                       atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_loads_what_transformers_saves(tmp_path, family):
    if family == "qwen3":
        cfg = transformers.Qwen3Config(vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                       max_position_embeddings=128, tie_word_embeddings=False)
    else:
        cfg = transformers.Qwen3MoeConfig(vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                          num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                                          norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = getattr(transformers, HF_CLASSES[family])(cfg).eval()
    with torch.no_grad():  # transformers initialises norms to 1: move them so they matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(str(tmp_path))
    ours = load_model(str(tmp_path))
    assert type(ours.config).MODEL_TYPE == family
    if family == "qwen3":
        assert ours.config.head_dim == 24
    else:
        assert ours.config.sparse_layers == [0, 2]
        assert "model.layers.0.mlp.experts.5.down_proj.weight" in dict(ours.named_parameters())
    ids = torch.tensor(random_sequences(3, 11, 11, 101, seed=2))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=ATOL, rtol=0)


def test_config_families_and_refusals(tmp_path):
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2)
    assert config_from_dict({**base, "model_type": "qwen3"}).head_dim == 128  # transformers' Qwen3 default
    assert config_from_dict({**base, "model_type": "qwen3_moe"}).head_dim == 4
    assert config_from_dict(base).qkv_bias and not config_from_dict(base).qk_norm
    with pytest.raises(ConfigError, match=r"'model_type' is 'llama' \(LlamaForCausalLM\); supported: qwen2 "
                                          r"\(Qwen2ForCausalLM\), qwen3 \(Qwen3ForCausalLM\), qwen3_moe"):
        config_from_dict({**base, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "x/config.json")
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        config_from_dict({**base, "model_type": "qwen3_moe", "num_experts": 2, "num_experts_per_tok": 4})
    with pytest.raises(ConfigError, match="attention_bias"):
        config_from_dict({**base, "model_type": "qwen3", "attention_bias": True})
    # A checkpoint whose tensors do not fit its config: refused naming the tensor.
    model = tiny_model(family="qwen3_moe")
    save_model(model, str(tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_experts": 4}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model.layers.\d.mlp.experts.[4-7]\."):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "qwen3"}))
    with pytest.raises(CheckpointError, match="mlp.experts"):
        load_model(str(tmp_path))


def test_parameter_counts():
    model = tiny_model(family="qwen3_moe")
    cfg: Qwen3MoeConfig = model.config
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert cfg.num_parameters() - cfg.num_parameters(active=True) == 2 * (8 - 2) * expert
    dense = tiny_model(family="qwen3")
    assert dense.config.num_parameters() == dense.config.num_parameters(active=True) == \
        sum(p.numel() for p in dense.parameters())


def test_routing_replay_reproduces_the_recorded_choice_and_routes_native_rows():
    model = tiny_model(seed=4, family="qwen3_moe")
    ids = torch.tensor(random_sequences(1, 12, 12, 97, seed=5))
    with torch.no_grad():
        trace = RoutingTrace(record=True)
        logits = model(ids, routing=trace)
        recorded = trace.experts()
        assert recorded.shape == (12, 2, 2)
        # Replaying what was recorded changes nothing.
        torch.testing.assert_close(model(ids, routing=RoutingTrace(replay=recorded)), logits, atol=0, rtol=0)
        # Replaying other experts changes the logits from that token on, and only from there.
        other = recorded.clone()
        other[5, 0] = torch.tensor([e for e in range(8) if e not in recorded[5, 0].tolist()][:2])
        moved = model(ids, routing=RoutingTrace(replay=other))
        torch.testing.assert_close(moved[0, :5], logits[0, :5], atol=1e-5, rtol=0)
        assert (moved[0, 5] - logits[0, 5]).abs().max() > 1e-3
        # A row marked ROUTE_NATIVE is routed by the router.
        other[5] = ROUTE_NATIVE
        torch.testing.assert_close(model(ids, routing=RoutingTrace(replay=other)), logits, atol=0, rtol=0)


def test_load_balancing_loss_matches_transformers(tmp_path):
    model = tiny_model(seed=6, family="qwen3_moe")
    save_model(model, str(tmp_path))
    hf = hf_load(str(tmp_path), "qwen3_moe")
    ids = torch.tensor(random_sequences(1, 20, 20, 97, seed=7))
    with torch.no_grad():
        expected = hf(ids, output_router_logits=True).aux_loss
        trace = RoutingTrace(keep_router_logits=True)
        model(ids, routing=trace)
    got = load_balancing_loss(trace.router_logits, 8, 2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
