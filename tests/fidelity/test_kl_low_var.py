"""The k3 KL to the reference policy (``update.grpo``'s ``kl_coef`` term, ``k3_kl``) against
verl's ``kl_penalty`` with ``low_var_kl``: each token's estimate and the gradient of their sum
w.r.t. the current log-probs. Unclamped by default (the deviations: tokens past verl's clamp of
the estimate at 10 or of the log-ratio at 20); ``kl_clamp: 10.0`` gives verl's on every case."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gfcr.stages.update.logprobs import k3_kl
from tests.fidelity.cases import case_ids, cases, check, check_setting

METHOD = "kl_low_var"


def estimate(inp: dict[str, Any], clamp: float | None = None) -> dict[str, Any]:
    logp = torch.tensor(inp["log_prob"], dtype=torch.float32, requires_grad=True)  # [B, R]
    kl = k3_kl(torch.tensor(inp["ref_log_prob"], dtype=torch.float32), logp, clamp)
    kl.sum().backward()
    return {"kl": kl.detach().tolist(), "grad": logp.grad.tolist()}


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_the_k3_kl_matches_verls_low_var_kl(case):
    check(METHOD, case, estimate)


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_with_verls_clamp_every_case_matches(case):
    check_setting(METHOD, case, lambda inp: estimate(inp, clamp=10.0))
