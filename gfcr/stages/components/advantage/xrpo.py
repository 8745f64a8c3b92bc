"""advantage ``xrpo``: XRPO's novelty-aware advantage sharpening (Bamba, Fang, Yu, Zheng, Lai, 2025;
arXiv 2510.06672, "XRPO: Pushing the limits of GRPO with Targeted Exploration and Exploitation";
code announced at ``UIUC-MLSys/XRPO``, not available to check).

XRPO's exploitation half: a correct response the policy found unlikely gets a larger advantage,
measured against the other responses of its group. With ``A_i`` GRPO's group-normalised
advantage (unbiased std, eps 1e-6) and ``s_i`` the response's mean token log-likelihood:

    s_i     = (1 / |y_i|) * sum_t log mu(y_i,t)      (behaviour log-probs, ``Rollout.behavior_logprobs``)
    s_bar   = mean_i s_i                              (over the group's non-empty responses)
    eta_i   = exp(s_i - s_bar)                        (< 1: less likely than the group's typical response)
    A+_i    = A_i + min(max(lambda_novelty * (1 - eta_i), 0), kappa_clip * A_i)
                                                      for correct i with A_i > 0
    A+_i    = A_i                                     otherwise

The bonus is never negative and at most ``kappa_clip * A_i``, so a correct response's advantage
grows by at most a factor ``1 + kappa_clip``; wrong responses are untouched.

Deviations: the paper's full text and code were not readable here, only its abstract and a
third-party implementation (``Wodlfvllf/grpo-composer``,
``core/advantages/novelty_sharpening.py``), so the first three items are unverified:

- the formula above is the third-party one; it is "group-relative" as the abstract says. The
  research note's other third-party form, ``A + lambda * max(s - kappa, 0)`` with ``s`` the
  negative mean log-prob (an older ``grpo-composer`` config), compares with a fixed threshold,
  not the group, and is not used;
- ``lambda_novelty = kappa_clip = 1`` are the third-party defaults, not checked against the
  paper; ``s_bar`` averages every non-empty response of the group (it might be the correct
  ones only in the paper);
- the bonus applies to rollouts a verifier marked ``correct`` with a positive advantage (the
  third-party code applies it wherever the clip allows, which for a negative advantage would
  lower it further); a rollout with no ``correct`` raises ValueError;
- the likelihood is the behaviour policy's, recorded at generation: the paper's ``pi_theta``
  at the start of the update, the same policy for fresh rollouts, but not for resumed or
  replayed segments of older versions. An empty response has no likelihood: it gets no bonus
  and is left out of ``s_bar``;
- the other parts of XRPO (the rollout allocator and in-context seeding) are Control stages,
  not this estimator;
- a group whose rewards are all equal, or a group of one rollout, gets exactly 0.0; unscored
  rollouts (NaN rewards) raise ValueError naming the group.

Example (two correct, two wrong; the second correct response is the least likely):

>>> import numpy as np
>>> from gfcr.records import Segment
>>> from gfcr.stages.testing import scored_group
>>> group = scored_group("p:0", [1.0, 1.0, 0.0, 0.0])
>>> for rollout, logprob in zip(group.rollouts, [-0.1, -1.0, -0.5, -0.5]):
...     rollout.segments = [Segment(0, 1, 0, np.array([logprob]))]
>>> [round(a, 3) for a in XRPO(XRPO.Config()).estimate(group).values]
[0.866, 1.244, -0.866, -0.866]

YAML:

.. code-block:: yaml

    update:
      use: update.grpo
      from: reward
      with: {advantage: {use: xrpo, with: {lambda_novelty: 1.0, kappa_clip: 1.0}}}
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
from pydantic import Field

from gfcr.records import RolloutGroup
from gfcr.stages.components.advantage.base import Advantages, EstimatorConfig, checked_rewards, has_no_baseline
from gfcr.stages.components.advantage.group_stats import correct_flags, standardised


def mean_logprobs(group: RolloutGroup) -> np.ndarray:
    """``s_i``: each response's mean behaviour log-prob ``[G]`` float64; NaN for an empty one."""
    return np.array([float(np.mean(r.behavior_logprobs, dtype=np.float64)) if len(r) else np.nan
                     for r in group.rollouts], dtype=np.float64)


def novelty(s: np.ndarray) -> np.ndarray:
    """``eta_i = exp(s_i - s_bar)`` ``[G]``; NaN where ``s_i`` is (empty responses)."""
    known = ~np.isnan(s)
    return np.exp(s - s[known].mean()) if known.any() else s


class XRPO:
    """GRPO advantage plus a bonus for correct responses less likely than their group's."""

    class Config(EstimatorConfig):
        lambda_novelty: Annotated[float, Field(ge=0.0, description="scale of the novelty bonus "
                                                                   "lambda * (1 - eta)")] = 1.0
        kappa_clip: Annotated[float, Field(ge=0.0, description="the bonus is at most kappa * A")] = 1.0
        eps: Annotated[float, Field(ge=0.0, description="added to the std")] = 1e-6

    def __init__(self, config: Config):
        self.config = config

    def estimate(self, group: RolloutGroup) -> Advantages:
        r = checked_rewards(group)  # [G]
        correct = correct_flags(group, "xrpo")  # [G]
        if has_no_baseline(r):
            return Advantages.scalars(r * 0.0)
        a = standardised(r, self.config.eps)
        eta = novelty(mean_logprobs(group))
        sharpened = correct & (a > 0) & ~np.isnan(eta)
        bonus = np.minimum(np.maximum(self.config.lambda_novelty * (1.0 - eta), 0.0), self.config.kappa_clip * a)
        return Advantages.scalars(np.where(sharpened, a + bonus, a))
