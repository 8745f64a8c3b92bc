"""filter.finish_reason: mask or remove rollouts by how their generation ended.

Every rollout carries the engine's ``finish_reason``: ``stop`` (it ended on its own),
``length`` (it hit ``max_new_tokens``: truncated), ``aborted`` or ``pruned`` (an in-flight
controller ended it). Each rollout of an included group whose finish reason is in ``reasons``
(default ``[length]``) gets the ``action``:

- ``mask`` (default): the rollout stays in its group, so its reward still counts in the
  group's baseline, but its ``loss_mask`` becomes all False: none of its tokens enters the
  loss or the aggregation's denominator. With ``reasons: [length]`` this is DAPO's overlong
  filtering (Yu et al., 2025, arXiv 2503.14476, section 3.4: the loss of truncated samples is
  masked; SkyRL's ``apply_overlong_filtering`` zeroes their loss masks the same way).
- ``drop``: the rollout is removed from its group (``RolloutGroup.remove``) before the
  advantage is computed, so it counts neither in the baseline nor in the update; lineage keeps
  it, with this stage's id and the reason ``finish reason `aborted```. A group left with no
  rollout is dropped. The output holds the included groups, as ``filter.nonzero_variance``'s.

Fidelity: checked against NovaSky-AI/SkyRL@a956457: 8/12 cases, 4 documented deviations
(``tests/fidelity/finish_reason.json``; ``apply_overlong_filtering``).

Deviations:
- SkyRL masks every response that did not end with a stop token; the default ``reasons:
  [length]`` masks truncated ones only, DAPO's rule, and ``reasons: [length, aborted, pruned,
  exited]`` gives SkyRL's (2 reference cases differ under the default; with those reasons
  they agree);
- a rollout whose ``finish_reason`` is empty (made by a stage that does not record one, such
  as ``generate.fake`` without in-flight controllers) never matches; SkyRL masks it (2
  reference cases);
- ``drop`` is not in DAPO (use it for partial rollouts, ``aborted`` or ``pruned``, whose
  reward says little about the prompt).

A group already dropped by an earlier filter is left alone, so that its lineage names the
first decision.

Example:

>>> from gfcr.stages.testing import scored_group
>>> from gfcr.records import RolloutGroups
>>> group = scored_group("p:0", [1, 0, 0])
>>> for rollout, reason in zip(group.rollouts, ["stop", "length", "aborted"]):
...     rollout.finish_reason = reason
>>> _ = FinishReasonFilter(FinishReasonFilter.Config()).run(RolloutGroups([group]))
>>> [None if r.loss_mask is None else bool(r.loss_mask.any()) for r in group.rollouts]
[None, False, None]
>>> _ = FinishReasonFilter(FinishReasonFilter.Config(reasons=["aborted"], action="drop")).run(RolloutGroups([group]))
>>> [r.finish_reason for r in group.rollouts], [m.reason for m in group.removed]
(['stop', 'length'], ['finish reason `aborted`'])

YAML:

.. code-block:: yaml

    overlong: {use: filter.finish_reason, from: reward, with: {reasons: [length], action: mask}}
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from gfcr.records import Rollout, RolloutGroup, RolloutGroups
from gfcr.registry import StageConfig
from gfcr.stages.engine import FinishReason


class FinishReasonFilter:
    """Mask (keep in the baseline, out of the loss) or remove rollouts with the given finish reasons."""

    class Config(StageConfig):
        per_group: ClassVar[bool] = True  # a capability (gfcr.registry.PerGroup): acts group by group
        reasons: list[FinishReason] = Field(["length"], min_length=1,
                                            description="finish reasons to act on (`length`: truncated)")
        action: Literal["mask", "drop"] = Field("mask", description="mask: keep its reward in the group's baseline "
                                                "but zero its loss mask (DAPO); drop: remove it from its group")

        @property
        def dropped_finishes(self) -> frozenset[str]:  # a capability (gfcr.registry.DropsFinishes)
            return frozenset(self.reasons) if self.action == "drop" else frozenset()

    def __init__(self, config: Config):
        self.config = config

    def run(self, groups: RolloutGroups) -> RolloutGroups:
        for group in groups.included():
            hits = [r for r in group.rollouts if r.finish_reason in self.config.reasons]
            if self.config.action == "mask":
                _mask(hits)
            elif hits:
                _remove(group, hits)
        return groups.included()


def _mask(rollouts: list[Rollout]) -> None:
    for r in rollouts:
        r.loss_mask = np.zeros(len(r), dtype=bool)  # [T]


def _remove(group: RolloutGroup, rollouts: list[Rollout]) -> None:
    for r in rollouts:
        group.remove(r.rollout_id, f"finish reason `{r.finish_reason}`")
    if not group.rollouts:
        reasons = ", ".join(sorted({f"`{r.finish_reason}`" for r in rollouts}))
        group.drop(f"every rollout removed by its finish reason ({reasons})")
