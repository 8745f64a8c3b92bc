"""advantage ``mean_std``: GRPO's group-normalised advantage (Shao et al., 2024, arXiv 2402.03300).

With ``r`` the group's ``G`` rewards, ``A = (r - mean(r)) / (std(r) + eps)``. ``std`` is the
unbiased sample std (``std_ddof: 1``), as TRL, verl (``torch.std``) and the peer hand loop
compute it; ``std_ddof: 0`` gives the population std. ``eps`` defaults to verl's 1e-6 (TRL
uses 1e-4).

Fidelity: checked against volcengine/verl@b178a3c: 32/36 cases, 4 documented deviations
(``tests/fidelity/mean_std.json``; ``compute_grpo_outcome_advantage``); with ``single_rollout:
verl`` and ``precision: float32`` all 36 agree.

Deviations:
- a group of one rollout gets exactly 0.0: a lone rollout has no baseline here; verl gives it
  ``r / (1 + eps)`` (mean 0, std 1) (3 reference cases: rewards 1, 0.5 and -2; a reward of 0
  agrees): ``single_rollout: verl`` gives verl's;
- computed in float64 (verl: float32), so a group whose spread is tiny next to its rewards
  (1 and 1 + 1e-4) differs in the third digit (1 reference case): ``precision: float32``
  gives verl's;
- a group whose rewards are all equal gets exactly 0.0, as in verl (where float32 rounding
  could leave a residue divided by ``eps``; none of the 6 such cases does);
- unscored rollouts (NaN rewards) raise ValueError naming the group.

Example:

>>> from gfcr.stages.testing import scored_group
>>> [round(a, 4) for a in MeanStd(MeanStd.Config()).estimate(scored_group("p:0", [0.0, 1.0])).values]
[-0.7071, 0.7071]

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {advantage: {use: mean_std, with: {eps: 1.0e-6, std_ddof: 1}}}}
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from gfcr.records import RolloutGroup
from gfcr.stages.components.advantage.base import (SINGLE_ROLLOUT_HELP, Advantages, EstimatorConfig, SingleRollout,
                                                   checked_rewards, has_no_baseline, lone_reward)


class MeanStd:
    """GRPO: rewards centred on the group mean and divided by the group std."""

    class Config(EstimatorConfig):
        eps: Annotated[float, Field(ge=0.0, description="added to the std")] = 1e-6
        std_ddof: Literal[0, 1] = Field(1, description="1: sample std (TRL, verl); 0: population std")
        single_rollout: SingleRollout = Field("zero", description=SINGLE_ROLLOUT_HELP)
        precision: Literal["float64", "float32"] = Field("float64", description="float32: verl's")

    def __init__(self, config: Config):
        self.config = config

    def estimate(self, group: RolloutGroup) -> Advantages:
        r = checked_rewards(group)  # [G]
        if lone_reward(r, self.config.single_rollout):
            return Advantages.scalars(r / (1.0 + self.config.eps))
        if has_no_baseline(r):
            return Advantages.scalars(r * 0.0)
        x = r.astype(np.float32) if self.config.precision == "float32" else r
        eps = x.dtype.type(self.config.eps)
        return Advantages.scalars(((x - x.mean()) / (x.std(ddof=self.config.std_ddof) + eps)).astype(np.float64))
