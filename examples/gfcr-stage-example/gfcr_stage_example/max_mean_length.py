"""filter.max_mean_length: drop groups whose mean response length exceeds a token budget.

A group whose rollouts run long on average costs the update the most tokens; this filter
keeps the update batch inside a length budget by leaving such groups out (the reason names
the mean length). Put it after the verifier, so the dropped groups keep their rewards in the
lineage.

Deviations: not a published method. DAPO's overlong filtering (Yu et al., 2025, arXiv
2503.14476) masks the loss of truncated rollouts one by one; this drops whole groups by their
mean length, truncated or not.

Fidelity: gfcr's own: an example stage (``docs/writing-a-stage.md``); no method to check against.

Example:

>>> from gfcr.records import Rollout, RolloutGroup, RolloutGroups, Segment
>>> def group(pid, lengths):
...     rollouts = [Rollout(f"{pid}/{i}", pid, pid, [1] * n, [Segment(0, n, 0, [0.0] * n)])
...                 for i, n in enumerate(lengths)]
...     return RolloutGroup(pid, pid, 0, len(rollouts), rollouts)
>>> groups = RolloutGroups([group("a", [4, 8]), group("b", [12, 16])])
>>> [g.prompt_id for g in MaxMeanLength(MaxMeanLength.Config(max_tokens=10)).run(groups)]
['a']
>>> [g.verdict.reason for g in groups if not g.verdict.included]
['mean length 14.0 > 10 tokens']

YAML:

.. code-block:: yaml

    short: {use: filter.max_mean_length, from: reward, with: {max_tokens: 256}}
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from gfcr.records import RolloutGroups
from gfcr.registry import StageConfig


class MaxMeanLength:
    """Keep only groups whose mean response length is at most ``max_tokens``."""

    class Config(StageConfig):
        max_tokens: Annotated[int, Field(ge=1, description="largest mean response length kept, in tokens")]

    def __init__(self, config: Config):
        self.config = config

    def run(self, groups: RolloutGroups) -> RolloutGroups:
        kept = []
        for group in groups:
            mean = group.stats.mean_length
            if mean <= self.config.max_tokens:
                kept.append(group)
            else:
                group.drop(f"mean length {mean:.1f} > {self.config.max_tokens} tokens")
        return RolloutGroups(kept)
