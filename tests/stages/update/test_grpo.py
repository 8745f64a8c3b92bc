"""update.grpo on the real tiny-arith policy: skipping zero-advantage rollouts leaves the
gradient unchanged, degenerate batches skip the update, and a step moves the weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gfcr.records import Allocation, AllocationEntry, Prompt, PromptPool, RolloutGroups
from gfcr.stages.generate.sample import Sample
from gfcr.runtime import LocalTrainer
from gfcr.stages.resources import Lent
from gfcr.stages.update.grpo import GRPOUpdate

PROMPTS = [Prompt(f"a:{i}", text=f"What is {10 + i} + {20 + 3 * i}? Answer:") for i in range(4)]
POOL = PromptPool(PROMPTS)


@pytest.fixture(scope="module")
def resources():
    from gfcr.engines import TransformersEngine, load_policy
    from gfcr.spec import PolicySpec

    policy = load_policy(PolicySpec(model="tiny-arith"))
    return Lent(policy, TransformersEngine(policy))


def _groups(resources, rewards: list[list[float]]) -> RolloutGroups:
    sample = Sample(Sample.Config(max_new_tokens=8, seed=0))
    sample.setup(resources)
    alloc = Allocation(0, tuple(AllocationEntry(p, len(r)) for p, r in zip(PROMPTS, rewards)))
    groups = sample.run(alloc)
    for g, rs in zip(groups, rewards):
        for rollout, reward in zip(g.rollouts, rs):
            rollout.reward, rollout.correct = reward, reward == 1.0
    return groups


def _update(resources, **config) -> GRPOUpdate:
    stage = GRPOUpdate(GRPOUpdate.Config(**config))
    stage.setup(resources)
    return stage


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_leaving_out_zero_advantage_rollouts_leaves_the_gradient_unchanged(resources, aggregation):
    model = resources.policy.model
    groups = _groups(resources, [[1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0]])
    stage = _update(resources, aggregation={"use": aggregation}, micro_batch_size=3)
    items, _, _ = stage._batch(groups, POOL)
    nonzero = [i for i in items if i.advantage != 0.0]
    assert len(nonzero) == 8  # the two zero-variance groups contribute nothing
    model.zero_grad(set_to_none=True)
    loss_all = stage.backward(items, stage.aggregation.plan([i.row() for i in items]), batch_term=True).loss
    full = _grads(model)
    model.zero_grad(set_to_none=True)
    loss_some = stage.backward(nonzero, stage.aggregation.plan([i.row() for i in items]), batch_term=True).loss
    some = _grads(model)
    model.zero_grad(set_to_none=True)
    assert loss_all == pytest.approx(loss_some, abs=1e-7)
    assert any(g.abs().sum() > 0 for g in full)
    for a, b in zip(full, some):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)


def test_an_update_moves_the_weights_and_reports_what_it_used(resources):
    groups = _groups(resources, [[1, 0, 0, 0], [1, 1, 1, 1]])
    stage = _update(resources, lr=1e-3)
    before = [p.detach().clone() for p in resources.policy.model.parameters()]
    version = resources.policy.version
    report = LocalTrainer(resources.policy).update(stage, groups, POOL)
    assert not report.skipped and report.policy_version == version + 1 == resources.policy.version
    assert report.rollouts_in_update == 4  # the all-correct group has zero advantage everywhere
    assert report.tokens_in_update == sum(len(r) for r in groups.groups[0].rollouts)
    assert report.metrics["batch_rollouts"] == 8 and report.metrics["batch_zero_variance_groups"] == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, resources.policy.model.parameters()))
    advantages = [r.advantage for r in groups.groups[0].rollouts]
    assert advantages[0] > 0 and all(a < 0 for a in advantages[1:])


def test_empty_and_all_zero_batches_skip_the_update(resources):
    stage = _update(resources)
    version = resources.policy.version
    empty = LocalTrainer(resources.policy).update(stage, RolloutGroups(), POOL)
    assert empty.skipped and empty.skip_reason == "empty batch" and empty.policy_version == version
    flat = stage.run(_groups(resources, [[1, 1], [0, 0]]), POOL)
    assert flat.skipped and flat.skip_reason == "every advantage is zero" and resources.policy.version == version


def test_a_non_finite_loss_skips_the_update_and_keeps_the_weights(resources):
    groups = _groups(resources, [[1, 0, 1, 0]])
    groups.groups[0].rollouts[0].segments[0].behavior_logprobs[:] = np.nan
    stage = _update(resources)
    before = [p.detach().clone() for p in resources.policy.model.parameters()]
    version = resources.policy.version
    report = LocalTrainer(resources.policy).update(stage, groups, POOL)
    assert report.skipped and "non-finite" in report.skip_reason and resources.policy.version == version
    assert all(torch.equal(a, b) for a, b in zip(before, resources.policy.model.parameters()))
    assert all(p.grad is None for p in resources.policy.model.parameters())


def test_the_estimator_is_a_registered_choice(resources):
    groups = _groups(resources, [[1, 0, 0, 0]])
    _update(resources, advantage={"use": "median"})._batch(groups, POOL)
    assert [r.advantage for r in groups.groups[0].rollouts] == [1.0, 0.0, 0.0, 0.0]
    _update(resources, advantage={"use": "mean"})._batch(groups, POOL)
    assert [r.advantage for r in groups.groups[0].rollouts] == [0.75, -0.25, -0.25, -0.25]
    with pytest.raises(Exception, match="did you mean `mean_std`"):
        GRPOUpdate.Config(advantage={"use": "mean-std"})
    with pytest.raises(Exception, match="is a mapping"):
        GRPOUpdate.Config(advantage="median")


def test_unscored_rollouts_are_refused_once_naming_the_group(resources):
    groups = _groups(resources, [[1, 0, 0, 0]])
    groups.groups[0].rollouts[1].reward = None
    with pytest.raises(ValueError, match="rewards are NaN .*filter.verify"):
        _update(resources)._batch(groups, POOL)


def test_a_kl_term_forwards_zero_advantage_rollouts_too(resources):
    groups = _groups(resources, [[1, 1, 1, 1], [1, 0, 0, 0]])
    report = _update(resources, kl_coef=0.1).run(groups, POOL)
    assert not report.skipped and report.rollouts_in_update == 8 and report.metrics["kl"] >= 0


def test_optimizer_state_round_trips(resources):
    stage = _update(resources, lr=1e-4)
    stage.run(_groups(resources, [[1, 0, 0, 1]]), POOL)
    state = stage.state_dict()
    again = _update(resources, lr=1e-4)
    again.load_state_dict(state)
    assert again.optimizer.state_dict()["state"].keys() == state["optimizer"]["state"].keys()
