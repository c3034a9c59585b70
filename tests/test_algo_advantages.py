"""algo.advantages against plain float64 loop references, on padded and packed layouts."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from algo.advantages import (
    apply_adv_norm,
    compute_advantages,
    gae,
    group_normalize,
    group_normalize_tokens,
    kl_penalty,
    masked_moments,
    normalize_advantages,
    sequence_rewards,
    token_rewards,
)
from algo.packing import cu_seqlens_from_lengths, pad_packed

HYP = settings(max_examples=40, deadline=None, derandomize=True)


# ---------------------------------------------------------------- references: loops, float64, lists


def ref_group_normalize(rewards: list[float], gids: list[int], use_std: bool, eps: float) -> list[float]:
    out = []
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if gids[j] == gids[i]]
        mean = sum(members) / len(members)
        x = r - mean
        if use_std:
            std = math.sqrt(sum((m - mean) ** 2 for m in members) / len(members))
            x = x / (std + eps)
        out.append(x)
    return out


def ref_pipeline(rewards, gids, mask, values, kl, kl_coef, gamma, lam, eps=1e-5, group_norm=False):
    """The whole recipe, one token at a time (the group form subtracts the group means first)."""
    B, T = len(mask), len(mask[0])
    r = ref_group_normalize(rewards, gids, True, eps) if group_norm else list(rewards)
    tok_r = [[0.0] * T for _ in range(B)]
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        valid = [t for t in range(T) if mask[b][t]]
        for t in valid:
            tok_r[b][t] = -kl_coef * kl[b][t]
        if valid:
            tok_r[b][valid[-1]] += r[b]
        running = 0.0
        for idx in range(len(valid) - 1, -1, -1):
            t = valid[idx]
            v_next = values[b][valid[idx + 1]] if idx + 1 < len(valid) else 0.0
            delta = tok_r[b][t] + gamma * v_next - values[b][t]
            running = delta + gamma * lam * running
            adv[b][t] = running
    flat = [adv[b][t] for b in range(B) for t in range(T) if mask[b][t]]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / len(flat))
    norm = [[(adv[b][t] - mean) / (std + eps) if mask[b][t] else 0.0 for t in range(T)] for b in range(B)]
    return norm, adv, tok_r


def random_batch(seed: int, B: int = 6, T: int = 9, n_groups: int = 2):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0] = False  # a zero-length response
    mask[1, :] = True
    rewards = torch.where(torch.rand(B, generator=g) < 0.5, 5.0, -5.0)
    gids = torch.randint(0, n_groups, (B,), generator=g) * 7 + 3  # arbitrary, non-contiguous ids
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp_ref = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    return rewards, gids, mask, values, logp, logp_ref


# ---------------------------------------------------------------- rewards


def test_sequence_rewards_default_and_configurable():
    s = torch.tensor([1.0, 0.0, 0.5])
    assert sequence_rewards(s).tolist() == [5.0, -5.0, 0.0]
    assert sequence_rewards(torch.tensor([True, False])).tolist() == [5.0, -5.0]
    out = sequence_rewards(s, correct_reward=1.0, wrong_reward=0.0, scale=2.0, bias=-0.5)
    assert out.tolist() == pytest.approx([1.0, -1.0, 0.0])
    assert sequence_rewards(s, clip=3.0).tolist() == [3.0, -3.0, 0.0]


def test_sequence_rewards_reject_bad_scores():
    with pytest.raises(ValueError, match="scores"):
        sequence_rewards(torch.tensor([0.5, float("nan")]))
    with pytest.raises(ValueError, match="scores"):
        sequence_rewards(torch.tensor([1.5]))
    with pytest.raises(ValueError, match="clip"):
        sequence_rewards(torch.tensor([1.0]), clip=0.0)


# ---------------------------------------------------------------- group normalisation


@HYP
@given(
    rewards=st.lists(st.sampled_from([-5.0, 5.0, 0.0, 1.5]), min_size=1, max_size=24),
    data=st.data(),
    use_std=st.booleans(),
)
def test_group_normalize_matches_reference(rewards, data, use_std):
    gids = data.draw(st.lists(st.integers(-3, 3), min_size=len(rewards), max_size=len(rewards)))
    got = group_normalize(torch.tensor(rewards, dtype=torch.float64), torch.tensor(gids), use_std=use_std)
    want = ref_group_normalize(rewards, gids, use_std, 1e-5)
    assert got.tolist() == pytest.approx(want, abs=1e-9)


def test_group_normalize_uniform_and_singleton_groups_are_zero():
    r = torch.tensor([5.0, 5.0, 5.0, -5.0, 2.0])
    g = torch.tensor([0, 0, 0, 1, 2])
    assert group_normalize(r, g).tolist() == [0.0] * 5
    assert group_normalize(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0


def test_group_normalize_rejects_bad_input():
    with pytest.raises(ValueError, match="rewards"):
        group_normalize(torch.tensor([1.0, float("inf")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="group_ids"):
        group_normalize(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="group_ids"):
        group_normalize(torch.tensor([1.0, 2.0]), torch.tensor([0]))


# ---------------------------------------------------------------- KL estimators


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_formulas(estimator):
    g = torch.Generator().manual_seed(1)
    a = -torch.rand(50, generator=g, dtype=torch.float64) * 4
    b = -torch.rand(50, generator=g, dtype=torch.float64) * 4
    got = kl_penalty(a, b, estimator)
    for x, y, k in zip(a.tolist(), b.tolist(), got.tolist()):
        lr = x - y
        want = {"k1": lr, "k2": 0.5 * lr * lr, "k3": math.exp(-lr) - 1 + lr}[estimator]
        assert k == pytest.approx(want, abs=1e-12)
    if estimator in ("k2", "k3"):
        assert bool((got >= 0).all())


def test_kl_rejects_nan_and_unknown_estimator():
    with pytest.raises(ValueError, match="logp_ref"):
        kl_penalty(torch.zeros(3), torch.tensor([0.0, float("nan"), 0.0]))
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(torch.zeros(3), torch.zeros(3), "k4")


# ---------------------------------------------------------------- GAE and the whole pipeline


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 1.0)])
@pytest.mark.parametrize("estimator", ["k1", "k3"])
@pytest.mark.parametrize("group_norm", [False, True], ids=["areal", "group"])
def test_pipeline_matches_reference(seed, gamma, lam, estimator, group_norm):
    rewards, gids, mask, values, logp, logp_ref = random_batch(seed)
    kl = kl_penalty(logp, logp_ref, estimator)
    out = compute_advantages(
        rewards, gids, mask, values=values, logp=logp, logp_ref=logp_ref, kl_coef=0.05,
        kl_estimator=estimator, gamma=gamma, lam=lam, group_norm=group_norm,
    )
    want_norm, want_adv, want_tok = ref_pipeline(
        rewards.tolist(), gids.tolist(), mask.tolist(), values.tolist(), kl.tolist(), 0.05, gamma, lam,
        group_norm=group_norm,
    )
    torch.testing.assert_close(out.token_rewards, torch.tensor(want_tok, dtype=torch.float32), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.advantages.double(), torch.tensor(want_norm, dtype=torch.float64), atol=1e-4, rtol=1e-4)
    want_returns = (torch.tensor(want_adv) + values * mask).float()
    torch.testing.assert_close(out.returns, want_returns, atol=1e-4, rtol=1e-5)
    assert bool((out.advantages[~mask] == 0).all())


def test_group_form_gives_every_token_its_group_normalised_reward():
    # gamma = lambda = 1, no critic, no KL: each valid token carries its answer's normalised reward
    rewards = torch.tensor([5.0, -5.0, -5.0, 5.0])
    gids = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    out = compute_advantages(rewards, gids, mask, group_norm=True, adv_norm="none")
    for b, r in enumerate([1.0, -1.0, -1.0, 1.0]):
        assert out.advantages[b][mask[b].bool()].tolist() == pytest.approx([r] * int(mask[b].sum()), abs=1e-4)


# Rewards [5, 5 | -5, 5]: two prompts, two one-token answers each. By hand:
# AReaL's form: GAE (gamma = lambda = 1, no critic) gives each token its reward, 5, 5, -5, 5; the mean over all
#   tokens is 2.5 and the population std sqrt((3 * 2.5^2 + 7.5^2) / 4) = sqrt(18.75) = 4.3301, so
#   (5 - 2.5) / 4.3301 = 0.5774 and (-5 - 2.5) / 4.3301 = -1.7321.
# The group form: group means 5 and 0, stds 0 and 5: 0, 0, -1, 1; then over all tokens (mean 0, std
#   sqrt(2 / 4) = 0.7071): 0, 0, -1.4142, 1.4142.
AREAL_FORM = [0.5774, 0.5774, -1.7321, 0.5774]
GROUP_FORM = [0.0, 0.0, -1.4142, 1.4142]


def test_areal_form_is_the_default_and_matches_the_hand_computed_values():
    rewards, gids = torch.tensor([5.0, 5.0, -5.0, 5.0]), torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 1, dtype=torch.bool)
    default = compute_advantages(rewards, gids, mask).advantages
    assert default[:, 0].tolist() == pytest.approx(AREAL_FORM, abs=1e-4)
    group = compute_advantages(rewards, gids, mask, group_norm=True).advantages
    assert group[:, 0].tolist() == pytest.approx(GROUP_FORM, abs=1e-4)
    # Longer answers: every token of an answer carries the same value, and the statistics weigh tokens, so
    # an answer of three tokens counts three times (AReaL normalises over all generated tokens).
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 0, 0], [1, 0, 0]], dtype=torch.bool)
    long = compute_advantages(rewards, gids, mask).advantages
    tokens = torch.tensor([5.0, 5.0, 5.0, 5.0, -5.0, 5.0], dtype=torch.float64)
    want = (tokens - tokens.mean()) / (tokens.std(unbiased=False) + 1e-5)
    assert long[mask].tolist() == pytest.approx(want.tolist(), abs=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_packed_layout_equals_padded_layout(seed):
    rewards, gids, mask, values, logp, logp_ref = random_batch(seed)
    lengths = [7, 9, 3, 5, 8, 1]
    B = len(lengths)
    cu = cu_seqlens_from_lengths(lengths)
    # build a packed stream and its padded twin
    g = torch.Generator().manual_seed(seed)
    total = int(cu[-1])
    p_mask = torch.rand(total, generator=g) < 0.8
    p_vals = torch.randn(total, generator=g, dtype=torch.float64)
    p_logp = -torch.rand(total, generator=g, dtype=torch.float64)
    p_ref = -torch.rand(total, generator=g, dtype=torch.float64)
    kw = dict(kl_coef=0.1, kl_estimator="k2", gamma=0.97, lam=0.9)
    packed = compute_advantages(rewards[:B], gids[:B], p_mask, cu_seqlens=cu, values=p_vals, logp=p_logp,
                                logp_ref=p_ref, **kw)
    pad = lambda x: pad_packed(x, cu)[0]
    padded_mask, layout = pad_packed(p_mask, cu, pad_value=False)
    padded = compute_advantages(rewards[:B], gids[:B], padded_mask, values=pad(p_vals), logp=pad(p_logp),
                                logp_ref=pad(p_ref), **kw)
    torch.testing.assert_close(packed.advantages, padded.advantages[layout])
    torch.testing.assert_close(packed.returns, padded.returns[layout])


def test_gae_without_values_and_unit_discount_is_reverse_cumsum():
    mask = torch.tensor([[1, 0, 1, 1]])
    r = torch.tensor([[1.0, 0.0, 2.0, 3.0]])
    adv, ret = gae(r, mask)
    assert adv.tolist() == [[6.0, 0.0, 5.0, 3.0]]
    assert ret.tolist() == adv.tolist()


def test_zero_length_responses_and_all_masked_batch():
    mask = torch.zeros(3, 4, dtype=torch.bool)
    out = compute_advantages(torch.tensor([5.0, -5.0, 5.0]), torch.tensor([0, 0, 0]), mask)
    assert bool((out.advantages == 0).all()) and bool((out.returns == 0).all())
    assert token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask).abs().sum() == 0


def test_token_normalisation_over_ranks_equals_global():
    rewards, gids, mask, values, *_ = random_batch(5, B=8, n_groups=3)
    adv, _ = gae(token_rewards(group_normalize(rewards, gids), mask), mask, values=values)
    whole = normalize_advantages(adv, mask)
    halves = [(adv[:3], mask[:3]), (adv[3:], mask[3:])]
    moments = sum(masked_moments(a, m) for a, m in halves)
    parts = [normalize_advantages(a, m, moments=moments) for a, m in halves]
    torch.testing.assert_close(torch.cat(parts), whole)
    valid = whole[mask].double()
    assert abs(float(valid.mean())) < 1e-5
    assert float(valid.std(unbiased=False)) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("arg", ["seq_rewards", "values", "logp", "loss_mask"])
def test_non_finite_inputs_are_rejected_by_name(arg):
    rewards, gids, mask, values, logp, logp_ref = random_batch(0)
    kw = dict(seq_rewards=rewards, group_ids=gids, loss_mask=mask.float(), values=values, logp=logp,
              logp_ref=logp_ref, kl_coef=0.1)
    bad = kw[arg].clone().double()
    bad.view(-1)[1] = float("nan")
    kw[arg] = bad
    name = "rewards" if arg == "seq_rewards" else arg  # group_normalize sees seq_rewards first
    with pytest.raises(ValueError, match=name):
        compute_advantages(**kw)


def test_shape_mismatch_and_missing_kl_inputs_are_rejected():
    rewards, gids, mask, values, logp, logp_ref = random_batch(0)
    with pytest.raises(ValueError, match="values"):
        gae(torch.zeros_like(values), mask, values=values[:, :-1])
    with pytest.raises(ValueError, match="logp"):
        compute_advantages(rewards, gids, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="seq_rewards"):
        token_rewards(rewards[:-1], mask)
    with pytest.raises(ValueError, match="gamma"):
        gae(torch.zeros_like(values), mask, gamma=1.5)


# --- algo.adv_norm: batch | group | none ----------------------------------------------------------------

def _two_groups():
    # two groups of two answers; group 1's advantages are ten times group 0's, lengths differ
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0], [10.0, 10.0, 10.0], [-10.0, -10.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return adv, mask, torch.tensor([0, 0, 1, 1])


def test_adv_norm_batch_standardises_over_every_token_of_the_batch():
    adv, mask, gids = _two_groups()
    out = apply_adv_norm(adv, mask, "batch")
    assert torch.allclose(out, normalize_advantages(adv, mask))
    vals = out[mask].double()
    assert abs(float(vals.mean())) < 1e-6 and abs(float(vals.std(unbiased=False)) - 1) < 1e-4
    # group 0's tokens stay small next to group 1's: one scale for the whole batch
    assert float(out[0, 0].abs()) < 0.5 * float(out[2, 0].abs())


def test_adv_norm_group_standardises_within_each_group():
    adv, mask, gids = _two_groups()
    out = apply_adv_norm(adv, mask, "group", group_ids=gids)
    for g in (0, 1):
        vals = out[gids == g][mask[gids == g]].double()
        assert abs(float(vals.mean())) < 1e-6 and abs(float(vals.std(unbiased=False)) - 1) < 1e-4
    # group 0 (1, 1, -1) and group 1 (10, 10, 10, -10, -10) differ only in scale and length: per group,
    # a token's sign and its group's token balance decide it, not the raw scale
    assert torch.allclose(out[0, :2], out[0, :1].expand(2)) and float(out[0, 0]) > 0 > float(out[1, 0])
    assert bool((out[~mask] == 0).all())
    with pytest.raises(ValueError, match="group_ids"):
        apply_adv_norm(adv, mask, "group")


def test_adv_norm_none_keeps_the_advantages_and_packed_equals_padded():
    adv, mask, gids = _two_groups()
    assert torch.equal(apply_adv_norm(adv, mask, "none"), adv)
    with pytest.raises(ValueError, match="adv_norm: must be one of"):
        apply_adv_norm(adv, mask, "token")
    lengths = mask.sum(1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    packed = apply_adv_norm(adv[mask], torch.ones(int(cu[-1]), dtype=torch.bool), "group", group_ids=gids,
                            cu_seqlens=cu)
    assert torch.allclose(packed, apply_adv_norm(adv, mask, "group", group_ids=gids)[mask])


def test_compute_advantages_modes_change_the_advantages_as_named():
    rewards, gids = torch.tensor([5.0, -5.0, 5.0, 5.0, -5.0, -5.0]), torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]],
                        dtype=torch.bool)
    raw = compute_advantages(rewards, gids, mask, adv_norm="none").advantages
    batch = compute_advantages(rewards, gids, mask).advantages
    group = compute_advantages(rewards, gids, mask, adv_norm="group").advantages
    assert torch.allclose(batch, normalize_advantages(raw, mask))
    assert torch.allclose(group, group_normalize_tokens(raw, mask, gids))
    assert not torch.allclose(batch, group) and not torch.allclose(raw, batch)
