"""filter.dynamic_sampling: collect informative groups across loop rounds until enough (DAPO).

DAPO's dynamic sampling (Yu et al., 2025, arXiv 2503.14476; verl ``recipe/dapo``) keeps
generating batches, dropping zero-variance groups, until ``train_batch_size`` groups are
collected or ``max_num_gen_batches`` is reached. In gfcr that is a loop block: the
generate and filter stages repeat, and this stage, the block's ``until`` stage,
accumulates what they keep and says when it has enough. Put the selection stage inside the
block, so each round draws new prompts as DAPO does.

The group criterion (``metric``, verl's ``algorithm.filter_groups.metric``): by default
(``metric`` unset) this stage keeps every included group it is given, and a filter upstream
(``filter.nonzero_variance``) does the dropping. With ``metric: acc`` or ``metric: reward`` it
applies verl's rule itself, to each included group of ``G`` rollouts with values
``v_1..v_G`` of the metric:

    keep  iff  std(v) > 0  or  G == 1,    std(v) = sqrt(mean((v - mean(v))^2))

(``np.std``, the population standard deviation, compared with exactly 0: verl has no
tolerance). ``acc`` reads ``v_i = 1.0 if rollout.correct else 0.0`` (verl's ``acc``, the
correctness its reward manager returns); ``reward`` reads ``v_i = rollout.reward`` (verl's
``score`` and ``seq_reward``, which equal it when no KL penalty is folded into the reward;
gfcr folds none, so ``seq_final_reward`` is the same too). A rollout with no value (``correct``
or ``reward`` None) is an error naming its group. A dropped group's reason gives the metric
and its constant value.

Deviations from verl's recipe:
- when ``max_rounds`` is reached with too few groups, verl raises an error; here the update
  trains on what was collected (fewer groups), and the shortfall shows in the step metrics;
- excess groups beyond ``target_groups`` are dropped (verl truncates the batch likewise),
  and each carries the verdict ``excess beyond target``;
- verl's ``filter_groups.metric`` has no default (``null``; the DAPO scripts set ``acc``) and
  may name any per-rollout field its reward manager returns; here only ``acc`` and
  ``reward``, and unset means "no criterion here".
- ``np.std`` of equal floats can be a rounding error above 0 (``np.std([0.1] * 3)`` is
  ``1.4e-17``), and such a group is kept, as in verl; ``filter.nonzero_variance`` compares
  ``max - min`` instead and drops it.

Fidelity: checked against volcengine/verl@004c888: 12/15 cases, 3 documented deviations

The cases (``tests/fidelity/dynamic_sampling.json``) run verl's ``filter_groups`` block from
``recipe/dapo/dapo_ray_trainer.py`` (``RayDAPOTrainer.fit``) over generation batches, for the
metrics ``acc``, ``score``, ``seq_reward`` and ``seq_final_reward``, with excess groups, ``n = 1``,
an endless ``max_num_gen_batches: 0`` and a rounding-level std kept. The 3 deviations are the
cases where verl raises at ``max_num_gen_batches`` (the first deviation listed above).

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
>>> acc = DynamicSampling(DynamicSampling.Config(target_groups=2, metric="acc"))
>>> acc.before_step(StepContext("run", step=0, seed=0, policy_version=0))
>>> groups = RolloutGroups([scored_group("p:0", [1, 1]), scored_group("p:1", [0, 1]), scored_group("p:2", [1])])
>>> [g.prompt_id for g in acc.run(groups)], groups.groups[0].verdict.reason
(['p:1', 'p:2'], 'acc std 0 (every acc = 1)')

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

The same block with verl's criterion in this stage (no separate ``filter.nonzero_variance``):

.. code-block:: yaml

    stages:
      pick:    {use: control.uniform, with: {batch_size: 16}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 8}}
      rollout: {use: generate.fake, from: budget}
      enough:  {use: filter.dynamic_sampling, from: rollout, with: {target_groups: 16, metric: acc}}
    loops:
      collect: {stages: [pick, budget, rollout, enough], until: enough, max_rounds: 3}
    update: {use: update.fake, from: collect}
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from gfcr.records import RolloutGroup, RolloutGroups, StepContext
from gfcr.registry import StageConfig


class DynamicSampling:
    """Accumulate kept groups over loop rounds; done once ``target_groups`` are collected."""

    class Config(StageConfig):
        target_groups: Annotated[int, Field(ge=1, description="groups the update needs (DAPO train_batch_size)")]
        metric: Literal["acc", "reward"] | None = Field(None, description=(
            "verl filter_groups.metric: drop included groups whose std of this per-rollout value is 0 "
            "(acc: correctness; reward: the scalar reward); unset: keep every included group"))

        @property
        def reads_rewards(self) -> bool:  # a capability (gfcr.registry.ReadsRewards): with a metric, a verifier upstream
            return self.metric is not None

    def __init__(self, config: Config):
        self.config = config
        self._collected: list[RolloutGroup] = []

    def before_step(self, ctx: StepContext) -> None:
        self._collected = []

    def run(self, groups: RolloutGroups) -> RolloutGroups:
        for group in groups:
            reason = self._zero_std_reason(group) if group.verdict.included else None
            if reason is not None:
                group.drop(reason)
        self._collected.extend(g for g in groups if g.verdict.included)
        target = self.config.target_groups
        for excess in self._collected[target:]:
            excess.drop(f"excess beyond target ({target} groups)")
        self._collected = self._collected[:target]
        return RolloutGroups(list(self._collected))

    def _zero_std_reason(self, group: RolloutGroup) -> str | None:
        """verl's rule: why ``group`` has no spread in the metric, or None if it is kept."""
        metric = self.config.metric
        if metric is None:
            return None
        values = metric_values(group, metric)
        if len(values) == 0:
            return "no rollouts"
        if np.std(values) > 0 or len(values) == 1:
            return None
        return f"{metric} std 0 (every {metric} = {values[0]:g})"

    def done(self) -> bool:
        return len(self._collected) >= self.config.target_groups


def metric_values(group: RolloutGroup, metric: str) -> np.ndarray:  # [G] float64
    """The per-rollout values of verl's ``filter_groups.metric``: ``acc`` (1.0 if correct,
    else 0.0) or ``reward``; a rollout without one is an error naming the group."""
    field = "correct" if metric == "acc" else "reward"
    missing = [r.rollout_id for r in group.rollouts if getattr(r, field) is None]
    if missing:
        raise ValueError(f"group {group.group_id}: rollouts {missing} have no `{field}` for metric {metric}; "
                         "put a verifier stage (filter.verify) before this filter")
    return np.array([float(getattr(r, field)) for r in group.rollouts], dtype=np.float64)
