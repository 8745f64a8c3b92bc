"""correction ``staleness``: tokens more than ``K`` policy versions old are masked out of the
loss and its denominator, with no reweighting (AReaL's ``max_head_offpolicyness``, Fu et al.,
2025, arXiv 2505.24298; verl's ``staleness_threshold``). The limit is per token: a resumed
rollout keeps its fresh segments.

    w_t = 1 if current_version - segment.policy_version <= K else 0

Every kept token's ratio is taken against ``mu``, as ``none`` does; the update still reports the
off-policy diagnostics (``off_policy_token_fraction``, counted before the mask). To mask and
correct, give ``tis``, ``decoupled_clip`` or ``recompute_old`` a ``max_staleness``.

Deviations: AReaL and verl bound staleness when they schedule generation (a rollout is not
started more than ``K`` versions ahead); here the tokens that arrive older are masked instead.

Example (a rollout whose first two tokens were sampled at version 0 and the last at 2, seen at
version 2 with ``K = 1``):

>>> import numpy as np
>>> from gfcr.records import Rollout, Segment
>>> r = Rollout("p:0@s0/0", "p:0@s0", "p:0", [3, 4, 5], [Segment(0, 2, 0, [-1.0, -1.0]), Segment(2, 3, 2, [-1.0])])
>>> Staleness(Staleness.Config(max_staleness=1)).keeps(r, version=2).tolist()
[False, False, True]

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {correction: {use: staleness, with: {max_staleness: 4}}}}
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import Field

from gfcr.records import Rollout
from gfcr.stages.components.correction.base import CorrectionConfig, TokenCorrection, kept_tokens, proximal_correction


class Staleness:
    """Mask tokens more than K versions old; no reweighting."""

    class Config(CorrectionConfig):
        max_staleness: Annotated[int, Field(ge=0, description="K: mask tokens more than K policy versions old out "
                                                              "of the loss and its denominator")]

    def __init__(self, config: Config):
        self.config = config

    def correct(self, logp: Any, behaviour: Any, stale: Any) -> TokenCorrection:
        import torch

        return proximal_correction(logp, behaviour, torch.zeros_like(stale))

    def keeps(self, rollout: Rollout, version: int) -> np.ndarray | None:
        return kept_tokens(self.config.max_staleness, rollout, version)
