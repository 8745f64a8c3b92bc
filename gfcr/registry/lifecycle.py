"""The stage lifecycle: one Protocol per role a stage may play, and how a class's roles are read.

A stage implements ``Stage`` (a ``Config`` and a typed ``run``) and any subset of the roles
below; the runtime calls each role's methods at fixed points of a run:

==================  ========================================  ===========================================
role                methods                                   called by the runtime
==================  ========================================  ===========================================
SetsUp              ``setup(lent)``                           once, after the stages are built
BeforeStep          ``before_step(ctx)``                      at the start of every step
Observes            ``observe(report)``                       after every step's update
ReportsMetrics      ``step_metrics() -> {name: number}``      after every step's update, before ``observe``
Stateful            ``state_dict()``, ``load_state_dict(s)``  when checkpointing / resuming
OwnsFiles           ``save_files(dir)``, ``load_files(dir)``  with the checkpoint, in the stage's own subdir
EndsLoop            ``done() -> bool``                        after each round, as a loop block's until stage
Trains              ``prepare``, ``train_shard``, ``finish``  by the runtime's trainer, for the update node
OwnsStore           ``owned_store() -> store``                once, lent to the stages that name its owner
InFlightController  ``every``, ``steer(view) -> Steer``       by the engine, every ``every`` decode steps
HostsInFlight       ``attach_in_flight(controllers)``         once, before setup, with its ``in_flight`` stages
HandsOverGroups     ``hand_over(sink)``                       around a streamed generate call (``stream_groups``)
ChecksPipeline      ``check_pipeline(config, view)``          by the compiler (``gfcr validate``), static
NeedsOfUpdate       ``update_needs(config) -> [UpdateNeed]``  by the compiler, for the update's check, static
==================  ========================================  ===========================================

An in-flight controller is a Control-family stage without ``run``: it never runs as a node
of the plan; its host (a Generate stage) hands it to the engine.

Parameters are typed loosely here (``Any``): the registry layer imports neither torch nor
``gfcr.stages``; the precise types (``Lent``, ``InFlightView``, ``Steer``) live in
``gfcr.stages.resources``, and ``TrainBatch`` and ``Ranks`` in ``gfcr.stages.training``.

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
    def setup(self, lent: Any) -> None: ...  # gfcr.stages.resources.Lent


@runtime_checkable
class Trains(Protocol):
    """An update that decides and leaves the moving to the runtime: ``prepare(*inputs)`` (its
    ``run``'s inputs) gives the batch (``gfcr.stages.training.TrainBatch``, or a skip),
    ``train_shard`` computes one shard's gradients and steps the optimizer, ``finish(batch,
    outcomes)`` gives the ``UpdateReport``. The runtime's trainer calls them, in this process or
    over trainer ranks, then bumps the policy version and moves the weights to the engine; the
    runner never calls ``run`` on such a stage."""

    def prepare(self, *inputs: Any) -> Any: ...
    def train_shard(self, shard: Any, plan: Any, version: int, ranks: Any) -> Any: ...  # gfcr.stages.training.Ranks
    def finish(self, batch: Any, outcomes: Any) -> Any: ...


@runtime_checkable
class TrainsSharded(Protocol):
    """A ``Trains`` update that can step with the policy's parameters sharded over the trainer ranks
    (``resources: {sharding: fsdp2}`` on the update; ``gfcr.runtime.training.sharding``): a
    staticmethod ``sharding_problems(config) -> [problem]`` names what its Config asks for that
    sharded ranks cannot do (each a ``PipelineProblem`` on a key under the update's ``with``). The
    stage's ``train_shard`` then honours ``Ranks.sharded``: the policy's gradients are reduced by the
    model in each backward pass, and every rank runs as many forward and backward passes as the
    busiest (``Ranks.most``). An update without it is refused with ``sharding: fsdp2``."""

    @staticmethod
    def sharding_problems(config: Any) -> Sequence[PipelineProblem]: ...


@runtime_checkable
class OwnsStore(Protocol):
    """A stage that owns a store other stages read (``replay.store``). The runtime lends
    ``owned_store`` (not the stage) to the stages, through ``Lent.require_store``."""

    def owned_store(self) -> Any: ...


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
class HandsOverGroups(Protocol):
    """A Generate stage that hands each group over as soon as every row of it has ended, while the
    engine goes on decoding the others: before a call the runtime gives it ``sink`` (a function of
    one ``RolloutGroup``, which must not block), after the call None. It hands each group once, the
    object it then returns in its output; a group it does not hand over is walked after the call
    (``lifecycle: {stream_groups: true}``, docs/async.md)."""

    def hand_over(self, sink: Any) -> None: ...  # Callable[[RolloutGroup], None] | None


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


def _is_member(name: str, protocol: type) -> bool:
    """A method a capability Protocol declares (its data members are its annotations)."""
    return not name.startswith("_") and callable(vars(protocol)[name])


# --- capabilities: what a stage's Config says it is, for the other stages' checks ---------------------
#
# A stage never asks which alias another stage has. Where a check needs to know what the stages
# around it do ("does any generator record entropies?", "what group size is fixed upstream?"), it
# asks ``PipelineView.having(Capability)`` for the stages whose Config declares that capability:
# a property (or field, or ClassVar) of the Config under the capability's name. Registration
# refuses a Config name that is a near miss of one (``record_entropy``), as for the lifecycle.


@runtime_checkable
class PicksBatch(Protocol):
    """A selector that draws ``batch_size`` prompts a step from the pool (``gfcr validate``
    checks the data can give that many)."""

    batch_size: int


@runtime_checkable
class SteersItsEngineCalls(Protocol):
    """Calls the engine itself with an in-flight controller of its own (``filter.judge``'s deadline),
    which the Ray executor's engine replicas cannot take: ``gfcr validate`` refuses it there."""

    steers_engine_calls: bool


@runtime_checkable
class LoadsModels(Protocol):
    """Loads models of its own besides the policy (``filter.judge``'s judge): ``models_loaded()``
    gives ``(key under with, model alias or folder)`` for each, which ``gfcr validate`` looks up
    as it does ``policy.model``, without loading anything."""

    def models_loaded(self) -> tuple[tuple[str, str], ...]: ...


@runtime_checkable
class LoadsRewardModels(Protocol):
    """Scores with a discriminative reward model of its own (``filter.reward_model``):
    ``reward_models_loaded()`` gives ``(key under with, folder, label)`` for each, which ``gfcr validate``
    checks from the folder's config.json (there, with a sequence-classification head), loading nothing."""

    def reward_models_loaded(self) -> tuple[tuple[str, str, int], ...]: ...


@runtime_checkable
class FixesGroupSize(Protocol):
    """Allocates the same ``rollouts_per_prompt`` to every prompt it keeps (``control.fixed_n``,
    ``control.mc_grpo``'s G + 1); ``group_size_setting(n)`` is the ``key=value`` of its ``with``
    that makes it allocate ``n`` (for a fix: ``n=8``, ``g=7``)."""

    rollouts_per_prompt: int

    def group_size_setting(self, n: int) -> str: ...


@runtime_checkable
class SizesEachGroup(Protocol):
    """Sets each prompt's group size itself, prompt by prompt (an allocator: DARS, XRPO, CoBA ...);
    a fixed size after it would undo its allocation."""

    sizes_each_group: bool


@runtime_checkable
class RecordsEntropy(Protocol):
    """A generator whose rollouts carry per-token entropies when ``records_entropy`` is true."""

    records_entropy: bool


@runtime_checkable
class MarksCorrect(Protocol):
    """Writes ``Rollout.correct`` (a verifier)."""

    marks_correct: bool


@runtime_checkable
class ReadsRewards(Protocol):
    """Reads each rollout's reward or verdict (a filter on reward variance, an advantage
    estimator), which only a stage that scores rollouts (``MarksCorrect``) upstream of it
    writes: ``UPSTREAM_NEEDS`` has ``gfcr validate`` refuse the pipeline without one."""

    reads_rewards: bool


@runtime_checkable
class DropsFinishes(Protocol):
    """Drops the rollouts whose finish reason is in ``dropped_finishes`` from their groups."""

    dropped_finishes: frozenset[str]


@runtime_checkable
class BuildsTrees(Protocol):
    """Generates tree groups (``RolloutGroup.tree``), which tree advantages read."""

    builds_trees: bool


@runtime_checkable
class ServesStore(Protocol):
    """A replay store other stages may name as their pool (``replay.store``)."""

    serves_store: bool


@runtime_checkable
class ReplaysFresh(Protocol):
    """Replays groups so that ``replays_fresh_fraction`` of the batch is fresh (DOTS's rollout
    replay), a fraction a selector of fresh prompts must agree with."""

    replays_fresh_fraction: float


@runtime_checkable
class EstimatesAdvantages(Protocol):
    """An update whose Config names its advantage estimator (``update.grpo``'s ``advantage``:
    a component spec with ``use`` and ``with_``)."""

    advantage: Any


@runtime_checkable
class NeedsOfEngine(Protocol):
    """Needs something of the policy's engine that not every engine has: ``engine_needs`` names
    each need (``top_p``: nucleus sampling with untruncated behaviour log-probabilities), as the
    engines' table ``gfcr.spec.models.ENGINE_LACKS`` spells them. ``gfcr validate`` refuses a
    stage whose needs ``policy.engine`` lacks."""

    engine_needs: frozenset[str]


@runtime_checkable
class PerGroup(Protocol):
    """A per-group map: its work on a step's groups is its work on each group alone. Its output on
    the step's groups is the concatenation of its outputs on each group, whichever order they come
    in, and nothing it reports (``step_metrics``, state, lineage) depends on how the step was split:
    no state across the step's groups, no statistic of the batch, no draw that depends on the batch.
    Under ``lifecycle: {stream_groups: true}`` the runtime runs such a stage, when it directly
    follows a generate stage, on each group as generation hands it over (docs/async.md)."""

    per_group: bool


@runtime_checkable
class NeedsSyncLifecycle(Protocol):
    """Needs the synchronous lifecycle: ``sync_only`` says why (a clause, "forwards the trained
    policy itself ..."). Under ``lifecycle: {mode: pipelined}`` or ``{mode: async}`` the update
    trains while generation runs, so such a stage would read a model that is changing under it,
    or decide on a batch that is no longer one version's; ``gfcr validate`` refuses it there."""

    sync_only: str


@runtime_checkable
class DeclaresCorrection(Protocol):
    """An update that says how it takes stale tokens: ``declared_correction()`` is the off-policy
    correction the pipeline's author chose (``tis``, ``decoupled_clip``, ... or ``none`` written
    out), None where the author left the default. A lifecycle whose staleness can be above 0
    needs a declared one (``gfcr validate``): never a silent on-policy ratio."""

    def declared_correction(self) -> str | None: ...


@dataclass(frozen=True)
class UpstreamNeed:
    """A stage whose Config declares ``needs`` reads what only a stage declaring ``provider``
    makes, so one must be upstream of it (``gfcr validate`` checks each path into it, feedback
    edges left out): ``what`` says what it reads, ``fix`` how to give it (``{stage}`` is the
    stage's id, ``{generator}`` the nearest generate stage upstream of it)."""

    needs: type
    provider: type
    what: str
    fix: str


UPSTREAM_NEEDS: tuple[UpstreamNeed, ...] = (
    UpstreamNeed(ReadsRewards, MarksCorrect, "reads the rollouts' rewards, but no stage upstream of it scores them",
                 "put a verifier between generation and `{stage}`: `reward: {{use: filter.verify, from: {generator}}}`, "
                 "then `from: reward` on `{stage}`"),
)


# --- what a data source (``DATA_SOURCES``) may offer ``gfcr validate`` ----------------------------------


@runtime_checkable
class ChecksRows(Protocol):
    """A data source that checks its rows cheaply before a run (file and line of each bad row)."""

    def check(self, on_error: str) -> list[Any]: ...  # [gfcr.errors.Problem]


@dataclass(frozen=True)
class HostNote:
    """What a data source's prompts need of this machine and do not get: the Config key it is about, what,
    the fix, and whether the run cannot go on here (``error``) or goes on with less (a warning)."""

    key: str
    message: str
    fix: str
    error: bool = False


@runtime_checkable
class ChecksHost(Protocol):
    """A data source whose prompts need something of this machine (the ``code`` verifier's sandbox),
    checked cheaply before a run."""

    def check_host(self) -> list[HostNote]: ...


@runtime_checkable
class CountsPrompts(Protocol):
    """A data source that counts its prompts up to ``limit`` (None when it cannot say cheaply)."""

    def count_prompts(self, limit: int) -> int | None: ...


CAPABILITIES: tuple[type, ...] = (PicksBatch, FixesGroupSize, SizesEachGroup, RecordsEntropy, MarksCorrect,
                                  ReadsRewards, DropsFinishes, BuildsTrees, ServesStore, ReplaysFresh,
                                  EstimatesAdvantages, NeedsOfEngine, NeedsSyncLifecycle, DeclaresCorrection,
                                  LoadsModels, LoadsRewardModels, SteersItsEngineCalls, PerGroup)


def capability_members(capability: type) -> tuple[str, ...]:
    """The names a capability Protocol declares: its data members and its methods."""
    return (*capability.__annotations__, *(n for n in vars(capability) if _is_member(n, capability)))


def declares(config: type, capability: type) -> bool:
    """Whether the Config class ``config`` declares ``capability`` (a field, property, ClassVar or
    method of each of its names). ``isinstance(config_instance, capability)`` says the same of an
    instance; ``issubclass`` cannot, for a Protocol with data members."""
    fields = getattr(config, "model_fields", {})
    return all(name in fields or hasattr(config, name) for name in capability_members(capability))


CAPABILITY_NAMES: frozenset[str] = frozenset(
    name for cap in CAPABILITIES for name in capability_members(cap))


ROLES: tuple[type, ...] = (Stage, SetsUp, BeforeStep, Observes, ReportsMetrics, Stateful, OwnsFiles, EndsLoop,
                           InFlightController, HostsInFlight, HandsOverGroups, ChecksPipeline, NeedsOfUpdate,
                           Trains, TrainsSharded, OwnsStore)
METHODS: dict[type, tuple[str, ...]] = {
    Stage: ("run",), SetsUp: ("setup",), BeforeStep: ("before_step",), Observes: ("observe",),
    ReportsMetrics: ("step_metrics",),
    Stateful: ("state_dict", "load_state_dict"), OwnsFiles: ("save_files", "load_files"),
    EndsLoop: ("done",), InFlightController: ("steer",), HostsInFlight: ("attach_in_flight",),
    HandsOverGroups: ("hand_over",),
    ChecksPipeline: ("check_pipeline",), NeedsOfUpdate: ("update_needs",),
    Trains: ("prepare", "train_shard", "finish"), TrainsSharded: ("sharding_problems",),
    OwnsStore: ("owned_store",),
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


def _config_names(config: Any) -> list[str]:
    """Public names a stage's Config defines: its fields, properties, methods and ClassVars
    (pydantic's own and ``StageConfig``'s left out)."""
    own = [k for k in getattr(config, "__mro__", ()) if "__pydantic_fields__" in vars(k)
           and not k.__module__.startswith("pydantic") and k.__name__ != "StageConfig"]
    names = [n for k in own for n in (*vars(k).get("__annotations__", {}), *vars(k))]
    return [n for n in dict.fromkeys(names) if not n.startswith("_") and n != "model_config"]


def refuse_near_misses(names: Sequence[str], known: frozenset[str], what: str) -> None:
    """RegistryError for the first of ``names`` that is not one of the ``known`` names but nearly is
    (difflib ratio >= NEAR_MISS_RATIO): whoever reads ``known`` by exact name would never find it.
    ``what`` starts the message: "stage `x` (X) defines `{name}`, which is not ..." with ``{name}``."""
    for name in names:
        if name in known:
            continue
        match = difflib.get_close_matches(name, known, n=1, cutoff=NEAR_MISS_RATIO)
        if match:
            raise RegistryError(what.format(name=name), f"did you mean `{match[0]}`? Rename it, or make it "
                                f"private (`_{name}`) if it is a helper")


def check_lifecycle_names(alias: str, cls: type) -> None:
    """RegistryError naming the first method of ``cls`` that is a near miss of a lifecycle method,
    or the first name of its Config that is a near miss of a capability."""
    refuse_near_misses(_config_names(vars(cls).get("Config")), CAPABILITY_NAMES,
                       f"stage `{alias}`: its Config defines `{{name}}`, which is not a capability: the other "
                       "stages' checks would never read it")
    refuse_near_misses(_own_methods(cls), LIFECYCLE_NAMES,
                       f"stage `{alias}` ({cls.__qualname__}) defines `{{name}}`, which is not a lifecycle method: "
                       "the runtime would never call it")
