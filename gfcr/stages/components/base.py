"""The pieces an ``update.*`` stage is assembled from, each chosen by alias from a registry of
its own with its own Config under ``with``:

- ``advantage``: an estimator (``gfcr.stages.components.advantage``; registry
  ``ADVANTAGE_ESTIMATORS``, entry-point group ``gfcr.advantages``);
- ``loss``: the per-token policy loss and its ratio (``gfcr.stages.components.loss``; ``LOSSES``,
  ``gfcr.losses``);
- ``aggregation``: how per-token losses become one scalar (``gfcr.stages.components.aggregation``;
  ``AGGREGATIONS``, ``gfcr.aggregations``);
- ``correction``: the off-policy correction of stale tokens' ratios and weights
  (``gfcr.stages.components.correction``; ``CORRECTIONS``, ``gfcr.corrections``);
- ``lr_rule``: how one step's learning rate is scaled from its batch
  (``gfcr.stages.components.lr_rule``; ``LR_RULES``, ``gfcr.lr_rules``).

.. code-block:: yaml

    update:
      use: update.grpo
      from: keep
      with:
        advantage: {use: rloo}
        loss: {use: ppo_clip, with: {clip: [0.2, 0.28]}}
        aggregation: {use: token_mean}
        correction: {use: tis, with: {cap: 2.0}}

A spec is checked when it is built: an unknown alias gets a did-you-mean, a key its Config
does not have is an error naming the keys it does have, never a silent default. A component
whose meaning depends on another one (Dr.GRPO's estimator on its aggregation, MC-GRPO on a
Control stage allocating ``G + 1``) says so in ``requires`` or ``pairing_problems``, which
``gfcr validate`` reports with the file and line of the update. What the update reads on a
component beyond its kind's required methods is declared in ``gfcr.registry.components``, and
registration refuses a near miss of those names.

This module imports no torch: ``gfcr validate`` builds every spec.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from gfcr.errors import RegistryError, did_you_mean, known
from gfcr.registry.components import ChecksPairing, declared, provides
from gfcr.registry.lifecycle import PipelineProblem
from gfcr.spec.problems import BOUNDS, FIXABLE, fixable


class ComponentConfig(BaseModel):
    """Base for the Config of an estimator, loss or aggregation: frozen, strict, unknown keys
    rejected, floats finite."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


@dataclass(frozen=True)
class PairingContext:
    """What a component may ask about the rest of the pipeline when it is checked.

    ``advantage``, ``loss``, ``aggregation`` and ``correction`` are the update's chosen aliases;
    ``token_corrections`` is what the chosen loss declares (it has a per-token ratio);
    ``rollouts_per_prompt`` is the fixed group size the nearest upstream Control stage
    allocates (a Config with the ``FixesGroupSize`` capability), None when no stage fixes it,
    and ``rollouts_setting(n)`` the ``key=value`` of that stage's ``with`` that would make it
    allocate ``n``; ``upstream`` lists the update's upstream stages as ``(id, alias)``, nearest
    first; ``trees_upstream`` says whether one of them builds trees (``BuildsTrees``)."""

    advantage: str
    loss: str
    aggregation: str
    rollouts_per_prompt: int | None = None
    rollouts_from: str | None = None  # the id of the stage that fixes it
    upstream: tuple[tuple[str, str], ...] = ()
    correction: str = "none"
    token_corrections: bool = True
    rollouts_setting: Callable[[int], str] | None = None
    trees_upstream: bool = False
    lr_rule: str = "constant"

    def chosen(self, kind: str) -> str:
        """The alias the update chose for its component ``kind`` ("advantage", "loss", ...)."""
        return {"advantage": self.advantage, "loss": self.loss, "aggregation": self.aggregation,
                "correction": self.correction, "lr_rule": self.lr_rule}[kind]





@dataclass(frozen=True)
class Requirement:
    """A declarative pairing: component ``kind`` ("advantage", "loss", "aggregation" or
    "correction") must be one of ``allowed``, because ``why``."""

    kind: str
    allowed: tuple[str, ...]
    why: str
    own: tuple[str, ...] = field(default=())  # the key path of the component that requires it

    def check(self, ctx: PairingContext) -> list[PipelineProblem]:
        chosen = ctx.chosen(self.kind)
        if chosen in self.allowed:
            return []
        choice = " or ".join(f"`{a}`" for a in self.allowed)
        return [PipelineProblem((self.kind, "use"), f"{self.why}, so it needs {self.kind} {choice}, not `{chosen}`",
                        f"set `{self.kind}: {{use: {self.allowed[0]}}}` (--set update.with.{self.kind}.use="
                        f"{self.allowed[0]})" + (f", or another {self.own[0]} than `{self.own[1]}`" if self.own else ""))]


