"""The advantage-estimator contract: one group in, one advantage per rollout out.

An estimator is a class registered in ``gfcr.registry.catalog.ADVANTAGE_ESTIMATORS`` (entry-point
group ``gfcr.advantages``) with a frozen ``Config`` (``extra="forbid"``), ``__init__(config)``
and ``estimate(group) -> Advantages``. It is numpy-only: ``gfcr validate`` imports the
estimators to check ``update.with.advantage`` and must not import torch.

An ``Advantages`` holds, per rollout of the group, a scalar advantage or a ``[T]`` array
(per-token estimators), and optionally a ``[T]`` bool loss mask (``False``: the token is
left out of the loss and of its denominator; MC-GRPO masks its pivot rollout this way).

In a pipeline the estimator is chosen by alias, with its own Config under ``with``:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {advantage: {use: gapo, with: {fraction: 0.5}}}}

Example:

>>> spec = AdvantageSpec(use="gapo", **{"with": {"fraction": 0.5}})
>>> spec.build().config
Config(fraction=0.5, eps=1e-06)
>>> try:
...     AdvantageSpec(use="medain")
... except ValueError as exc:
...     print(exc.errors()[0]["msg"])
unknown advantage estimator `medain`; did you mean `median` or `mean`?
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, Sequence

import numpy as np
from pydantic import BaseModel, Field

from gfcr.records import RolloutGroup
from gfcr.registry.components import EstimatesBatch, provides
from gfcr.stages.components.base import ComponentConfig, ComponentSpec


EstimatorConfig = ComponentConfig  # frozen, strict, unknown keys rejected


@dataclass(frozen=True, slots=True)
class Advantages:
    """Per rollout of one group: its advantage (scalar or ``[T]``) and optional loss mask."""

    values: tuple[float | np.ndarray, ...]
    loss_masks: tuple[np.ndarray | None, ...] = ()  # per rollout [T] bool or None; () = no masks

    @classmethod
    def scalars(cls, values: np.ndarray) -> "Advantages":
        return cls(tuple(float(v) for v in values))

    def mask(self, index: int) -> np.ndarray | None:
        return self.loss_masks[index] if self.loss_masks else None


class AdvantageEstimator(Protocol):
    """``estimate(group)`` is required; an estimator that needs the whole batch (REINFORCE++'s
    batch normalisation) or the prompts (a stored reference value) also defines
    ``estimate_batch(groups, pool) -> list[Advantages]`` (``gfcr.registry.components.EstimatesBatch``),
    which the update then calls instead."""

    config: BaseModel

    def estimate(self, group: RolloutGroup) -> Advantages: ...


def checked_rewards(group: RolloutGroup) -> np.ndarray:
    """The group's rewards ``[G]`` float64; ValueError naming the group if any is unscored."""
    rewards = group.rewards
    if np.isnan(rewards).any():
        raise ValueError(
            f"group {group.group_id}: {int(np.isnan(rewards).sum())} of {len(rewards)} rewards are NaN "
            "(unscored rollouts); put a verifier stage (filter.verify) between generation and the update, "
            "or drop the unscored rollouts")
    return rewards


# a group of one rollout: gfcr gives it no advantage (no baseline); verl's estimators use mean 0
# (and std 1), so its raw reward enters
SingleRollout = Literal["zero", "verl"]
SINGLE_ROLLOUT_HELP = ("a group of one rollout: `zero` (it has no baseline), `verl` (verl's mean 0 and std 1: "
                       "its raw reward enters)")


def lone_reward(rewards: np.ndarray, single_rollout: SingleRollout) -> bool:
    """The group is one rollout whose reward, as verl takes it, is its advantage's numerator."""
    return len(rewards) == 1 and single_rollout == "verl"


def has_no_baseline(rewards: np.ndarray) -> bool:
    """A lone rollout has no group baseline, and equal rewards have nothing to prefer."""
    return len(rewards) < 2 or bool(rewards.max() == rewards.min())


def lower_median(values: np.ndarray) -> float:
    """The middle of the sorted values; the lower of the two middles when their count is even
    (``torch.median`` semantics)."""
    ordered = np.sort(values)
    return float(ordered[(len(ordered) - 1) // 2])


class AdvantageSpec(ComponentSpec):
    """``{use: <estimator alias>, with: {<its Config>}}``, checked against the registry."""

    kind: ClassVar[str] = "advantage estimator"
    key: ClassVar[str] = "advantage"
    registry_name: ClassVar[str] = "ADVANTAGE_ESTIMATORS"

    use: str = Field("mean_std", description="advantage estimator alias (`gfcr stages --components` lists them)")

    def build(self) -> AdvantageEstimator:
        return super().build()


def estimate_all(estimator: AdvantageEstimator, groups: Sequence[RolloutGroup], pool: Any) -> list[Advantages]:
    """One ``Advantages`` per group: the estimator's ``estimate_batch(groups, pool)`` when it
    has one (estimators that normalise across the batch, or read the prompts), else
    ``estimate(group)`` for each group."""
    if provides(estimator, EstimatesBatch):
        out = list(estimator.estimate_batch(groups, pool))
        if len(out) != len(groups):
            raise RuntimeError(f"{type(estimator).__name__}.estimate_batch returned {len(out)} results "
                               f"for {len(groups)} groups")
        return out
    return [estimator.estimate(g) for g in groups]
