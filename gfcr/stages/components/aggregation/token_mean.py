"""aggregation ``token_mean``: every token of the batch weighs the same (DAPO, arXiv 2503.14476,
section 3.3; verl's ``loss_agg_mode: token-mean``).

    L = sum_{i,t} w_it l_it / sum_{i,t} w_it

over the whole batch (all micro-batches), so a long response counts in proportion to its
length, and a tree's shared prefix (weight ``1/k`` on each of ``k`` leaves) counts once.

Fidelity: checked against volcengine/verl@b178a3c: 10/10 cases (``tests/fidelity/token_mean.json``;
``agg_loss`` with ``token-mean``, reduced in micro-batches against the batch's token count);
checked against volcengine/verl@b178a3c: 9/9 cases (``tests/fidelity/token_mean_micro.json``;
``agg_loss`` once per micro-batch with the engine workers' ``global_batch_info``, batches with
fully masked and empty responses);
checked against huggingface/trl@f2cd577: 24/24 cases (``tests/fidelity/token_mean_trl.json``;
``GRPOTrainer._compute_loss`` with ``loss_type`` ``bnpo`` and ``dapo``, after ``ppo_clip``).

Deviations:
- verl's legacy actor worker (``dp_actor``) reduces each micro-batch against its own totals
  and scales it by ``1 / gradient_accumulation``, so there the loss depends on how the batch is
  split; here, as in verl's engine workers (``global_batch_info``), every micro-batch is reduced
  against the batch's totals (the ``*_micro`` cases). No setting gives the legacy worker's split.

Example:

>>> import torch
>>> agg = TokenMean(TokenMean.Config())
>>> rows = [Row("g", 2, None, 1, 1.0, 1), Row("g", 2, None, 3, 3.0, 3)]
>>> per_token = torch.tensor([[4.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
>>> weight = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
>>> float(agg.reduce(per_token, weight, rows, agg.plan(rows)))
1.75

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {aggregation: {use: token_mean}}}
"""

from __future__ import annotations

from typing import Any, Sequence

from gfcr.stages.components.aggregation.base import AggregationConfig, Row


class TokenMean:
    """The weighted mean over every token of the batch."""

    class Config(AggregationConfig):
        pass

    def __init__(self, config: Config):
        self.config = config

    def plan(self, rows: Sequence[Row]) -> float | int:
        if all(r.token_weight == r.length for r in rows):
            return sum(r.length for r in rows)  # an int, as before masks existed: the default stays exact
        return float(sum(r.token_weight for r in rows))

    def reduce(self, per_token: Any, weight: Any, rows: Sequence[Row], plan: float | int) -> Any:
        return (per_token * weight).sum() / plan
