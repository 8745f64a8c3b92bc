"""advantage ``hgpo``: HGPO's hierarchy-of-groups step advantages for multi-turn agents.

HGPO (arXiv 2602.22817, ICLR 2026; the recipe ``recipe/hgpo`` of langfengQ/verl-agent, read in
its fork OliverLeeXZ/SERL, ``recipe/hgpo/core_hgpo.py``: ``compute_step_discounted_returns``,
``hgpo_advantage_estimate``).

A group is one prompt's trajectories (``generate.multi_turn``). Each model turn is a **step**;
its **anchor** is the observation the model read before it: the prompt for the first turn, the
environment turn(s) just before it for the others. Per step:

    R(i)      = r(i) + gamma * R(i+1)                 (discounted return of the turn rewards r)
    level k   = the steps of the group whose last k anchors (this one included) are identical,
                for k = 1 .. history_length + 1
    a_k(i)    = (R(i) - mean) / (std + eps)           over i's level-k group, when it has >= 2 steps
                (``mean_norm``: R(i) - mean); population std
    A(i)      = sum_k w_k a_k(i),  w_k = (k + 1)^alpha / (sum (k + 1)^alpha + eps)
                over the levels whose a_k(i) is not exactly 0 (0 when there are none)

and every token of the turn carries ``A(i)`` (environment tokens carry 0: the update never trains
on them). ``base_group: true`` adds a level ``k = 0``: the trajectory's reward centred (and scaled
by the unbiased std, ``mean_std_norm``) over every step of the group, each trajectory counted once
per step (the reference's ``trajectory_advantages`` with ``compute_mean_std_cross_steps``).

Mapping from verl-agent, where each step is a sample of its own: the step's ``anchor_obs`` is the
anchor here; ``rewards`` (the environment's step reward) is the model turn's ``Turn.reward``; the
episode score (``token_level_rewards`` summed) is the rollout's ``reward``. A trajectory with no
turn rewards (scored after the fact by ``filter.verify``) has its ``reward`` on its last turn; a
single-turn rollout is one step. The defaults are the recipe's
(``run_qwen2.5_1.5b_alfworld_train.sh``: ``history_length`` 2, ``mean_std_norm``, alpha 1.0,
``base_group`` false, gamma 0.95).

Fidelity: checked against OliverLeeXZ/SERL@3c63ef3: 36/36 cases (``tests/fidelity/hgpo.json``).

Deviations:
- a group (or level) whose rewards are all equal gets exactly 0, as gfcr's other group estimators
  do; the reference's mean and std give rounding noise there (-1.4e-11 for 0.1 x 3), which its
  "levels not exactly 0" rule would then count as a level;
- the first step's anchor is the prompt's id, not its text (the same within a group; it cannot
  equal an environment observation by accident, as the same text could in the reference);
- a turn the environment gave no reward counts 0; the reference's invalid-action penalty
  (``invalid_action_penalty_coef`` 0.1) is the environment's to give, not the estimator's;
- a trajectory is one sample of the update (its turns' tokens in one row), where verl-agent trains
  each step as a sample: the advantage per token is the same, the loss aggregation (and so a
  step's weight in ``token_mean``) follows the update's ``aggregation``.

Example (two trajectories: one answers right at once, one retries after the feedback and fails):

>>> from gfcr.stages.testing import trajectory
>>> g = RolloutGroup("g", "p", 0, 2, [trajectory("g/0", [(2, 1.0)]),
...                                  trajectory("g/1", [(2, 0.0), " No", (1, 0.0)])])
>>> [[round(float(v), 3) for v in a] for a in HGPO(HGPO.Config()).estimate(g).values]
[[1.0, 1.0], [-1.0, -1.0, 0.0, 0.0, 0.0, 0.0]]

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: rollout, with: {advantage: {use: hgpo, with: {history_length: 2}}}}
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from gfcr.records import Rollout, RolloutGroup, TurnRole
from gfcr.stages.components.advantage.base import Advantages, EstimatorConfig, checked_rewards


@dataclass(frozen=True, slots=True)
class Step:
    """One model turn of a trajectory: its response span, the anchor it read, its own reward."""

    start: int
    end: int
    anchor: str
    reward: float


def steps_of(rollout: Rollout) -> list[Step]:
    """The model turns of ``rollout`` as steps (a single-turn rollout is one step)."""
    if not rollout.turns:
        return [Step(0, len(rollout), "", float(rollout.reward or 0.0))]
    steps, seen = [], []
    for turn in rollout.turns:
        if turn.role == TurnRole.ENVIRONMENT:
            seen.append(str(turn.info.get("observation", turn.text)))
            continue
        steps.append(Step(turn.start, turn.end, "".join(seen), float(turn.reward or 0.0)))
        seen = []
    if steps and all(t.reward is None for t in rollout.turns if t.role == TurnRole.MODEL):
        last = steps[-1]
        steps[-1] = Step(last.start, last.end, last.anchor, float(rollout.reward or 0.0))
    return steps


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """``R(i) = r(i) + gamma R(i+1)``, from the last step back."""
    out, running = [0.0] * len(rewards), 0.0
    for i in reversed(range(len(rewards))):
        running = rewards[i] + gamma * running
        out[i] = running
    return out


class HGPO:
    """Step advantages normalised within groups of steps that share their last k observations,
    weighted across levels k by (k + 1)^alpha."""

    class Config(EstimatorConfig):
        history_length: Annotated[int, Field(ge=0, description=(
            "observations before the current one that a step's groups may share; levels k = 1 .. this + 1"))] = 2
        mode: Literal["mean_std_norm", "mean_norm"] = Field("mean_std_norm", description=(
            "within a group: `mean_std_norm` (r - mean) / (std + eps), `mean_norm` r - mean"))
        length_weight_alpha: Annotated[float, Field(ge=0.0, description=(
            "a level k weighs (k + 1)^alpha; 0: every level alike"))] = 1.0
        base_group: bool = Field(False, description="add the trajectory-level advantage as level k = 0")
        gamma: Annotated[float, Field(ge=0.0, le=1.0, description="discount of a trajectory's turn rewards")] = 0.95
        eps: Annotated[float, Field(gt=0.0, description="added to the std and to the weights' sum")] = 1e-6

    def __init__(self, config: Config):
        self.config = config

    def step_advantages(self, group: RolloutGroup) -> list[list[float]]:
        """``A(i)`` per step of each rollout of the group, in order."""
        cfg = self.config
        episode = checked_rewards(group)
        steps = [steps_of(r) for r in group.rollouts]
        returns = [discounted_returns([s.reward for s in st], cfg.gamma) for st in steps]
        anchors = [[(group.prompt_id,) if i == 0 else ("obs", s.anchor) for i, s in enumerate(st)] for st in steps]
        items: dict[tuple[int, int], list[tuple[int, float]]] = defaultdict(list)
        if cfg.base_group:
            for (ti, si), a in self._base(episode, steps).items():
                items[(ti, si)].append((0, a))
        for (k, _), members in self._clusters(anchors).items():
            if len(members) > 1:
                for (ti, si), a in zip(members, self._normalise(np.array([returns[t][s] for t, s in members]))):
                    items[(ti, si)].append((k, a))
        return [[self._aggregate(items[(ti, si)]) for si in range(len(st))] for ti, st in enumerate(steps)]

    def estimate(self, group: RolloutGroup) -> Advantages:
        values = []
        for r, advantages in zip(group.rollouts, self.step_advantages(group)):
            a = np.zeros(len(r), dtype=np.float64)  # [T]: environment tokens stay 0 (never trained)
            for step, value in zip(steps_of(r), advantages):
                a[step.start:step.end] = value
            values.append(a)
        return Advantages(tuple(values))

    def _clusters(self, anchors: list[list[tuple]]) -> dict[tuple, list[tuple[int, int]]]:
        """Level-k groups: ``(k, last k anchors) -> [(trajectory, step)]``, in the reference's order."""
        clusters: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
        for ti, seq in enumerate(anchors):
            for si in range(len(seq)):
                for k in range(1, min(self.config.history_length + 1, si + 1) + 1):
                    clusters[(k, tuple(seq[si - k + 1: si + 1]))].append((ti, si))
        return clusters

    def _normalise(self, r: np.ndarray) -> np.ndarray:
        if np.all(r == r[0]):  # equal rewards: exactly 0, not the mean's rounding (0.1 x 3 gives -1.4e-11)
            return np.zeros_like(r)
        centred = r - r.mean()
        return centred / (r.std() + self.config.eps) if self.config.mode == "mean_std_norm" else centred

    def _base(self, episode: np.ndarray, steps: list[list[Step]]) -> dict[tuple[int, int], float]:
        """Level 0: each trajectory's reward over every step of the group (GiGPO's episode level)."""
        scores = np.array([episode[ti] for ti, st in enumerate(steps) for _ in st])
        if len(scores) > 1 and np.all(scores == scores[0]):  # equal rewards: exactly 0, as `_normalise`
            return {(ti, si): 0.0 for ti, st in enumerate(steps) for si in range(len(st))}
        mean, std = (0.0, 1.0) if len(scores) == 1 else (scores.mean(), scores.std(ddof=1))
        scale = 1.0 if self.config.mode == "mean_norm" else std + self.config.eps
        return {(ti, si): (episode[ti] - mean) / scale for ti, st in enumerate(steps) for si in range(len(st))}

    def _aggregate(self, items: list[tuple[int, float]]) -> float:
        """The levels' weighted sum, over the levels whose advantage is not exactly 0."""
        valid = [(k, a) for k, a in items if a != 0]
        if not valid:
            return 0.0
        w = np.array([(k + 1.0) ** self.config.length_weight_alpha for k, _ in valid])
        return float((w / (w.sum() + self.config.eps)) @ np.array([a for _, a in valid]))
