"""filter.step_reward: Step-GRPO's step-aware relative reward, reshaping scored rewards by the number
of reasoning steps.

Step-GRPO (arXiv 2604.16890, Sections 3.3-3.4; ``compute_score`` in
``examples/reward_function/step_grpo.py`` of ``davidweidawang/Step-GRPO``) rewards a correct answer
more when it took fewer steps than the group's correct answers did. For a rollout ``i`` of a group:

- ``k_i = 1 + `` the number of trigger words in its response (``Wait``; whole words: ``Waiting``,
  ``await`` and ``AWait`` do not count, ``Wait,`` and ``Wait9`` do);
- ``mu`` = the mean ``k`` over the group's correct rollouts (``baseline: all``: over all of them,
  the paper's "all-sample mean" ablation);
- ``R_i = alpha * acc_i * (1 - beta * tanh((k_i - mu) / mu)) + (1 - alpha) * fmt_i``,

where ``acc_i`` and ``fmt_i`` are the verifier's ``correct`` and ``format`` (``filter.verify``'s
``reward_components``). A wrong rollout, or one of a group with no correct rollout (``mu``
undefined), gets no step term: ``alpha * acc_i + (1 - alpha) * fmt_i``. Defaults are the
reference's (alpha 0.9, beta 0.5, trigger ``Wait``); ``beta: 0`` is the paper's "w/o step reward"
ablation. The stage writes ``reward``, adds ``reward_components["step_bonus"]`` (the step term,
``alpha * acc_i * -beta * tanh((k_i - mu) / mu)``, 0 where there is none) and appends the step count
and ``mu`` to ``reward_reason``. Run it after ``filter.verify`` (with any ``format_weight``: this
stage recomputes the reward from ``correct`` and ``format``); a rollout of an included group
without a verdict is refused with a ValueError naming its group. Replayed rollouts that already
carry a ``step_bonus`` are left alone. Nothing is dropped.

It pairs with ``control.truncate_steps`` (Step-GRPO's Dynamic Truncated Rollout), whose
``markers`` should be the same words.

Fidelity: checked against davidweidawang/Step-GRPO@df76889: 13/13 cases
(``tests/fidelity/step_grpo_reward.json``, ``compute_score``), with the verifier's verdict given
as the reference's. Deviations: the reference's accuracy and format come from mathruler
(``grade_answer`` on the ``\\boxed{}`` content); here they are the prompt's verifier's. Its
format term is 1 for every response at that commit (mathruler's ``extract_boxed_content``
returns the string ``"None"`` when there is no ``\\boxed{}``, which is truthy), so the reference
adds ``1 - alpha`` to every reward; here ``format`` is what the verifier found. The reference
strips whitespace around ``<``, ``>`` and ``/`` before counting, which cannot change a count of
whole words.

Example (a group of three; the two correct ones took 1 and 3 steps, so ``mu = 2``):

>>> from gfcr.records import Rollout, RolloutGroup, RolloutGroups, Segment
>>> texts = ["\\\\boxed{7}", "Wait, Wait. \\\\boxed{7}", "Wait \\\\boxed{5}"]
>>> rollouts = [Rollout(f"g/{i}", "g", "p", [1], [Segment(0, 1, 0, [0.0])], reward=float(ok), correct=ok,
...                     text=t, reward_components={"correct": float(ok), "format": 1.0})
...             for i, (t, ok) in enumerate(zip(texts, [True, True, False]))]
>>> _ = StepReward(StepReward.Config()).run(RolloutGroups([RolloutGroup("g", "p", 0, 3, rollouts)]))
>>> [round(r.reward, 4) for r in rollouts]  # 0.9 (1 + 0.5 tanh(1/2)) + 0.1, 0.9 (1 - 0.5 tanh(1/2)) + 0.1, 0.1
[1.208, 0.792, 0.1]

YAML:

.. code-block:: yaml

    steps:   {use: control.truncate_steps, with: {markers: [Wait]}}
    rollout: {use: generate.sample, from: budget, in_flight: [steps]}
    verify:  {use: filter.verify, from: rollout}
    reward:  {use: filter.step_reward, from: verify, with: {alpha: 0.9, beta: 0.5}}
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from gfcr.records import Rollout, RolloutGroup, RolloutGroups
from gfcr.registry import StageConfig
from gfcr.stages.verifiers.scoring import response_text

COMPONENT = "step_bonus"


def count_steps(text: str, words: Sequence[str] = ("Wait",)) -> int:
    """Step-GRPO's semantic step count: 1 + the occurrences of ``words`` not touching a letter."""
    pattern = "|".join(re.escape(w) for w in words)
    return 1 + len(re.findall(rf"(?<![A-Za-z])(?:{pattern})(?![A-Za-z])", text))


