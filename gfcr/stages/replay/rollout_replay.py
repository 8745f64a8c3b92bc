"""replay.rollout_replay: DOTS rollout replay, groups of earlier steps fill part of the update batch.

DOTS (Sun et al., 2025, "Improving Data Efficiency for LLM Reinforcement Fine-tuning Through
Difficulty-targeted Online Data Selection and Rollout Replay", arXiv 2506.05316; reference
``ASTRAL-Group/data-efficient-llm-rl``, ``ray_trainer_teacher_replay.py::select_buffer``)
trains on a batch of ``B`` groups of which ``sigma * B`` are fresh (rolled out this step) and
``(1 - sigma) * B`` are *replayed*: sampled uniformly, without replacement, from a FIFO buffer of
recent groups that keeps the latest group per prompt and holds at most ``buffer_size`` prompts.
The step's fresh groups join the buffer after the draw, as the reference's ``select_buffer``
orders it: the buffer first keeps its newest ``buffer_size - n`` groups (``n`` fresh groups), then
each fresh group joins at the back (a prompt already there moves to the back with its new group,
so the buffer may hold fewer than ``buffer_size`` until the next step).

Placement and sigma: the stage reads the fresh groups (after the verifier, or after a filter)
and returns them followed by the replayed ones: ``k = round(n * (1 - sigma) / sigma)`` replayed
groups for ``n`` fresh included groups, so that the fresh share of the update batch is
``sigma``. The Control stage selects the ``sigma * B`` fresh prompts: write its batch size as
``sigma * B`` (``pick: {batch_size: 8}`` with ``fresh_fraction: 0.5`` trains on 16 groups,
8 of them generated). Under a filter that drops groups (DAPO) ``n`` is the number of groups it
kept, so the share still holds.

The loss of a replayed group (DOTS' ``compute_policy_loss_temp``), with ``mu`` the behaviour
log-probs stored at generation and ``pi_old`` recomputed: ``r = pi_theta / mu``,
``r_old = pi_old / mu``, ``L = -E[min(A r, A clip(r, r_old (1 - eps), r_old (1 + eps)))]``. As
``r_old > 0``, ``clip(r, r_old (1 - eps), r_old (1 + eps)) = r_old clip(r / r_old, 1 - eps,
1 + eps)``, so ``L = -E[r_old min(A rho, A clip(rho, 1 - eps, 1 + eps))]`` with ``rho = pi_theta /
pi_old`` and ``r_old`` detached: exactly ``update.grpo``'s correction ``decoupled_clip`` on stale tokens
(ratio against ``pi_old``, clipped around 1, loss weighted by ``pi_old / mu``). Replayed tokens
are stale (their segments keep their policy versions), so ``gfcr validate`` requires
``correction: {use: decoupled_clip}`` on the update (``update_needs``).

Replayed rollouts are new rollouts (``origin: replayed``, ``replayed_from`` the original id,
``created_step`` its step, segments with their original policy versions), in new groups
``<original group>~rr<step>``; they are not counted in ``tokens_generated``. Metrics per step
(``stages.<id>``): ``groups_replayed``, ``rollouts_replayed``, ``tokens_replayed``,
``replayed_staleness_mean`` (policy versions, over the replayed rollouts' oldest tokens) and
``buffer_prompts``. The buffer is saved with each checkpoint (``files/entries.parquet``, its
order in the stage state).

Defaults: ``fresh_fraction`` 0.5 and ``buffer_size`` 512, the main script's
(``run_bash/final_ds_teacher_replay.sh``: ``SIGMA=0.5``, ``BUFFER_SIZE=512``); ``zero_variance:
true`` as its trainer (``ray_trainer_teacher_replay.py``, whose 0/1 filter is commented out).

Deviations:
- sigma is the fresh share of the groups that reach the update, not of the prompts selected:
  the stage cannot make the Control stage select fewer prompts, so the pipeline sets that batch
  size (above); the reference fixes both, ``sigma * B`` fresh prompts and ``(1 - sigma) * B``
  replayed groups, which is the same without a dropping filter.
- a prompt rolled out fresh this step is not replayed in the same step (the reference's draw
  can pick it and logs the overlap; a prompt twice in one batch would give its group double
  weight): 2 reference cases replay fewer groups.
- the reference replays nothing in DOTS' first round (``mu`` steps); this replays from the
  second step on: 1 reference case.
- groups are buffered as the stage receives them: after a filter (DAPO) only the kept ones,
  with the rollouts still in them; a filter's loss mask is not kept (a replayed rollout counts
  every token).
- the draw is seeded by ``(run seed, step)``, so a resumed run replays the same groups.
- ``zero_variance: false`` leaves out groups whose rewards are all equal: the reference's
  filter for them exists but is commented out, so the default (true) replays them, as it does.

Fidelity: checked against ASTRAL-Group/data-efficient-llm-rl@59df918: 15/18 cases, 3 documented
deviations (``select_buffer`` with ``replay_strategy: random``, ``tests/fidelity/rollout_replay.json``:
the replayed count, the buffer drawn from and after each step, the buffer order of the draw;
torch.randperm's draw itself is not compared). The buffer's trimming before the fresh groups join
was corrected against these cases (1 case differed). ``control.dots``'s selection is checked in
``tests/fidelity/dots.json``.

Example:

>>> from gfcr.records import RolloutGroups, StepContext
>>> from gfcr.stages.testing import scored_group
>>> stage = RolloutReplay(RolloutReplay.Config(fresh_fraction=0.5, buffer_size=2))
>>> first = stage.run(RolloutGroups([scored_group("a", [0, 1]), scored_group("b", [1, 1])]), StepContext("r", 0, 0, 0))
>>> len(first)  # nothing buffered yet: the fresh groups only
2
>>> second = stage.run(RolloutGroups([scored_group("c", [1, 0], step=1)]), StepContext("r", 1, 0, 1))
>>> [(g.group_id, g.rollouts[0].origin.value) for g in second]  # 1 fresh, 1 replayed (sigma 0.5)
[('c@s1', 'fresh'), ('a@s0~rr1', 'replayed')]
>>> stage.buffered_prompts()  # the latest group per prompt, 2 prompts at most: `a` left first
['b', 'c']

YAML:

.. code-block:: yaml

    pick:   {use: control.uniform, with: {batch_size: 8}}     # sigma * B fresh prompts
    replay: {use: replay.rollout_replay, from: reward, with: {fresh_fraction: 0.5, buffer_size: 512}}
    update: {use: update.grpo, from: replay, with: {correction: {use: decoupled_clip}}}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import Field

from gfcr.records import Origin, RolloutGroup, RolloutGroups, StepContext, rollout_id
from gfcr.registry import StageConfig, UpdateNeed
from gfcr.stages.common.reuse import keep, load_entries, reuse, save_entries
from gfcr.stages.common.stored import StoredRollout

ENTRIES = "entries.parquet"
_SALT = 0x444F5453  # "DOTS": this stage's draws differ from other seeded draws of the step


@dataclass
class BufferedGroup:
    """The latest group of one prompt: its rollouts as kept, and what rebuilds the group."""

    group_id: str
    prompt_id: str
    step: int
    target_size: int
    sample_weight: float
    rollouts: list[StoredRollout]

    def zero_variance(self) -> bool:
        rewards = [r.reward for r in self.rollouts]
        return len(set(rewards)) <= 1


class RolloutReplay:
    """DOTS rollout replay: fill (1 - sigma) of the update batch with groups from a FIFO buffer."""

    @staticmethod
    def update_needs(config: "RolloutReplay.Config") -> list[UpdateNeed]:
        return [UpdateNeed("correction", ("decoupled_clip",), "replays groups sampled by earlier policies, and DOTS "
                           "clips their ratio around the stale ratio pi_old/mu, which is the update's correction "
                           "`decoupled_clip`")]

    class Config(StageConfig):
        fresh_fraction: Annotated[float, Field(gt=0.0, le=1.0, description=(
            "sigma: the fresh share of the update batch; round(n * (1 - sigma) / sigma) groups are replayed "
            "for n fresh groups (the Control stage selects the sigma * B fresh prompts)"))] = 0.5
        buffer_size: Annotated[int, Field(ge=1, description=(
            "prompts the FIFO buffer holds, the latest group of each; the oldest leave first"))] = 512
        zero_variance: Annotated[bool, Field(description=(
            "replay groups whose rewards are all equal too (the reference does); false leaves them out of the draw"))] = True

        @property
        def replays_fresh_fraction(self) -> float:  # a capability (gfcr.registry.ReplaysFresh)
            return self.fresh_fraction

    def __init__(self, config: Config):
        self.config = config
        self.buffer: dict[str, BufferedGroup] = {}  # prompt id -> latest group; insertion order is FIFO order
        self.next_entry_id = 0
        self._last: dict[str, float] = _metrics([], 0, 0)
        self._loaded: dict[str, Any] | None = None

    def run(self, groups: RolloutGroups, ctx: StepContext) -> RolloutGroups:
        fresh = [g for g in groups if g.verdict.included and g.rollouts and not any(r.reused for r in g.rollouts)]
        want = round(len(fresh) * (1.0 - self.config.fresh_fraction) / self.config.fresh_fraction)
        chosen = self._draw(want, {g.prompt_id for g in groups}, ctx)
        replayed = [self._replayed(b, ctx.step) for b in chosen]
        self._make_room(len(fresh))
        for g in fresh:
            self._append(g, ctx.step)
        self._last = _metrics(replayed, ctx.policy_version, len(self.buffer))
        return RolloutGroups(list(groups) + replayed)

    def _draw(self, want: int, exclude: set[str], ctx: StepContext) -> list[BufferedGroup]:
        """``want`` buffered groups, uniformly without replacement, in buffer (FIFO) order."""
        pool = [b for b in self.buffer.values() if b.prompt_id not in exclude
                and (self.config.zero_variance or not b.zero_variance())]
        if want <= 0 or not pool:
            return []
        rng = np.random.default_rng([ctx.seed, ctx.step, ctx.round or 0, _SALT])
        picked = sorted(rng.choice(len(pool), size=min(want, len(pool)), replace=False).tolist())
        return [pool[i] for i in picked]

    def _replayed(self, buffered: BufferedGroup, step: int) -> RolloutGroup:
        gid = f"{buffered.group_id}~rr{step}"
        rollouts = [reuse(e, rollout_id(gid, i), gid, Origin.REPLAYED) for i, e in enumerate(buffered.rollouts)]
        return RolloutGroup(gid, buffered.prompt_id, step, buffered.target_size, rollouts,
                            sample_weight=buffered.sample_weight)

    def _make_room(self, fresh: int) -> None:
        """Keep the newest ``buffer_size - fresh`` groups before the fresh ones join, as the reference's
        ``select_buffer`` does: a fresh prompt already kept there then replaces its old group, and the
        buffer holds one group fewer than ``buffer_size`` until the next step."""
        while self.buffer and len(self.buffer) > self.config.buffer_size - fresh:
            self.buffer.pop(next(iter(self.buffer)))

    def _append(self, group: RolloutGroup, step: int) -> None:
        self.buffer.pop(group.prompt_id, None)  # the latest group per prompt, at the back
        kept = []
        for r in group.rollouts:
            kept.append(keep(r, self.next_entry_id, step))
            self.next_entry_id += 1
        self.buffer[group.prompt_id] = BufferedGroup(group.group_id, group.prompt_id, group.step, group.target_size,
                                                     group.sample_weight, kept)
        while len(self.buffer) > self.config.buffer_size:
            self.buffer.pop(next(iter(self.buffer)))

    def buffered_prompts(self) -> list[str]:
        """The buffer's prompts, oldest first."""
        return list(self.buffer)

    def step_metrics(self) -> dict[str, float]:
        """What this step replayed, and the buffer's size after it."""
        return dict(self._last)

    # --- checkpoint ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        groups = [[b.group_id, b.prompt_id, b.step, b.target_size, b.sample_weight, [e.entry_id for e in b.rollouts]]
                  for b in self.buffer.values()]
        return {"next_entry_id": self.next_entry_id, "groups": groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded = state  # the rollouts arrive with the files (load_files)

    def save_files(self, directory: Path) -> None:
        save_entries([e for b in self.buffer.values() for e in b.rollouts], directory / ENTRIES)

    def load_files(self, directory: Path) -> None:
        state, self._loaded = self._loaded, None
        assert state is not None, "load_state_dict comes before load_files"
        entries = {e.entry_id: e for e in load_entries(directory / ENTRIES)}
        self.buffer = {}
        for group_id, prompt_id, step, target_size, weight, ids in state["groups"]:
            self.buffer[prompt_id] = BufferedGroup(group_id, prompt_id, int(step), int(target_size), float(weight),
                                                   [entries[int(i)] for i in ids])
        self.next_entry_id = int(state["next_entry_id"])


def _metrics(replayed: list[RolloutGroup], version: int, buffered: int) -> dict[str, float]:
    rollouts = [r for g in replayed for r in g.rollouts]
    staleness = [version - int(r.policy_versions().min()) for r in rollouts if len(r)]
    return {"groups_replayed": len(replayed), "rollouts_replayed": len(rollouts),
            "tokens_replayed": sum(len(r) for r in rollouts),
            "replayed_staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
            "buffer_prompts": buffered}
