"""The loss menu's settings (topology/experiment.py AlgoSection): a loss name fills what its paper fixes, a
contradicting value or a meaningless combination is refused before launch with one line naming the key."""
from __future__ import annotations

import pytest

from topology.experiment import LOSS_SETTINGS, ExperimentConfig, experiment_problems


@pytest.mark.parametrize("loss", sorted(LOSS_SETTINGS))
def test_a_loss_name_fills_the_settings_its_paper_fixes(loss: str) -> None:
    algo = ExperimentConfig.model_validate({"algo": {"loss": loss}}).algo
    for key, value in LOSS_SETTINGS[loss].items():
        assert getattr(algo, key) == value, key


def test_the_default_is_todays_objective() -> None:
    algo = ExperimentConfig().algo
    assert (algo.loss, algo.loss_agg_mode, algo.rejection, algo.tis_cap, algo.m2po_tau, algo.overlong_buffer) == \
        ("ppo", "token-mean", "none", None, None, None)


def test_a_value_the_loss_contradicts_is_refused_in_one_line() -> None:
    (line,) = experiment_problems({"algo": {"loss": "dapo", "eps_clip_high": 0.2}})
    assert line.startswith("experiment.algo: value error, loss dapo sets eps_clip_high: 0.28") and "{" not in line
    assert "arXiv 2503.14476" in line and "leave them out or use loss ppo" in line
    # the same value is no contradiction
    assert experiment_problems({"algo": {"loss": "dapo", "eps_clip_high": 0.28}}) == []


@pytest.mark.parametrize("algo, error", [
    ({"loss": "grpo2"}, "experiment.algo.loss: input should be 'ppo', 'grpo'"),
    ({"loss_agg_mode": "seq-sum"}, "experiment.algo.loss_agg_mode: input should be"),
    ({"baseline": "leave_one_out"}, "baseline leave_one_out (RLOO) needs group_norm: true and group_std: false"),
    ({"std_level": "batch"}, "std_level batch needs group_norm: true and group_std: true"),
    ({"sapo_tau_pos": 2.0}, "only loss sapo has a gate temperature"),
    ({"loss": "cispo", "dual_clip": 3.0}, "dual_clip: loss cispo has no clipped branch"),
    ({"overlong_penalty": 2.0}, "overlong_penalty: set overlong_buffer too"),
    ({"overlong_buffer": 1.5}, "experiment.algo.overlong_buffer: input should be less than or equal to 1"),
    ({"rejection": "sequence"}, "rejection sequence needs rejection_upper"),
    ({"rejection_upper": 2.0}, "rejection_lower/rejection_upper: set rejection"),
    ({"rejection": "token", "rejection_lower": 3.0, "rejection_upper": 2.0}, "rejection_lower (3.0) must be below"),
    ({"tis_level": "sequence"}, "tis_level: set tis_cap too"),
    ({"tis_cap": 0.5}, "experiment.algo.tis_cap: input should be greater than 1"),
    ({"decoupled": False, "tis_cap": 2.0}, "tis_cap: with decoupled: false the proximal log-probs are the engine's"),
    ({"decoupled": False, "rejection": "icepop"}, "rejection: with decoupled: false"),
    ({"mismatch_warn_kl": -1.0}, "experiment.algo.mismatch_warn_kl: input should be greater than or equal to 0"),
])
def test_meaningless_combinations_are_refused(algo: dict, error: str) -> None:
    problems = experiment_problems({"algo": algo})
    assert len(problems) == 1 and error in problems[0], problems


def test_icepop_takes_its_papers_bounds_unless_set() -> None:
    assert ExperimentConfig.model_validate({"algo": {"rejection": "icepop"}}).algo.rejection_bounds == (0.5, 5.0)
    algo = ExperimentConfig.model_validate({"algo": {"rejection": "icepop", "rejection_upper": 3.0}}).algo
    assert algo.rejection_bounds == (0.5, 3.0)
    assert ExperimentConfig.model_validate(
        {"algo": {"rejection": "geometric", "rejection_upper": 1.25}}).algo.rejection_bounds == (0.8, 1.25)


def test_switching_a_documents_loss_lets_its_settings_apply() -> None:
    from topology.experiment import switched_loss
    recorded = {"loss": "gspo", "eps_clip": 0.2, "eps_clip_high": 0.2, "group_norm": True, "lr": 1e-3}
    # the recorded clip range gives way to GSPO's; what GSPO does not fix stays
    assert switched_loss(recorded, {"loss"}) == {"loss": "gspo", "lr": 1e-3}
    assert ExperimentConfig.model_validate({"algo": switched_loss(recorded, {"loss"})}).algo.eps_clip == 3e-4
    # a key the user set for the switch stays, and is refused if it contradicts the loss
    kept = switched_loss(recorded, {"loss", "eps_clip"})
    assert kept["eps_clip"] == 0.2 and "loss gspo sets eps_clip: 0.0003" in experiment_problems({"algo": kept})[0]
