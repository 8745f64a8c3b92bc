"""The aggregation ``seq_mean_token_mean`` against verl's ``agg_loss``: one batch's per-token losses
reduced in micro-batches of two responses (each against the batch's plan) and summed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gfcr.registry.catalog import AGGREGATIONS
from tests.fidelity.cases import case_ids, cases, check
from tests.fidelity.update_terms import aggregate, build, rows

METHOD = "seq_mean_token_mean"


def aggregated(inp: dict[str, Any]) -> float:
    config = {} if METHOD != "seq_mean_token_sum" else {"constant": inp["constant"]}
    loss = aggregate(build(AGGREGATIONS, METHOD, **config), torch.tensor(inp["loss_mat"]),
                     torch.tensor(inp["mask"]), rows(inp))
    return float(loss)


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_seq_mean_token_mean_matches_the_reference(case):
    check(METHOD, case, aggregated)
