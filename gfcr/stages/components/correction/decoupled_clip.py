"""correction ``decoupled_clip``: AReaL's decoupled PPO objective for stale tokens (Fu et al.,
2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning",
arXiv 2505.24298): the ratio against ``pi_old``, the loss weighted by ``pi_old / mu``.

For a stale token (``staleness = current_version - segment.policy_version > 0``):

    ratio_t = pi_theta(y_t) / pi_old(y_t)              (clipped by the loss around 1)
    w_t     = pi_old(y_t) / mu(y_t)                    (detached, uncapped)

and a fresh token keeps the ratio against ``mu`` and the weight 1. On stale tokens this is also
DOTS' loss (Sun et al., 2025, arXiv 2506.05316): ``-min(A r, A clip(r, r_old (1 - eps), r_old
(1 + eps)))`` with ``r = pi_theta / mu`` and ``r_old = pi_old / mu`` equals ``r_old`` times the
clipped surrogate of ``pi_theta / pi_old``; ``replay.rollout_replay`` and ``replay.pilot_join``
need it (``gfcr validate`` says so). With ``max_staleness: K``, tokens more than ``K`` versions
old are also masked (AReaL's ``max_head_offpolicyness``, per token here).

Deviations: AReaL recomputes ``pi_old`` with a forward pass before its PPO epochs; the update
takes one optimizer step per batch, so ``pi_old`` is the detached log-prob of the gradient pass
itself.

Example (a stale token whose probability rose from 0.2 to 0.5 gets the uncapped weight 2.5, a
fresh one keeps the weight 1):

>>> import math, torch
>>> logp, mu = torch.tensor([[math.log(0.5), math.log(0.5)]]), torch.tensor([[math.log(0.2), math.log(0.2)]])
>>> c = DecoupledClip(DecoupledClip.Config()).correct(logp, mu, torch.tensor([[True, False]]))
>>> [round(float(w), 4) for w in c.weight[0]]
[2.5, 1.0]

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: replay, with: {correction: {use: decoupled_clip}}}
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gfcr.records import Rollout
from gfcr.registry import PipelineProblem
from gfcr.stages.components.base import PairingContext
from gfcr.stages.components.correction.base import (CorrectionConfig, MaxStaleness, TokenCorrection, kept_tokens,
                                                per_token_ratio_problems, proximal_correction)


class DecoupledClip:
    """Stale tokens: the ratio against pi_old, weighted by pi_old / mu."""

    class Config(CorrectionConfig):
        max_staleness: MaxStaleness = None

    @staticmethod
    def pairing_problems(config: Config, ctx: PairingContext) -> list[PipelineProblem]:
        return per_token_ratio_problems("decoupled_clip", ctx)

    def __init__(self, config: Config):
        self.config = config

    def correct(self, logp: Any, behaviour: Any, stale: Any) -> TokenCorrection:
        return proximal_correction(logp, behaviour, stale)

    def keeps(self, rollout: Rollout, version: int) -> np.ndarray | None:
        return kept_tokens(self.config.max_staleness, rollout, version)
