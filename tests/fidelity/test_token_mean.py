"""The aggregation ``token_mean`` against verl's ``agg_loss``: one batch's per-token losses reduced
in micro-batches (each against the batch's plan) and summed; ``token_mean_micro`` as verl's engine
workers call it once per micro-batch with the batch's totals (``global_batch_info``). With the
settings a Deviations entry names (``update_terms.aggregated_with``), every case agrees."""

from __future__ import annotations

import pytest

from tests.fidelity.cases import case_ids, cases, check, check_setting
from tests.fidelity.update_terms import aggregated, aggregated_with

METHOD = "token_mean"
MICRO = "token_mean_micro"


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_token_mean_matches_the_reference(case):
    check(METHOD, case, aggregated(METHOD))


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_token_mean_with_verls_setting_matches_every_case(case):
    check_setting(METHOD, case, aggregated_with(METHOD, verl="batch"))


@pytest.mark.parametrize("case", cases(MICRO), ids=case_ids(MICRO))
def test_token_mean_in_micro_batches_matches_verls_engine(case):
    check(MICRO, case, aggregated_with(METHOD))


@pytest.mark.parametrize("case", cases(MICRO), ids=case_ids(MICRO))
def test_token_mean_in_micro_batches_with_verls_setting_matches_every_case(case):
    check_setting(MICRO, case, aggregated_with(METHOD, verl="engine"))
