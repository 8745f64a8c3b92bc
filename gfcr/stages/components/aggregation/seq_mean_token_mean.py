"""aggregation ``seq_mean_token_mean``: each response's mean token loss, averaged over the
responses (GRPO as written, arXiv 2402.03300 eq. 3; verl's ``seq-mean-token-mean``).

    L = (1 / N) sum_i ( sum_t w_it l_it / n_i )

with ``n_i`` the number of tokens of response ``i`` whose weight is non-zero and ``N`` the
number of responses with any such token (and the empty ones), over the whole batch;
``responses: with_tokens`` counts only those with a counted token (verl's ``agg_loss`` on one
batch), ``responses: all`` every response of the batch (verl's engine workers, which divide by
the mini-batch size).

Fidelity: checked against volcengine/verl@b178a3c: 8/10 cases, 2 documented deviations
(``tests/fidelity/seq_mean_token_mean.json``; ``agg_loss`` with ``seq-mean-token-mean``);
checked against volcengine/verl@b178a3c: 3/9 cases, 6 documented deviations
(``tests/fidelity/seq_mean_token_mean_micro.json``; ``agg_loss`` once per micro-batch with the
engine workers' ``global_batch_info``); with the settings below every verl case agrees;
checked against huggingface/trl@f2cd577: 10/12 cases, 2 documented deviations
(``tests/fidelity/seq_mean_token_mean_trl.json``; ``GRPOTrainer._compute_loss`` with
``loss_type: grpo``, after ``ppo_clip``).

Deviations:
- an empty response (0 tokens) is one of the ``N`` responses (TRL's GRPO loss counts every
  response the same way); verl's ``agg_loss`` on one batch leaves a response with no counted
  token out of ``N`` (2 verl reference cases): ``responses: with_tokens`` gives verl's;
- a response whose every token is masked out of the loss is left out of ``N``, as verl's
  ``agg_loss`` on one batch leaves it out; verl's engine workers count it (they divide by the
  mini-batch's responses, 6 ``_micro`` reference cases) and so does TRL's mean over the
  batch's rows (2 TRL reference cases): ``responses: all`` gives theirs;
- verl's legacy actor worker (``dp_actor``) reduces each micro-batch against its own totals
  and scales it by ``1 / gradient_accumulation``, so there the loss depends on how the batch is
  split; here, as in verl's engine workers (``global_batch_info``), every micro-batch is reduced
  against the batch's totals (the ``*_micro`` cases). No setting gives the legacy worker's split;
- a tree's shared tokens are weighted ``1/k`` in each leaf's sum but each leaf is
still divided by its own length, so "a shared prefix counts once" is exact only under
``token_mean``.

Example (two responses: the short one's single token weighs as much as the long one's three):

>>> import torch
>>> agg = SeqMeanTokenMean(SeqMeanTokenMean.Config())
>>> rows = [Row("g", 2, None, 1, 1.0, 1), Row("g", 2, None, 3, 3.0, 3)]
>>> per_token = torch.tensor([[4.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
>>> weight = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
>>> float(agg.reduce(per_token, weight, rows, agg.plan(rows)))
2.5

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {aggregation: {use: seq_mean_token_mean}}}
"""

from __future__ import annotations

from typing import Any, Sequence

from pydantic import Field

from gfcr.stages.components.aggregation.base import (RESPONSES_HELP, AggregationConfig, ResponsesCounted, Row,
                                                     counted_lengths, responses_counted)


class SeqMeanTokenMean:
    """Mean over responses of the mean over their tokens."""

    class Config(AggregationConfig):
        responses: ResponsesCounted = Field("counted", description=RESPONSES_HELP)

    def __init__(self, config: Config):
        self.config = config

    def plan(self, rows: Sequence[Row]) -> int:
        return responses_counted(rows, self.config.responses)

    def reduce(self, per_token: Any, weight: Any, rows: Sequence[Row], plan: int) -> Any:
        return ((per_token * weight).sum(1) / counted_lengths(weight).clamp(min=1)).sum() / plan
