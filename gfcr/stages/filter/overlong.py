"""filter.overlong: DAPO's soft overlong punishment, a length penalty added to scored rewards.

DAPO (Yu et al., 2025, arXiv 2503.14476, section 3.4, eq. 13) shapes the reward of long
responses. With ``L_max = max_length`` (the generation's ``max_new_tokens``), ``L_cache =
buffer`` and ``|y|`` the response's token count (``len(rollout)``), a response gets

    R_length(y) = 0                                  if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                = -1                                 if |y| > L_max

and the stage adds ``penalty_factor * R_length(y)`` to its ``reward`` and records that term in
``reward_components["overlong"]`` (0.0 for a response inside the budget, so every rollout
carries the component: ``gdpo`` normalises it as its own reward). The penalty reaches
``-penalty_factor`` at ``|y| = L_max``: a truncated response (finish reason ``length``)
scores ``reward - penalty_factor``. Run it after a stage that scores rollouts
(``filter.verify``); a rollout of an included group with no reward is refused with a
ValueError naming its group. Nothing is dropped: groups pass through, rewards changed in
place. Defaults are verl's DAPO recipe (``recipe/dapo``, reward manager ``dapo``:
``overlong_buffer.len = 4096``, ``penalty_factor = 1.0``); ``max_length`` has no default,
since it must equal the generate stage's ``max_new_tokens`` (verl's
``max_response_length``), and ``buffer`` may not exceed it (verl asserts the same).

Fidelity: checked against OpenRLHF/OpenRLHF@3c3be62: 5/5 cases (``tests/fidelity/overlong.json``;
``apply_overlong_penalty`` of ``openrlhf/trainer/ppo_utils/length_penalty.py``, which caps the
excess at the buffer as eq. 13 does: lengths around both edges of the buffer and past
``max_length``, DAPO's 20480/4096, penalty factors 0.5 to 2, a buffer as long as
``max_length``).

Deviations: verl computes ``min(-(|y| - (L_max - L_cache)) / L_cache * penalty_factor, 0)``
with no floor (its responses cannot exceed ``L_max``); this stage follows eq. 13 and floors
the penalty at ``-penalty_factor`` for ``|y| > L_max`` (possible only when ``max_length`` is
set below the generation's ``max_new_tokens``). verl's ``overlong_buffer.log`` flag has no
equivalent: the penalty is always recorded in ``reward_components``. A rollout that already
carries an ``overlong`` component (a replayed rollout scored in an earlier step) is left
alone, so its reward is not penalised twice. ``|y|`` is the response's token count, EOS
included when the engine returned one, as verl's ``valid_response_length``.

Example (``L_max = 8``, ``L_cache = 4``: lengths 4, 6, 8 and 9 get 0, -2/4, -4/4 and -1):

>>> from gfcr.records import Rollout, RolloutGroup, RolloutGroups, Segment
>>> rollouts = [Rollout(f"g/{n}", "g", "p", [1] * n, [Segment(0, n, 0, [0.0] * n)], reward=1.0)
...             for n in (4, 6, 8, 9)]
>>> groups = RolloutGroups([RolloutGroup("g", "p", 0, 4, rollouts)])
>>> _ = Overlong(Overlong.Config(max_length=8, buffer=4)).run(groups)
>>> [(r.reward, r.reward_components["overlong"]) for r in rollouts]
[(1.0, 0.0), (0.5, -0.5), (0.0, -1.0), (0.0, -1.0)]

YAML:

.. code-block:: yaml

    rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 20480}}
    reward:  {use: filter.verify, from: rollout}
    length:  {use: filter.overlong, from: reward, with: {max_length: 20480, buffer: 4096, penalty_factor: 1.0}}
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field, model_validator

from gfcr.records import Rollout, RolloutGroup, RolloutGroups
from gfcr.registry import StageConfig

COMPONENT = "overlong"


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """DAPO's R_length (eq. 13) of a response of ``length`` tokens, in [-1, 0]."""
    expected = max_length - buffer  # L_max - L_cache: the length that is still free
    if length <= expected:
        return 0.0
    if length <= max_length:
        return (expected - length) / buffer  # linear from 0 to -1 across the buffer
    return -1.0


class Overlong:
    """Add DAPO's soft overlong punishment, ``penalty_factor * R_length(|y|)``, to each scored reward."""

    class Config(StageConfig):
        reads_rewards: ClassVar[bool] = True  # a capability (gfcr.registry.ReadsRewards): a verifier must be upstream
        per_group: ClassVar[bool] = True  # a capability (gfcr.registry.PerGroup): shapes each rollout's reward alone
        max_length: Annotated[int, Field(ge=1, description="L_max: the generation's max_new_tokens (verl's "
                                                           "max_response_length), in tokens")]
        buffer: Annotated[int, Field(ge=1, description="L_cache: the last tokens before max_length over which "
                                                       "the penalty grows from 0 to penalty_factor")] = 4096
        penalty_factor: Annotated[float, Field(ge=0.0, description="scale of the penalty: a response of "
                                                                   "max_length tokens loses this much reward")] = 1.0

        @model_validator(mode="after")
        def _buffer_fits(self) -> "Overlong.Config":
            if self.buffer > self.max_length:
                raise ValueError(f"buffer ({self.buffer}) exceeds max_length ({self.max_length}); "
                                 "set buffer to at most max_length (DAPO: 4096 of 20480)")
            return self

    def __init__(self, config: Config):
        self.config = config

    def run(self, groups: RolloutGroups) -> RolloutGroups:
        for group in groups.included():
            _check_scored(group)
            for rollout in group.rollouts:
                if COMPONENT not in rollout.reward_components:
                    self._punish(rollout)
        return groups

    def _punish(self, rollout: Rollout) -> None:
        cfg = self.config
        penalty = cfg.penalty_factor * overlong_penalty(len(rollout), cfg.max_length, cfg.buffer)
        rollout.reward_components = {**rollout.reward_components, COMPONENT: penalty}
        rollout.reward += penalty


def _check_scored(group: RolloutGroup) -> None:
    unscored = [r.rollout_id for r in group.rollouts if r.reward is None]
    if unscored:
        raise ValueError(f"group {group.group_id}: rollouts {', '.join(unscored)} have no reward to penalise; "
                         "filter.overlong shapes scored rewards: put it after the stage that scores them "
                         "(`from: reward`, where reward is filter.verify)")
