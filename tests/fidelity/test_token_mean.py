"""The aggregation ``token_mean`` against verl's ``agg_loss``: one batch's per-token losses
reduced in micro-batches of two responses (each against the batch's plan) and summed."""

from __future__ import annotations

import pytest

from tests.fidelity.cases import case_ids, cases, check
from tests.fidelity.update_terms import aggregated

METHOD = "token_mean"


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_token_mean_matches_the_reference(case):
    check(METHOD, case, aggregated(METHOD))
