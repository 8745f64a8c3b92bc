"""advantage ``stratified``: Stratified GRPO's Stratified Advantage Normalization, blended with
GRPO's group normalization (Zhu, Chen, Yu, Zhao, Jia, 2025; arXiv 2510.06214, "Stratified GRPO:
Handling Structural Heterogeneity in Reinforcement Learning of LLM Search Agents"; no reference
code was found).

A search agent's trajectories differ in structure (how many searches they made), and so do
their reward distributions; one baseline for all of them compares apples to oranges. The
group's rollouts are partitioned into strata ``B_k`` by a structural key, and with ``R`` the
rewards:

    A_SAN(i)   = (R_i - mean_{B_k}(R)) / (std_{B_k}(R) + eps)    for rollout i in stratum B_k
    A_GN(i)    = (R_i - mean(R)) / (std(R) + eps)                 GRPO's group normalization
    A(i)       = alpha * A_SAN(i) + (1 - alpha) * A_GN(i)

``std`` is the unbiased sample std (as ``mean_std``); a stratum of one rollout, or whose
rewards are all equal, has ``A_SAN = 0`` (nothing to compare it with), so ``alpha = 1`` is
pure SAN and ``alpha = 0`` is GRPO. The paper blends because strata are small in a finite
group; ``alpha`` has no default here (see Deviations): choose it.

The stratum key (``stratum_by``), a small and explicit set:

- ``reward_component``: the value of ``Rollout.reward_components[component]``; rollouts with
  equal values share a stratum. The paper's stratum, the number of search calls, is a
  component a verifier or tool stage writes (e.g. ``component: search_calls``);
- ``finish_reason``: ``Rollout.finish_reason`` (stopped vs truncated responses);
- ``length_bucket``: ``len(response) // bucket_tokens``.

``component`` is required with ``reward_component`` and ``bucket_tokens`` with
``length_bucket``; either given with another key is an error. A rollout without the component,
or with a NaN one, is a ValueError naming the group.

Deviations:
- strata are formed within each prompt's group: the paper's "global" estimator is GRPO's
  normalization over the trajectories sampled for one question, and SAN partitions those;
  this reading rests on the abstract and public summaries, the full text could not be checked;
- no default for ``alpha``: the paper's value could not be verified; nor whether its stds are
  sample or population stds (the unbiased one is used, as GRPO implementations do);
- the stratum keys other than a reward component (finish reason, length bucket) are gfcr's,
  not the paper's;
- a group whose rewards are all equal, or of one rollout, gets exactly 0.0; unscored rollouts
  (NaN rewards) raise ValueError naming the group.

Example (strata by search count ``[0, 0, 1, 1]``, rewards ``[0, 1, 1, 1]``: SAN compares the
first two only; GN gives ``[-1.5, 0.5, 0.5, 0.5]``):

>>> from gfcr.stages.testing import scored_group
>>> group = scored_group("p:0", [0.0, 1.0, 1.0, 1.0])
>>> for rollout, calls in zip(group.rollouts, [0.0, 0.0, 1.0, 1.0]):
...     rollout.reward_components = {"search_calls": calls}
>>> config = Stratified.Config(stratum_by="reward_component", component="search_calls", alpha=0.5)
>>> [round(a, 2) for a in Stratified(config).estimate(group).values]
[-1.1, 0.6, 0.25, 0.25]

YAML:

.. code-block:: yaml

    update:
      use: update.grpo
      from: reward
      with:
        advantage: {use: stratified, with: {stratum_by: reward_component, component: search_calls, alpha: 0.5}}
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Annotated, Literal

import numpy as np
from pydantic import Field, model_validator

from gfcr.records import Rollout, RolloutGroup
from gfcr.stages.components.advantage.base import Advantages, EstimatorConfig, checked_rewards, has_no_baseline
from gfcr.stages.components.advantage.group_stats import standardised


class Stratified:
    """SAN within strata of the group, blended with the group normalization by alpha."""

    class Config(EstimatorConfig):
        stratum_by: Literal["reward_component", "finish_reason", "length_bucket"] = Field(
            description="the structural key of a stratum: a reward component's value (the paper's search-call "
                        "count), the finish reason, or the response length in buckets")
        component: str | None = Field(None, description="with stratum_by: reward_component, the component whose "
                                                         "value is the stratum (e.g. search_calls)")
        bucket_tokens: Annotated[int, Field(ge=1)] | None = Field(
            None, description="with stratum_by: length_bucket, tokens per length bucket")
        alpha: Annotated[float, Field(ge=0.0, le=1.0, description="weight of SAN against GRPO's group "
                                                                  "normalization (1: pure SAN, 0: GRPO)")]
        eps: Annotated[float, Field(ge=0.0, description="added to the stds")] = 1e-6

        @model_validator(mode="after")
        def _key_fields(self) -> "Stratified.Config":
            if self.stratum_by == "reward_component" and self.component is None:
                raise ValueError("stratum_by: reward_component needs `component`, the reward component whose value "
                                 "is the stratum (e.g. component: search_calls)")
            if self.stratum_by == "length_bucket" and self.bucket_tokens is None:
                raise ValueError("stratum_by: length_bucket needs `bucket_tokens`, the tokens per length bucket")
            if self.component is not None and self.stratum_by != "reward_component":
                raise ValueError(f"`component` is read only with stratum_by: reward_component, not {self.stratum_by}; "
                                 "remove it")
            if self.bucket_tokens is not None and self.stratum_by != "length_bucket":
                raise ValueError(f"`bucket_tokens` is read only with stratum_by: length_bucket, not "
                                 f"{self.stratum_by}; remove it")
            return self

    def __init__(self, config: Config):
        self.config = config

    def estimate(self, group: RolloutGroup) -> Advantages:
        r = checked_rewards(group)  # [G]
        keys = [self.stratum(group, ro) for ro in group.rollouts]
        if has_no_baseline(r):
            return Advantages.scalars(r * 0.0)
        alpha = self.config.alpha
        blended = alpha * self.san(r, keys) + (1.0 - alpha) * standardised(r, self.config.eps)
        return Advantages.scalars(blended)

    def san(self, r: np.ndarray, keys: list[Hashable]) -> np.ndarray:
        """``A_SAN``: each reward standardised within its stratum ``[G]``."""
        out = np.zeros_like(r)
        for key in dict.fromkeys(keys):  # strata in order of first appearance
            members = np.array([k == key for k in keys])
            out[members] = standardised(r[members], self.config.eps)
        return out

    def stratum(self, group: RolloutGroup, rollout: Rollout) -> Hashable:
        """The rollout's stratum key under ``stratum_by``."""
        cfg = self.config
        if cfg.stratum_by == "finish_reason":
            return rollout.finish_reason
        if cfg.stratum_by == "length_bucket":
            return len(rollout) // cfg.bucket_tokens
        value = rollout.reward_components.get(cfg.component)
        if value is None or np.isnan(value):
            raise ValueError(f"group {group.group_id}: rollout {rollout.rollout_id} has "
                             f"{'no' if value is None else 'a NaN'} reward component `{cfg.component}`, the stratum "
                             "key of advantage `stratified`; the verifier or tool stage that counts it must write it "
                             "on every rollout")
        return float(value)
