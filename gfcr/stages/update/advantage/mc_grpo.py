"""advantage ``mc_grpo``: MC-GRPO as its reference code computes it (arXiv 2601.22582;
``lotusroot-kim/MC-GRPO``, ``grpo_trainer_gsm.py`` with ``mc=True``).

The group holds ``G + 1`` rollouts (ask the Control stage for one more, e.g.
``control.fixed_n`` with ``n: 9`` for ``G = 8``). With ``r`` their rewards:

1. ``m`` = the lower median of ``r`` (``torch.median``); the pivot is the rollout whose reward
   is ``m``;
2. ``A = (r - m) / (median(|r - m|) + mad_eps)`` (``mad_scale: true``, the reference), or
   ``A = r - m``;
3. every non-zero advantage (``|A| > 1e-6``, the reference's ``isclose`` tolerance) is
   multiplied by ``(G + 1) / #non-zero`` (``rescale_nonzero: true``);
4. the pivot is left out of the loss: its loss mask is all ``False``, so its tokens count
   neither in the loss nor in its denominator, as the reference removes it from the batch.

Deviations:
- when several rollouts share the median reward, the pivot is the first of them in rollout
  order (``torch.median`` leaves the index among ties unspecified);
- with binary rewards the MAD is usually 0, so ``A = +-1000`` before the rescale, exactly as
  in the reference (the research note's ambiguity 2); ``mad_scale: false`` turns it off;
- a group whose rewards are all equal gets exactly 0.0 (its pivot is still masked); unscored
  rollouts (NaN rewards) raise ValueError naming the group.

Example (``G + 1 = 5``: the median is 1, the pivot is the first rollout, and the two non-zero
advantages are rescaled by 5/2):

>>> from gfcr.stages.testing import scored_group
>>> out = MCGRPO(MCGRPO.Config(mad_scale=False)).estimate(scored_group("p:0", [1.0, 0.0, 0.0, 1.0, 1.0]))
>>> out.values
(0.0, -2.5, -2.5, 0.0, 0.0)
>>> [bool(m.all()) for m in out.loss_masks]
[False, True, True, True, True]

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {advantage: {use: mc_grpo, with: {mad_scale: true}}}}
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
from pydantic import Field

from gfcr.records import RolloutGroup
from gfcr.stages.update.advantage.base import (Advantages, EstimatorConfig, checked_rewards, has_no_baseline,
                                               lower_median)
from gfcr.stages.update.advantage.median import median_centred

NONZERO_ATOL = 1e-6  # the reference's torch.isclose(..., atol=1e-6)


class MCGRPO:
    """Median baseline over G+1 rollouts; the pivot is masked out, the rest rescaled."""

    class Config(EstimatorConfig):
        mad_scale: bool = Field(True, description="divide by the median absolute deviation + mad_eps (reference)")
        mad_eps: Annotated[float, Field(gt=0.0, description="floor of the MAD (the reference's 1e-3)")] = 1e-3
        rescale_nonzero: bool = Field(True, description="multiply non-zero advantages by (G+1) / #non-zero")

    def __init__(self, config: Config):
        self.config = config

    def estimate(self, group: RolloutGroup) -> Advantages:
        r = checked_rewards(group)  # [G+1]
        pivot = int(np.flatnonzero(r == lower_median(r))[0]) if len(r) else -1
        masks = tuple(np.full(len(ro), i != pivot, dtype=bool) for i, ro in enumerate(group.rollouts))
        if has_no_baseline(r):
            return Advantages(tuple(0.0 for _ in r), masks)
        a = median_centred(r, self.config.mad_scale, self.config.mad_eps)
        nonzero = np.abs(a) > NONZERO_ATOL
        if self.config.rescale_nonzero and nonzero.any():
            a = np.where(nonzero, a * (len(r) / int(nonzero.sum())), a)
        return Advantages(tuple(float(v) for v in a), masks)
