"""The trainer's step on a real batch from the generation engine (DESIGN.md section 9 invariants)."""
import asyncio
import copy

import pytest
import torch

from actors.engines.base import GenerationRequest, SamplingParams
from actors.engines.testing import tiny_model
from actors.engines.torch_gen import TorchGenerationEngine
from actors.engines.torch_train import TorchTrainEngine, TrainConfig
from actors.trainer import StepConfig, batch_to_sequences, train_on_batch
from transport.protocol import Batch, BufferStats, Sample, ScoredGroup, Task


def _batch(model, groups: int = 3, n: int = 4, version: int = 0) -> Batch:
    async def run() -> list[ScoredGroup]:
        gen = TorchGenerationEngine(model=copy.deepcopy(model), version=version)
        await gen.start()
        out = []
        try:
            for g in range(groups):
                res = await gen.generate(GenerationRequest(
                    rid=f"r{g}", input_ids=(1 + g, 2, 3), sampling=SamplingParams(max_new_tokens=10, seed=g), n=n))
                samples = [Sample(output_ids=r.output_ids, logprobs=r.logprobs, versions=r.versions,
                                  finish_reason=r.finish_reason, reward=5.0 if i % 2 else -5.0, correct=bool(i % 2))
                           for i, r in enumerate(res)]
                out.append(ScoredGroup(group_id=str(g), query_id=str(g), prompt_ids=[1 + g, 2, 3],
                                       task=Task(level=g % 2), samples=samples, rollout="r"))
        finally:
            await gen.stop()
        return out
    return Batch(step=version + 1, groups=asyncio.run(run()), stats=BufferStats())


def test_first_step_is_on_policy_and_updates_weights():
    model = tiny_model(0)
    batch = _batch(model)
    engine = TorchTrainEngine(model=copy.deepcopy(model), config=TrainConfig(lr=1e-3))
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    stats = train_on_batch(engine, batch, StepConfig(minibatches=1), version=0)
    # Same weights sampled and recompute: importance weight 1, approximate KL 0, tiny log-prob gap.
    assert stats["logprob_gap_max"] < 1e-4
    assert stats["importance_weight"] == pytest.approx(1.0, abs=1e-4)
    assert abs(stats["ppo_approx_kl"]) < 1e-5
    assert stats["n_seqs"] == 12 and stats["n_tokens"] == sum(len(s.output_ids) for g in batch.groups for s in g.samples)
    assert stats["staleness_max"] == 0 and stats["accuracy"] == 0.5
    assert stats["accuracy_by_level"] == {"0": 0.5, "1": 0.5}
    changed = [k for k, v in engine.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "a training step must change the weights"


def test_staleness_is_measured_from_the_oldest_token():
    model = tiny_model(1)
    batch = _batch(model, groups=2, n=2, version=3)
    engine = TorchTrainEngine(model=copy.deepcopy(model), config=TrainConfig(lr=1e-3))
    stats = train_on_batch(engine, batch, StepConfig(minibatches=2), version=5)
    assert stats["staleness_max"] == 2 and stats["staleness_mean"] == 2


def test_batch_flattening_aligns_fields_with_tokens():
    model = tiny_model(2)
    batch = _batch(model, groups=1, n=2)
    flat = batch_to_sequences(batch)
    for seq, mask, behav in zip(flat["seqs"], flat["loss_mask"], flat["behav"]):
        assert len(seq) == len(mask) == len(behav)
        assert mask[:3] == [0.0, 0.0, 0.0] and all(m == 1.0 for m in mask[3:])
