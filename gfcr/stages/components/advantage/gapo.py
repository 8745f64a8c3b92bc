"""advantage ``gapo``: GAPO's adaptive-Q advantage (arXiv 2510.21830; ``TsingZ0/verl-GAPO``).

Sort the group's rewards ``r``, take the shortest contiguous window of the sorted rewards that
holds ``k = ceil(G * (100 fraction) / 100)`` values (the reference's float expression, so
``fraction`` 0.55 of 20 rollouts gives 12) (the leftmost one when several are equally short: the
reference keeps the first window with a strictly smaller span), ``Q`` = the median of that
window (the average of the two middle values for an even-length window, as the reference
computes it), and ``A = (r - Q) / (sqrt(sum((r - Q)^2) / (G - 1)) + eps)``.

Fidelity: checked against TsingZ0/verl-GAPO@58f42b5: 87/88 cases, 1 documented deviation
(``tests/fidelity/gapo.json``).

Deviations:
- a group of one rollout gets exactly 0.0 (the reference: ``r / (1 + eps)``, its baseline 0
  and scale 1); a group whose rewards are all equal gets 0.0, as in the reference;
  unscored rollouts (NaN rewards) raise ValueError naming the group. A group of two works
  here; the reference raises (its distribution report needs three values).

Example:

>>> from gfcr.stages.testing import scored_group
>>> [round(a, 4) for a in GAPO(GAPO.Config(fraction=0.5)).estimate(scored_group("p:0", [0.0, 0.0, 0.0, 1.0])).values]
[0.0, 0.0, 0.0, 1.732]

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {advantage: {use: gapo, with: {fraction: 0.5}}}}
"""

from __future__ import annotations

import math
from typing import Annotated

import numpy as np
from pydantic import Field

from gfcr.records import RolloutGroup
from gfcr.stages.components.advantage.base import Advantages, EstimatorConfig, checked_rewards, has_no_baseline


def shortest_window(sorted_rewards: np.ndarray, size: int) -> np.ndarray:
    """The leftmost of the shortest windows of ``size`` consecutive values of a sorted array."""
    spans = sorted_rewards[size - 1:] - sorted_rewards[: len(sorted_rewards) - size + 1]
    start = int(np.argmin(spans))  # argmin returns the first minimum: the leftmost window
    return sorted_rewards[start: start + size]


class GAPO:
    """Rewards centred on the median of their densest window, scaled by the RMS deviation."""

    class Config(EstimatorConfig):
        fraction: Annotated[float, Field(gt=0.0, le=1.0, description="share of the group the window holds")] = 0.5
        eps: Annotated[float, Field(ge=0.0, description="added to the scale")] = 1e-6

    def __init__(self, config: Config):
        self.config = config

    def estimate(self, group: RolloutGroup) -> Advantages:
        r = checked_rewards(group)  # [G]
        if has_no_baseline(r):
            return Advantages.scalars(r * 0.0)
        size = max(1, math.ceil(len(r) * (self.config.fraction * 100) / 100))  # the reference's rounding
        centred = r - float(np.median(shortest_window(np.sort(r), size)))
        return Advantages.scalars(centred / (math.sqrt(float(np.sum(centred**2)) / (len(r) - 1)) + self.config.eps))
