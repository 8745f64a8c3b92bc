"""advantage ``median``: a median baseline, the centring of MC-GRPO (arXiv 2601.22582).

With ``r`` the group's rewards, ``A = r - m``, where ``m`` is the LOWER middle of the sorted
rewards when ``G`` is even, as ``torch.median`` returns in the reference code
(``lotusroot-kim/MC-GRPO``). ``mad_scale: true`` divides by ``median(|r - m|) + mad_eps``
(again the lower median), as the reference does.

This is the baseline alone: every rollout reaches the loss with weight 1. The full method as
the reference code computes it (G+1 rollouts, pivot left out of the loss, non-zero
advantages rescaled) is ``mc_grpo``.

Deviations:
- MAD scaling is off by default: with binary rewards the MAD is usually 0 and the advantages
  become +-1000 (ambiguity 2 of the research note);
- a group whose rewards are all equal, or a group of one rollout, gets exactly 0.0;
  unscored rollouts (NaN rewards) raise ValueError naming the group.

Example:

>>> from gfcr.stages.testing import scored_group
>>> Median(Median.Config()).estimate(scored_group("p:0", [0.0, 0.0, 1.0, 1.0])).values
(0.0, 0.0, 1.0, 1.0)

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {advantage: {use: median, with: {mad_scale: false}}}}
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
from pydantic import Field

from gfcr.records import RolloutGroup
from gfcr.stages.components.advantage.base import (Advantages, EstimatorConfig, checked_rewards, has_no_baseline,
                                               lower_median)


def median_centred(r: np.ndarray, mad_scale: bool, mad_eps: float) -> np.ndarray:
    """``r - m``, divided by ``MAD + mad_eps`` when ``mad_scale`` (lower medians)."""
    centred = r - lower_median(r)
    return centred / (lower_median(np.abs(centred)) + mad_eps) if mad_scale else centred


class Median:
    """Rewards centred on the group's (lower) median, optionally divided by the MAD."""

    class Config(EstimatorConfig):
        mad_scale: bool = Field(False, description="divide by the median absolute deviation + mad_eps")
        mad_eps: Annotated[float, Field(gt=0.0, description="floor of the MAD (the reference's 1e-3)")] = 1e-3

    def __init__(self, config: Config):
        self.config = config

    def estimate(self, group: RolloutGroup) -> Advantages:
        r = checked_rewards(group)  # [G]
        if has_no_baseline(r):
            return Advantages.scalars(r * 0.0)
        return Advantages.scalars(median_centred(r, self.config.mad_scale, self.config.mad_eps))
