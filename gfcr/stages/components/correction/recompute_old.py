"""correction ``recompute_old``: every token's ratio against the recomputed ``pi_old``, with no
weight (APRIL, Zhou et al., 2025, arXiv 2509.18521; SPEC-RL, Liu et al., 2025, arXiv
2509.23232). A stale token is treated as if the current policy had sampled it: the standard PPO
ratio against recomputed ``old_log_probs`` that APRIL's code (slime), SPEC-RL's and RLEP's
reference code use.

    ratio_t = pi_theta(y_t) / pi_old(y_t)              (clipped by the loss around 1)
    w_t     = 1

The weight these methods leave out, ``pi_old / mu``, is still reported (``is_weight_mean``,
``is_weight_max``): a known bias, made a choice here (the seed-method notes: "make it
configurable"). With ``max_staleness: K``, tokens more than ``K`` versions old are also masked.

Deviations: the methods recompute ``pi_old`` with a forward pass before their PPO epochs; the
update takes one optimizer step per batch, so ``pi_old`` is the detached log-prob of the
gradient pass itself (the same numbers).

Example (the ratio is 1 at the update's start and no token is weighted):

>>> import math, torch
>>> logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
>>> c = RecomputeOld(RecomputeOld.Config()).correct(logp, torch.tensor([[math.log(0.2)]]), torch.tensor([[True]]))
>>> float(torch.exp(logp - c.proximal).detach()), float(c.weight), round(float(c.raw_weight), 4)
(1.0, 1.0, 2.5)

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: reward, with: {correction: {use: recompute_old}}}
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gfcr.records import Rollout
from gfcr.registry import PipelineProblem
from gfcr.stages.components.base import PairingContext
from gfcr.stages.components.correction.base import (CorrectionConfig, MaxStaleness, TokenCorrection, kept_tokens,
                                                per_token_ratio_problems, proximal_correction)


class RecomputeOld:
    """Every token's ratio against pi_old, unweighted."""

    class Config(CorrectionConfig):
        max_staleness: MaxStaleness = None

    @staticmethod
    def pairing_problems(config: Config, ctx: PairingContext) -> list[PipelineProblem]:
        return per_token_ratio_problems("recompute_old", ctx)

    def __init__(self, config: Config):
        self.config = config

    def correct(self, logp: Any, behaviour: Any, stale: Any) -> TokenCorrection:
        import torch

        return proximal_correction(logp, behaviour, torch.ones_like(stale), weighted=False)

    def keeps(self, rollout: Rollout, version: int) -> np.ndarray | None:
        return kept_tokens(self.config.max_staleness, rollout, version)
