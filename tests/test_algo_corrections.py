"""algo/corrections.py: each correction and the mismatch monitor on a case worked by hand."""
from __future__ import annotations

import math

import pytest
import torch

from algo.corrections import CorrectionConfig, correct, m2po_mask, mismatch_stats


def _gap(weights: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_prox, logp_behav) whose behaviour weights exp(prox - behav) are `weights`."""
    behav = torch.full((len(weights),), -2.0)
    return behav + torch.log(torch.tensor(weights)), behav


def test_no_correction_keeps_every_token_with_its_raw_weight() -> None:
    prox, behav = _gap([0.4, 1.0, 6.0, 2.0])
    c = correct(prox, behav, torch.ones(4))
    assert c.keep.all() and c.weight.tolist() == pytest.approx([0.4, 1.0, 6.0, 2.0])


def test_behaviour_cap_masks_tokens_above_it() -> None:
    prox, behav = _gap([0.4, 1.0, 6.0, 2.0])
    c = correct(prox, behav, torch.ones(4), CorrectionConfig(behav_cap=5.0))
    assert c.keep.tolist() == [True, True, False, True] and c.stats.n_behav_capped == 1


def test_token_tis_truncates_and_keeps() -> None:
    prox, behav = _gap([0.4, 1.0, 6.0, 2.0])
    c = correct(prox, behav, torch.ones(4), CorrectionConfig(tis_cap=2.0))
    assert c.keep.all() and c.weight.tolist() == pytest.approx([0.4, 1.0, 2.0, 2.0])
    assert c.stats.n_tis_truncated == 1 and c.stats.summary()["tis_truncated_frac"] == 0.25


def test_sequence_tis_truncates_each_answers_product() -> None:
    # answer 0: 2 x 2 = 4, truncated at 2 on both tokens; answer 1: 0.5 x 1 = 0.5
    prox, behav = _gap([2.0, 2.0, 0.5, 1.0])
    c = correct(prox, behav, torch.ones(4), CorrectionConfig(tis_cap=2.0, tis_level="sequence"),
                cu_seqlens=torch.tensor([0, 2, 4]))
    assert c.weight.tolist() == pytest.approx([2.0, 2.0, 0.5, 0.5]) and c.stats.n_tis_truncated == 2


def test_token_rejection_is_icepop() -> None:
    # IcePop's band [0.5, 5]: 0.4 and 6 are masked
    prox, behav = _gap([0.4, 1.0, 6.0, 2.0])
    c = correct(prox, behav, torch.ones(4), CorrectionConfig(rejection="token", rejection_lower=0.5, rejection_upper=5.0))
    assert c.keep.tolist() == [False, True, False, True] and c.stats.n_rejected == 2


def test_sequence_rejection_masks_whole_answers_by_their_product() -> None:
    # products 4 and 0.5; band [1/3, 3] (lower defaults to 1 / upper): the first answer goes
    prox, behav = _gap([2.0, 2.0, 0.5, 1.0])
    c = correct(prox, behav, torch.ones(4), CorrectionConfig(rejection="sequence", rejection_upper=3.0),
                cu_seqlens=torch.tensor([0, 2, 4]))
    assert c.keep.tolist() == [False, False, True, True]


def test_geometric_rejection_uses_the_mean_log_weight() -> None:
    # geometric means 2 and sqrt(0.5) = 0.71; band [0.5, 1.5]
    prox, behav = _gap([2.0, 2.0, 0.5, 1.0])
    cfg = CorrectionConfig(rejection="geometric", rejection_lower=0.5, rejection_upper=1.5)
    c = correct(prox.reshape(2, 2), behav.reshape(2, 2), torch.ones(2, 2), cfg)   # [B, T]: rows are answers
    assert c.keep.tolist() == [[False, False], [True, True]]


def test_m2po_masks_the_fewest_largest_squared_log_weights() -> None:
    # (log w)^2 = [0, 0, 0, 1, 0.25], mean 0.25. tau 0.1: without the 1, 0.25 / 4 = 0.0625 is enough;
    # tau 0.05: the 0.25 goes too.
    log_w = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.5])
    every = torch.ones(5, dtype=torch.bool)
    assert m2po_mask(log_w, every, 0.1).tolist() == [False, False, False, True, False]
    assert m2po_mask(log_w, every, 0.05).tolist() == [False, False, False, True, True]
    assert not m2po_mask(log_w, every, 0.3).any()
    c = correct(log_w - 2.0, torch.full((5,), -2.0), torch.ones(5), CorrectionConfig(m2po_tau=0.1))
    assert c.stats.n_m2po_masked == 1 and not bool(c.keep[3])


def test_corrections_ignore_tokens_off_the_mask() -> None:
    prox, behav = _gap([100.0, 1.0])
    c = correct(prox, behav, torch.tensor([0, 1]), CorrectionConfig(tis_cap=2.0, rejection="token", rejection_upper=3.0))
    assert c.keep.tolist() == [False, True] and c.stats.n_tokens == 1 and c.stats.n_rejected == 0


def test_mismatch_k3_by_hand() -> None:
    # one token with p_prox / p_behav = 2: k3 = (2 - 1) - ln 2; one with ratio 1: 0
    prox, behav = _gap([2.0, 1.0])
    m = mismatch_stats(prox, behav, torch.ones(2))
    s = m.summary()
    assert s["mismatch_kl_k3"] == pytest.approx((1 - math.log(2)) / 2)
    assert s["mismatch_logprob_diff_mean"] == pytest.approx(math.log(2) / 2) and s["mismatch_tokens"] == 2
    assert m.merge(m).summary()["mismatch_kl_k3"] == pytest.approx(s["mismatch_kl_k3"])


@pytest.mark.parametrize("kwargs, error", [
    ({"tis_cap": 1.0}, "tis_cap: must be > 1"),
    ({"rejection": "token"}, "rejection_upper: rejection 'token' needs"),
    ({"rejection": "token", "rejection_lower": 2.0, "rejection_upper": 1.5}, "rejection_lower: must be in"),
    ({"rejection": "median", "rejection_upper": 2.0}, "rejection: must be one of"),
    ({"m2po_tau": 0.0}, "m2po_tau: must be positive"),
])
def test_bad_settings_are_refused(kwargs: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        CorrectionConfig(**kwargs)
