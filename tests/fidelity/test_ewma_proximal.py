"""PPO-EWMA's proximal policy (correction ``ewma_proximal``) against the authors'
``compute_losses`` and ``EwmaModel.update`` (openai/ppo-ewma): the policy-gradient loss and its
gradient w.r.t. the current log-probs, the clip and importance-sampling clip fractions; and the
moving average of the weights after each of a sequence of steps."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from gfcr.registry.catalog import AGGREGATIONS, CORRECTIONS, LOSSES
from tests.fidelity.cases import case_ids, cases, check, close, load
from tests.fidelity.update_terms import build

METHOD = "ewma_proximal"
WIDE = 1.0e9  # the reference's clip_param 0 (no clip): a clip range no ratio reaches


def ewma_loss(inp: dict[str, Any]) -> dict[str, Any]:
    c = inp["clip"]
    loss = build(LOSSES, "ppo_clip", clip=(c, c) if c > 0 else (1.0, WIDE))
    correction = build(CORRECTIONS, "ewma_proximal", decay=0.9,
                       imp_samp_max=inp["imp_samp_max"] if inp["imp_samp_max"] > 0 else None)
    logp = torch.tensor(inp["log_prob"], dtype=torch.float32, requires_grad=True)  # [B, R]
    behaviour = torch.tensor(inp["behaviour_log_prob"], dtype=torch.float32)
    proximal = torch.tensor(inp["ewma_log_prob"], dtype=torch.float32)
    advantages = torch.tensor(inp["advantages"], dtype=torch.float32)
    weight = torch.ones_like(behaviour)
    corr = correction.correct_with(logp, behaviour, weight > 0, proximal)
    terms = loss.terms(logp - corr.proximal, advantages, weight)
    aggregation = build(AGGREGATIONS, "token_mean")
    rows = [r for r in _rows(weight)]
    total = aggregation.reduce(terms.per_token * corr.weight, weight, rows, aggregation.plan(rows))
    total.backward()
    out = {"loss": float(total.detach()), "grad": logp.grad.tolist()}
    if c > 0:
        out["clipfrac"] = float(terms.clipped.float().mean())
    if inp["imp_samp_max"] > 0:
        out["imp_samp_clipfrac"] = float(corr.capped.float().mean())
    return out


def _rows(weight: torch.Tensor) -> list:
    import numpy as np

    from gfcr.stages.components.aggregation import Row

    b, r = weight.shape
    return [Row("g", b, np.zeros(b), r, float(r), r) for _ in range(b)]


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_ewma_loss_matches_the_reference(case):
    check(METHOD, case, ewma_loss)


@pytest.mark.parametrize("case", load(METHOD)["ewma_cases"], ids=lambda c: c["id"])
def test_the_moving_average_matches_the_reference(case):
    inp = case["input"]
    model = torch.nn.Linear(len(inp["initial"][0]), 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(inp["initial"]))
    correction = build(CORRECTIONS, "ewma_proximal", decay=inp["decay"])
    correction.attach(model)
    for params, expected in zip(inp["params_after_each_step"], case["expected"]["ewma_after_each_step"]):
        with torch.no_grad():
            model.weight.copy_(torch.tensor(params))
        correction.follow(model)
        assert close(correction.proximal_model().weight.tolist(), expected["weights"], 1e-6, 1e-7)
        assert math.isclose(correction.total_weight, expected["total_weight"], rel_tol=1e-12)
