"""replay.pilot_join: Pilot-Commit's update groups, a commit's fresh rollouts joined by its stored pilots.

The Replay half of Pilot-Commit (arXiv 2605.26606; reference ``databricks/pilot-commit``,
``recipe/pc/pc_ray_trainer.py``: ``DataProto.concat([commit_batch_previous_samples,
commit_batch])``). ``control.pilot_commit`` allocates, in one generation call, ``n_pilot``
rollouts to each candidate prompt (``stage_index`` 0) and ``n_commit`` to each committed prompt
(``stage_index`` 1), the latter carrying its pilots from an earlier step in
``AllocationEntry.joins``. After the verifier, this stage reads those groups and that allocation:

- a **pilot** group is dropped ("pilot: judged after the step"): pilots are trained on only once
  their prompt is committed, as the reference does; it stays in the step's report, where
  ``control.pilot_commit`` judges it (``observe``);
- a **commit** group gets its pilots appended, as reused rollouts (``origin: replayed``,
  ``replayed_from`` the pilot's id, ``created_step`` its step, segments with their policy
  versions and behaviour log-probs, rewards as verified then), with ids continuing the group's;
  the group, ``n_commit + n_pilot_effective`` rollouts, shares one baseline.

The pilots are stale (up to ``max_off_steps + 1`` policy versions): ``gfcr validate`` requires
the update's correction ``decoupled_clip`` (their ratio against ``pi_old``, as the reference's recomputed
``old_log_probs``; see ``control.pilot_commit``). They count as replayed, not generated, in this
step (they were counted as generated on their own step). Metrics per step (``stages.<id>``):
``pilot_groups_dropped``, ``commit_groups``, ``pilots_joined``, ``pilot_tokens_joined``,
``update_rollouts`` (commit plus joined pilots), ``pilot_staleness_mean`` (policy versions of
the joined pilots' oldest tokens).

Deviations:
- the pilots are appended after the fresh rollouts (the reference puts them first); the order
  does not change a group baseline.
- joined pilots keep the rewards verified on their own step and are not verified again.
- a commit group a filter already dropped gets no pilots and stays dropped.

Fidelity: checked against databricks/pilot-commit@6def20e: 12/12 cases (``tests/fidelity/pilot_join.json``:
each committed prompt's update group, its size and the GRPO advantages of its pilot and commit
rows as the trainer's concat, ``extract_original_prompts`` and verl's
``compute_grpo_outcome_advantage`` give them; the step's own pilot groups are not trained on).
``control.pilot_commit``'s verdicts are checked in ``tests/fidelity/pilot_commit.json``.

Example:

>>> from gfcr.records import Allocation, AllocationEntry, Prompt, RolloutGroups, StepContext
>>> from gfcr.stages.testing import scored_group
>>> pilot = scored_group("a", [1, 0], step=0).rollouts
>>> allocation = Allocation(1, (
...     AllocationEntry(Prompt("b", text="b"), 2, reason="pilot"),
...     AllocationEntry(Prompt("a", text="a"), 2, reason="commit", stage_index=1, joins=tuple(pilot))))
>>> groups = RolloutGroups([scored_group("b", [0, 1], step=1), scored_group("a", [1, 1], step=1)])
>>> out = PilotJoin(PilotJoin.Config()).run(groups, allocation, StepContext("r", 1, 0, 1))
>>> [(r.rollout_id, r.reward, r.origin.value, r.replayed_from)  # doctest: +NORMALIZE_WHITESPACE
...  for g in out for r in g.rollouts]
[('a@s1/0', 1.0, 'fresh', None), ('a@s1/1', 1.0, 'fresh', None),
 ('a@s1/2', 1.0, 'replayed', 'a@s0/0'), ('a@s1/3', 0.0, 'replayed', 'a@s0/1')]
>>> [(g.group_id, g.verdict.included) for g in out], len(out)  # the pilot group `b` was dropped
([('a@s1', True)], 1)

YAML:

.. code-block:: yaml

    join:   {use: replay.pilot_join, from: {groups: reward, allocation: plan}}
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from gfcr.records import Allocation, Origin, Rollout, RolloutGroup, RolloutGroups, StepContext, rollout_id
from gfcr.registry import StageConfig, UpdateNeed

PILOT_REASON = "pilot: judged after the step by control.pilot_commit; trained on when committed"


class PilotJoin:
    """Pilot-Commit's update groups: drop pilot groups, append the stored pilots to commit groups."""

    @staticmethod
    def update_needs(config: "PilotJoin.Config") -> list[UpdateNeed]:
        return [UpdateNeed("correction", ("decoupled_clip",), "joins pilot rollouts sampled by earlier policies, "
                           "whose ratio must be taken against pi_old (the reference recomputes old log-probs), which "
                           "is the update's correction `decoupled_clip`")]

    class Config(StageConfig):
        pass

    def __init__(self, config: Config):
        self.config = config
        self._last: dict[str, float] = _metrics([], [], 0, 0)

    def run(self, groups: RolloutGroups, allocation: Allocation, ctx: StepContext) -> RolloutGroups:
        pilots = {e.prompt_id for e in allocation.active() if e.stage_index == 0}
        joins = {e.prompt_id: e.joins for e in allocation.active() if e.stage_index == 1}
        kept, joined, commit_rollouts = [], [], 0
        for group in groups:
            if group.prompt_id in pilots:
                group.drop(PILOT_REASON)
                continue
            if group.prompt_id in joins and group.verdict.included:
                commit_rollouts += len(group.rollouts)
                joined += _join(group, joins[group.prompt_id])
            kept.append(group)
        self._last = _metrics(joined, [g for g in kept if g.prompt_id in joins], commit_rollouts, ctx.policy_version)
        self._last["pilot_groups_dropped"] = sum(g.prompt_id in pilots for g in groups)
        return RolloutGroups(kept)

    def step_metrics(self) -> dict[str, float]:
        """What this step joined."""
        return dict(self._last)


def _join(group: RolloutGroup, pilots: tuple[Rollout, ...]) -> list[Rollout]:
    """Append copies of ``pilots`` to ``group`` with ids continuing its own; the copies."""
    added = []
    for pilot in pilots:
        rid = rollout_id(group.group_id, len(group.rollouts) + len(group.removed))
        original = pilot.replayed_from or pilot.rollout_id
        version = pilot.replayed_policy_version
        if version is None:
            version = int(pilot.policy_versions().min()) if len(pilot) else 0
        added.append(replace(pilot, rollout_id=rid, group_id=group.group_id, origin=Origin.REPLAYED,
                             replayed_from=original, replayed_policy_version=version))
        group.rollouts.append(added[-1])
    return added


def _metrics(joined: list[Rollout], commits: list[RolloutGroup], commit_rollouts: int,
             version: int) -> dict[str, float]:
    staleness = [version - int(r.policy_versions().min()) for r in joined if len(r)]
    return {"pilot_groups_dropped": 0, "commit_groups": len(commits), "pilots_joined": len(joined),
            "pilot_tokens_joined": sum(len(r) for r in joined), "update_rollouts": commit_rollouts + len(joined),
            "pilot_staleness_mean": float(np.mean(staleness)) if staleness else 0.0}
