"""advantage ``krpo``: KRPO, Kalman-filter enhanced GRPO (Wang, Ma, Reid and Yaqub, 2025, "Kalman
Filter Enhanced GRPO for Reinforcement Learning-Based Language Model Reasoning", arXiv 2505.07527;
reference code ``billhhh/KRPO_LLMs_RL``, ``train.py``: ``KalmanFilter`` and ``group_advantages``).

A one-dimensional Kalman filter runs over the group's rewards ``r_1 .. r_G`` in rollout order,
treating each as a noisy measurement of a latent reward level. A fresh filter starts every
group at ``x_0 = init_mean``, ``P_0 = init_var``; for ``i = 1 .. G``, with process noise ``Q``
and measurement noise ``R``:

    P_pred = P_{i-1} + Q                         (predict; x_pred = x_{i-1})
    K_i    = P_pred / (P_pred + R)                (Kalman gain)
    x_i    = x_{i-1} + K_i (r_i - x_{i-1})        (filtered mean)
    P_i    = (1 - K_i) P_pred                     (filtered variance)
    A_i    = (r_i - x_i) / (sqrt(P_i) + eps)

Each rollout's advantage uses the filter's state right after its own reward, as the reference
code computes it. The defaults are the reference code's: ``Q = 1e-5``, ``R = 1e-2``,
``x_0 = 0``, ``P_0 = 1``, ``eps = 1e-8``.

Because the filter starts from ``x_0 = 0``, a group whose rewards are all equal gets 0.0 only
when they equal ``init_mean``: equal positive rewards get positive advantages that shrink
along the group (the filtered mean catches up and its variance shrinks). That is the method,
not rounding, so it is kept; a single rollout likewise gets ``(r - x_1) / sqrt(P_1)``.

Deviations:
- a summary of the paper writes the scale as ``sqrt(P_i + eps)`` (not checked against the
  paper's own equation); the reference code's ``sqrt(P_i) + eps`` is used: at the defaults
  ``P_i`` stays above its steady state of about ``3.1e-4``, so the two differ by less than
  ``2e-5`` relative;
- float64 arithmetic (the reference: float32); unscored rollouts (NaN rewards) raise
  ValueError naming the group.

Example (rewards ``[0, 0]`` leave the filter at 0; the reward 1 is measured with gain
``K = 1.00001 / 1.01001``, so ``x_1 = K``, ``P_1 = (1 - K) * 1.00001``):

>>> from gfcr.stages.testing import scored_group
>>> [round(a, 4) for a in KRPO(KRPO.Config()).estimate(scored_group("p:0", [0.0, 0.0])).values]
[0.0, 0.0]
>>> [round(a, 4) for a in KRPO(KRPO.Config()).estimate(scored_group("p:0", [1.0])).values]
[0.0995]

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {advantage: {use: krpo, with: {meas_var: 1.0e-2}}}}
"""

from __future__ import annotations

import math
from typing import Annotated

import numpy as np
from pydantic import Field

from gfcr.records import RolloutGroup
from gfcr.stages.components.advantage.base import Advantages, EstimatorConfig, checked_rewards


class KRPO:
    """Rewards centred and scaled by a 1-D Kalman filter run over the group."""

    class Config(EstimatorConfig):
        process_var: Annotated[float, Field(ge=0.0, description="process noise variance Q (reference: 1e-5)")] = 1e-5
        meas_var: Annotated[float, Field(gt=0.0, description="measurement noise variance R (reference: 1e-2)")] = 1e-2
        init_mean: float = Field(0.0, description="the filter's initial mean x_0 (reference: 0)")
        init_var: Annotated[float, Field(gt=0.0, description="the filter's initial variance P_0 (reference: 1)")] = 1.0
        eps: Annotated[float, Field(ge=0.0, description="added to sqrt(P_i) (reference: 1e-8)")] = 1e-8

    def __init__(self, config: Config):
        self.config = config

    def estimate(self, group: RolloutGroup) -> Advantages:
        r = checked_rewards(group)  # [G]
        return Advantages.scalars(self.filtered_advantages(r))

    def filtered_advantages(self, rewards: np.ndarray) -> np.ndarray:
        """``A_i`` for rewards measured one after the other by a fresh filter."""
        cfg = self.config
        x, p = cfg.init_mean, cfg.init_var
        out = np.empty(len(rewards))
        for i, z in enumerate(rewards):
            p_pred = p + cfg.process_var
            gain = p_pred / (p_pred + cfg.meas_var)
            x = x + gain * (z - x)
            p = (1.0 - gain) * p_pred
            out[i] = (z - x) / (math.sqrt(p) + cfg.eps)
        return out
