"""advantage ``pvpo``: PVPO's static-value advantage (Feng et al., 2025, "PVPO: Pre-Estimated
Value-Based Policy Optimization for Agentic Reasoning", arXiv 2508.21104, "Static V Estimate"; no
reference code was found).

The baseline of a prompt is not its group's mean but a fixed reference anchor: the mean reward
``V_sta(s_0) = mean(r_ref)`` of a reference policy's rollouts on that prompt, computed before
training. With ``r`` the group's rewards:

    A_i = r_i - V_sta(prompt)          (the paper's A = Q_dyn - V_sta = r_i - mean(r_ref))

No std division: the paper replaces GRPO's ``(r_i - mean(r)) / std(r)`` by this difference
(read from summaries of the paper and a third-party port, which agree; the paper's full text
was not available to check).

gfcr reads ``V_sta`` from the prompt's metadata, ``Prompt.metadata[key]`` (``key`` defaults to
``reference_reward``), so the update calls ``estimate_batch(groups, pool)`` with the prompt
pool; ``estimate(group)`` alone has no pool and raises. A prompt without the value is a
ValueError naming it: its data source must put the pre-computed mean reward into every
prompt's metadata (the ``jsonl`` source does with ``metadata_fields: [reference_reward]``).

Deviations:
- the anchor is static for the whole run: the paper refreshes ``r_ref`` with the reference
  model every fixed number of steps, which here means a new data source and a new run;
- PVPO's other half, "group sampling" (dropping prompts the reference always solves and
  injecting ground-truth trajectories for those it never solves), is data preparation, not
  an estimator, and is not part of ``pvpo``;
- a group whose rewards are all equal still gets ``r - V_sta`` (the baseline is not the
  group's), and so does a group of one rollout; unscored rollouts (NaN rewards) raise
  ValueError naming the group.

Example (the reference policy solved 25% of this prompt's rollouts):

>>> from gfcr.records import Prompt, PromptPool
>>> from gfcr.stages.testing import scored_group
>>> pool = PromptPool([Prompt("p:0", text="2 + 2?", metadata={"reference_reward": 0.25})])
>>> PVPO(PVPO.Config()).estimate_batch([scored_group("p:0", [1.0, 0.0, 1.0])], pool)[0].values
(0.75, -0.25, 0.75)

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {advantage: {use: pvpo, with: {key: reference_reward}}}}
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Sequence

from pydantic import Field

from gfcr.records import RolloutGroup
from gfcr.stages.components.advantage.base import Advantages, EstimatorConfig, checked_rewards


class PVPO:
    """Rewards minus a pre-computed reference reward of their prompt."""

    class Config(EstimatorConfig):
        key: Annotated[str, Field(min_length=1, description="the Prompt.metadata field holding the mean reward "
                                                             "of the reference policy's rollouts on the prompt")] = \
            "reference_reward"

    def __init__(self, config: Config):
        self.config = config

    def estimate(self, group: RolloutGroup) -> Advantages:
        raise ValueError(f"group {group.group_id}: `pvpo` reads each prompt's `{self.config.key}` from the prompt "
                         "pool, which estimate(group) does not have; call estimate_batch(groups, pool), as "
                         "update.grpo does")

    def estimate_batch(self, groups: Sequence[RolloutGroup], pool: Any) -> list[Advantages]:
        out = []
        for g in groups:
            r = checked_rewards(g)  # [G]
            out.append(Advantages.scalars(r - self.reference_reward(g, pool)))
        return out

    def reference_reward(self, group: RolloutGroup, pool: Any) -> float:
        """``V_sta`` of the group's prompt; ValueError naming the prompt when it is missing."""
        key, pid = self.config.key, group.prompt_id
        if pool is None or pid not in pool:
            raise ValueError(f"group {group.group_id}: prompt {pid} is not in the prompt pool, so `pvpo` cannot "
                             f"read its `{key}`; pass the pool the groups were drawn from")
        value = pool.get(pid).metadata.get(key)
        if value is None:
            raise ValueError(f"prompt {pid}: no `{key}` in its metadata; `pvpo`'s baseline is the mean reward of "
                             "a reference policy's rollouts on each prompt, computed before training: give every "
                             f"prompt `metadata['{key}']` in its data source (the jsonl source copies row fields with "
                             f"`metadata_fields: [{key}]`), or set the estimator's `key:` to the field that holds it")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"prompt {pid}: `metadata['{key}']` is {value!r}; `pvpo` needs a finite number "
                             "(the mean reward of the reference policy's rollouts on the prompt)")
        return float(value)
