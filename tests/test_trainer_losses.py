"""The loss menu in the trainer's step (actors/trainer/step.py): every loss trains, the corrections and the
mismatch monitors reach the metrics, the warning reaches the live view, and the default step is unchanged."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from actors.engines.torch_train import TorchTrainEngine, TrainConfig
from launch.progress import TrainingProgress
from actors.trainer.metrics import mismatch_warning
from actors.trainer.step import StepConfig, train_on_batch
from testsupport.tiny_models import sampled_batch, tiny_model
from topology.experiment import LOSS_SETTINGS, ExperimentConfig


@pytest.fixture(scope="module")
def model_and_batch():
    model = tiny_model(7)
    batch = sampled_batch(model, groups=3, n=4, version=0)
    for g, rs in zip(batch.groups, ([5., -5., -5., 5.], [5., 5., -5., -5.], [-5., 5., 5., 5.])):
        for s, r in zip(g.samples, rs):
            s.reward = r
    return model, batch


def _step(model, batch, algo: dict, version: int = 2, minibatches: int = 2) -> tuple[dict, TorchTrainEngine]:
    cfg = StepConfig.from_settings(ExperimentConfig.model_validate({"algo": {"ppo_minibatches": minibatches, **algo}}))
    engine = TorchTrainEngine(model=copy.deepcopy(model), config=TrainConfig(lr=1e-3))
    return train_on_batch(engine, batch, cfg, version=version), engine


def test_the_default_step_gives_the_numbers_it_gave_before_the_loss_menu(model_and_batch) -> None:
    # Recorded on this batch before policy losses were chosen by name: the default objective must not move.
    # (One torch thread, as tests/conftest.py sets: float sums depend on the thread count.)
    model, batch = model_and_batch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        stats, _ = _step(model, batch, {})
    finally:
        torch.set_num_threads(threads)
    assert stats["loss"] == pytest.approx(0.09521522521972656, rel=1e-9, abs=0)
    assert stats["grad_norm"] == pytest.approx(2.3347716331481934, rel=1e-9, abs=0)
    assert stats["actor_clip_ratio"] == pytest.approx(1 / 24)


@pytest.mark.parametrize("loss", sorted(LOSS_SETTINGS))
def test_every_loss_trains(model_and_batch, loss: str) -> None:
    model, batch = model_and_batch
    stats, engine = _step(model, batch, {"loss": loss})
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0, stats
    changed = [n for n, p in engine.model.named_parameters() if not torch.equal(p, dict(model.named_parameters())[n])]
    assert changed


def test_aggregation_changes_the_loss_by_the_hand_worked_factor(model_and_batch) -> None:
    # In the first minibatch every ratio is 1, so the clip is inactive and the loss is -sum(A w a) / denominator:
    # seq-mean-token-sum over answers is seq-mean-token-sum-norm times gen.max_new_tokens (64 by default).
    model, batch = model_and_batch
    agg = {"group_norm": True, "adv_norm": "none", "ppo_minibatches": 1}
    s_sum, _ = _step(model, batch, {**agg, "loss_agg_mode": "seq-mean-token-sum"}, minibatches=1)
    s_norm, _ = _step(model, batch, {**agg, "loss_agg_mode": "seq-mean-token-sum-norm"}, minibatches=1)
    assert s_sum["loss"] == pytest.approx(64 * s_norm["loss"], rel=1e-5)


def _tampered(batch, shift: float):
    """A copy of `batch` whose behaviour log-probs are `shift` lower on every other answer token."""
    out = copy.deepcopy(batch)
    for g in out.groups:
        for s in g.samples:
            s.logprobs = [lp - shift * (i % 2) for i, lp in enumerate(s.logprobs)]
    return out


def test_corrections_and_mismatch_reach_the_metrics(model_and_batch) -> None:
    model, batch = model_and_batch
    clean, _ = _step(model, batch, {}, version=0)
    # same weights sampled and trained: the mismatch is numerical noise
    assert clean["mismatch_tokens"] == clean["n_tokens"] and clean["mismatch_kl_k3"] < 1e-8
    assert clean["rejected_frac"] == clean["tis_truncated_frac"] == clean["m2po_masked_frac"] == 0
    # behaviour log-probs 2 lower on half the tokens: weight e^2 = 7.4 there
    bad = _tampered(batch, 2.0)
    k3 = math.expm1(2.0) - 2.0
    stats, _ = _step(model, bad, {"rejection": "icepop", "behav_imp_weight_cap": 0.0}, version=0)
    assert stats["rejected_frac"] == pytest.approx(0.5, abs=0.05)
    assert stats["mismatch_kl_k3"] == pytest.approx(k3 * 0.5, rel=0.05)
    assert mismatch_warning(stats, 1e-3).startswith("engine/trainer mismatch: KL (k3)")
    assert mismatch_warning(stats, 0.0) is None and mismatch_warning(clean, 1e-3) is None
    stats, _ = _step(model, bad, {"tis_cap": 2.0, "behav_imp_weight_cap": 0.0})
    assert stats["tis_truncated_frac"] == pytest.approx(0.5, abs=0.05) and stats["behav_masked_frac"] == 0
    assert stats["importance_weight_max"] == pytest.approx(2.0)
    stats, _ = _step(model, bad, {"m2po_tau": 0.04, "behav_imp_weight_cap": 0.0})
    assert 0.4 < stats["m2po_masked_frac"] <= 0.55


def test_the_live_view_shows_the_warning(tmp_path: Path) -> None:
    line = {"step": 3, "task_reward": 0.5, "accuracy": 0.5, "effective_throughput": 10.0, "staleness_mean": 0.0,
            "staleness_max": 0, "weight_sync_seconds": 0.1, "buffer_depth": 2}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(line) + "\n" +
                                            json.dumps({**line, "step": 4, "mismatch_warning": "engine/trainer "
                                                        "mismatch: KL (k3) 0.5 > algo.mismatch_warn_kl 0.001"}) + "\n")
    text = TrainingProgress(tmp_path, 10).poll()
    assert text.startswith("step 4/10") and "WARNING engine/trainer mismatch: KL (k3) 0.5" in text
