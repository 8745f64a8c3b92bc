"""correction ``seq_tis``: sequence-level truncated importance sampling, verl's ``rollout_is:
sequence`` (the rollout correction of verl's ``rollout_corr_helper``, as the VCPO authors' fork
carries it, mit-han-lab/vcpo; VCPO, arXiv 2602.17616, trains with it): every token of a
response is weighted by the response's own importance weight, truncated.

    w = min(exp(clamp(sum_t log pi_old(y_t) - log mu(y_t), -20, 20)), C)      (detached)
    ratio_t = pi_theta(y_t) / pi_old(y_t)

with the sum over the response's counted tokens (``pi_old``, the policy at update start, is the
detached log-prob of the gradient pass: the VCPO script's ``skip_recompute_old_log_prob``; ``mu``
the behaviour log-probs). Unlike ``tis`` (a weight per token), the weight is the product of the
token ratios, unbiased for the sequence's likelihood ratio and of higher variance; the cap
``C`` bounds it. The metrics' ``is_weight_mean`` and ``is_weight_max`` are those of the
untruncated sequence weight, over the counted tokens.

Defaults: ``cap: 2.0``, the function's ``rollout_is_threshold``; the VCPO script uses 8.0
(``pipelines/examples/vcpo_arith.yaml``).

Fidelity: checked against mit-han-lab/vcpo@c7f030f: 8/8 cases (``tests/fidelity/seq_tis.json``;
``compute_rollout_correction_weights`` with ``rollout_is='sequence'``: near on-policy, stale with
caps 8, 2 and 1.5, padding, tiny weights, a sum past the safety bound, one-token responses).

Deviations:
- verl's batch normalisation of the weights (``rollout_is_batch_normalize``) and its rejection
  sampling (``rollout_rs``) are not offered (the VCPO script uses neither);
- the sum runs over the tokens that count in the loss (a Filter's loss mask, the staleness limit
  and environment turns are left out); verl's over the response mask.

Example (a two-token response whose tokens are each twice as likely now: ``w = 4``, capped at 2):

>>> import math, torch
>>> logp, mu = torch.full((1, 2), math.log(0.5)), torch.full((1, 2), math.log(0.25))
>>> c = SeqTIS(SeqTIS.Config()).correct_sequences(logp, mu, torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 2))
>>> [round(float(w), 4) for w in c.weight[0]], round(float(c.raw_weight[0, 0]), 4)
([2.0, 2.0], 4.0)

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {correction: {use: seq_tis, with: {cap: 8.0}}}}
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import Field

from gfcr.records import Rollout
from gfcr.registry import PipelineProblem
from gfcr.stages.components.base import PairingContext
from gfcr.stages.components.correction.base import (CorrectionConfig, MaxStaleness, TokenCorrection, kept_tokens,
                                                    per_token_ratio_problems)

SAFETY_BOUND = 20.0  # verl's clamp of the summed log-ratio before the exponential


class SeqTIS:
    """Every token's ratio against pi_old, weighted by its response's min(prod pi_old / mu, C)."""

    class Config(CorrectionConfig):
        cap: Annotated[float, Field(gt=0.0, description="C: the largest sequence weight (verl's rollout_is_threshold, "
                                                        "2.0; the VCPO script's 8.0)")] = 2.0
        max_staleness: MaxStaleness = None

    @staticmethod
    def pairing_problems(config: Config, ctx: PairingContext) -> list[PipelineProblem]:
        return per_token_ratio_problems("seq_tis", ctx)

    def __init__(self, config: Config):
        self.config = config

    def correct_sequences(self, logp: Any, behaviour: Any, stale: Any, weight: Any) -> TokenCorrection:
        import torch

        old = logp.detach()
        counted = weight > 0
        total = torch.where(counted, old - behaviour, torch.zeros_like(old)).sum(1, keepdim=True)  # [B, 1]
        raw = torch.exp(total.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(old)  # [B, R]
        capped = raw > self.config.cap
        return TokenCorrection(old, raw.clamp(max=self.config.cap), raw, torch.ones_like(stale), capped)

    def keeps(self, rollout: Rollout, version: int) -> np.ndarray | None:
        return kept_tokens(self.config.max_staleness, rollout, version)
