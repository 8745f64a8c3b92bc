"""Shared drivers of the update components' fidelity tests: one case's token tensors through a
gfcr loss and aggregation, in micro-batches as ``update.grpo`` runs them.

A case gives ``old_log_prob``, ``log_prob``, ``advantages`` and ``mask`` as ``[B, R]`` lists
(``mask`` 0 on padding and on masked tokens) and ``lengths``, each response's token count.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gfcr.registry.catalog import ADVANTAGE_ESTIMATORS, AGGREGATIONS, LOSSES
from gfcr.stages.components.aggregation import Row
from gfcr.stages.testing import scored_group

MICRO_BATCH = 2  # responses per reduce call: the aggregation must divide by the batch's totals


def rows(inp: dict[str, Any]) -> list[Row]:
    """One ``Row`` per response, as ``update.grpo`` builds them (one group holding the batch)."""
    mask = np.asarray(inp["mask"], dtype=np.float64)  # [B, R]
    b = len(inp["lengths"])
    return [Row("g", b, np.zeros(b), n, float(mask[i].sum()), int((mask[i] > 0).sum()))
            for i, n in enumerate(inp["lengths"])]


def build(registry: Any, alias: str, **config: Any) -> Any:
    cls = registry.get(alias)
    return cls(cls.Config(**config))


def aggregate(aggregation: Any, per_token: torch.Tensor, weight: torch.Tensor, all_rows: list[Row]) -> torch.Tensor:
    """The step's loss: the sum of ``reduce`` over micro-batches, each against the batch's plan."""
    plan = aggregation.plan(all_rows)
    return sum(aggregation.reduce(per_token[s:s + MICRO_BATCH], weight[s:s + MICRO_BATCH],
                                  all_rows[s:s + MICRO_BATCH], plan)
               for s in range(0, len(all_rows), MICRO_BATCH))


def loss_terms(inp: dict[str, Any], loss: str, aggregation: str, aggregation_config: dict[str, Any] | None = None,
               **loss_config: Any) -> dict[str, Any]:
    """The aggregated loss, its gradient w.r.t. ``log_prob`` and the loss's ``clipped`` fraction
    over the counted tokens, for ``log_ratio = log_prob - old_log_prob``."""
    log_prob = torch.tensor(inp["log_prob"], dtype=torch.float32, requires_grad=True)  # [B, R]
    weight = torch.tensor(inp["mask"], dtype=torch.float32)  # [B, R]
    log_ratio = log_prob - torch.tensor(inp["old_log_prob"], dtype=torch.float32)
    terms = build(LOSSES, loss, **loss_config).terms(log_ratio, torch.tensor(inp["advantages"]), weight)
    total = aggregate(build(AGGREGATIONS, aggregation, **(aggregation_config or {})), terms.per_token, weight,
                      rows(inp))
    total.backward()
    counted = weight > 0
    clipfrac = float(terms.clipped[counted].float().mean()) if counted.any() else 0.0
    return {"loss": float(total.detach()), "grad": log_prob.grad.tolist(), "clipfrac": clipfrac}


AGGREGATION_OF_MODE = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean_token_mean"}


def group_advantages(estimator: str, **config: Any) -> Any:
    """A case's one group through the advantage ``estimator`` (its ``config``, default if none):
    its advantages."""
    def advantages(inp: dict[str, Any]) -> list[float]:
        cls = ADVANTAGE_ESTIMATORS.get(estimator)
        return [float(a) for a in cls(cls.Config(**config)).estimate(scored_group("p", inp["rewards"])).values]

    return advantages


def aggregated(method: str) -> Any:
    """A case's per-token losses reduced by the aggregation ``method`` in micro-batches of two
    responses (each against the batch's plan) and summed; ``seq_mean_token_sum`` takes the case's
    ``constant``."""
    def reduce(inp: dict[str, Any]) -> float:
        config = {"constant": inp["constant"]} if method == "seq_mean_token_sum" else {}
        return float(aggregate(build(AGGREGATIONS, method, **config), torch.tensor(inp["loss_mat"]),
                               torch.tensor(inp["mask"]), rows(inp)))

    return reduce


def aggregated_with(method: str, verl: str | None = None) -> Any:
    """Like ``aggregated``, in micro-batches of the case's ``micro_batch`` responses (2 where it
    gives none), with the settings that reproduce verl: ``verl="batch"`` for ``agg_loss`` on one
    batch, ``"engine"`` for its engine workers' ``global_batch_info``; None for the defaults."""
    def reduce(inp: dict[str, Any]) -> float:
        config: dict[str, Any] = {}
        if method == "seq_mean_token_sum":
            config["constant"] = inp.get("constant", 1)
        if verl and method != "token_mean":
            config["responses"] = "with_tokens" if verl == "batch" else "all"
        if verl and inp["mode"] == "seq-mean-token-sum-norm":
            config["per_response"] = False
        aggregation, all_rows = build(AGGREGATIONS, method, **config), rows(inp)
        per_token, weight = torch.tensor(inp["loss_mat"]), torch.tensor(inp["mask"])
        plan, size = aggregation.plan(all_rows), inp.get("micro_batch", MICRO_BATCH)
        return float(sum(aggregation.reduce(per_token[s:s + size], weight[s:s + size], all_rows[s:s + size], plan)
                         for s in range(0, len(all_rows), size)))

    return reduce
