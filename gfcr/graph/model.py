"""The compiled pipeline: nodes with validated configs, typed bindings and an execution plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import networkx as nx
from pydantic import BaseModel

from gfcr.registry import Port, StageInfo, UpdateNeed
from gfcr.spec import PipelineSpec, StageSpec


@dataclass(frozen=True)
class Binding:
    """Input ``param`` of a stage reads the output of ``source``. A feedback binding (inside a
    loop block, from its until stage) reads the previous round's output, empty in round 0."""

    param: str
    source: str
    type: type
    feedback: bool = False


@dataclass(frozen=True)
class PipelineView:
    """What a stage's ``check_pipeline`` may read about the pipeline around it.

    ``upstream``: the stages it depends on, ``(id, alias)``, nearest first (breadth-first over
    the edges into it, feedback edges left out); ``rollouts_per_prompt``: the group size fixed
    by the nearest upstream stage whose Config exposes ``rollouts_per_prompt`` (``control.fixed_n``),
    None when none does, and ``rollouts_from`` that stage's id; ``aliases`` and ``configs``: every
    stage's alias and validated Config by id, the update's under ``update`` (a Config is None
    where it did not validate), for a pairing with a stage that is not upstream;
    ``update_needs``: what the upstream stages declare they need of the update (the
    ``NeedsOfUpdate`` role, ``replay.rollout_replay``'s ``decoupled_clip`` correction), as
    ``(id, need)``, nearest first, which the update's own check reads; ``families``: every
    stage's family by id.

    A check asks what the other stages *do* through ``having(Capability)`` (the capabilities of
    ``gfcr.registry.lifecycle``), never which alias they have."""

    upstream: tuple[tuple[str, str], ...]
    rollouts_per_prompt: int | None
    rollouts_from: str | None
    aliases: Mapping[str, str] = field(default_factory=dict)
    configs: Mapping[str, Any] = field(default_factory=dict)
    update_needs: tuple[tuple[str, UpdateNeed], ...] = ()
    families: Mapping[str, str] = field(default_factory=dict)

    def having(self, capability: type, upstream: bool = False) -> list[tuple[str, Any]]:
        """``(id, config)`` of the stages (only those upstream, nearest first, with ``upstream``)
        whose validated Config declares ``capability``."""
        ids = [sid for sid, _ in self.upstream] if upstream else list(self.configs)
        return [(sid, self.configs[sid]) for sid in ids if isinstance(self.configs.get(sid), capability)]

    def in_family(self, family: str, upstream: bool = False) -> list[str]:
        """Ids of the stages of ``family`` (only those upstream, nearest first, with ``upstream``)."""
        ids = [sid for sid, _ in self.upstream] if upstream else list(self.families)
        return [sid for sid in ids if self.families.get(sid) == family]


@dataclass(frozen=True)
class Node:
    id: str
    info: StageInfo
    config: BaseModel
    spec: StageSpec
    loop: str | None
    bindings: tuple[Binding, ...]
    in_flight: tuple[str, ...] = ()  # ids of the in-flight controllers this (generate) stage hosts

    @property
    def runtime_inputs(self) -> tuple[Port, ...]:
        return tuple(p for p in self.info.inputs if p.from_runtime)

    @property
    def runs(self) -> bool:
        """False for an in-flight controller, which is built and attached but is no node of the plan."""
        return not self.info.in_flight


@dataclass(frozen=True)
class LoopBlock:
    """Stages repeated, in ``body`` order, until ``until`` is done, ``max_rounds`` have run, or
    (when set) ``max_seconds`` of wall-clock time have passed in the step's rounds."""

    name: str
    body: tuple[str, ...]
    until: str
    max_rounds: int
    max_seconds: float | None = None


PlanItem = str | LoopBlock


@dataclass(frozen=True)
class DataBinding:
    """A data source resolved from the spec: its class, validated config, and what to do
    with bad rows (``fail``: raise a DataError listing them all; ``skip``: leave them out,
    recorded on ``PromptPool.skipped``)."""

    name: str
    cls: type
    config: BaseModel
    on_error: Literal["fail", "skip"] = "fail"

    def load(self) -> Any:
        return self.cls(self.config).load(on_error=self.on_error)


@dataclass(frozen=True)
class CompiledPipeline:
    spec: PipelineSpec
    nodes: dict[str, Node]  # in plan order, then the in-flight controllers
    plan: tuple[PlanItem, ...]
    graph: nx.MultiDiGraph  # stage ids; edges carry param, type and feedback
    data: DataBinding
    eval: DataBinding | None

    @property
    def loops(self) -> dict[str, LoopBlock]:
        return {item.name: item for item in self.plan if isinstance(item, LoopBlock)}

    def describe_plan(self) -> str:
        """``pick -> budget -> [collect x<=3: rollout (in flight: stop) -> keep -> enough] -> update``."""
        parts = []
        for item in self.plan:
            if isinstance(item, LoopBlock):
                parts.append(f"[{item.name} x<={item.max_rounds}: {' -> '.join(map(self._named, item.body))}]")
            else:
                parts.append(self._named(item))
        return " -> ".join(parts)

    def _named(self, sid: str) -> str:
        hosted = self.nodes[sid].in_flight
        return f"{sid} (in flight: {', '.join(hosted)})" if hosted else sid
