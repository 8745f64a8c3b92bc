"""GSPO (loss ``gspo``) against verl's ``compute_policy_loss_gspo``: the batch's loss
(``seq_mean_token_mean``) and its gradient w.r.t. the current log-probs."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fidelity.cases import case_ids, cases, check
from tests.fidelity.update_terms import loss_terms

METHOD = "gspo"


def loss_and_grad(inp: dict[str, Any]) -> dict[str, Any]:
    out = loss_terms(inp, "gspo", "seq_mean_token_mean", clip=tuple(inp["clip"]))
    return {"loss": out["loss"], "grad": out["grad"]}


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_gspo_matches_the_reference(case):
    check(METHOD, case, loss_and_grad)
