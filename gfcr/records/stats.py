"""Per-prompt memory kept across steps by the stages that need it (GRESO streaks, Beta
posteriors, GDRO bins, lifecycle). Owned and checkpointed by those stages."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum


class ObservationSource(StrEnum):
    TRAIN = "train"
    PILOT = "pilot"
    REFERENCE = "reference"
    PROFILE = "profile"
    EVAL = "eval"


@dataclass(frozen=True, slots=True)
class Observation:
    """What one sampling event of a prompt showed."""

    step: int
    policy_version: int
    n: int
    n_correct: int
    mean_reward: float
    reward_std: float
    mean_length: float = 0.0
    source: ObservationSource = ObservationSource.TRAIN
    # mean entropy of the sampling distribution over the group's response tokens (HIVE's
    # "response entropy"); NaN when the generator did not record per-token entropy
    mean_entropy: float = math.nan

    @property
    def all_correct(self) -> bool:
        return self.n > 0 and self.n_correct == self.n

    @property
    def all_wrong(self) -> bool:
        return self.n > 0 and self.n_correct == 0


class Lifecycle(StrEnum):
    ACTIVE = "active"
    DEFERRED = "deferred"
    EVICTED = "evicted"
    TRIVIAL = "trivial"
    UNSOLVED = "unsolved"


@dataclass(slots=True)
class PromptStats:
    """History of one prompt, with the derived quantities kept incrementally.

    ``easy_streak`` / ``hard_streak`` count the consecutive most recent observations that
    were all-correct / all-wrong (GRESO's z_i); they are exact even when ``history`` (a ring
    buffer of ``history_size``) has forgotten older entries.
    """

    prompt_id: str
    history_size: int = 64
    history: deque[Observation] = field(default_factory=deque)
    easy_streak: int = 0
    hard_streak: int = 0
    beta_alpha: float = 1.0  # Beta posterior over the success rate (VADE, MoPPS)
    beta_beta: float = 1.0
    bin_id: str | None = None  # difficulty bin (Prompt-/Rollout-GDRO)
    lifecycle: Lifecycle = Lifecycle.ACTIVE
    deferred_until: int | None = None
    times_selected: int = 0
    last_selected_step: int | None = None

    def record(self, obs: Observation) -> None:
        self.history.append(obs)
        while len(self.history) > self.history_size:
            self.history.popleft()
        self.easy_streak = self.easy_streak + 1 if obs.all_correct else 0
        self.hard_streak = self.hard_streak + 1 if obs.all_wrong else 0

    @property
    def last(self) -> Observation | None:
        return self.history[-1] if self.history else None