def step_aware_reward(correct: bool, formatted: float, steps: int, mu: float | None, alpha: float,
                      beta: float) -> float:
    """Eq. 5: ``alpha * acc * (1 - beta * tanh((k - mu) / mu)) + (1 - alpha) * fmt``; no step term for a
    wrong answer or an undefined ``mu``."""
    efficiency = 1.0 - beta * math.tanh((steps - mu) / mu) if correct and mu else 1.0
    return alpha * float(correct) * efficiency + (1.0 - alpha) * formatted


def group_baseline(steps: Sequence[int], correct: Sequence[bool], over: str = "correct") -> float | None:
    """Eq. 4: the mean step count of the group's correct rollouts (``over: all``: of all); None if none."""
    pool = [k for k, ok in zip(steps, correct) if ok or over == "all"]
    return sum(pool) / len(pool) if pool else None


class StepReward:
    """Reshape each scored reward by its step count against the group's correct answers (Step-GRPO)."""

    class Config(StageConfig):
        reads_rewards: ClassVar[bool] = True  # a capability (gfcr.registry.ReadsRewards): a verifier must be upstream
        per_group: ClassVar[bool] = True  # a capability (gfcr.registry.PerGroup): each group's own step counts
        alpha: Annotated[float, Field(ge=0.0, le=1.0, description="weight of accuracy against format")] = 0.9
        beta: Annotated[float, Field(ge=0.0, description=(
            "strength of the step term: it moves a correct reward within alpha * (1 -/+ beta)"))] = 0.5
        words: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, description=(
            "trigger words that start a new reasoning step"))] = ["Wait"]
        baseline: Annotated[Literal["correct", "all"], Field(description=(
            "mu is the mean step count of the group's correct rollouts (Step-GRPO) or of all of them"))] = "correct"

    def __init__(self, config: Config):
        self.config = config

    def run(self, groups: RolloutGroups) -> RolloutGroups:
        for group in groups.included():
            todo = [r for r in group.rollouts if COMPONENT not in r.reward_components]
            _check_scored(group, todo)
            self.reshape(todo)
        return groups

    def reshape(self, rollouts: Sequence[Rollout]) -> None:
        """Rewrite the rewards of one group's rollouts (all scored by a verifier)."""
        cfg = self.config
        steps = [count_steps(response_text(r), cfg.words) for r in rollouts]
        correct = [bool(r.correct) for r in rollouts]
        mu = group_baseline(steps, correct, cfg.baseline)
        for r, k, ok in zip(rollouts, steps, correct):
            fmt = r.reward_components["format"]
            r.reward = step_aware_reward(ok, fmt, k, mu, cfg.alpha, cfg.beta)
            r.reward_components = {**r.reward_components,
                                   COMPONENT: r.reward - (cfg.alpha * float(ok) + (1.0 - cfg.alpha) * fmt)}
            mean = "none" if mu is None else f"{mu:.3g}"
            r.reward_reason = f"{r.reward_reason or ''}; {k} steps, group mean {mean}".lstrip("; ")


def _check_scored(group: RolloutGroup, rollouts: Sequence[Rollout]) -> None:
    unscored = [r.rollout_id for r in rollouts if r.correct is None or "format" not in r.reward_components]
    if unscored:
        raise ValueError(f"group {group.group_id}: rollouts {', '.join(unscored)} have no verifier verdict "
                         "(correct and a `format` component); filter.step_reward reshapes verified rewards: put it "
                         "after filter.verify (`from: verify`, where verify is filter.verify)")
