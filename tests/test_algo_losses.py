"""algo/losses.py: every surrogate and aggregation mode on a case worked by hand, the registry against the config's
loss table, and the default objective pinned to the numbers it gave before the loss menu existed."""
from __future__ import annotations

import math
import typing

import pytest
import torch

from algo.losses import (LOSS_AGG_MODES, POLICY_LOSSES, LossConfig, aggregation_weights, loss_denominator,
                         policy_loss)
from algo.ppo import PPOConfig, ppo_loss
from topology.experiment import LOSS_SETTINGS, LOSS_SOURCES, AlgoSection, LossName


def _lp(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp with a gradient, logp_prox) whose ratios exp(logp - logp_prox) are `ratios`."""
    prox = torch.full((len(ratios),), -1.0, dtype=torch.float64)
    logp = (prox + torch.log(torch.tensor(ratios, dtype=torch.float64))).requires_grad_(True)
    return logp, prox


def test_clip_surrogate_by_hand() -> None:
    # A = 1, r = 1.5: max(-1.5, -1.28) = -1.28 (clipped); A = -1, r = 0.5: max(0.5, 0.8) = 0.8 (clipped);
    # A = 2, r = 0.9: -1.8 inside the band. Sum -2.28 over 3 tokens.
    logp, prox = _lp([1.5, 0.5, 0.9])
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    loss, st = policy_loss(logp, prox, adv, torch.ones(3), 3, LossConfig("dapo", 0.2, 0.28))
    assert float(loss.detach()) == pytest.approx(-0.76)
    assert st.n_clipped == 2 and st.n_trained == 3
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -2.0 * 0.9 / 3])   # clipped tokens carry no gradient


def test_dual_clip_bounds_negative_advantages_by_hand() -> None:
    # A = -1, r = 5: max(5, 1.2) = 5, bounded by -A * c = 3
    logp, prox = _lp([5.0])
    loss, st = policy_loss(logp, prox, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1), 1,
                           LossConfig("ppo", 0.2, None, 3.0))
    assert loss.item() == pytest.approx(3.0) and st.n_dual_clipped == 1


def test_gspo_sequence_ratio_by_hand() -> None:
    # one answer, token ratios 1.2 and 0.8: s = exp(mean log) = sqrt(0.96); advantage 1 on both tokens.
    # GSPO's own band [1 - 3e-4, 1 + 4e-4]: for A > 0 max(-s, -(1 - 3e-4)) = -s (s is below the band)
    logp, prox = _lp([1.2, 0.8])
    cu = torch.tensor([0, 2])
    loss, st = policy_loss(logp, prox, torch.ones(2, dtype=torch.float64), torch.ones(2), 2,
                           LossConfig("gspo", 3e-4, 4e-4), cu_seqlens=cu)
    s = math.sqrt(0.96)
    assert loss.item() == pytest.approx(-s) and st.ratio_sum == pytest.approx(2 * s)
    loss.backward()
    # d(-s)/d logp_t = -s / 2 on each token
    assert logp.grad.tolist() == pytest.approx([-s / 2, -s / 2])


def test_gspo_uses_each_answers_mean_advantage_and_its_own_ratio() -> None:
    logp, prox = _lp([2.0, 2.0, 1.0])
    adv = torch.tensor([1.0, 3.0, -1.0], dtype=torch.float64)
    loss, _ = policy_loss(logp, prox, adv, torch.ones(3), 1, LossConfig("gspo", 10.0, 10.0),
                          cu_seqlens=torch.tensor([0, 2, 3]))
    # answer 0: s = 2, mean advantage 2, two tokens: -2 * 2 * 2 = -8; answer 1: s = 1, A = -1: +1
    assert loss.item() == pytest.approx(-7.0)


def test_cispo_by_hand() -> None:
    # band [0, 2] (eps_low 1, eps_high 1): r = 3 -> weight 2 (out of the band), r = 0.5 -> 0.5
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    prox = logp.detach() - torch.log(torch.tensor([3.0, 0.5], dtype=torch.float64))
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, st = policy_loss(logp, prox, adv, torch.ones(2), 1, LossConfig("cispo", 1.0, 1.0))
    # -2 * 1 * (-1) + -(0.5) * (-1) * (-2) = 2 - 1
    assert loss.item() == pytest.approx(1.0) and st.n_clipped == 1
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-2.0, 0.5])   # the out-of-band token keeps its gradient


def test_sapo_gate_by_hand() -> None:
    # r = 1: the gate is (4 / tau) * sigmoid(0) = 2 / tau; its slope 4 * 0.25 = 1 makes the gradient PPO's -A
    logp, prox = _lp([1.0, 1.0])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, st = policy_loss(logp, prox, adv, torch.ones(2), 1, LossConfig("sapo", tau_pos=1.0, tau_neg=1.05))
    assert loss.item() == pytest.approx(-2.0 + 2.0 / 1.05) and st.n_clipped == 0
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.0, 1.0])
    # far from 1 the gate flattens: r = 3, A = 1, tau 1: d/dlogp = -4 sigmoid(2)(1 - sigmoid(2)) * 3
    logp, prox = _lp([3.0])
    loss, _ = policy_loss(logp, prox, torch.ones(1, dtype=torch.float64), torch.ones(1), 1, LossConfig("sapo"))
    loss.backward()
    sig = 1 / (1 + math.exp(-2))
    assert float(logp.grad[0]) == pytest.approx(-4 * sig * (1 - sig) * 3)


@pytest.mark.parametrize("mode, expected", [("token-mean", 1.0), ("seq-mean-token-mean", 1.0),
                                            ("seq-mean-token-sum", 3.0), ("seq-mean-token-sum-norm", 6 / 16)])
def test_aggregation_modes_by_hand(mode: str, expected: float) -> None:
    # two answers of 2 and 4 tokens (padded to 4), every token's loss 1 (A = -1, r = 1)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    logp = torch.zeros(2, 4, dtype=torch.float64)
    agg = aggregation_weights(mask, mode)
    denominator = loss_denominator(mode, n_trained_tokens=6, n_answers=2, norm_length=8)
    loss, _ = policy_loss(logp, logp, -torch.ones(2, 4, dtype=torch.float64), mask, denominator, LossConfig(),
                          agg_weight=agg)
    assert loss.item() == pytest.approx(expected)


def test_seq_mean_token_mean_weights_each_answer_equally_in_a_packed_stream() -> None:
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)   # prompt tokens are off the mask
    w = aggregation_weights(mask, "seq-mean-token-mean", torch.tensor([0, 3, 8]))
    assert w.tolist() == pytest.approx([0, 0.5, 0.5, 0, 0.25, 0.25, 0.25, 0.25])
    assert aggregation_weights(mask, "token-mean") is None
    with pytest.raises(ValueError, match="norm_length"):
        loss_denominator("seq-mean-token-sum-norm", 6, 2, None)


def test_masked_and_weighted_tokens() -> None:
    logp, prox = _lp([1.0, 1.0, 1.0])
    adv = -torch.ones(3, dtype=torch.float64)
    loss, st = policy_loss(logp, prox, adv, torch.ones(3), 2, LossConfig(),
                           weight=torch.tensor([2.0, 0.5, 9.0], dtype=torch.float64),
                           keep=torch.tensor([True, True, False]))
    assert loss.item() == pytest.approx((2.0 + 0.5) / 2) and st.n_trained == 2 and st.n_tokens == 3


def test_the_registry_and_the_config_name_the_same_losses() -> None:
    names = set(typing.get_args(LossName))
    assert names == set(POLICY_LOSSES) == set(LOSS_SETTINGS) == set(LOSS_SOURCES)
    assert set(typing.get_args(AlgoSection.model_fields["loss_agg_mode"].annotation)) == set(LOSS_AGG_MODES)
    for name in names:
        AlgoSection.model_validate({"loss": name})   # each loss's settings are valid settings


def test_unknown_loss_and_meaningless_dual_clip_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown loss 'ppo2'"):
        LossConfig("ppo2")
    with pytest.raises(ValueError, match="dual_clip: only the clip surrogate"):
        LossConfig("sapo", dual_clip=3.0)


def _golden_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(2, 5, generator=g) * 0.5 - 1
    prox = logp + torch.randn(2, 5, generator=g) * 0.3
    behav = prox + torch.randn(2, 5, generator=g) * 0.8
    adv = torch.randn(2, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]).bool()
    return logp, prox, behav, adv, mask


def test_the_default_objective_gives_the_numbers_it_gave_before_the_loss_menu() -> None:
    # Recorded from algo.ppo.ppo_loss before policy losses were chosen by name: the default objective must not move.
    logp, prox, behav, adv, mask = _golden_inputs()
    loss, st = ppo_loss(logp, prox, behav, adv, mask, 7, PPOConfig(behav_cap=2.0, dual_clip=3.0))
    assert loss.item() == 0.4002419412136078
    assert (st.n_trained, st.n_clipped, st.loss_sum, st.ratio_sum, st.behav_weight_sum) == \
        (7.0, 2.0, 2.8016934394836426, 8.173298835754395, 9.375020027160645)
