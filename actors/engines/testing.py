"""Small random Qwen2 models for the engine tests and the engine benchmark (no checkpoint needed), and the
greedy continuation a full forward pass gives, to check engines against."""
from __future__ import annotations

import torch

from actors.engines.model import Qwen2Config, Qwen2ForCausalLM


def tiny_config(**overrides) -> Qwen2Config:
    values = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False)
    values.update(overrides)
    return Qwen2Config(**values)


def tiny_model(seed: int = 0, **overrides) -> Qwen2ForCausalLM:
    """A random model whose norms and biases are not at their init values, so every parameter matters."""
    model = Qwen2ForCausalLM(tiny_config(**overrides)).init_weights(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "embed" in name or "lm_head" in name:
                p.mul_(20.0)  # sharper next-token distributions make greedy/sampling tests meaningful
    return model.eval()


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
