"""VCPO's learning-rate rule (lr_rule ``vcpo_ess``) against the authors' ``compute_is_info``,
``compute_ess_info`` and ``_optimizer_step_with_buffer`` (mit-han-lab/vcpo): each case is one
mini-batch of trajectories (current and behaviour log-probs, response masks); expected are the
ESS figures and the learning rate of each of two param groups at the step and after it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gfcr.registry.catalog import LR_RULES
from gfcr.stages.components.lr_rule import sequence_log_weights
from tests.fidelity.cases import case_ids, cases, check
from tests.fidelity.update_terms import build

METHOD = "vcpo_ess"


def vcpo_ess(inp: dict[str, Any]) -> dict[str, Any]:
    rule = build(LR_RULES, "vcpo_ess", scaling_rule=inp["scaling_rule"], base_ess_ratio=inp["base_ess_ratio"],
                 use_clipped=inp["use_clipped"], rollout_is_threshold=inp["rollout_is_threshold"])
    width = max(len(m) for m in inp["mask"])
    pad = [lambda rows, w=width: [r + [0.0] * (w - len(r)) for r in rows]][0]
    logp = torch.tensor(pad(inp["old_log_prob"]), dtype=torch.float32)  # [B, R]: pi_old, the gradient pass's
    behaviour = torch.tensor(pad(inp["rollout_log_prob"]), dtype=torch.float32)
    weight = torch.tensor(pad(inp["mask"]), dtype=torch.float32)
    half = len(inp["mask"]) // 2  # two micro-batches: the sums add up
    totals = [a + b for a, b in zip(rule.sums(sequence_log_weights(logp[:half], behaviour[:half], weight[:half])),
                                    rule.sums(sequence_log_weights(logp[half:], behaviour[half:], weight[half:])))]
    factor, metrics = rule.factor([float(t) for t in totals])
    lrs = [inp["lr"], inp["lr"] * 10]
    return {"ess": metrics["ess"], "ess_ratio": metrics["ess_ratio"], "ess_clipped": metrics["ess_clipped"],
            "ess_ratio_clipped": metrics["ess_ratio_clipped"], "lr_at_step": [lr * factor for lr in lrs],
            "lr_after": lrs}


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_vcpo_ess_matches_the_reference(case):
    check(METHOD, case, vcpo_ess)


def test_the_update_scales_its_learning_rate_for_one_step_and_restores_it():
    """In ``update.grpo``: stale behaviour log-probs lower the ESS, the step is taken at the
    scaled rate (AdamW's first step moves each weight by about lr), and the rate is put back."""
    import numpy as np

    from gfcr.runtime import LocalTrainer
    from gfcr.stages.resources import Lent
    from gfcr.stages.update.grpo import GRPOUpdate
    from tests.stages.update.test_component_conformance import _batch
    from tests.stages.update.test_tree_and_off_policy import ToyPolicy

    moved = {}
    for use in ("constant", "vcpo_ess"):
        policy = ToyPolicy()
        stage = GRPOUpdate(GRPOUpdate.Config.model_validate({"lr": 1e-2, "lr_rule": {"use": use}}))
        stage.setup(Lent(policy))
        groups, pool = _batch()
        for g in groups:  # behaviour log-probs far from the policy's: the sequence weights spread
            for i, r in enumerate(g.rollouts):
                r.segments[0].behavior_logprobs = np.full(len(r), -0.5 - 1.5 * (i % 2), dtype=np.float32)
        before = [p.detach().clone() for p in policy.model.parameters()]
        report = LocalTrainer(policy).update(stage, groups, pool)
        moved[use] = max(float((p.detach() - b).abs().max()) for p, b in zip(policy.model.parameters(), before))
        assert stage.optimizer.param_groups[0]["lr"] == 1e-2
        if use == "vcpo_ess":
            assert 0.0 < report.metrics["ess_ratio"] < 0.9 and report.metrics["lr_factor"] < 1.0
            assert report.metrics["lr_factor"] == pytest.approx(report.metrics["ess_ratio"] ** 0.5)
    assert moved["vcpo_ess"] < moved["constant"]
