"""filter.dynamic_sampling: collect informative groups across loop rounds until enough (DAPO).

DAPO's dynamic sampling (Yu et al., 2025, arXiv 2503.14476; verl ``recipe/dapo``) keeps
generating batches, dropping zero-variance groups, until ``train_batch_size`` groups are
collected or ``max_num_gen_batches`` is reached. In gfcr that is a loop block: the
generate and filter stages repeat, and this stage, the block's ``until`` stage,
accumulates what they keep and says when it has enough. Put the selection stage inside the
block, so each round draws new prompts as DAPO does.

Deviations from verl's recipe:
- when ``max_rounds`` is reached with too few groups, verl raises an error; here the update
  trains on what was collected (fewer groups), and the shortfall shows in the step metrics;
- excess groups beyond ``target_groups`` are dropped (verl truncates the batch likewise),
  and each carries the verdict ``excess beyond target``.

Example:

>>> from gfcr.stages.testing import scored_group
>>> from gfcr.records import RolloutGroups, StepContext
>>> stage = DynamicSampling(DynamicSampling.Config(target_groups=2))
>>> stage.before_step(StepContext("run", step=0, seed=0, policy_version=0))
>>> out = stage.run(RolloutGroups([scored_group("p:0", [0, 1])]))
>>> stage.done()
False
>>> out = stage.run(RolloutGroups([scored_group("p:1", [1, 0]), scored_group("p:2", [0, 1])]))
>>> stage.done(), [g.prompt_id for g in out]
(True, ['p:0', 'p:1'])

YAML (a DAPO loop block; on the labelled fake engine until the real engine lands):

.. code-block:: yaml

    stages:
      pick:    {use: control.uniform, with: {batch_size: 16}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 8}}
      rollout: {use: generate.fake, from: budget}
      keep:    {use: filter.nonzero_variance, from: rollout}
      enough:  {use: filter.dynamic_sampling, from: keep, with: {target_groups: 16}}
    loops:
      collect: {stages: [pick, budget, rollout, keep, enough], until: enough, max_rounds: 3}
    update: {use: update.fake, from: collect}
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from gfcr.records import RolloutGroup, RolloutGroups, StepContext
from gfcr.registry import StageConfig


class DynamicSampling:
    """Accumulate kept groups over loop rounds; done once ``target_groups`` are collected."""

    class Config(StageConfig):
        target_groups: Annotated[int, Field(ge=1, description="groups the update needs (DAPO train_batch_size)")]

    def __init__(self, config: Config):
        self.config = config
        self._collected: list[RolloutGroup] = []

    def before_step(self, ctx: StepContext) -> None:
        self._collected = []

    def run(self, groups: RolloutGroups) -> RolloutGroups:
        self._collected.extend(g for g in groups if g.verdict.included)
        target = self.config.target_groups
        for excess in self._collected[target:]:
            excess.drop(f"excess beyond target ({target} groups)")
        self._collected = self._collected[:target]
        return RolloutGroups(list(self._collected))

    def done(self) -> bool:
        return len(self._collected) >= self.config.target_groups
