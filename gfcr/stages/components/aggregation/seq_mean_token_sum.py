"""aggregation ``seq_mean_token_sum``: Dr.GRPO's length-unbiased aggregation (Liu et al., 2025,
"Understanding R1-Zero-Like Training: A Critical Perspective", arXiv 2503.20783, section 3.1;
TRL's ``loss_type: dr_grpo``).

    L = (1 / N) sum_i ( sum_t w_it l_it / C )

Each response's token losses are summed and divided by one constant ``C`` (the reference
code's ``generate_max_length``), not by the response's own length, so that long wrong
answers are not penalised less per token than short ones. ``N`` is the number of responses
with any counted token (and the empty ones); ``responses`` chooses otherwise, as for
``seq_mean_token_mean`` (``with_tokens``: verl's ``agg_loss`` on one batch; ``all``: verl's
engine workers). ``per_response: false`` leaves out the ``1 / N``: verl's
``seq-mean-token-sum-norm``.

``constant`` has no default: Dr.GRPO sets it to the generation's ``max_new_tokens``, and a
silent guess would rescale the loss (and, through gradient clipping, the step).

``constant: 1`` is verl's ``seq-mean-token-sum``.

Fidelity: checked against volcengine/verl@b178a3c: 12/30 cases, 18 documented deviations
(``tests/fidelity/seq_mean_token_sum.json``; ``agg_loss`` with ``seq-mean-token-sum`` and
``seq-mean-token-sum-norm``); checked against volcengine/verl@b178a3c: 3/27 cases, 24 documented
deviations (``tests/fidelity/seq_mean_token_sum_micro.json``; ``agg_loss`` once per micro-batch
with the engine workers' ``global_batch_info``); with the settings below every verl case
agrees; checked against huggingface/trl@f2cd577: 10/12 cases, 2 documented
deviations (``tests/fidelity/seq_mean_token_sum_trl.json``; ``GRPOTrainer._compute_loss`` with
``loss_type: dr_grpo``, ``constant`` = its ``max_completion_length``).

Deviations:
- verl's ``seq-mean-token-sum-norm`` divides the sum of the responses' token-loss sums by
  ``C`` alone; here it is also divided by ``N``, Dr.GRPO's ``1/G`` (as TRL's ``dr_grpo``
  divides by the batch size times ``max_completion_length``), so verl's loss is ``N`` times
  this one (16 verl reference cases and 18 ``_micro`` ones; the 4 with one response agree):
  ``per_response: false`` gives verl's. verl's default ``C`` is the padded response length
  of the micro-batch (``loss_mask.shape[-1]``) unless ``loss_scale_factor`` is set; here
  ``constant`` is required;
- an empty response (0 tokens) is one of the ``N`` responses (TRL counts every response the
  same way); verl's ``agg_loss`` on one batch leaves a response with no counted token out of
  ``N`` (2 verl reference cases, ``seq-mean-token-sum``): ``responses: with_tokens`` gives verl's;
- verl's legacy actor worker (``dp_actor``) reduces each micro-batch against its own totals
  and scales it by ``1 / gradient_accumulation``, so there the loss depends on how the batch is
  split; here, as in verl's engine workers (``global_batch_info``), every micro-batch is reduced
  against the batch's totals (the ``*_micro`` cases). No setting gives the legacy worker's split;
- a response whose every token is masked out of the loss is left out of ``N``, as verl's
  ``agg_loss`` on one batch leaves it out; verl's engine workers count it (6 ``_micro`` verl
  reference cases) and so does TRL's mean over the batch's rows (2 TRL reference cases):
  ``responses: all`` gives theirs.

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

from gfcr.stages.components.aggregation.base import (RESPONSES_HELP, AggregationConfig, ResponsesCounted, Row,
                                                     responses_counted)


class SeqMeanTokenSum:
    """Mean over responses of their token-loss sum divided by a constant."""

    class Config(AggregationConfig):
        constant: Annotated[float, Field(gt=0.0, description="the normaliser C: the generation's max_new_tokens "
                                                              "(Dr.GRPO's generate_max_length)")]
        responses: ResponsesCounted = Field("counted", description=RESPONSES_HELP)
        per_response: bool = Field(True, description="divide by the N responses (Dr.GRPO's 1/G); false: by C "
                                                     "alone, verl's seq-mean-token-sum-norm")

    def __init__(self, config: Config):
        self.config = config

    def plan(self, rows: Sequence[Row]) -> int:
        return responses_counted(rows, self.config.responses) if self.config.per_response else 1

    def reduce(self, per_token: Any, weight: Any, rows: Sequence[Row], plan: int) -> Any:
        return (per_token * weight).sum() / self.config.constant / plan