def _validated(config: type[BaseModel], values: dict[str, Any]) -> BaseModel:
    """Validate as the stage Configs are (JSON mode: a YAML list fills a tuple field)."""
    try:
        text = json.dumps(values)
    except TypeError:
        return config.model_validate(values)
    return config.model_validate_json(text)


def _config_problems(exc: ValidationError, allowed: list[str], key: str, use: str) -> tuple[str, str]:
    """What is wrong with the ``with`` of the update's component ``key: {use: ...}``, and the fix."""
    parts, fixes = [], []
    for err in exc.errors(include_url=False):
        field = ".".join(str(p) for p in err["loc"]) or "with"
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown key `{field}`")
            fixes.append(did_you_mean(field, allowed) or f"the keys allowed are {known(allowed) or 'none'}")
        elif err["type"] == FIXABLE:  # a Config validator that says its own fix
            parts.append(err["ctx"]["message"])
            fixes.append(err["ctx"]["fix"])
        elif err["type"] == "missing":
            parts.append(f"`{field}` is required")
            fixes.append(f"it has no default: write `{key}: {{use: {use}, with: {{{field}: ...}}}}` "
                         f"(--set update.with.{key}.with.{field}=...)")
        elif err["type"] == "finite_number":
            parts.append(f"`{field}` must be a finite number, got `{err['input']!r}`")
            fixes.append(f"give `{field}` a finite number: `.inf`, `-.inf` and `.nan` cannot run")
        else:
            parts.append(f"`{field}`: {err['msg']}, got `{err['input']!r}`")
            fixes.append(f"change `{field}` to satisfy the bound" if err["type"] in BOUNDS else
                         f"give `{field}` a value of its type (`gfcr stages --components` shows the defaults)")
    return "; ".join(parts), "; ".join(dict.fromkeys(fixes))


class ComponentSpec(BaseModel):
    """``{use: <alias>, with: {<its Config>}}``, checked against the kind's registry.

    Subclasses set ``kind`` (for messages), ``key`` (the update's field), ``registry_name``
    (the registry's name in ``gfcr.registry.catalog``) and the default ``use``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, serialize_by_alias=True,
                              validate_by_name=True, validate_by_alias=True)

    kind: ClassVar[str] = "component"
    key: ClassVar[str] = "component"
    registry_name: ClassVar[str] = ""

    use: str
    with_: dict[str, Any] = Field(default_factory=dict, alias="with", description="the component's Config")

    @classmethod
    def registry(cls):
        from gfcr.registry import catalog

        return getattr(catalog, cls.registry_name)

    @model_validator(mode="before")
    @classmethod
    def _not_a_bare_name(cls, data: Any) -> Any:
        if isinstance(data, str):
            raise fixable(f"the {cls.kind} is a mapping", f"write `{cls.key}: {{use: {data}}}` "
                                                          f"(or --set update.with.{cls.key}.use={data})")
        if isinstance(data, dict) and "with" not in data and "with_" not in data:
            data = {**data, "with": {}}  # so that `_fits` checks an absent `with` too (a required key)
        return data

    @field_validator("use")
    @classmethod
    def _known(cls, use: str) -> str:
        try:
            cls.registry().get(use)
        except RegistryError as exc:
            raise fixable(exc.message, exc.fix) from None
        return use

    @field_validator("with_")
    @classmethod
    def _fits(cls, values: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        use = info.data.get("use")
        if use is None:
            return values  # the alias is already reported
        config = cls.registry().get(use).Config
        try:
            _validated(config, values)
        except ValidationError as exc:
            message, fix = _config_problems(exc, list(config.model_fields), cls.key, use)
            raise fixable(f"{cls.kind} `{use}`: {message}", fix) from None
        return values

    def component_class(self) -> type:
        return self.registry().get(self.use)

    def config(self) -> BaseModel:
        return _validated(self.component_class().Config, self.with_)

    def build(self) -> Any:
        cls = self.component_class()
        return cls(_validated(cls.Config, self.with_))

    def pairing_problems(self, ctx: PairingContext) -> list[PipelineProblem]:
        """This component's unmet pairings: its class's ``requires`` (Requirements) and its
        ``pairing_problems(config, ctx)`` staticmethod, if any (keys relative to the update's
        ``with``)."""
        cls, config = self.component_class(), self.config()
        found: list[PipelineProblem] = []
        for req in declared(cls, "requires"):
            found += Requirement(req.kind, req.allowed, req.why, (self.key, self.use)).check(ctx)
        if provides(cls, ChecksPairing):
            found += list(cls.pairing_problems(config, ctx))
        return found
