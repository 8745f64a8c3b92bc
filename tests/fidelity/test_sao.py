"""SAO (loss ``sao``) against the reproduction's ``compute_sao_loss`` (Human-Agent-Society/reef,
``recipes/sao``): each case is one ``[B, R]`` batch of tokens; the per-token losses, the masked
indicator and the gradient w.r.t. the current log-probs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gfcr.registry.catalog import LOSSES
from tests.fidelity.cases import case_ids, cases, check
from tests.fidelity.update_terms import build

METHOD = "sao"


def sao(inp: dict[str, Any]) -> dict[str, Any]:
    loss = build(LOSSES, "sao", clip=(inp["eps_clip"], inp["eps_clip_high"]))
    log_prob = torch.tensor(inp["log_prob"], dtype=torch.float32, requires_grad=True)  # [B, R]
    log_ratio = log_prob - torch.tensor(inp["old_log_prob"], dtype=torch.float32)
    advantages = torch.tensor(inp["advantages"], dtype=torch.float32)
    terms = loss.terms(log_ratio, advantages, torch.ones_like(advantages), logprobs=log_prob.detach())
    terms.per_token.sum().backward()
    return {"pg_losses": terms.per_token.detach().tolist(), "clipfrac": terms.clipped.float().tolist(),
            "grad": log_prob.grad.tolist()}


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_sao_matches_the_reference(case):
    check(METHOD, case, sao)
