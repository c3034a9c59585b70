"""Small random Qwen2 models for the engine tests and the engine benchmark (no checkpoint needed), and the
greedy continuation a full forward pass gives, to check engines against, and sampled trainer batches."""
from __future__ import annotations

import asyncio
import copy
import shutil
from pathlib import Path

import torch

from actors.batch import Batch, BatchGroup
from actors.engines.base import GenerationRequest, SamplingParams
from actors.engines.checkpoint import bucketize, hf_state_dict, save_model
from actors.engines.model import FAMILIES, Qwen2Config, Qwen2ForCausalLM
from actors.engines.torch_gen import TorchGenerationEngine
from actors.weights import weights_hash
from transport.protocol import BufferStats, Sample

#: The shipped tokenizer of the embedded default (vocabulary 272), for models the actors can load.
ARITH_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "configs" / "models" / "arith-tiny"
ARITH_VOCAB = 272


# What a tiny Qwen3-MoE adds to tiny_config: 8 experts of which each token takes 2.
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def tiny_config(family: str = "qwen2", **overrides) -> Qwen2Config:
    """A tiny config of ``family`` (a model_type of model.FAMILIES)."""
    values = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False)
    if family == "qwen3":
        values["head_dim"] = 16
    if family == "qwen3_moe":
        values.update(TINY_MOE)
    values.update(overrides)
    return FAMILIES[family](**values)


def tiny_model(seed: int = 0, family: str = "qwen2", **overrides) -> Qwen2ForCausalLM:
    """A random model whose norms and biases are not at their init values, so every parameter matters."""
    model = Qwen2ForCausalLM(tiny_config(family, **overrides)).init_weights(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "embed" in name or "lm_head" in name:
                p.mul_(20.0)  # sharper next-token distributions make greedy/sampling tests meaningful
    return model.eval()


def near_tie_moe_model() -> Qwen2ForCausalLM:
    """A tiny Qwen3-MoE whose router scores experts 0 and 1 equal up to a relative 3e-7, the size of the rounding
    differences between a KV-cache decode step and a whole-sequence forward: which of the two a token goes to
    depends on the engine that routes it (each token takes one expert of four)."""
    model = tiny_model(seed=11, family="qwen3_moe", num_experts=4, num_experts_per_tok=1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight[1] = layer.mlp.gate.weight[0] * (1 + 3e-7)
    return model


def random_sequences(count: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def greedy_reference(model: Qwen2ForCausalLM, prompt: list[int], count: int) -> list[int]:
    """The next ``count`` greedy tokens after ``prompt``, one full forward pass per token (no KV cache)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def sampled_batch(model: Qwen2ForCausalLM, groups: int = 3, n: int = 4, version: int = 0,
                  record_routing: bool = False, max_new_tokens: int = 10) -> Batch:
    """A trainer Batch of `groups` prompts x `n` answers sampled from `model`, half of them rewarded."""
    async def run() -> list[BatchGroup]:
        gen = TorchGenerationEngine(model=copy.deepcopy(model), version=version, record_routing=record_routing)
        await gen.start()
        out = []
        try:
            for g in range(groups):
                res = await gen.generate(GenerationRequest(
                    rid=f"r{g}", input_ids=(1 + g, 2, 3), sampling=SamplingParams(max_new_tokens=max_new_tokens, seed=g),
                    n=n))
                samples = [Sample(output_ids=r.output_ids, logprobs=r.logprobs, versions=r.versions,
                                  finish_reason=r.finish_reason, reward=5.0 if i % 2 else -5.0, correct=bool(i % 2),
                                  routed_experts=r.routed_experts)
                           for i, r in enumerate(res)]
                out.append(BatchGroup(prompt_ids=[1 + g, 2, 3], level=g % 2, samples=samples))
        finally:
            await gen.stop()
        return out
    return Batch(step=version + 1, groups=asyncio.run(run()), stats=BufferStats())


def tiny_model_dir(path: Path, seed: int = 0, family: str = "qwen2") -> Path:
    """A tiny random model of ``family`` in Hugging Face layout with the shipped arith tokenizer, which actors load."""
    save_model(tiny_model(seed, family, vocab_size=ARITH_VOCAB, max_position_embeddings=4096), str(path))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(ARITH_TOKENIZER_DIR / name, path / name)
    return path


def tiny_weight_buckets(seed: int) -> tuple[list[list[tuple[str, torch.Tensor]]], str]:
    """A 'trained' version of ``tiny_model_dir``'s model (another seed's parameters), in ~64 KB buckets,
    and its weights hash."""
    named = list(hf_state_dict(tiny_model(seed, vocab_size=ARITH_VOCAB, max_position_embeddings=4096)).items())
    return list(bucketize(named, 64 << 10)), weights_hash(named)
