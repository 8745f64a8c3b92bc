"""aggregation ``seq_mean_token_mean``: each response's mean token loss, averaged over the
responses (GRPO as written, arXiv 2402.03300 eq. 3; verl's ``seq-mean-token-mean``).

    L = (1 / N) sum_i ( sum_t w_it l_it / n_i )

with ``n_i`` the number of tokens of response ``i`` whose weight is non-zero and ``N`` the
number of responses with any such token, over the whole batch.

Fidelity: checked against volcengine/verl@b178a3c: 8/10 cases, 2 documented deviations
(``tests/fidelity/seq_mean_token_mean.json``; ``agg_loss`` with ``seq-mean-token-mean``);
checked against huggingface/trl@f2cd577: 10/12 cases, 2 documented deviations
(``tests/fidelity/seq_mean_token_mean_trl.json``; ``GRPOTrainer._compute_loss`` with
``loss_type: grpo``, after ``ppo_clip``).

Deviations:
- an empty response (0 tokens) is one of the ``N`` responses (TRL's GRPO loss counts every
  response the same way); verl's ``agg_loss`` leaves a response with no counted token out of
  ``N`` (2 verl reference cases);
- a response whose every token is masked out of the loss is left out of ``N``, as verl leaves
  it out; TRL's mean over the batch's rows counts it (2 TRL reference cases);
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

from gfcr.stages.components.aggregation.base import AggregationConfig, Row, counted_lengths


class SeqMeanTokenMean:
    """Mean over responses of the mean over their tokens."""

    class Config(AggregationConfig):
        pass

    def __init__(self, config: Config):
        self.config = config

    def plan(self, rows: Sequence[Row]) -> int:
        return sum(1 for r in rows if r.counts)

    def reduce(self, per_token: Any, weight: Any, rows: Sequence[Row], plan: int) -> Any:
        return ((per_token * weight).sum(1) / counted_lengths(weight).clamp(min=1)).sum() / plan
