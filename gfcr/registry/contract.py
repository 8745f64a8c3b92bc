"""The stage contract: what a class must look like to be registered as a stage.

A stage is a class with

- ``Config``: a frozen pydantic model with ``extra="forbid"`` (subclass ``StageConfig``);
- ``__init__(self, config)``;
- ``run(self, ...) -> T``: every parameter and the return annotated with a port type or,
  for inputs only, a runtime input (fed by the runtime, not by an edge). A parameter whose
  default is ``None`` is optional.

and any of the lifecycle roles of ``gfcr.registry.lifecycle`` (``setup``, ``before_step``,
``observe``, ``state_dict``/``load_state_dict``, ``save_files``/``load_files``, ``done``,
``attach_in_flight``). An in-flight controller (``every`` and ``steer``) is a Control stage
without ``run``. A method whose name is a near miss of a lifecycle name is refused. The
family is the alias's prefix; composition, not a base class, is how stages share code.

Ports (edge types) and who may use them:

==============  =================================  =============================================
type            produced by                        read by
==============  =================================  =============================================
Allocation      control, replay                    generate, control (chained), replay
RolloutGroups   generate, filter, replay (mix,     filter, replay, update
                provide into groups)
UpdateReport    update                             nobody (stages learn it through ``observe``)
Provided        replay (provide)                   generate only (``provided: Provided | None``)
==============  =================================  =============================================

Runtime inputs: ``PromptPool`` (the data), ``StepContext`` (the step, seed, policy version
and loop round of this call) and ``StepOutputs`` (the Replay ingest port: the groups the
step produced before the stage runs; replay stages only).
"""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from gfcr.errors import RegistryError
from gfcr.records import (
    PORT_TYPES, RUNTIME_INPUTS, Allocation, Provided, RolloutGroups, StepOutputs, UpdateReport,
)
from gfcr.registry.lifecycle import (
    EndsLoop, HostsInFlight, InFlightController, Observes, OwnsFiles, Stateful, check_lifecycle_names, has_role,
)

FAMILIES = ("control", "generate", "filter", "replay", "update")
FAMILY_OUTPUTS: dict[str, tuple[type, ...]] = {
    "control": (Allocation,),
    "generate": (RolloutGroups,),
    "filter": (RolloutGroups,),
    "replay": (Allocation, RolloutGroups, Provided),
    "update": (UpdateReport,),
}
# inputs only some families may take: the Replay ports
FAMILY_ONLY_INPUTS: dict[type, tuple[str, ...]] = {
    Provided: ("generate",),  # provide: partials, drafts, replayed rollouts into generation
    StepOutputs: ("replay",),  # ingest: what the step produced
}


class StageConfig(BaseModel):
    """Base for stage configs: frozen, strict, unknown keys rejected, floats finite (``.inf`` and
    ``.nan`` validate as numbers but no rate, temperature or weight can run with them)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


# a seed: numpy's generators, which every seeded draw goes through, take non-negative integers
Seed = Annotated[int, Field(ge=0)]


class _FilePath:
    """The mark of a Config field that holds a file or folder path (``FilePath``)."""

    def __repr__(self) -> str:
        return "FilePath"


FILE_PATH = _FilePath()
# a file or folder a stage or data source reads: written relative, it is relative to the pipeline
# file's folder (``gfcr.spec.loader.resolve_paths``), as every path in a spec is
FilePath = Annotated[str, FILE_PATH, Field(min_length=1)]


def path_keys(config: type) -> list[tuple[str, ...]]:
    """The key paths of ``config``'s ``FilePath`` fields, a nested Config's included
    (``replay.rlep``'s ``("seed_from", "jsonl")``), by their YAML names."""
    found: list[tuple[str, ...]] = []
    for name, field in getattr(config, "model_fields", {}).items():
        key = field.alias or name
        if FILE_PATH in field.metadata or any(FILE_PATH in getattr(a, "__metadata__", ()) for a in
                                              typing.get_args(field.annotation)):
            found.append((key,))
        for inner in typing.get_args(field.annotation) or (field.annotation,):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                found += [(key, *sub) for sub in path_keys(inner)]
    return found


@dataclass(frozen=True)
class Port:
    name: str
    type: type
    required: bool

    @property
    def from_runtime(self) -> bool:
        return self.type in RUNTIME_INPUTS


@dataclass(frozen=True)
class StageInfo:
    """A registered stage as the compiler and the CLI see it. ``output`` is None for an in-flight
    controller, which has no ``run`` and is attached to a Generate stage, not wired by edges."""

    alias: str
    family: str
    cls: type
    inputs: tuple[Port, ...]
    output: type | None
    origin: str

    @property
    def config(self) -> type[BaseModel]:
        return self.cls.Config

    @property
    def edge_inputs(self) -> tuple[Port, ...]:
        """Inputs that come from other stages (not from the runtime)."""
        return tuple(p for p in self.inputs if not p.from_runtime)

    @property
    def can_end_loop(self) -> bool:
        return has_role(self.cls, EndsLoop)

    @property
    def stateful(self) -> bool:
        return has_role(self.cls, Stateful)

    @property
    def owns_files(self) -> bool:
        return has_role(self.cls, OwnsFiles)

    @property
    def observes(self) -> bool:
        return has_role(self.cls, Observes)

    @property
    def in_flight(self) -> bool:
        """An in-flight controller: attached to a Generate stage's ``in_flight`` list."""
        return has_role(self.cls, InFlightController) and not callable(getattr(self.cls, "run", None))

    @property
    def hosts_in_flight(self) -> bool:
        return has_role(self.cls, HostsInFlight)

    @property
    def output_name(self) -> str:
        return self.output.__name__ if self.output is not None else "in flight"

    @property
    def testing(self) -> bool:
        return bool(getattr(self.cls, "testing", False))

    @property
    def summary(self) -> str:
        return (inspect.getdoc(self.cls) or "").split("\n\n")[0].replace("\n", " ")

    def to_json(self) -> dict[str, Any]:
        return {
            "alias": self.alias,
            "family": self.family,
            "summary": self.summary,
            "inputs": [{"name": p.name, "type": p.type.__name__, "required": p.required,
                        "from_runtime": p.from_runtime} for p in self.inputs],
            "output": self.output_name,
            "can_end_loop": self.can_end_loop,
            "stateful": self.stateful,
            "owns_files": self.owns_files,
            "observes": self.observes,
            "in_flight": self.in_flight,
            "hosts_in_flight": self.hosts_in_flight,
            "testing": self.testing,
            "origin": self.origin,
            "config": self.config.model_json_schema(),
        }


def _port_type(annotation: Any) -> tuple[type | None, bool]:
    """(port type, optional) of an annotation such as ``RolloutGroups | None``."""
    args = typing.get_args(annotation)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else None), True
    return (annotation if isinstance(annotation, type) else None), False


