"""The embedded engines on Qwen3-MoE: the generation engine records the experts each token was routed to,
and the trainer replaying them computes the engine's log-probs exactly, where its own routing breaks near-ties
differently; training with and without the load-balancing loss."""
from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from actors.engines.base import GenerationRequest, PackedBatch, SamplingParams
from actors.engines.moe import ROUTE_NATIVE
from actors.engines.torch_gen import TorchGenerationEngine
from actors.engines.torch_train import TorchTrainEngine, TrainConfig, token_nll_loss
from testsupport.bounded import run_bounded
from testsupport.tiny_models import random_sequences, tiny_model

PROMPT = [1, 2, 3, 4, 5]


def near_tie_model() -> torch.nn.Module:
    """A MoE whose router scores experts 0 and 1 equal up to a relative 3e-7, the size of the rounding
    differences between a KV-cache decode step and a whole-sequence forward: which of the two a token goes to
    depends on the engine that routes it (each token takes one expert of four)."""
    model = tiny_model(seed=11, family="qwen3_moe", num_experts=4, num_experts_per_tok=1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight[1] = layer.mlp.gate.weight[0] * (1 + 3e-7)
    return model


def generate(model, n: int = 6, tokens: int = 40):
    async def main():
        engine = TorchGenerationEngine(model=copy.deepcopy(model), record_routing=True)
        await engine.start()
        try:
            return await engine.generate(GenerationRequest(
                "r", tuple(PROMPT), SamplingParams(max_new_tokens=tokens, seed=1), n=n))
        finally:
            await engine.stop()
    return run_bounded(main(), timeout=120.0)


def test_replayed_routing_gives_the_engines_logprobs_and_native_routing_does_not():
    model = near_tie_model()
    results = generate(model)
    trainer = TorchTrainEngine(model=copy.deepcopy(model))
    batch = PackedBatch.from_sequences([PROMPT + r.output_ids for r in results])
    # The engine routed every token it fed; the last answer token was never fed, so it is routed natively.
    routes = torch.cat([torch.cat([r.routed_experts.long(), torch.full((1, 2, 1), ROUTE_NATIVE)]) for r in results])
    assert routes.shape[0] == batch.num_tokens
    answer = torch.cat([torch.tensor([False] * len(PROMPT) + [True] * len(r.output_ids)) for r in results])
    engine_logprobs = torch.cat([torch.tensor([0.0] * len(PROMPT) + r.logprobs) for r in results])

    native = trainer.compute_logprobs(batch, record_routing=True)
    fed = routes[:, 0, 0] != ROUTE_NATIVE
    flipped = (native.routed_experts != routes).any(-1).any(-1) & fed
    assert int(flipped.sum()) > 0, "no token was routed differently: the case tests nothing"
    assert float((native.logprobs - engine_logprobs)[answer].abs().max()) > 1e-3

    replayed = trainer.compute_logprobs(PackedBatch(batch.input_ids, batch.cu_seqlens, batch.position_ids,
                                                    {"routed_experts": routes}))
    torch.testing.assert_close(replayed.logprobs[answer], engine_logprobs[answer], atol=1e-5, rtol=0)


def test_replayed_routing_still_trains_the_router():
    model = tiny_model(seed=3, family="qwen3_moe")
    trainer = TorchTrainEngine(model=model, config=TrainConfig(lr=1e-3))
    seqs = random_sequences(3, 10, 20, 97, seed=4)
    batch = PackedBatch.from_sequences(seqs)
    recorded = trainer.compute_logprobs(batch, record_routing=True).routed_experts
    replay = PackedBatch(batch.input_ids, batch.cu_seqlens, batch.position_ids, {"routed_experts": recorded})
    router = model.model.layers[0].mlp.gate.weight
    before = router.detach().clone()
    trainer.train_step([replay], token_nll_loss)
    assert not torch.equal(router.detach(), before)


@pytest.mark.parametrize("aux", [0.0, 0.01])
def test_training_reduces_the_loss_with_and_without_the_balance_loss(aux):
    trainer = TorchTrainEngine(model=tiny_model(seed=5, family="qwen3_moe"),
                               config=TrainConfig(lr=3e-3, moe_aux_loss_coef=aux))
    batch = PackedBatch.from_sequences(random_sequences(4, 8, 16, 97, seed=6))
    first = trainer.train_step([batch], token_nll_loss)
    for _ in range(5):
        last = trainer.train_step([batch], token_nll_loss)
    assert last["loss"] < first["loss"]
    assert ("moe_aux_loss" in first) == (aux > 0)
    if aux:
        assert 0.9 < first["moe_aux_loss"] < 8.0  # 1.0 when balanced, num_experts when all on one expert
