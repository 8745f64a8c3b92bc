"""The stage lifecycle: one Protocol per role a stage may play, and how a class's roles are read.

A stage implements ``Stage`` (a ``Config`` and a typed ``run``) and any subset of the roles
below; the runtime calls each role's methods at fixed points of a run:

==================  ========================================  ===========================================
role                methods                                   called by the runtime
==================  ========================================  ===========================================
SetsUp              ``setup(resources)``                      once, after the stages are built
BeforeStep          ``before_step(ctx)``                      at the start of every step
Observes            ``observe(report)``                       after every step's update
ReportsMetrics      ``step_metrics() -> {name: number}``      after every step's update, before ``observe``
Stateful            ``state_dict()``, ``load_state_dict(s)``  when checkpointing / resuming
OwnsFiles           ``save_files(dir)``, ``load_files(dir)``  with the checkpoint, in the stage's own subdir
EndsLoop            ``done() -> bool``                        after each round, as a loop block's until stage
InFlightController  ``every``, ``steer(view) -> Steer``       by the engine, every ``every`` decode steps
HostsInFlight       ``attach_in_flight(controllers)``         once, before setup, with its ``in_flight`` stages
ChecksPipeline      ``check_pipeline(config, view)``          by the compiler (``gfcr validate``), static
NeedsOfUpdate       ``update_needs(config) -> [UpdateNeed]``  by the compiler, for the update's check, static
==================  ========================================  ===========================================

An in-flight controller is a Control-family stage without ``run``: it never runs as a node
of the plan; its host (a Generate stage) hands it to the engine.

Parameters are typed loosely here (``Any``): the registry layer imports neither torch nor
``gfcr.stages``; the precise engine types (``Resources``, ``InFlightView``, ``Steer``) live in
``gfcr.stages.resources``.

Registration rejects a method whose name is a near miss of a lifecycle name (``observer``,
``load_state``, ``setup_``): the runtime would silently never call it.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Sequence, runtime_checkable

from gfcr.errors import RegistryError


@dataclass(frozen=True)
class PipelineProblem:
    """One requirement a stage (or an update component) puts on the pipeline around it that
    the pipeline does not meet: the key path under the stage's ``with`` it is about, what is
    wrong, and how to fix it. ``gfcr validate`` reports it with the file and line of that key."""

    key: tuple[str, ...]
    message: str
    fix: str


@runtime_checkable
class Stage(Protocol):
    """Every stage but an in-flight controller: a pydantic ``Config`` and a typed ``run``."""

    Config: ClassVar[type]

    def run(self, *args: Any, **kwargs: Any) -> Any: ...


@runtime_checkable
class SetsUp(Protocol):
    def setup(self, resources: Any) -> None: ...  # gfcr.stages.resources.Resources


@runtime_checkable
class BeforeStep(Protocol):
    def before_step(self, ctx: Any) -> None: ...  # gfcr.records.StepContext (frozen)


@runtime_checkable
class Observes(Protocol):
    def observe(self, report: Any) -> None: ...  # gfcr.records.StepReport


@runtime_checkable
class ReportsMetrics(Protocol):
    """Numbers the stage reports per step (``metrics.jsonl`` under ``stages.<id>``, and MLflow).
    They must be deterministic for a seeded run: clock readings do not belong here."""

    def step_metrics(self) -> dict[str, float]: ...


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class OwnsFiles(Protocol):
    def save_files(self, directory: Path) -> None: ...
    def load_files(self, directory: Path) -> None: ...


@runtime_checkable
class EndsLoop(Protocol):
    def done(self) -> bool: ...


@runtime_checkable
class InFlightController(Protocol):
    every: int  # the engine calls ``steer`` every ``every`` decode steps

    def steer(self, view: Any) -> Any: ...  # InFlightView -> Steer (gfcr.stages.resources)


@runtime_checkable
class HostsInFlight(Protocol):
    def attach_in_flight(self, controllers: Sequence[Any]) -> None: ...  # Sequence[InFlightController]


@runtime_checkable
class ChecksPipeline(Protocol):
    """A staticmethod ``check_pipeline(config, view) -> [problem]``: requirements the stage's
    Config puts on the rest of the pipeline (``view`` is ``gfcr.graph.model.PipelineView``;
    each problem a ``PipelineProblem``)."""

    @staticmethod
    def check_pipeline(config: Any, view: Any) -> Sequence[PipelineProblem]: ...


@dataclass(frozen=True)
class UpdateNeed:
    """What a stage's Config needs of the update downstream of it: the update's component ``key``
    (``correction``) must be one of ``allowed``, because the stage ``why`` (a clause: "replays
    groups sampled by earlier policies")."""

    key: str
    allowed: tuple[str, ...]
    why: str


@runtime_checkable
class NeedsOfUpdate(Protocol):
    """A staticmethod ``update_needs(config) -> [UpdateNeed]``: what the stage, configured so,
    needs of the update (``replay.rollout_replay``: the ``decoupled_clip`` correction). The
    compiler hands the upstream stages' needs to the update's ``check_pipeline``
    (``PipelineView.update_needs``), which reports those its components do not meet."""

    @staticmethod
    def update_needs(config: Any) -> Sequence[UpdateNeed]: ...


ROLES: tuple[type, ...] = (Stage, SetsUp, BeforeStep, Observes, ReportsMetrics, Stateful, OwnsFiles, EndsLoop,
                           InFlightController, HostsInFlight, ChecksPipeline, NeedsOfUpdate)
METHODS: dict[type, tuple[str, ...]] = {
    Stage: ("run",), SetsUp: ("setup",), BeforeStep: ("before_step",), Observes: ("observe",),
    ReportsMetrics: ("step_metrics",),
    Stateful: ("state_dict", "load_state_dict"), OwnsFiles: ("save_files", "load_files"),
    EndsLoop: ("done",), InFlightController: ("steer",), HostsInFlight: ("attach_in_flight",),
    ChecksPipeline: ("check_pipeline",), NeedsOfUpdate: ("update_needs",),
}
LIFECYCLE_NAMES: frozenset[str] = frozenset(m for names in METHODS.values() for m in names)
NEAR_MISS_RATIO = 0.8  # observer/observe 0.93, load_state/load_state_dict 0.8, observe_groups/observe 0.67


def has_role(cls: type, role: type) -> bool:
    """Whether the class ``cls`` implements ``role`` (its methods are defined and callable).

    ``issubclass`` cannot test a protocol with data members (``every``); this reads the
    methods, and an in-flight controller's ``every`` must be declared on the class
    (``every: int`` or a property)."""
    if not all(callable(getattr(cls, m, None)) for m in METHODS[role]):
        return False
    if role is InFlightController:
        return _declares(cls, "every")
    if role is Stage:
        return isinstance(getattr(cls, "Config", None), type)
    return True


def _declares(cls: type, name: str) -> bool:
    return hasattr(cls, name) or any(name in getattr(k, "__annotations__", {}) for k in cls.__mro__)


def _own_methods(cls: type) -> list[str]:
    """Public callables and properties the class (not ``object``) defines, nested classes excluded."""
    names = []
    for klass in cls.__mro__:
        if klass is object:
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or isinstance(value, type):
                continue
            if callable(value) or isinstance(value, (property, classmethod, staticmethod)):
                names.append(name)
    return list(dict.fromkeys(names))


def check_lifecycle_names(alias: str, cls: type) -> None:
    """RegistryError naming the first method of ``cls`` that is a near miss of a lifecycle method."""
    for name in _own_methods(cls):
        if name in LIFECYCLE_NAMES:
            continue
        match = difflib.get_close_matches(name, LIFECYCLE_NAMES, n=1, cutoff=NEAR_MISS_RATIO)
        if match:
            raise RegistryError(
                f"stage `{alias}` ({cls.__qualname__}) defines `{name}`, which is not a lifecycle method: "
                f"the runtime would never call it",
                f"did you mean `{match[0]}`? Rename it, or make it private (`_{name}`) if it is a helper")
