"""TEST STAGES: a fake engine and a fake update, for testing the runtime's logic and trying
the DSL without a model. They do no learning; never use them to measure a method.

``generate.fake`` draws each rollout's reward from a per-prompt success probability
(a stable hash of the prompt id and the seed), so some prompts are easy, some hard, and
zero-variance groups occur as they do in real runs. ``update.fake`` counts what reaches it
and bumps the policy version.
"""

from __future__ import annotations

import zlib
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import Field

from gfcr.records import (
    Allocation, Rollout, RolloutGroup, RolloutGroups, Segment, StepContext, UpdateReport, group_id, rollout_id,
)
from gfcr.registry import StageConfig


def scored_group(prompt: str, rewards: list[float], step: int = 0) -> RolloutGroup:
    """A group of one-token rollouts with the given rewards (reward 1 counts as correct)."""
    gid = group_id(prompt, step)
    rollouts = [
        Rollout(rollout_id(gid, i), gid, prompt, [1], [Segment(0, 1, 0, np.zeros(1))],
                reward=float(r), correct=r == 1)
        for i, r in enumerate(rewards)
    ]
    return RolloutGroup(gid, prompt, step, len(rewards), rollouts)


def prompt_success_probability(prompt_id: str, seed: int) -> float:
    """A stable pseudo-difficulty in [0, 1) for a prompt."""
    return zlib.crc32(f"{seed}:{prompt_id}".encode()) / 2**32


class FakeGenerate:
    """TEST STAGE (fake engine): random tokens, rewards from a per-prompt success rate.

    Example:

    >>> from gfcr.records import Allocation, AllocationEntry, Prompt
    >>> stage = FakeGenerate(FakeGenerate.Config(length=4))
    >>> groups = stage.run(Allocation(0, (AllocationEntry(Prompt("p:0", text="x"), 3),)))
    >>> [len(g.rollouts) for g in groups], len(groups.groups[0].rollouts[0])
    ([3], 4)

    YAML:

    .. code-block:: yaml

        rollout: {use: generate.fake, from: budget, with: {length: 8}}
    """

    testing: ClassVar[bool] = True

    class Config(StageConfig):
        length: Annotated[int, Field(ge=1, description="tokens per rollout")] = 8
        vocab_size: Annotated[int, Field(ge=2)] = 64
        seed: int = 0

    def __init__(self, config: Config):
        self.config = config
        self.ctx: StepContext | None = None

    def before_step(self, ctx: StepContext) -> None:
        self.ctx = ctx  # the runtime updates ctx.round in place inside loop blocks

    def run(self, allocation: Allocation) -> RolloutGroups:
        loop_round = (self.ctx.round or 0) if self.ctx else 0
        version = self.ctx.policy_version if self.ctx else 0
        groups = []
        for entry in allocation.active():
            gid = group_id(entry.prompt_id, allocation.step, loop_round)
            rng = np.random.default_rng(zlib.crc32(f"{self.config.seed}:{gid}".encode()))
            p = prompt_success_probability(entry.prompt_id, self.config.seed)
            rollouts = []
            for i in range(entry.n_rollouts):
                tokens = rng.integers(0, self.config.vocab_size, self.config.length).tolist()
                logprobs = np.log(rng.uniform(0.05, 1.0, self.config.length))
                correct = bool(rng.random() < p)
                rollouts.append(Rollout(
                    rollout_id(gid, i), gid, entry.prompt_id, tokens,
                    [Segment(0, len(tokens), version, logprobs)],
                    created_step=allocation.step, reward=float(correct), correct=correct,
                    reward_reason="fake: Bernoulli(p_prompt)",
                ))
            groups.append(RolloutGroup(gid, entry.prompt_id, allocation.step, entry.n_rollouts, rollouts,
                                       sample_weight=entry.sample_weight))
        return RolloutGroups(groups)


class FakeUpdate:
    """TEST STAGE (fake update): counts the rollouts and tokens it receives; learns nothing.

    Example:

    >>> from gfcr.records import RolloutGroups
    >>> report = FakeUpdate(FakeUpdate.Config()).run(RolloutGroups([scored_group("p:0", [0, 1])]))
    >>> report.policy_version, report.rollouts_in_update
    (1, 2)

    YAML:

    .. code-block:: yaml

        update: {use: update.fake, from: keep}
    """

    testing: ClassVar[bool] = True

    class Config(StageConfig):
        skip_empty: bool = Field(True, description="an empty batch skips the update (no version bump)")

    def __init__(self, config: Config):
        self.config = config
        self.version = 0

    def run(self, groups: RolloutGroups) -> UpdateReport:
        rollouts = list(groups.rollouts())
        if not rollouts and self.config.skip_empty:
            return UpdateReport(self.version, skipped=True, skip_reason="empty batch")
        self.version += 1
        return UpdateReport(self.version, len(rollouts), sum(len(r) for r in rollouts))

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
