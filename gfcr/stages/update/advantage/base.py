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
Value error, unknown advantage estimator `medain`; did you mean `median` or `mean`?
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from gfcr.errors import RegistryError, did_you_mean, known
from gfcr.records import RolloutGroup


class EstimatorConfig(BaseModel):
    """Base for estimator configs: frozen, strict, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


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


def has_no_baseline(rewards: np.ndarray) -> bool:
    """A lone rollout has no group baseline, and equal rewards have nothing to prefer."""
    return len(rewards) < 2 or bool(rewards.max() == rewards.min())


def lower_median(values: np.ndarray) -> float:
    """The middle of the sorted values; the lower of the two middles when their count is even
    (``torch.median`` semantics)."""
    ordered = np.sort(values)
    return float(ordered[(len(ordered) - 1) // 2])


def _registry():
    from gfcr.registry.catalog import ADVANTAGE_ESTIMATORS

    return ADVANTAGE_ESTIMATORS


def _config_problems(exc: ValidationError, allowed: list[str]) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        key = ".".join(str(p) for p in err["loc"]) or "with"
        if err["type"] == "extra_forbidden":
            hint = did_you_mean(key, allowed) or f"the keys allowed are {known(allowed) or 'none'}"
            parts.append(f"unknown key `{key}` ({hint})")
        else:
            parts.append(f"`{key}`: {err['msg']}, got `{err['input']!r}`")
    return "; ".join(parts)


class AdvantageSpec(BaseModel):
    """``{use: <estimator alias>, with: {<its Config>}}``, checked against the registry."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, serialize_by_alias=True,
                              validate_by_name=True, validate_by_alias=True)

    use: str = Field("mean_std", description="advantage estimator alias: mean_std | mean | median | gapo | mc_grpo")
    with_: dict[str, Any] = Field(default_factory=dict, alias="with", description="the estimator's Config")

    @model_validator(mode="before")
    @classmethod
    def _not_a_bare_name(cls, data: Any) -> Any:
        if isinstance(data, str):
            raise ValueError(f"the estimator is a mapping now: write `advantage: {{use: {data}}}` "
                             f"(or --set update.with.advantage.use={data})")
        return data

    @field_validator("use")
    @classmethod
    def _known(cls, use: str) -> str:
        try:
            _registry().get(use)
        except RegistryError as exc:
            raise ValueError(f"{exc.message}; {exc.fix}") from None
        return use

    @field_validator("with_")
    @classmethod
    def _fits(cls, values: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        use = info.data.get("use")
        if use is None:
            return values  # the alias is already reported
        config = _registry().get(use).Config
        try:
            config.model_validate(values)
        except ValidationError as exc:
            allowed = list(config.model_fields)
            raise ValueError(f"advantage estimator `{use}`: {_config_problems(exc, allowed)}") from None
        return values

    def build(self) -> AdvantageEstimator:
        cls = _registry().get(self.use)
        return cls(cls.Config.model_validate(self.with_))
