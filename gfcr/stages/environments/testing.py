"""Labelled test environments (``testing.*``): for the runtime logic of ``generate.multi_turn``,
not tasks. ``testing.echo`` answers every turn with a fixed observation until its turn limit;
``testing.raising`` raises in ``step`` for chosen episodes (an environment that fails)."""

from __future__ import annotations

from gfcr.records import Prompt
from gfcr.stages.environments.base import Action, Observation


class Echo:
    """Answers each turn with ``reply`` and reward ``reward``; done after ``turns`` model turns."""

    def __init__(self, reply: str = " 1 Answer:", turns: int = 3, reward: float = 0.5):
        self.reply, self.turns, self.reward = reply, turns, reward
        self.seen = 0

    def reset(self, prompt: Prompt, seed: int) -> None:
        self.seen = 0

    def step(self, action: Action) -> Observation:
        self.seen += 1
        done = self.seen >= self.turns
        return Observation("" if done else self.reply, done=done, reward=self.reward,
                           metadata={"correct": done, "reason": f"turn {self.seen}"})


class Raising(Echo):
    """``testing.echo`` whose ``step`` raises at turn ``at`` of the episodes whose seed is odd
    (``every: 1``: of every episode)."""

    def __init__(self, at: int = 2, every: int = 2, **echo):
        super().__init__(**echo)
        self.at, self.every = at, every
        self.fails = False

    def reset(self, prompt: Prompt, seed: int) -> None:
        super().reset(prompt, seed)
        self.fails = seed % self.every == self.every - 1

    def step(self, action: Action) -> Observation:
        if self.fails and self.seen + 1 == self.at:
            raise RuntimeError(f"tool server unreachable at turn {self.at}")
        return super().step(action)
