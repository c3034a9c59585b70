"""The trainer's step on a real batch from the generation engine (docs/architecture.md, "Invariants")."""
import copy

import pytest
import torch

from actors.batch import TrainBatch, from_batch, share
from actors.engines.base import PackedBatch
from actors.engines.torch_train import TorchTrainEngine, TrainConfig
from actors.trainer.step import StepConfig, batch_to_sequences, train_on_batch
from testsupport.tiny_models import sampled_batch, tiny_model
from topology.experiment import ExperimentConfig


def test_first_step_is_on_policy_and_updates_weights():
    model = tiny_model(0)
    batch = sampled_batch(model)
    engine = TorchTrainEngine(model=copy.deepcopy(model), config=TrainConfig(lr=1e-3))
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    stats = train_on_batch(engine, batch, StepConfig.defaults(minibatches=1), version=0)
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
    batch = sampled_batch(model, groups=2, n=2, version=3)
    engine = TorchTrainEngine(model=copy.deepcopy(model), config=TrainConfig(lr=1e-3))
    stats = train_on_batch(engine, batch, StepConfig.defaults(minibatches=2), version=5)
    assert stats["staleness_max"] == 2 and stats["staleness_mean"] == 2


def test_batch_flattening_aligns_fields_with_tokens():
    model = tiny_model(2)
    batch = sampled_batch(model, groups=1, n=2)
    flat = batch_to_sequences(batch)
    for seq, mask, behav in zip(flat["seqs"], flat["loss_mask"], flat["behav"]):
        assert len(seq) == len(mask) == len(behav)
        assert mask[:3] == [0.0, 0.0, 0.0] and all(m == 1.0 for m in mask[3:])


def test_a_train_batchs_micro_batches_are_the_list_forms_sequences():
    """The packed layout's micro-batches hold exactly what packing the list form's sequences gives, for the
    whole batch and for a rank's share (which carries some sequences' tokens only)."""
    batch = sampled_batch(tiny_model(4), groups=3, n=3)
    batch.groups[1].samples[2].versions[1:3] = [-1, -1]   # an episode's environment tokens: never trained
    listed = batch_to_sequences(batch)
    fields = ("loss_mask", "behav", "versions")
    for columns, ids in ((from_batch(batch), [8, 0, 4, 5]), (share(from_batch(batch), [1, 5, 7]), [7, 1, 5])):
        lay = TrainBatch.of(columns)
        got = lay.micro_batch(ids, {k: getattr(lay, k) for k in fields})
        want = PackedBatch.from_sequences([listed["seqs"][i] for i in ids],
                                          {k: [listed[k][i] for i in ids] for k in fields})
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.cu_seqlens, want.cu_seqlens)
        assert torch.equal(got.position_ids, want.position_ids)
        assert got.fields.keys() == want.fields.keys()
        assert all(torch.equal(got.fields[k], want.fields[k]) for k in fields)
    assert lay.carried.tolist() == [i in (1, 5, 7) for i in range(9)]


def test_adv_norm_setting_reaches_the_step():
    model = tiny_model(3)
    batch = sampled_batch(model, groups=2, n=4)
    # groups of different spreads (one right answer in four; two in four), no division by the group's std:
    # only then do the three normalisations give advantages of different scales
    for group, rewards in zip(batch.groups, ([5.0, -5.0, -5.0, -5.0], [5.0, 5.0, -5.0, -5.0])):
        for sample, reward in zip(group.samples, rewards):
            sample.reward = reward
    deltas = {}
    for mode in ("batch", "group", "none"):
        cfg = StepConfig.from_settings(ExperimentConfig.model_validate({"algo": {"adv_norm": mode, "group_std": False}}))
        assert cfg.adv_norm == mode
        # a large Adam epsilon keeps the first update proportional to the gradient (not its sign)
        engine = TorchTrainEngine(model=copy.deepcopy(model), config=TrainConfig(lr=1e-3, adam_eps=1.0,
                                                                                 grad_clip=0.0))
        train_on_batch(engine, batch, cfg, version=0)
        deltas[mode] = torch.cat([(p.detach() - q.detach()).flatten() for p, q in
                                  zip(engine.model.parameters(), model.parameters())])
    assert not torch.allclose(deltas["batch"], deltas["group"])
    assert not torch.allclose(deltas["batch"], deltas["none"])


