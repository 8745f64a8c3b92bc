"""filter.merge_rounds: merge each later loop round's groups into the prompt's first group (a top-up).

Top-up methods sample a prompt again inside the same step: DARS (``control.dars``) gives a
hard prompt ``ΔN`` more rollouts after its first ``N``. The generate stage samples each loop
round as new groups (their own ids and seeds); this stage, the loop block's ``until`` stage,
makes one group per prompt of them: the groups of round 0 are the base, and the rollouts of
a later round's group are appended to the base group of the same prompt (its ``target_size``
grows by the top-up group's), so the update computes one group baseline over all of a
prompt's rollouts. The emptied top-up group is dropped ("merged into <base group id>") and
keeps no rollouts, so the step counts each rollout once (``rollouts_generated``); a moved
rollout keeps its id (which names the round it was sampled in) and now names the base
group as its ``group_id``. A later group of a prompt without a base group becomes its base.

Every round, the output is every base group, in the order they first came; a control stage
in the loop reads it back through the loop's feedback edge (the first-stage groups in round
1). ``done()`` is true once a round after the first brought no group (the allocator asked for
nothing), or round 0 brought none; ``max_rounds`` bounds the rest.

Deviations: not a published method; it is the merge step of DARS's ``fit`` (the reference
concatenates the second batch to the first, grouped by the prompt's ``uid``), written as a
stage so that any top-up allocator in a loop block can share it.

Fidelity: gfcr's own: the merge step of DARS's ``fit`` written as a stage, so that any top-up
allocator in a loop block can share it.

Example:

>>> from gfcr.records import Rollout, RolloutGroup, RolloutGroups, Segment, StepContext, group_id
>>> from gfcr.stages.testing import scored_group
>>> stage = MergeRounds(MergeRounds.Config())
>>> stage.before_step(StepContext("run", step=0, seed=0, policy_version=0))
>>> def round_(r): return StepContext("run", step=0, seed=0, policy_version=0, round=r)
>>> first = stage.run(RolloutGroups([scored_group("p:0", [0, 0, 0, 1])]), round_(0))
>>> stage.done()
False
>>> topup = RolloutGroup(group_id("p:0", 0, 1), "p:0", 0, 2, [
...     Rollout(f"{group_id('p:0', 0, 1)}/{i}", group_id("p:0", 0, 1), "p:0", [1], [Segment(0, 1, 0, [0.0])],
...             reward=1.0, correct=True) for i in range(2)])
>>> merged = stage.run(RolloutGroups([topup]), round_(1))
>>> [(g.group_id, g.target_size, len(g.rollouts)) for g in merged]
[('p:0@s0', 6, 6)]
>>> topup.verdict.reason, len(topup.rollouts)
('merged into p:0@s0', 0)
>>> len(stage.run(RolloutGroups(), round_(2))), stage.done()   # round 2 brought nothing: the loop ends
(1, True)

YAML (the until stage of a top-up loop; see ``control.dars``):

.. code-block:: yaml

    merged: {use: filter.merge_rounds, from: reward}
"""

from __future__ import annotations

from gfcr.records import RolloutGroup, RolloutGroups, StepContext
from gfcr.registry import StageConfig


class MergeRounds:
    """One group per prompt across loop rounds: later rounds' rollouts join the prompt's first group."""

    class Config(StageConfig):
        pass

    def __init__(self, config: Config):
        self.config = config
        self._base: dict[str, RolloutGroup] = {}  # prompt id -> its base group this step
        self._last_round_empty = False

    def before_step(self, ctx: StepContext) -> None:
        self._base, self._last_round_empty = {}, False

    def run(self, groups: RolloutGroups, ctx: StepContext) -> RolloutGroups:
        round_ = ctx.round or 0
        if round_ == 0:
            self._base = {}
        for group in groups:
            base = self._base.get(group.prompt_id)
            if base is None:
                self._base[group.prompt_id] = group
            elif base is group:
                continue
            else:
                _merge(base, group)
        self._last_round_empty = len(groups) == 0
        return RolloutGroups(list(self._base.values()))

    def done(self) -> bool:
        return self._last_round_empty


def _merge(base: RolloutGroup, topup: RolloutGroup) -> None:
    """Move ``topup``'s rollouts (kept and removed) into ``base``; ``topup`` is left empty and dropped."""
    for r in topup.generated:
        r.group_id = base.group_id
    base.rollouts.extend(topup.rollouts)
    base.removed.extend(topup.removed)
    base.target_size += topup.target_size
    topup.rollouts, topup.removed = [], []
    topup.drop(f"merged into {base.group_id}")
