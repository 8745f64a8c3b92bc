"""Labelled test environments for ``generate.elpo`` and ``generate.trace``: ``Doom``, a planted first
irrecoverable turn; ``Parity``, per-turn rewards that predict success.

An episode lasts ``turns`` model turns, each answered " Answer:". The first episode reset with a
seed (per ``key``) is the *original*: its actions are recorded, and it fails (reward 0). A later
episode with that seed (a continuation, replayed from the original's prefix) succeeds (reward 1)
exactly when one of its first ``at`` actions differs from the original's: so a prefix of the
original with fewer than ``at`` model turns is recoverable, one with ``at`` or more is not, and
model turn ``at`` is the original's first irrecoverable turn."""

from __future__ import annotations

from typing import ClassVar

from gfcr.records import Prompt
from gfcr.stages.environments.base import Action, Observation


class Doom:
    originals: ClassVar[dict[tuple[str, int], list[str]]] = {}

    def __init__(self, turns: int = 5, at: int = 3, key: str = "doom"):
        self.turns, self.at, self.key = turns, at, key
        self.seen, self.actions, self.original = 0, [], False

    def reset(self, prompt: Prompt, seed: int) -> None:
        self.seen, self.seed = 0, (self.key, seed)
        self.original = self.seed not in self.originals
        self.actions = self.originals.setdefault(self.seed, []) if self.original else []

    def step(self, action: Action) -> Observation:
        self.seen += 1
        self.actions.append(action.text)
        done = self.seen >= self.turns
        if not done:
            return Observation(" Answer:", done=False, reward=0.0)
        if self.original:
            return Observation("", done=True, reward=0.0, metadata={"correct": False})
        first = self.originals[self.seed]
        diverged = any(a != b for a, b in zip(self.actions[:self.at], first[:self.at]))
        return Observation("", done=True, reward=float(diverged), metadata={"correct": diverged})


class Parity:
    """Each model turn earns 0.5 when its text has an even number of characters; ``turns`` model
    turns, the reward the sum: a prefix's reward so far predicts its trajectories' success."""

    def __init__(self, turns: int = 3):
        self.turns, self.seen = turns, 0

    def reset(self, prompt: Prompt, seed: int) -> None:
        self.seen = 0

    def step(self, action: Action) -> Observation:
        self.seen += 1
        return Observation("" if self.seen >= self.turns else " Answer:", done=self.seen >= self.turns,
                           reward=0.5 * (len(action.text) % 2 == 0))
