"""correction ``freshness``: f-OPD's sample-level freshness score (Chen, Zhang, Wu, "f-OPD:
Stabilizing Long-Horizon On-Policy Distillation with Freshness-Aware Control", arXiv 2605.17862)
as a per-sample weight in the update, from the abstract.

A buffered sample is as reliable as it is fresh: each rollout gets one score from the policy
versions its segments recorded, read against the version being trained,

    age_i = mean_t (current_version - version_it)      (over the rollout's response tokens)
    f_i   = 2 ** (-age_i / half_life)

and every token of the rollout weighs ``f_i`` in the loss: the score multiplies the token
weights the aggregation sums and divides by, so a stale sample's influence shrinks against
the fresher samples of its batch (a batch all equally stale trains as an unweighted one).
``max_staleness`` also masks tokens more than ``K`` versions old (weight 0), as every
correction's limit does: the drift the update can accumulate stays bounded. The ratio is taken
against ``mu``, as ``none`` and ``staleness`` take it.

Why a correction and not a Filter: the score is a function of the version the update trains,
which only the update knows; under the ``async`` lifecycle a Filter runs in the producer,
versions before the update that trains its samples, and would score them fresher than they
are. And the update's correction is where gfcr says how stale tokens are taken: the score
composes with any loss and estimator there (a Filter's ``sample_weight`` would scale the
advantage only, not the aggregation's denominator). The cost: one correction at a time, so
it does not stack with ``tis`` or ``decoupled_clip``.

Fidelity: from the abstract: no public code (pages and code search found none; the
asynchronous OPD code of furiosa-ai/async-opd, arXiv 2606.24143, is another method). The
abstract states a sample-level freshness score quantifying a buffered sample's reliability
for the on-policy objective, built from a decomposition into rollout drift (the student's
rollout staleness) and supervision drift (the teacher context's), and that f-OPD adaptively
regulates stale samples' influence and constrains accumulated policy drift.

Deviations (choices the abstract leaves open):
- the score's form, an exponential decay in the sample's mean token age with
  ``half_life: 4.0`` versions, is this component's (the paper's is not in the abstract);
- rollout drift only: the supervision drift is the teacher's (on-policy distillation); with a
  verifier's reward nothing drifts on that side, so gfcr's RL pipelines have none;
- "regulates influence" is a weight normalised by the batch (the aggregation's denominator),
  and "constrains drift" is the staleness mask: f-OPD's own control law is not known;
- a resumed rollout with segments of several versions gets one score, from its tokens' mean age.

Example (a rollout whose two tokens were sampled at version 0 and one at 4, trained at 4:
mean age 8/3 versions, so it weighs ``2 ** (-2/3) = 0.63``; a fresh rollout weighs 1):

>>> import numpy as np
>>> from gfcr.records import Rollout, Segment
>>> r = Rollout("p:0@s0/0", "p:0@s0", "p:0", [3, 4, 5], [Segment(0, 2, 0, [-1.0, -1.0]), Segment(2, 3, 4, [-1.0])])
>>> [round(float(w), 4) for w in Freshness(Freshness.Config()).keeps(r, version=4)]
[0.63, 0.63, 0.63]
>>> [round(float(w), 4) for w in Freshness(Freshness.Config(max_staleness=3)).keeps(r, version=4)]
[0.0, 0.0, 0.63]

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {correction: {use: freshness, with: {half_life: 4.0, max_staleness: 8}}}}
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import Field

from gfcr.records import Rollout
from gfcr.stages.components.correction.base import (CorrectionConfig, MaxStaleness, TokenCorrection, kept_tokens,
                                                    proximal_correction)


class Freshness:
    """Weigh each rollout by its freshness, ``2 ** (-mean age / half_life)``; ratio against mu."""

    class Config(CorrectionConfig):
        half_life: Annotated[float, Field(gt=0.0, description="the mean token age, in policy versions, at which a "
                                                              "sample weighs one half")] = 4.0
        max_staleness: MaxStaleness = None

    def __init__(self, config: Config):
        self.config = config

    def correct(self, logp: Any, behaviour: Any, stale: Any) -> TokenCorrection:
        import torch

        return proximal_correction(logp, behaviour, torch.zeros_like(stale))

    def keeps(self, rollout: Rollout, version: int) -> np.ndarray | None:
        """``[T]`` float64: the rollout's freshness on every token, 0 past ``max_staleness``."""
        weights = np.full(len(rollout), freshness(rollout, version, self.config.half_life))
        kept = kept_tokens(self.config.max_staleness, rollout, version)
        return weights if kept is None else weights * kept


def freshness(rollout: Rollout, version: int, half_life: float) -> float:
    """``2 ** (-mean token age / half_life)``; 1.0 for a rollout with no response tokens."""
    age = rollout.staleness(version)  # [T]
    return 1.0 if age.size == 0 else float(2.0 ** (-float(age.mean()) / half_life))
