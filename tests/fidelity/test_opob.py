"""VCPO's optimal off-policy baseline (advantage ``opob``) against the authors'
``compute_grad_info``, ``compute_opob_baseline`` and ``_update_grad_buffers``
(mit-han-lab/vcpo): each case gives every trajectory's unscaled gradient norm, sequence IS
weight, length and reward; expected are each group's baseline and each trajectory's effective
advantage (its coefficient in the reference's gradient buffers)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from gfcr.registry.catalog import ADVANTAGE_ESTIMATORS
from tests.fidelity.cases import case_ids, cases, check
from tests.fidelity.update_terms import build

METHOD = "opob"


def opob(inp: dict[str, Any]) -> dict[str, Any]:
    est = build(ADVANTAGE_ESTIMATORS, "opob", agg=inp["agg"], use_is_weights=inp["use_is_weights"],
                use_clipped_is_ratios=inp["use_clipped_is_ratios"], normalize_by_length=inp["normalize_by_length"],
                norm_by_std=inp["norm_by_std"], rollout_is_threshold=inp["rollout_is_threshold"])
    baselines, advantages = [], []
    for group in inp["groups"]:
        cols = [np.array([t[k] for t in group], dtype=np.float64) for k in ("reward", "grad_norm", "seq_is", "length")]
        rewards, norms, seq_is, lengths = cols
        log_w = np.log(seq_is)
        baselines.append(est.baseline(rewards, est.trajectory_weights(norms ** 2, log_w, lengths)))
        advantages.append([float(a) for a in est.refine_group(rewards, norms ** 2, log_w, lengths)])
    return {"baselines": baselines, "advantages": advantages}


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_opob_matches_the_reference(case):
    check(METHOD, case, opob)


def test_the_update_weighs_each_trajectory_by_its_own_gradient():
    """In ``update.grpo``: the squared gradient norms the update measures are those of each
    trajectory's loss at advantage 1 (recomputed here, one backward per trajectory), its sequence
    weight the sum of ``log pi - log mu``, and the advantages written on the rollouts are ``refine_group``'s from them."""
    import torch

    from gfcr.runtime import LocalTrainer
    from gfcr.stages.resources import Lent
    from gfcr.stages.update.grpo import GRPOUpdate
    from gfcr.stages.update.logprobs import response_logprobs
    from tests.stages.update.test_component_conformance import _batch
    from tests.stages.update.test_tree_and_off_policy import ToyPolicy

    policy = ToyPolicy()
    config = {"lr": 1e-2, "advantage": {"use": "opob"}, "aggregation": {"use": "seq_mean_token_mean"},
              "loss": {"use": "ppo_clip", "with": {"clip": [1.0, 1.0e9]}}}
    stage = GRPOUpdate(GRPOUpdate.Config.model_validate(config))
    stage.setup(Lent(policy))
    groups, pool = _batch()
    items, _, _ = stage._batch(groups, pool)
    expected_norms, log_weights = [], []
    for item in items:  # fresh rollouts, correction none: the ratio against mu, sum_t r_t, r_t = pi / mu
        logp, mask = response_logprobs(policy.model, [item], 1.0)
        mu = torch.tensor(item.rollout.behavior_logprobs, dtype=logp.dtype)[None]
        total = (torch.exp(logp - mu) * mask).sum()
        grads = torch.autograd.grad(total, [p for p in policy.model.parameters()], allow_unused=True)
        expected_norms.append(sum(float(g.pow(2).sum()) for g in grads if g is not None))
        log_weights.append(float(((logp.detach() - mu) * mask).sum()))  # log pi_old / mu over the sequence
    report = LocalTrainer(policy).update(stage, groups, pool)
    assert not report.skipped
    estimator, k = stage.estimator, 0
    for g in groups:
        n = len(g.rollouts)
        norms = np.array(expected_norms[k:k + n])
        want = estimator.refine_group(g.rewards, norms, np.array(log_weights[k:k + n]),
                                      np.array([len(r) for r in g.rollouts], float))
        got = [r.advantage for r in g.rollouts]
        assert got == pytest.approx(list(want), rel=1e-4), (got, list(want))
        assert not np.allclose(want, estimator.estimate(g).values)  # the gradient weights moved the baseline
        k += n
    assert all(math.isfinite(r.advantage) for g in groups for r in g.rollouts)
