"""gfcr's losses and aggregations against TRL's ``GRPOTrainer._compute_loss``: its loss types
``grpo`` (``seq_mean_token_mean``), ``bnpo`` and ``dapo`` (``token_mean``), ``dr_grpo``
(``seq_mean_token_sum`` with ``max_completion_length``), GSPO (``importance_sampling_level:
sequence``) and ``cispo``; the batch's loss and its gradient w.r.t. the current log-probs."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fidelity.cases import case_ids, cases, check
from tests.fidelity.update_terms import loss_terms

AGGREGATION = {"bnpo": "token_mean", "dapo": "token_mean", "grpo": "seq_mean_token_mean",
               "dr_grpo": "seq_mean_token_sum"}


def loss_type(inp: dict[str, Any]) -> dict[str, Any]:
    """A TRL loss type: PPO's clipped surrogate with TRL's (epsilon_low, epsilon_high), then its normaliser."""
    kind = inp["loss_type"]
    agg_config = {"constant": inp["max_completion_length"]} if kind == "dr_grpo" else None
    out = loss_terms(inp, "ppo_clip", AGGREGATION[kind], agg_config, clip=tuple(inp["clip"]))
    return {"loss": out["loss"], "grad": out["grad"]}


def gspo(inp: dict[str, Any]) -> dict[str, Any]:
    out = loss_terms(inp, "gspo", "seq_mean_token_mean", clip=tuple(inp["clip"]))
    return {"loss": out["loss"], "grad": out["grad"]}


def cispo(inp: dict[str, Any]) -> dict[str, Any]:
    """TRL's ``epsilon_high`` is the cap on the IS weight itself; gfcr's cap is ``1 + eps_high``."""
    return {"grad": loss_terms(inp, "cispo", "token_mean", eps_high=inp["epsilon_high"] - 1.0)["grad"]}


RUNS = {"token_mean_trl": loss_type, "seq_mean_token_mean_trl": loss_type, "seq_mean_token_sum_trl": loss_type,
        "gspo_trl": gspo, "cispo_trl": cispo}
PARAMS = [(method, case) for method in RUNS for case in cases(method)]


@pytest.mark.parametrize("method, case", PARAMS, ids=[f"{m}/{i}" for m in RUNS for i in case_ids(m)])
def test_trl_cases_match(method, case):
    check(method, case, RUNS[method])
