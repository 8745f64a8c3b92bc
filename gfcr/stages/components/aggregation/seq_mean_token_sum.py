"""aggregation ``seq_mean_token_sum``: Dr.GRPO's length-unbiased aggregation (Liu et al., 2025,
"Understanding R1-Zero-Like Training: A Critical Perspective", arXiv 2503.20783, section 3.1;
TRL's ``loss_type: dr_grpo``).

    L = (1 / N) sum_i ( sum_t w_it l_it / C )

Each response's token losses are summed and divided by one constant ``C`` (the reference
code's ``generate_max_length``), not by the response's own length, so that long wrong
answers are not penalised less per token than short ones. ``N`` is the number of responses
with any counted token.

``constant`` has no default: Dr.GRPO sets it to the generation's ``max_new_tokens``, and a
silent guess would rescale the loss (and, through gradient clipping, the step).

``constant: 1`` is verl's ``seq-mean-token-sum``.

Fidelity: checked against volcengine/verl@b178a3c: 12/30 cases, 18 documented deviations
(``tests/fidelity/seq_mean_token_sum.json``; ``agg_loss`` with ``seq-mean-token-sum`` and
``seq-mean-token-sum-norm``); checked against huggingface/trl@f2cd577: 10/12 cases, 2 documented
deviations (``tests/fidelity/seq_mean_token_sum_trl.json``; ``GRPOTrainer._compute_loss`` with
``loss_type: dr_grpo``, ``constant`` = its ``max_completion_length``).

Deviations:
- verl's ``seq-mean-token-sum-norm`` divides the sum of the responses' token-loss sums by
  ``C`` alone; here it is also divided by ``N``, Dr.GRPO's ``1/G`` (as TRL's ``dr_grpo``
  divides by the batch size times ``max_completion_length``), so verl's loss is ``N`` times
  this one (16 verl reference cases; the 4 with one response agree);
- an empty response (0 tokens) is one of the ``N`` responses (TRL counts every response the
  same way); verl's ``agg_loss`` leaves a response with no counted token out of ``N`` (2
  verl reference cases, ``seq-mean-token-sum``);
- a response whose every token is masked out of the loss is left out of ``N``, as verl leaves
  it out; TRL's mean over the batch's rows counts it (2 TRL reference cases).

Example (C = 4):

>>> import torch
>>> agg = SeqMeanTokenSum(SeqMeanTokenSum.Config(constant=4))
>>> rows = [Row("g", 2, None, 1, 1.0, 1), Row("g", 2, None, 3, 3.0, 3)]
>>> per_token = torch.tensor([[4.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
>>> weight = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
>>> float(agg.reduce(per_token, weight, rows, agg.plan(rows)))
0.875

YAML (Dr.GRPO: its estimator and this aggregation, with the generation's max_new_tokens):

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {advantage: {use: dr_grpo}, aggregation: {use: seq_mean_token_sum, with: {constant: 8}}}}
"""

from __future__ import annotations

from typing import Annotated, Any, Sequence

from pydantic import Field

from gfcr.stages.components.aggregation.base import AggregationConfig, Row


class SeqMeanTokenSum:
    """Mean over responses of their token-loss sum divided by a constant."""

    class Config(AggregationConfig):
        constant: Annotated[float, Field(gt=0.0, description="the normaliser C: the generation's max_new_tokens "
                                                              "(Dr.GRPO's generate_max_length)")]

    def __init__(self, config: Config):
        self.config = config

    def plan(self, rows: Sequence[Row]) -> int:
        return sum(1 for r in rows if r.counts)

    def reduce(self, per_token: Any, weight: Any, rows: Sequence[Row], plan: int) -> Any:
        return (per_token * weight).sum() / self.config.constant / plan
