"""PPO's clipped surrogate with DAPO's clip-higher and the dual clip (loss ``ppo_clip``) against
verl's ``compute_policy_loss_vanilla``: the batch's aggregated loss and its gradient w.r.t. the
current log-probs, under ``token_mean`` and ``seq_mean_token_mean``."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fidelity.cases import case_ids, cases, check, check_setting
from tests.fidelity.update_terms import AGGREGATION_OF_MODE, loss_terms

METHOD = "ppo_clip"


def loss_and_grad(inp: dict[str, Any], **config: Any) -> dict[str, Any]:
    out = loss_terms(inp, "ppo_clip", AGGREGATION_OF_MODE[inp["aggregation"]],
                     clip=tuple(inp["clip"]), dual_clip=inp["dual_clip"], **config)
    return {"loss": out["loss"], "grad": out["grad"]}


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_ppo_clip_matches_the_reference(case):
    check(METHOD, case, loss_and_grad)


EDGES = "ppo_clip_edges"


@pytest.mark.parametrize("case", cases(EDGES), ids=case_ids(EDGES))
def test_ppo_clip_on_the_bounds_and_past_verls_clamp(case):
    check(EDGES, case, loss_and_grad)


@pytest.mark.parametrize("case", cases(EDGES) + cases(METHOD), ids=case_ids(EDGES) + case_ids(METHOD))
def test_ppo_clip_with_verls_clamp_matches_every_case(case):
    check_setting(EDGES if case in cases(EDGES) else METHOD, case,
                  lambda inp: loss_and_grad(inp, log_ratio_clamp=20.0))
