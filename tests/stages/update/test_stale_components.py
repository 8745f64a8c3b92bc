"""The freshness correction and mu-GRPO's veto inside ``update.grpo``: the gradient the update
hands its optimizer equals a hand computation on the stale toy group of
``test_tree_and_off_policy`` (rollout 0: two tokens at version 0 and two at 2; rollout 1: three
at version 0; trained at version 2)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gfcr.records import RolloutGroups
from tests.stages.update.test_tree_and_off_policy import (hand_gradients, stage_and_policy, stage_gradients,
                                                          stale_group, surrogate, token_logprobs)

REWARDS = np.array([1.0, 0.0])
ADVANTAGES = (REWARDS - REWARDS.mean()) / (REWARDS.std(ddof=1) + 1e-6)


def _fresh_weight(ages: list[int], half_life: float) -> float:
    return 2.0 ** (-float(np.mean(ages)) / half_life)


@pytest.mark.parametrize("max_staleness", [None, 1])
def test_freshness_weighs_each_rollout_by_its_mean_age_in_the_loss_and_the_denominator(max_staleness):
    stage, policy = stage_and_policy(version=2, correction={"use": "freshness", "with": {
        "half_life": 2.0, "max_staleness": max_staleness}})
    group = stale_group(policy.model)
    got, metrics = stage_gradients(stage, RolloutGroups([group]))
    ages = [[2, 2, 0, 0], [2, 2, 2]]
    total, denominator = 0.0, 0.0
    for r, a, age in zip(group.rollouts, ADVANTAGES, ages):
        w = torch.full((len(r),), _fresh_weight(age, 2.0))  # 2^-1/2 and 2^-1
        if max_staleness is not None:
            w = w * torch.tensor([float(x <= max_staleness) for x in age])
        ratio = torch.exp(token_logprobs(policy.model, r.response_token_ids) - torch.tensor(r.behavior_logprobs))
        total = total - (w * surrogate(ratio, float(a))).sum()
        denominator += float(w.sum())
    for g, want in zip(got, hand_gradients(policy.model, total / denominator)):
        torch.testing.assert_close(g, want, atol=1e-6, rtol=0)
    assert metrics["batch_tokens"] == pytest.approx(denominator)
    assert metrics["off_policy_token_fraction"] == pytest.approx(5 / 7)


def test_freshness_on_a_fresh_batch_is_the_staleness_correction():
    """Nothing stale: every weight is 1, so the gradient is the plain one (``staleness`` with no limit hit)."""
    grads = []
    for correction in ({"use": "freshness"}, {"use": "staleness", "with": {"max_staleness": 8}}):
        stage, policy = stage_and_policy(version=0, correction=correction)
        group = stale_group(policy.model)
        for r in group.rollouts:  # every segment sampled by version 0, trained at 0
            for s in r.segments:
                s.policy_version = 0
        grads.append(stage_gradients(stage, RolloutGroups([group]))[0])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_the_mu_grpo_veto_removes_the_suffix_after_a_ratio_drop_in_a_negative_response():
    """Rollout 1 (advantage < 0) gets its behaviour log-prob raised by log 4 on its second token, so
    its ratio there is 1/4 < 0.5: its third token is vetoed (no loss, still in the denominator)."""
    stage, policy = stage_and_policy(version=2, loss={"use": "mu_grpo", "with": {"clip": [0.4, 0.4]}},
                                     correction={"use": "staleness", "with": {"max_staleness": 8}})
    group = stale_group(policy.model)
    with torch.no_grad():
        for r in group.rollouts:
            lp = token_logprobs(policy.model, r.response_token_ids).numpy().astype(np.float32)
            if r is group.rollouts[1]:
                lp[1] += math.log(4.0)
            start = 0
            for s in r.segments:
                s.behavior_logprobs = lp[start:start + len(s.behavior_logprobs)]
                start += len(s.behavior_logprobs)
    got, _ = stage_gradients(stage, RolloutGroups([group]))
    total = 0.0
    for r, a in zip(group.rollouts, ADVANTAGES):
        ratio = torch.exp(token_logprobs(policy.model, r.response_token_ids) - torch.tensor(r.behavior_logprobs))
        kept = torch.tensor([1.0, 1.0, 0.0]) if r is group.rollouts[1] else torch.ones(len(r))
        total = total - (kept * surrogate(ratio, float(a), eps=0.4)).sum()
    for g, want in zip(got, hand_gradients(policy.model, total / 7)):
        torch.testing.assert_close(g, want, atol=1e-6, rtol=0)


def test_without_the_veto_mu_grpo_is_ppo_clip_with_its_interval():
    from gfcr.stages.components.loss.mu_grpo import MuGRPO
    from gfcr.stages.components.loss.ppo_clip import PPOClip

    g = torch.Generator().manual_seed(0)
    log_ratio, adv = torch.randn(4, 6, generator=g), torch.tensor([[1.0], [-1.0], [-0.5], [2.0]]).expand(4, 6)
    mu = MuGRPO(MuGRPO.Config(veto_ratio=None)).terms(log_ratio, adv, torch.ones(4, 6))
    ppo = PPOClip(PPOClip.Config(clip=(0.4, 0.4))).terms(log_ratio, adv, torch.ones(4, 6))
    assert torch.equal(mu.per_token, ppo.per_token) and torch.equal(mu.clipped, ppo.clipped)
    vetoed = MuGRPO(MuGRPO.Config()).vetoed(log_ratio, adv, torch.ones(4, 6))
    assert bool(vetoed.any()) and not bool(vetoed[(adv > 0)].any())