def _kl_step(policy, reference, batch, kl_coef):
    """One step on `batch` with every reward equal (so, in the group form, only the KL penalty makes advantages)."""
    engine = TorchTrainEngine(model=copy.deepcopy(policy), config=TrainConfig(lr=1e-2))
    ref_engine = TorchTrainEngine(model=copy.deepcopy(reference))
    cfg = StepConfig.from_settings(ExperimentConfig.model_validate(
        {"algo": {"kl_coef": kl_coef, "kl_estimator": "k1", "adv_norm": "none", "group_norm": True}}))
    return engine, train_on_batch(engine, batch, cfg, version=0, ref_engine=ref_engine)


def _sampled_logprobs(model, batch):
    """Per answer, the summed log-prob of its tokens under `model` (the trainer's own computation)."""
    flat = batch_to_sequences(batch)
    engine = TorchTrainEngine(model=copy.deepcopy(model))
    mb = PackedBatch.from_sequences(flat["seqs"], {"loss_mask": flat["loss_mask"]})
    lp = engine.compute_logprobs(mb).logprobs * mb.fields["loss_mask"]
    return torch.stack([lp[int(a):int(b)].sum() for a, b in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:])])


def test_kl_penalty_moves_the_loss_and_the_policy_as_the_reference_says():
    policy, reference = tiny_model(4), tiny_model(5)
    batch = sampled_batch(policy, groups=2, n=3)
    for g in batch.groups:
        for s in g.samples:
            s.reward = 5.0
    # The reference is the policy itself: no penalty, no advantage, no update.
    engine, stats = _kl_step(policy, policy, batch, kl_coef=0.5)
    assert stats["kl_reward"] == pytest.approx(0.0, abs=1e-5) and stats["loss"] == pytest.approx(0.0, abs=1e-5)
    # Another reference: each token's advantage is -kl_coef * (sum of k1 = logp - logp_ref from it to the
    # end of its answer); the first (on-policy) step's loss is minus their mean over answer tokens.
    flat = batch_to_sequences(batch)
    mb = PackedBatch.from_sequences(flat["seqs"], {"loss_mask": flat["loss_mask"], "behav": flat["behav"]})
    ref_lp = TorchTrainEngine(model=copy.deepcopy(reference)).compute_logprobs(mb).logprobs
    mask = mb.fields["loss_mask"].bool()
    k1 = (mb.fields["behav"] - ref_lp) * mask
    adv = torch.cat([k1[int(a):int(b)].flip(0).cumsum(0).flip(0) for a, b in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:])])
    expected_loss = 0.5 * float(adv[mask].mean())
    engine, stats = _kl_step(policy, reference, batch, kl_coef=0.5)
    assert stats["kl_reward"] == pytest.approx(-0.5 * float(k1[mask].mean()), rel=1e-4)
    assert stats["loss"] == pytest.approx(expected_loss, rel=1e-3)
    # ... and the update moves the policy's answers toward the reference's likelihoods.
    before = _sampled_logprobs(policy, batch) - _sampled_logprobs(reference, batch)
    after = _sampled_logprobs(engine.model, batch) - _sampled_logprobs(reference, batch)
    assert float(after.abs().mean()) < float(before.abs().mean())
def test_the_trainer_step_takes_the_form_from_the_experiment_config():
    from actors.trainer.step import StepConfig
    from topology.experiment import ExperimentConfig

    assert StepConfig.from_settings(ExperimentConfig()).group_norm is False
    cfg = ExperimentConfig.model_validate({"algo": {"group_norm": True, "group_std": False}})
    step = StepConfig.from_settings(cfg)
    assert (step.group_norm, step.group_std) == (True, False)


