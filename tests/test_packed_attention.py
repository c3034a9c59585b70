"""The Megatron trainer's packed attention on an O(L)-memory kernel, and its norms with Apex installed.

`TorchPackedAttention` (actors/engines/megatron.py) is the core attention every Megatron run without
Transformer Engine takes. Its packed (THD) call must reach torch's flash kernel, which takes only 4-D input:
with only that backend enabled (torch.nn.attention.sdpa_kernel) the call is accepted, runs the flash kernel
(the aten op is observed) and equals the math kernel's output, values and gradients. A sequence too long for
the math kernel where that kernel is refused fails with one error naming the fix. An install with Apex and
without Transformer Engine builds Qwen2's RMSNorm and trains (a stand-in `apex` package makes megatron-core
pick its Apex norm at import, as a real one would).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from actors.engines import megatron as mg
from actors.engines.model import sdpa

needs_megatron = pytest.mark.skipif(not mg.is_available(),
                                    reason=f"megatron-core not importable ({mg.MEGATRON_IMPORT_ERROR}); "
                                           "pip install --no-deps megatron-core==0.11.0 einops")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADS, GROUPS, HEAD_DIM = 4, 2, 16
CU_SEQLENS = [0, 5, 12, 12, 21]   # an empty sequence among them


class OpsSeen(TorchDispatchMode):
    """Records the name of every aten op that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _thd(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = CU_SEQLENS[-1]
    return (torch.randn(t, HEADS, HEAD_DIM, generator=g, requires_grad=True),
            torch.randn(t, GROUPS, HEAD_DIM, generator=g, requires_grad=True),
            torch.randn(t, GROUPS, HEAD_DIM, generator=g, requires_grad=True))


def _attention_module() -> torch.nn.Module:
    from megatron.core.transformer import TransformerConfig
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=HEAD_DIM, use_cpu_initialization=True)
    return mg.TorchPackedAttention(config, layer_number=1, attn_mask_type=None, attention_type="self")


def _packed_call(module: torch.nn.Module, backend: SDPBackend) -> tuple[torch.Tensor, list[torch.Tensor], set[str]]:
    """The trainer's call (THD with PackedSeqParams) with only ``backend`` enabled: output, input gradients, ops."""
    from megatron.core.packed_seq_params import PackedSeqParams
    q, k, v = _thd()
    cu = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    seen = OpsSeen()
    with sdpa_kernel([backend]), seen:
        out = module(q, k, v, None, packed_seq_params=params)
        out.square().sum().backward()
    return out.detach(), [x.grad for x in (q, k, v)], seen.ops


