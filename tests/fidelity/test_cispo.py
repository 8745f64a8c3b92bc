"""CISPO (loss ``cispo``) against verl's ``compute_policy_loss_cispo``: the gradient of the
batch's aggregated loss w.r.t. the current log-probs and the fraction of clipped IS weights.
The loss value is not compared (gfcr's is a constant apart by design; see the JSON's driver)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fidelity.cases import case_ids, cases, check
from tests.fidelity.update_terms import AGGREGATION_OF_MODE, loss_terms

METHOD = "cispo"


def grad_and_clipfrac(inp: dict[str, Any]) -> dict[str, Any]:
    out = loss_terms(inp, "cispo", AGGREGATION_OF_MODE[inp["aggregation"]],
                     eps_low=inp["eps_low"], eps_high=inp["eps_high"])
    return {"grad": out["grad"], "clipfrac": out["clipfrac"]}


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_cispo_matches_the_reference(case):
    check(METHOD, case, grad_and_clipfrac)
