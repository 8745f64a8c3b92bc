"""filter.max_solve_rate: drop the groups whose share of correct rollouts exceeds ``max_rate``.

A group the policy already solves almost every time has little to teach (with a binary reward,
an all-correct group has zero advantage); this filter leaves such groups out of the update and
says why (the reason names the solve rate). Put it after the verifier: it reads the verdicts
through ``GroupStats`` (``n_correct`` of ``n_scored``); a group no verifier judged is kept.

Deviations: not a published method. It is the upper bound of the pass-rate band that online
difficulty filtering keeps, without the lower bound and without resampling the dropped prompts.

Fidelity: gfcr's own: an example plugin stage; no method to check against.

Example:

>>> from gfcr.records import Rollout, RolloutGroup, RolloutGroups, Segment
>>> def group(pid, correct):
...     rollouts = [Rollout(f"{pid}/{i}", pid, pid, [1], [Segment(0, 1, 0, [0.0])], reward=float(c), correct=c)
...                 for i, c in enumerate(correct)]
...     return RolloutGroup(pid, pid, 0, len(rollouts), rollouts)
>>> groups = RolloutGroups([group("easy", [True, True, True, True]), group("hard", [True, False, False, False])])
>>> [g.prompt_id for g in MaxSolveRate(MaxSolveRate.Config(max_rate=0.75)).run(groups)]
['hard']
>>> [g.verdict.reason for g in groups if not g.verdict.included]
['solve rate 1.00 > 0.75']

YAML:

.. code-block:: yaml

    not_easy: {use: filter.max_solve_rate, from: reward, with: {max_rate: 0.75}}
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from gfcr.records import RolloutGroups
from gfcr.registry import STAGES, StageConfig


@STAGES.register("filter.max_solve_rate")
class MaxSolveRate:
    """Keep only the groups whose share of correct rollouts is at most ``max_rate``."""

    class Config(StageConfig):
        max_rate: Annotated[float, Field(ge=0.0, le=1.0, description="largest share of correct rollouts kept")]

    def __init__(self, config: Config):
        self.config = config

    def run(self, groups: RolloutGroups) -> RolloutGroups:
        kept = []
        for group in groups:
            stats = group.stats
            rate = stats.n_correct / stats.n_scored if stats.n_scored else 0.0
            if rate <= self.config.max_rate:
                kept.append(group)
            else:
                group.drop(f"solve rate {rate:.2f} > {self.config.max_rate}")
        return RolloutGroups(kept)