@functools.lru_cache(maxsize=None)
def _ports(cls: type) -> tuple[tuple[Port, ...], type]:
    where = f"{cls.__module__}.{cls.__qualname__}"
    run = getattr(cls, "run", None)
    if not callable(run):
        raise RegistryError(f"stage class {where} has no `run` method", "define `def run(self, ...) -> PortType`")
    try:
        hints = typing.get_type_hints(run)
    except Exception as exc:  # unresolvable forward references
        raise RegistryError(f"the annotations of {where}.run cannot be resolved: {exc}",
                            "import the record types the annotations name") from exc
    allowed = ", ".join(t.__name__ for t in PORT_TYPES)
    runtime = ", ".join(t.__name__ for t in RUNTIME_INPUTS)
    inputs = []
    for name, param in list(inspect.signature(run).parameters.items())[1:]:
        if name not in hints:
            raise RegistryError(f"{where}.run: parameter `{name}` has no type annotation",
                                f"annotate it with a port type ({allowed}) or a runtime input ({runtime})")
        ptype, optional = _port_type(hints[name])
        if ptype not in PORT_TYPES + RUNTIME_INPUTS:
            raise RegistryError(f"{where}.run: parameter `{name}` is annotated {hints[name]!r}, not a port type",
                                f"use one of {allowed}, or a runtime input ({runtime})")
        inputs.append(Port(name, ptype, required=not (optional and param.default is None)))
    output = hints.get("return")
    if output not in PORT_TYPES:
        raise RegistryError(f"{where}.run must be annotated to return a port type, not {output!r}",
                            f"annotate the return with one of {allowed}")
    return tuple(inputs), output


def describe_stage(alias: str, cls: type, origin: str) -> StageInfo:
    """Check ``cls`` against the stage contract and describe it; RegistryError if it breaks it."""
    family = alias.partition(".")[0]
    if family not in FAMILIES or "." not in alias:
        raise RegistryError(f"stage alias `{alias}` must be `<family>.<name>` with a family in {FAMILIES}",
                            "rename the alias, e.g. `filter.my_filter`")
    config = getattr(cls, "Config", None)
    if not (isinstance(config, type) and issubclass(config, BaseModel)):
        raise RegistryError(f"stage `{alias}` ({cls.__qualname__}) has no pydantic `Config` class",
                            "add `class Config(StageConfig): ...` inside the stage class")
    if config.model_config.get("extra") != "forbid" or not config.model_config.get("frozen"):
        raise RegistryError(f"stage `{alias}`: its Config must be frozen and forbid unknown keys",
                            "subclass gfcr.registry.StageConfig")
    check_lifecycle_names(alias, cls)
    if has_role(cls, InFlightController) or callable(getattr(cls, "steer", None)):
        return _describe_controller(alias, family, cls, origin)
    inputs, output = _ports(cls)
    for port in inputs:
        families = FAMILY_ONLY_INPUTS.get(port.type)
        if families is not None and family not in families:
            raise RegistryError(f"stage `{alias}`: input `{port.name}: {port.type.__name__}` is a Replay port that "
                                f"only {' or '.join(families)} stages take",
                                f"remove the input, or register the class as a {families[0]} stage")
    if output not in FAMILY_OUTPUTS[family]:
        expected = " or ".join(t.__name__ for t in FAMILY_OUTPUTS[family])
        raise RegistryError(f"stage `{alias}` returns {output.__name__}, but {family} stages return {expected}",
                            "fix the return annotation, or register the class under the right family")
    return StageInfo(alias, family, cls, inputs, output, origin)


def _describe_controller(alias: str, family: str, cls: type, origin: str) -> StageInfo:
    """An in-flight controller: ``every`` and ``steer``, no ``run``, in the Control family."""
    where = f"stage `{alias}` ({cls.__qualname__})"
    if family != "control":
        raise RegistryError(f"{where} is an in-flight controller (it has `steer`), but it is registered as a "
                            f"{family} stage", f"register it as `control.{alias.partition('.')[2]}`")
    if callable(getattr(cls, "run", None)):
        raise RegistryError(f"{where} has both `steer` and `run`: an in-flight controller is attached to a "
                            "generate stage and never runs as a node", "remove `run`, or split it into two stages")
    if not has_role(cls, InFlightController):
        raise RegistryError(f"{where} has `steer` but does not declare `every`",
                            "declare `every: int` on the class (how many decode steps between `steer` calls)")
    return StageInfo(alias, family, cls, (), None, origin)
