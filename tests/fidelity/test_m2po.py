"""M2PO (loss ``m2po``) against the authors' ``compute_m2po_policy_loss`` (Infini-AI-Lab/M2PO):
each case is one micro-batch (the reference solves one ``tau`` per micro-batch): the aggregated
loss, its gradient w.r.t. the current log-probs, the ratio bounds and M2 before and after."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gfcr.registry.catalog import AGGREGATIONS, LOSSES
from tests.fidelity.cases import case_ids, cases, check
from tests.fidelity.update_terms import AGGREGATION_OF_MODE, build, rows

METHOD = "m2po"


def m2po(inp: dict[str, Any]) -> dict[str, Any]:
    loss = build(LOSSES, "m2po", m2_budget=inp["m2_budget"], miniclip=tuple(inp["miniclip"]))
    log_prob = torch.tensor(inp["log_prob"], dtype=torch.float32, requires_grad=True)  # [B, R]
    weight = torch.tensor(inp["mask"], dtype=torch.float32)
    log_ratio = log_prob - torch.tensor(inp["old_log_prob"], dtype=torch.float32)
    advantages = torch.tensor(inp["advantages"], dtype=torch.float32)
    terms = loss.terms(log_ratio, advantages, weight)
    aggregation, all_rows = build(AGGREGATIONS, AGGREGATION_OF_MODE[inp["aggregation"]]), rows(inp)
    total = aggregation.reduce(terms.per_token, weight, all_rows, aggregation.plan(all_rows))  # one micro-batch
    total.backward()
    b = loss.bounds(log_ratio, advantages, weight)
    return {"loss": float(total.detach()), "grad": log_prob.grad.tolist(), "eps_low": 1 - b.low,
            "eps_high": b.high - 1, "m2": b.m2, "m2_after": b.m2_after}


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_m2po_matches_the_reference(case):
    check(METHOD, case, m2po)
