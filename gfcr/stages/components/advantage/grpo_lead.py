"""advantage ``grpo_lead``: GRPO-LEAD's difficulty-aware advantage reweighting (Zhang, Zuo, 2025;
arXiv 2504.09696; reference code ``aeroplanepaper/GRPO-LEAD``, ``verl/trainer/ppo/core_algos.py``).

With ``R`` the group's rewards and ``rho`` the prompt's empirical accuracy (the share of the
group's rollouts a verifier marked ``correct``), the group-normalised advantage

    A_i = (R_i - mean(R)) / (std(R) + eps)          (unbiased std, eps 1e-6, as the reference)

is reweighted by a logistic function of the accuracy,

    w(x)  = weight_min + (weight_max - weight_min) / (1 + exp(steepness * (x - midpoint)))
    A'_i  = A_i * w(rho)        if A_i > 0
    A'_i  = A_i * w(1 - rho)    if A_i <= 0

so correct answers to hard prompts (low ``rho``) and wrong answers to easy prompts (high
``rho``) weigh up to ``weight_max``, and the opposite cases down to ``weight_min``. Defaults
are the paper's and the reference's: ``weight_min = 0.4``, ``weight_max = 1.5``,
``midpoint = 0.75``, ``steepness = 10``.

Deviations:
- GRPO-LEAD's other two parts, the length-dependent accuracy reward ``exp(-alpha z)`` and the
  explicit penalty (reward -1) for wrong answers, shape the reward: they belong to a verifier,
  not to this estimator, which takes the rewards as given;
- the accuracy is the share of rollouts with ``correct`` set by the verifier; the reference
  counts rewards ``> 0``, which is the same under its reward (``exp(-alpha z)`` if correct, -1
  if not) and under a 0/1 correctness reward. A rollout with no ``correct`` raises ValueError;
- a group whose rewards are all equal, or a group of one rollout, gets exactly 0.0 (the
  reference gives a lone rollout its raw reward times the weight); unscored rollouts (NaN
  rewards) raise ValueError naming the group.

Example (one of four correct: ``rho = 0.25``, ``w(0.25) = 1.4926``, ``w(0.75) = 0.95``):

>>> from gfcr.stages.testing import scored_group
>>> [round(a, 3) for a in GRPOLead(GRPOLead.Config()).estimate(scored_group("p:0", [1.0, 0.0, 0.0, 0.0])).values]
[2.239, -0.475, -0.475, -0.475]

YAML:

.. code-block:: yaml

    update:
      use: update.grpo
      from: reward
      with:
        advantage: {use: grpo_lead, with: {weight_min: 0.4, weight_max: 1.5, midpoint: 0.75, steepness: 10.0}}
"""

from __future__ import annotations

import math
from typing import Annotated

import numpy as np
from pydantic import Field

from gfcr.records import RolloutGroup
from gfcr.stages.components.advantage.base import Advantages, EstimatorConfig, checked_rewards, has_no_baseline
from gfcr.stages.components.advantage.group_stats import correct_flags, standardised


class GRPOLead:
    """Group-normalised advantage times a logistic weight of the prompt's accuracy."""

    class Config(EstimatorConfig):
        weight_min: Annotated[float, Field(ge=0.0, description="A: the weight far past the midpoint")] = 0.4
        weight_max: Annotated[float, Field(ge=0.0, description="B: the weight far before the midpoint")] = 1.5
        midpoint: Annotated[float, Field(ge=0.0, le=1.0, description="rho_0: accuracy where the weight is "
                                                                     "halfway")] = 0.75
        steepness: Annotated[float, Field(ge=0.0, description="k: slope of the logistic")] = 10.0
        eps: Annotated[float, Field(ge=0.0, description="added to the std (the reference's 1e-6)")] = 1e-6

    def __init__(self, config: Config):
        self.config = config

    def weight(self, x: float) -> float:
        """The logistic ``w(x)``: ``weight_max`` for low ``x``, ``weight_min`` for high ``x``."""
        cfg = self.config
        z = min(cfg.steepness * (x - cfg.midpoint), 700.0)  # exp(700) is finite; beyond, the weight is weight_min
        return cfg.weight_min + (cfg.weight_max - cfg.weight_min) / (1.0 + math.exp(z))

    def estimate(self, group: RolloutGroup) -> Advantages:
        r = checked_rewards(group)  # [G]
        correct = correct_flags(group, "grpo_lead")  # [G]
        if has_no_baseline(r):
            return Advantages.scalars(r * 0.0)
        rho = float(correct.mean())
        a = standardised(r, self.config.eps)
        return Advantages.scalars(np.where(a > 0, a * self.weight(rho), a * self.weight(1.0 - rho)))
