"""algo.ppo: the decoupled loss against a per-token float64 reference, its reduction to standard PPO,
and invariance to how a batch is split into micro-batches / ranks."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from algo.ppo import PPOConfig, PPOStats, count_loss_tokens, ppo_loss, token_entropy, value_loss

HYP = settings(max_examples=30, deadline=None, derandomize=True)


def make_batch(seed: int, B: int = 5, T: int = 7, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    logp_behav = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp_prox = logp_behav + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    logp = (logp_prox + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.8
    return logp, logp_prox, logp_behav, adv, mask


def ref_loss(logp, prox, behav, adv, mask, n_tokens, cfg: PPOConfig):
    """One token at a time, in python floats; returns (loss, clipped count, masked count)."""
    eps_high = cfg.eps_high if cfg.eps_high is not None else cfg.eps_low
    total, n_clip, n_masked = 0.0, 0, 0
    for lp, px, bh, a, m in zip(logp, prox, behav, adv, mask):
        if not m:
            continue
        w = math.exp(px - bh)
        if cfg.behav_cap is not None and w > cfg.behav_cap:
            n_masked += 1
            continue
        r = math.exp(lp - px)
        unclipped = -a * r
        clipped = -a * min(max(r, 1 - cfg.eps_low), 1 + eps_high)
        pg = max(unclipped, clipped)
        n_clip += clipped > unclipped
        if cfg.dual_clip is not None and a < 0:
            pg = min(pg, -a * cfg.dual_clip)
        total += pg * w
    return total / n_tokens, n_clip, n_masked


CONFIGS = [
    PPOConfig(),
    PPOConfig(eps_low=0.2, eps_high=0.28),
    PPOConfig(dual_clip=3.0),
    PPOConfig(behav_cap=1.2),
    PPOConfig(eps_low=0.1, eps_high=0.3, dual_clip=2.0, behav_cap=1.5),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.eps_high}-{c.dual_clip}-{c.behav_cap}")
@pytest.mark.parametrize("seed", range(3))
def test_loss_and_stats_match_reference(cfg, seed):
    logp, prox, behav, adv, mask = make_batch(seed, spread=0.4)
    n = count_loss_tokens(mask, prox, behav, cfg.behav_cap)
    loss, stats = ppo_loss(logp, prox, behav, adv, mask, n, cfg)
    flat = [x.reshape(-1).tolist() for x in (logp.detach(), prox, behav, adv, mask)]
    want, n_clip, n_masked = ref_loss(*flat, n, cfg)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-10, abs=1e-12)
    assert stats.n_clipped == n_clip
    assert stats.n_tokens - stats.n_trained == n_masked
    assert stats.n_trained == n
    assert stats.summary()["behav_masked_frac"] == pytest.approx(n_masked / int(mask.sum()))
    # gradient: d loss / d logp against autograd of the reference formula, token by token
    loss.backward()
    for idx in range(logp.numel()):
        lp = torch.tensor(flat[0][idx], dtype=torch.float64, requires_grad=True)
        b, t = divmod(idx, logp.shape[1])
        if not mask[b, t] or (cfg.behav_cap is not None and math.exp(flat[1][idx] - flat[2][idx]) > cfg.behav_cap):
            assert float(logp.grad[b, t]) == 0.0
            continue
        r = torch.exp(lp - flat[1][idx])
        a = flat[3][idx]
        eps_high = cfg.eps_high if cfg.eps_high is not None else cfg.eps_low
        pg = torch.maximum(-a * r, -a * r.clamp(1 - cfg.eps_low, 1 + eps_high))
        if cfg.dual_clip is not None and a < 0:
            pg = torch.minimum(pg, torch.tensor(-a * cfg.dual_clip, dtype=torch.float64))
        (pg * math.exp(flat[1][idx] - flat[2][idx]) / n).backward()
        assert float(logp.grad[b, t]) == pytest.approx(float(lp.grad), rel=1e-9, abs=1e-14)


@pytest.mark.parametrize("seed", range(3))
def test_reduces_to_standard_ppo_when_proximal_is_behaviour(seed):
    logp, prox, _, adv, mask = make_batch(seed)
    loss, stats = ppo_loss(logp, prox, prox, adv, mask, int(mask.sum()))
    # textbook PPO-clip: -mean over tokens of min(r A, clip(r, 1-eps, 1+eps) A)
    r = torch.exp(logp - prox)
    surrogate = torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)
    standard = -(surrogate[mask]).mean()
    torch.testing.assert_close(loss, standard, rtol=1e-12, atol=1e-14)
    g1 = torch.autograd.grad(loss, logp)[0]
    g2 = torch.autograd.grad(standard, logp)[0]
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-14)
    s = stats.summary()
    assert s["importance_weight_mean"] == 1.0 and s["importance_weight_max"] == 1.0
    assert s["behav_masked_frac"] == 0.0


def test_first_step_is_on_policy_zero_kl_and_unit_ratio():
    _, prox, _, adv, mask = make_batch(0)
    logp = prox.clone().requires_grad_(True)
    _, stats = ppo_loss(logp, prox, prox, adv, mask, int(mask.sum()))
    s = stats.summary()
    assert s["approx_kl"] == 0.0 and s["clip_ratio"] == 0.0 and s["ratio_max"] == 1.0


@HYP
@given(seed=st.integers(0, 10_000), data=st.data(), ranks=st.integers(1, 3))
def test_loss_and_gradient_invariant_to_micro_batch_split(seed, data, ranks):
    cfg = PPOConfig(eps_high=0.28, dual_clip=3.0, behav_cap=1.3)
    logp, prox, behav, adv, mask = make_batch(seed, B=6, T=5, spread=0.3)
    n_global = count_loss_tokens(mask, prox, behav, cfg.behav_cap)
    if n_global == 0:
        return
    full, full_stats = ppo_loss(logp, prox, behav, adv, mask, n_global, cfg)
    g_full = torch.autograd.grad(full, logp)[0]
    # split the sequences over ranks, then each rank's share into micro-batches, in any order
    perm = data.draw(st.permutations(list(range(6))))
    cuts = sorted(data.draw(st.lists(st.integers(1, 5), max_size=4, unique=True)))
    pieces = [perm[a:b] for a, b in zip([0] + cuts, cuts + [6]) if b > a]
    total = torch.zeros((), dtype=torch.float64)
    grad = torch.zeros_like(logp)
    merged = PPOStats()
    for rank in range(ranks):
        for piece in pieces[rank::ranks]:
            idx = torch.tensor(piece)
            part = logp.detach()[idx].clone().requires_grad_(True)
            loss, st_ = ppo_loss(part, prox[idx], behav[idx], adv[idx], mask[idx], n_global, cfg)
            loss.backward()
            grad[idx] += part.grad  # the all-reduce of per-rank gradients is this sum
            total = total + loss.detach()
            merged = merged.merge(st_)
    torch.testing.assert_close(total, full.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, g_full, rtol=1e-12, atol=1e-14)
    for key, value in full_stats.summary().items():
        assert merged.summary()[key] == pytest.approx(value, rel=1e-9, abs=1e-12)


def test_packed_stream_equals_padded_batch():
    logp, prox, behav, adv, mask = make_batch(3)
    n = int(mask.sum())
    padded, _ = ppo_loss(logp, prox, behav, adv, mask, n)
    packed, _ = ppo_loss(logp[mask], prox[mask], behav[mask], adv[mask], torch.ones(n, dtype=torch.bool), n)
    torch.testing.assert_close(packed, padded, rtol=1e-12, atol=1e-14)


def test_entropy_from_logits_matches_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=g)
    ent = token_entropy(logits)
    for b in range(2):
        for t in range(3):
            z = [math.exp(x) for x in logits[b, t].tolist()]
            p = [x / sum(z) for x in z]
            assert float(ent[b, t]) == pytest.approx(-sum(q * math.log(q) for q in p), rel=1e-5)
    logp, prox, behav, adv, _ = make_batch(0, B=2, T=3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    _, stats = ppo_loss(logp, prox, behav, adv, mask, 3, logits=logits)
    assert stats.summary()["entropy"] == pytest.approx(float(ent[mask.bool()].mean()), rel=1e-6)


def test_padding_garbage_never_poisons_the_gradient():
    logp, prox, behav, adv, mask = make_batch(1)
    with torch.no_grad():
        logp[~mask] = 200.0  # exp(200) overflows float64 exp(x)*... and float32 outright
        prox[~mask] = -200.0
    loss, _ = ppo_loss(logp, prox, behav, adv, mask, int(mask.sum()), PPOConfig(behav_cap=2.0))
    loss.backward()
    assert bool(torch.isfinite(loss)) and bool(torch.isfinite(logp.grad).all())


@pytest.mark.parametrize("arg", ["logp", "logp_prox", "logp_behav", "advantages"])
def test_non_finite_inputs_are_rejected_by_name(arg):
    logp, prox, behav, adv, mask = make_batch(0)
    args = dict(logp=logp.detach().clone(), logp_prox=prox, logp_behav=behav, advantages=adv)
    args[arg] = args[arg].clone()
    args[arg][0, 0] = float("inf") if arg != "advantages" else float("nan")
    with pytest.raises(ValueError, match=arg):
        ppo_loss(loss_mask=mask, n_tokens=10, **args)


def test_bad_arguments_are_rejected():
    logp, prox, behav, adv, mask = make_batch(0)
    with pytest.raises(ValueError, match="n_tokens"):
        ppo_loss(logp, prox, behav, adv, mask, 0)
    with pytest.raises(ValueError, match="advantages"):
        ppo_loss(logp, prox, behav, adv[:, :-1], mask, 10)
    with pytest.raises(ValueError, match="loss_mask"):
        ppo_loss(logp, prox, behav, adv, mask.float() * 2, 10)
    with pytest.raises(ValueError, match="dual_clip"):
        PPOConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="behav_cap"):
        count_loss_tokens(mask, behav_cap=2.0)


def test_value_loss_matches_reference_and_splits():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    old = v.detach() + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    ret = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=g) < 0.7
    n = int(mask.sum())
    got = value_loss(v, old, ret, mask, n, clip=0.2)
    want = 0.0
    for x, o, r, m in zip(v.detach().view(-1).tolist(), old.view(-1).tolist(), ret.view(-1).tolist(), mask.view(-1).tolist()):
        if m:
            vc = o + min(max(x - o, -0.2), 0.2)
            want += 0.5 * max((x - r) ** 2, (vc - r) ** 2)
    assert float(got.detach()) == pytest.approx(want / n, rel=1e-12)
    halves = value_loss(v[:2], old[:2], ret[:2], mask[:2], n) + value_loss(v[2:], old[2:], ret[2:], mask[2:], n)
    torch.testing.assert_close(halves, got)
