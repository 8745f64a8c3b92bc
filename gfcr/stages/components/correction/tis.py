"""correction ``tis``: truncated importance sampling, every token's ratio against ``pi_old``, its
loss weighted by ``min(pi_old / mu, C)`` (V-trace's truncated weights, Espeholt et al., 2018,
arXiv 1802.01561, as Yao et al., 2025, "Your efficient RL framework secretly brings you
off-policy RL training", apply them to the rollout-training mismatch; verl's
``tis_imp_ratio_cap``).

With ``mu`` the behaviour log-prob each token's segment recorded and ``pi_old`` the policy at
update start, for every token (stale or not):

    ratio_t = pi_theta(y_t) / pi_old(y_t)              (clipped by the loss around 1)
    w_t     = min(pi_old(y_t) / mu(y_t), C)            (detached)
    l_t     = w_t * loss_t(ratio_t)

so a token the engine sampled with a different probability than the trainer computes (numerics,
or an older policy) is reweighted, and no weight exceeds ``C``. ``is_clipped_fraction`` is the
share of tokens whose weight the cap truncated. With ``max_staleness: K``, tokens more than
``K`` versions old are also masked (as ``staleness``).

Deviations: V-trace truncates the weights of its value targets and policy gradient against the
current policy; here, as in Yao et al.'s verl patch, the weight is against ``pi_old`` and
multiplies the clipped surrogate. ``pi_old`` is the detached log-prob of the gradient pass (one
optimizer step per batch), not a second forward pass.

Example (a token whose probability rose from 0.2 to 0.5 since it was sampled: weight 2.5,
truncated to the cap 2):

>>> import math, torch
>>> tis = TIS(TIS.Config(cap=2.0))
>>> c = tis.correct(torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.2)]]), torch.tensor([[False]]))
>>> round(float(c.weight), 4), round(float(c.raw_weight), 4), bool(c.capped)
(2.0, 2.5, True)

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {correction: {use: tis, with: {cap: 2.0, max_staleness: 4}}}}
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import Field

from gfcr.records import Rollout
from gfcr.registry import PipelineProblem
from gfcr.stages.components.base import PairingContext
from gfcr.stages.components.correction.base import (CorrectionConfig, MaxStaleness, TokenCorrection, kept_tokens,
                                                per_token_ratio_problems, proximal_correction)


class TIS:
    """Every token's ratio against pi_old, weighted by min(pi_old / mu, C)."""

    class Config(CorrectionConfig):
        cap: Annotated[float, Field(gt=0.0, description="C: the largest IS weight min(pi_old/mu, C)")] = 2.0
        max_staleness: MaxStaleness = None

    @staticmethod
    def pairing_problems(config: Config, ctx: PairingContext) -> list[PipelineProblem]:
        return per_token_ratio_problems("tis", ctx)

    def __init__(self, config: Config):
        self.config = config

    def correct(self, logp: Any, behaviour: Any, stale: Any) -> TokenCorrection:
        import torch

        return proximal_correction(logp, behaviour, torch.ones_like(stale), cap=self.config.cap)

    def keeps(self, rollout: Rollout, version: int) -> np.ndarray | None:
        return kept_tokens(self.config.max_staleness, rollout, version)