@needs_megatron
def test_trainer_attention_runs_on_the_flash_kernel_alone_and_equals_the_math_kernel() -> None:
    module = _attention_module()
    flash, flash_grads, flash_ops = _packed_call(module, SDPBackend.FLASH_ATTENTION)
    math, math_grads, math_ops = _packed_call(module, SDPBackend.MATH)
    assert "_scaled_dot_product_flash_attention_for_cpu" in flash_ops, sorted(flash_ops)
    assert "_scaled_dot_product_flash_attention_for_cpu_backward" in flash_ops
    assert not any("math" in op for op in flash_ops), sorted(flash_ops)
    assert not any("flash" in op for op in math_ops), sorted(math_ops)
    assert flash.shape == (CU_SEQLENS[-1], HEADS * HEAD_DIM)
    assert torch.allclose(flash, math, atol=1e-5), float((flash - math).abs().max())
    for a, b in zip(flash_grads, math_grads):
        assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())
    # ... and it is causal attention within each sequence: one sequence alone gives its rows.
    q, k, v = (x.detach() for x in _thd())
    s, e = CU_SEQLENS[1], CU_SEQLENS[2]
    alone = sdpa(*(x[s:e].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, enable_gqa=True)
    assert torch.allclose(flash[s:e], alone[0].transpose(0, 1).reshape(e - s, -1), atol=1e-5)


def test_a_long_sequence_where_the_math_kernel_is_refused_fails_with_the_fix(monkeypatch) -> None:
    monkeypatch.setattr(mg, "math_kernel_refused", lambda device: True)   # as on a GPU
    monkeypatch.setattr(mg, "MATH_KERNEL_MAX_TOKENS", 8)
    q, k, v = (x.detach() for x in _thd())
    cu = torch.tensor([0, 8, 21], dtype=torch.int32)   # 8 tokens: still allowed; 13: too long for math
    with sdpa_kernel([SDPBackend.MATH]):   # nothing but the math kernel could take it
        with pytest.raises(mg.LongSequenceAttentionError) as err:
            mg.packed_causal_attention(q, k, v, cu, 13, None)
        short = mg.packed_causal_attention(q[:8], k[:8], v[:8], cu[:2], 8, None)
    message = str(err.value)
    assert "13 tokens" in message and "bf16: true" in message and "flash-attn" in message, message
    assert short.shape == (8, HEADS, HEAD_DIM)
    # with the flash kernel allowed the same long sequence runs (on the CPU's flash kernel)
    assert mg.packed_causal_attention(q, k, v, cu, 13, None).shape == (21, HEADS, HEAD_DIM)


def test_a_long_grouped_query_sequence_goes_to_the_efficient_kernel_with_repeated_keys(monkeypatch) -> None:
    """Where flash cannot run, the memory-efficient CUDA kernel refuses enable_gqa (torch 2.11, H200): the
    long sequence runs there with keys and values repeated per query head, equal to grouped attention."""
    monkeypatch.setattr(mg, "math_kernel_refused", lambda device: True)   # as on a GPU
    monkeypatch.setattr(mg, "MATH_KERNEL_MAX_TOKENS", 8)
    calls: list[tuple[bool, tuple[str, ...]]] = []

    def gpu_like_sdpa(q, k, v, *, is_causal, scale, enable_gqa=False, backends=None):
        names = tuple(b.name for b in backends)
        calls.append((enable_gqa, names))
        if enable_gqa or "EFFICIENT_ATTENTION" not in names:   # no flash here; efficient refuses GQA
            raise RuntimeError("No available kernel. Aborting execution.")
        return sdpa(q, k, v, is_causal=is_causal, scale=scale, backends=[SDPBackend.MATH])
    monkeypatch.setattr(mg, "sdpa", gpu_like_sdpa)
    q, k, v = (x.detach() for x in _thd())
    cu = torch.tensor([0, 21], dtype=torch.int32)
    out = mg.packed_causal_attention(q, k, v, cu, 21, None)
    assert calls == [(True, ("FLASH_ATTENTION", "EFFICIENT_ATTENTION")), (False, ("EFFICIENT_ATTENTION",))]
    grouped = sdpa(*(x.transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, enable_gqa=True)
    assert torch.allclose(out, grouped[0].transpose(0, 1), atol=1e-6), float((out - grouped[0].transpose(0, 1)).abs().max())


def test_our_backend_list_narrows_an_enclosing_sdpa_kernel() -> None:
    q = _thd()[0].detach()[None].transpose(1, 2)   # [1, heads, t, d]
    assert sdpa(q, q, q, is_causal=True).shape == q.shape
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):   # CPU has no efficient kernel: nothing may run
        with pytest.raises(RuntimeError):
            sdpa(q, q, q, is_causal=True)


FAKE_APEX = {
    "apex/__init__.py": "",
    "apex/normalization/__init__.py": "",
    # what megatron-core's fused_layer_norm imports to decide Apex's fused norm is there
    "apex/normalization/fused_layer_norm.py": "class FusedLayerNormAffineFunction:\n    pass\n",
}

APEX_CHILD = textwrap.dedent("""
    import json, os, sys, tempfile
    import torch
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block
    assert gpt_layer_specs.LNImpl.__name__ == "FusedLayerNorm", gpt_layer_specs.LNImpl   # Apex was picked
    assert transformer_block.LayerNormImpl.__name__ == "FusedLayerNorm"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from tests import megatron_cpu_shim
    megatron_cpu_shim.install()
    from actors.engines import megatron as mg
    from actors.engines.base import PackedBatch
    from actors.engines.checkpoint import save_model
    from actors.engines.torch_train import TorchTrainEngine, TrainConfig, token_nll_loss
    from testsupport.tiny_models import random_sequences, tiny_model
    d = tempfile.mkdtemp()
    save_model(tiny_model(0), d)
    batch = PackedBatch.from_sequences(random_sequences(3, 3, 9, 97, seed=1))
    engine = mg.MegatronTrainEngine(d, mg.MegatronConfig(lr=1e-3))
    norms = sorted({type(m).__name__ for m in engine.model.modules() if "Norm" in type(m).__name__})
    got = engine.compute_logprobs(batch).logprobs
    stats = engine.train_step([batch], token_nll_loss)
    ref = TorchTrainEngine(d, TrainConfig(lr=1e-3)).compute_logprobs(batch).logprobs
    print(json.dumps({"norms": norms, "diff": float((got - ref).abs().max()), "loss": stats["loss"]}))
""")


@needs_megatron
def test_an_install_with_apex_and_without_transformer_engine_builds_rmsnorm_and_trains(tmp_path) -> None:
    from transport.ports import free_port
    for rel, text in FAKE_APEX.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", APEX_CHILD, str(free_port())], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["norms"] == ["LocalRMSNorm"], result
    assert result["diff"] < 1e-5 and result["loss"] > 0, result
