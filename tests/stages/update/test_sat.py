"""SAT and SAT-GSPO (losses ``sat``, ``sat_gspo``; arXiv 2607.18722, from the abstract): the three
properties the abstract states or implies, on random batches. The interval stays inside PPO's
(GSPO's); with no staleness the loss and its gradient are PPO's (GSPO's); within a batch the
contraction grows with the log-ratio, on the advantage's side only."""

from __future__ import annotations

import pytest
import torch

from gfcr.stages.components.loss.gspo import GSPO
from gfcr.stages.components.loss.ppo_clip import PPOClip
from gfcr.stages.components.loss.sat import SAT
from gfcr.stages.components.loss.sat_gspo import SATGSPO


def _batch(seed: int, scale: float, shape=(6, 9)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(shape, generator=g) * scale
    advantages = torch.randn(shape[0], 1, generator=g).expand(shape).clone()
    weight = (torch.rand(shape, generator=g) > 0.15).float()
    return log_ratio, advantages, weight


def _loss_and_grad(loss, log_ratio, advantages, weight):
    x = log_ratio.clone().requires_grad_(True)
    terms = loss.terms(x, advantages, weight)
    total = (terms.per_token * weight).sum()
    total.backward()
    return float(total.detach()), x.grad


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("scale", [0.05, 0.5, 2.0])
def test_sat_stays_inside_the_ppo_interval(seed, scale):
    log_ratio, adv, weight = _batch(seed, scale)
    sat, ppo = SAT(SAT.Config(clip=(0.2, 0.28))), PPOClip(PPOClip.Config(clip=(0.2, 0.28)))
    low, high = sat.interval(log_ratio, adv, weight)
    assert bool((low >= 0.8 - 1e-7).all() and (high <= 1.28 + 1e-7).all() and (low <= 1).all() and (high >= 1).all())
    # a narrower interval on the advantage's side is more pessimistic: never a smaller loss than PPO's
    sat_tokens = sat.terms(log_ratio, adv, weight).per_token
    ppo_tokens = ppo.terms(log_ratio, adv, weight).per_token
    assert bool((sat_tokens >= ppo_tokens - 1e-6).all())
    # something was contracted once the batch is stale
    contracted = (high < 1.28 - 1e-6) | (low > 0.8 + 1e-6)
    assert bool(contracted.any())


@pytest.mark.parametrize("seed", range(3))
def test_sat_is_ppo_without_staleness(seed):
    _, adv, weight = _batch(seed, 1.0)
    fresh = torch.zeros_like(adv)
    sat, ppo = SAT(SAT.Config()), PPOClip(PPOClip.Config())
    low, high = sat.interval(fresh, adv, weight)
    assert torch.equal(low, torch.full_like(low, 0.8)) and torch.equal(high, torch.full_like(high, 1.2))
    loss_s, grad_s = _loss_and_grad(sat, fresh, adv, weight)
    loss_p, grad_p = _loss_and_grad(ppo, fresh, adv, weight)
    assert loss_s == loss_p and torch.equal(grad_s, grad_p)


def test_sat_rounding_noise_contracts_nothing_measurable():
    """Fresh tokens whose log-ratio is engine noise (1e-6) keep PPO's interval to 1e-9."""
    log_ratio, adv, weight = _batch(0, 1e-6)
    low, high = SAT(SAT.Config()).interval(log_ratio, adv, weight)
    assert torch.allclose(low, torch.full_like(low, 0.8), atol=1e-9)
    assert torch.allclose(high, torch.full_like(high, 1.2), atol=1e-9)


def test_sat_contraction_grows_with_the_log_ratio_on_the_advantage_side_only():
    d = torch.linspace(0.0, 1.5, 16)[None, :].repeat(2, 1)  # [2, 16]: |log-ratio| rising along each row
    adv = torch.tensor([[1.0], [-1.0]]).expand(2, 16)
    low, high = SAT(SAT.Config(quantile=0.5)).interval(d, adv, torch.ones(2, 16))
    pos_width, neg_width = high[0] - 1, 1 - low[1]
    assert bool((pos_width[1:] <= pos_width[:-1]).all()) and bool((neg_width[1:] <= neg_width[:-1]).all())
    assert float(pos_width[-1]) < 0.2 * 0.01 and float(pos_width[0]) == pytest.approx(0.2)
    # the other endpoint never moves
    assert torch.equal(low[0], torch.full_like(low[0], 0.8)) and torch.equal(high[1], torch.full_like(high[1], 1.2))
    # the sign of the log-ratio does not matter, its size does
    low_neg, high_neg = SAT(SAT.Config(quantile=0.5)).interval(-d, adv, torch.ones(2, 16))
    assert torch.equal(high_neg, high) and torch.equal(low_neg, low)


def test_sat_masked_tokens_do_not_set_the_quantile():
    d = torch.tensor([[0.0, 0.0, 0.0, 5.0]])
    adv, counted = torch.ones(1, 4), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    low, high = SAT(SAT.Config(quantile=0.5)).interval(d, adv, counted)
    assert float(high[0, 3]) < 1.0 + 1e-6  # past the counted tokens' quantile (0): contracted to 1
    assert torch.equal(high[0, :3], torch.full((3,), 1.2))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("scale", [1e-4, 1e-3, 0.1])
def test_sat_gspo_stays_inside_the_gspo_interval(seed, scale):
    log_ratio, adv, weight = _batch(seed, scale)
    sat, gspo = SATGSPO(SATGSPO.Config()), GSPO(GSPO.Config())
    low, high = sat.interval(log_ratio, adv, weight)
    assert bool((low >= 1 - 3e-4 - 1e-7).all() and (high <= 1 + 4e-4 + 1e-7).all())
    assert bool((sat.terms(log_ratio, adv, weight).per_token >= gspo.terms(log_ratio, adv, weight).per_token - 1e-6).all())
    # one interval per response (a scalar advantage): every counted token of a row has the same
    for b in range(log_ratio.shape[0]):
        row = high[b][weight[b] > 0]
        assert torch.equal(row, row[:1].expand_as(row))


def test_sat_gspo_is_gspo_without_staleness():
    _, adv, weight = _batch(1, 1.0)
    fresh = torch.zeros_like(adv)
    loss_s, grad_s = _loss_and_grad(SATGSPO(SATGSPO.Config()), fresh, adv, weight)
    loss_g, grad_g = _loss_and_grad(GSPO(GSPO.Config()), fresh, adv, weight)
    assert loss_s == loss_g and torch.equal(grad_s, grad_g)


def test_sat_gspo_contracts_the_stalest_responses_most():
    log_s = torch.tensor([0.0, 1e-4, 4e-4, 8e-4, 2e-3])  # per response
    log_ratio = log_s[:, None].expand(5, 3)
    low, high = SATGSPO(SATGSPO.Config(quantile=0.2)).interval(log_ratio, torch.ones(5, 3), torch.ones(5, 3))
    widths = (high[:, 0] - 1).tolist()
    assert widths == sorted(widths, reverse=True) and widths[0] == pytest.approx(4e-4, rel=1e-3) and widths[-1] < 1e-6
