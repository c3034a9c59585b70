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
from actors.trainer.step import StepConfig, train_on_batch
from testsupport.tiny_models import near_tie_moe_model, random_sequences, sampled_batch, tiny_model
from transport.messages import decode, encode
from actors.batch import as_columns

PROMPT = [1, 2, 3, 4, 5]


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
    model = near_tie_moe_model()
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


@pytest.mark.parametrize("replay", ["none", "r2", "r3"])
def test_training_step_replays_the_routing_that_travelled_with_the_trajectories(replay):
    model = near_tie_moe_model()
    batch = as_columns(sampled_batch(model, groups=2, n=6, record_routing=True, max_new_tokens=40))
    _, batch = decode(encode(batch))  # as the buffer sends it: one uint8 tensor per answer
    assert all(r.dtype == torch.uint8 and r.shape[1:] == (2, 1) for r in batch.routed_experts)
    engine = TorchTrainEngine(model=copy.deepcopy(model), config=TrainConfig(lr=1e-3))
    stats = train_on_batch(engine, batch, StepConfig.defaults(minibatches=2, routing_replay=replay), version=0)
    # The engine/trainer mismatch on tokens the current weights sampled: none with the rollout's routing.
    if replay == "r3":
        assert stats["logprob_gap_max"] < 1e-5
    else:
        assert stats["logprob_gap_max"] > 1e-3 and stats["logprob_gap_mean"] > 1e-6


def test_routed_experts_cross_the_wire_from_rollout_to_buffer():
    from transport.protocol import Answers, Sample, ScoredGroup, Task, Trajectories
    routes = torch.randint(0, 8, (7, 2, 2), dtype=torch.uint8)
    samples = [Sample(output_ids=[5, 6, 7], logprobs=[-1.0] * 3, versions=[0] * 3, finish_reason="stop",
                      routed_experts=routes),
               Sample(output_ids=[5], logprobs=[-1.0], versions=[0], finish_reason="stop")]
    for msg in (Trajectories(group_id="g", task=Task(answer="1"), answers=Answers(samples=samples, rollout="r")),
                ScoredGroup(group_id="g", answers=Answers(samples=samples, rollout="r"))):
        _, back = decode(encode(msg))
        assert torch.equal(back.answers.samples[0].routed_experts, routes)
        assert back.answers.samples[1].routed_experts is None
