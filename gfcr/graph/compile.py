"""Compile a ``PipelineSpec`` into a type-checked graph and an execution plan.

Every problem is collected and raised together as one ``GraphError``: unknown stages,
stage configs that do not validate, inputs left unbound, edges whose types do not match,
cycles outside loop blocks, loop blocks that cannot end, outputs nobody reads, in-flight
controllers that are not attached to exactly one generate stage that can host them, stages
that need of the engine what ``policy.engine`` lacks (``ENGINE_LACKS``), engine replicas Ray
cannot place as the spec asks (``gfcr.graph.placement``), groups streamed where they cannot be
(``gfcr.graph.streaming``).

In-flight controllers are nodes of the graph (an ``in flight`` edge to their host) but not
of the plan: they never run; the runtime builds them and attaches them to their host.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path
from typing import Any, Iterable

import networkx as nx
from pydantic import BaseModel, ValidationError

from gfcr.errors import GraphError, Problem, RegistryError, did_you_mean, known
from gfcr.graph.engine_choice import with_engine_chosen
from gfcr.graph.model import Binding, CompiledPipeline, DataBinding, LoopBlock, Node, PipelineView, PlanItem
from gfcr.graph.lifecycle import lifecycle_problems
from gfcr.graph.placement import placement_problems, trainer_problems
from gfcr.graph.streaming import streaming_problems
from gfcr.records import StepOutputs
from gfcr.registry import (DATA_SOURCES, STAGES, UPSTREAM_NEEDS, ChecksPipeline, FixesGroupSize, NeedsOfEngine,
                           NeedsOfUpdate, Port, Registry, StageInfo, SteersItsEngineCalls, UpdateNeed, has_role,
                           path_keys, stage_info)
from gfcr.registry.plugins import import_plugin
from gfcr.spec import UPDATE_ID, PipelineSpec, SourceMap, StageSpec, load_spec
from gfcr.spec.loader import check_references
from gfcr.spec.models import ALIAS, ENGINE_LACKS, ENGINE_NEEDS, is_plugin_ref
from gfcr.spec.problems import dotted, problems_from_validation

LOOP_FIX = ("pipelines are acyclic; to repeat stages within a step, list them in a loop block "
            "(`loops: {name: {stages: [...], until: <stage>, max_rounds: N}}`), "
            "where only the until stage may feed back")
IN_FLIGHT_EXAMPLE = ("e.g. `stop: {use: control.stop_at_target, with: {groups: 8}}` with `in_flight: [stop]` "
                     "on the generate stage")


def _stage_path(sid: str) -> tuple:
    """Key path of a node in the spec: ``stages.<id>``, or ``update``."""
    return (UPDATE_ID,) if sid == UPDATE_ID else ("stages", sid)


def _flag(capability: type) -> str:
    """The one member a flag capability (``ReadsRewards``: ``reads_rewards``) declares."""
    return next(iter(capability.__annotations__))


def _update_needs(upstream: list[str], infos: dict[str, StageInfo],
                  configs: dict[str, BaseModel | None]) -> tuple[tuple[str, UpdateNeed], ...]:
    """What the ``upstream`` stages (ids, nearest first) declare they need of the update."""
    return tuple((u, need) for u in upstream if configs.get(u) is not None and has_role(infos[u].cls, NeedsOfUpdate)
                 for need in infos[u].cls.update_needs(configs[u]))


class _Checker:
    """Checks that need the registries but not a valid spec: stage aliases, stage configs and
    data sources. Shared by the compiler and by ``entry_problems`` (schema-failed files)."""

    def __init__(self, source: SourceMap, stages: Registry[type], data_sources: Registry[type]):
        self.source, self.stages, self.data_sources = source, stages, data_sources
        self.problems: list[Problem] = []

    def problem(self, path: tuple, message: str, fix: str | None) -> None:
        self.problems.append(Problem(self.source.locate(path), dotted(path), message, fix))

    def plugins(self, refs: list[Any]) -> None:
        """Import the pipeline's plugins, before its stages are looked up: what they register is
        then known like a built-in."""
        base = Path(self.source.file).parent if self.source.file else None
        for i, ref in enumerate(refs):
            if not isinstance(ref, str) or not is_plugin_ref(ref):
                continue  # the schema reports it
            try:
                import_plugin(ref, base)
            except RegistryError as exc:
                self.problem(("plugins", i), exc.message, exc.fix)

    def stage(self, sid: str, use: str, values: dict[str, Any]) -> tuple[StageInfo, BaseModel | None] | None:
        base = _stage_path(sid)
        try:
            info = stage_info(use, self.stages)
        except RegistryError as exc:
            self.problem(base + ("use",), exc.message, exc.fix)
            return None
        if sid == UPDATE_ID and info.family != "update":
            self.problem(base + ("use",), f"`{use}` is a {info.family} stage, but `update:` needs an update stage",
                         f"use one of {known(i for i in self.stages.names() if i.startswith('update.'))}")
        elif sid != UPDATE_ID and info.family == "update":
            self.problem(base + ("use",), f"`{use}` is an update stage, which belongs under the top-level "
                                          "`update:` key", "move it to `update:`; a pipeline has one update, at its end")
        return info, self.config(info.config, values, base + ("with",))

    def config(self, config: type[BaseModel], values: dict[str, Any], path: tuple) -> BaseModel | None:
        try:
            return config.model_validate_json(json.dumps(values), strict=True)
        except ValidationError as exc:
            self.problems += problems_from_validation(exc, config, values, self.source, path)
        except TypeError as exc:
            self.problem(path, f"config values must be plain data: {exc}", "use numbers, strings, lists and mappings")
        return None

    def data(self, key: str, name: str, values: dict[str, Any]) -> DataBinding | None:
        try:
            cls = self.data_sources.get(name)
        except RegistryError as exc:
            self.problem((key, "source"), exc.message, exc.fix)
            return None
        config = self.config(cls.Config, values, (key, "with"))
        return DataBinding(name, cls, config) if config is not None else None


def entry_problems(data: Any, source: SourceMap, stages: Registry[type] = STAGES,
                   data_sources: Registry[type] = DATA_SOURCES) -> list[Problem]:
    """Alias, config and data-source problems of raw spec data whose schema did not validate,
    so that they are reported together with the schema's problems."""
    checker = _Checker(source, stages, data_sources)
    if not isinstance(data, dict):
        return []
    if isinstance(data.get("plugins"), list):
        checker.plugins(data["plugins"])
    entries = dict(data["stages"]) if isinstance(data.get("stages"), dict) else {}
    if "update" in data:
        entries[UPDATE_ID] = data["update"]
    for sid, entry in entries.items():
        if isinstance(entry, dict) and isinstance(entry.get("use"), str) and re.match(ALIAS, entry["use"]):
            values = entry.get("with", {})
            checker.stage(str(sid), entry["use"], values if isinstance(values, dict) else {})
    for key in ("data", "eval"):
        entry = data.get(key)
        if isinstance(entry, dict) and isinstance(entry.get("source"), str):
            values = entry.get("with", {})
            checker.data(key, entry["source"], values if isinstance(values, dict) else {})
    return checker.problems


class _Compiler:
    def __init__(self, spec: PipelineSpec, stages: Registry[type], data_sources: Registry[type]):
        self.spec = spec
        self.checker = _Checker(spec.source, stages, data_sources)
        self.problems = self.checker.problems
        self.problem = self.checker.problem
        self.loop_of = {m: name for name, loop in spec.loops.items() for m in loop.stages}
        self.order = {sid: i for i, sid in enumerate(spec.all_stages())}
        # every resolved reference, also those with a type or visibility problem, so that
        # one bad edge does not cascade into "nobody reads this" errors
        self.references: list[tuple[str, str, Binding]] = []

    def resolve_data(self, key: str) -> DataBinding | None:
        data = getattr(self.spec, key)
        binding = None if data is None else self.checker.data(key, data.source, data.with_)
        return None if binding is None else dataclasses.replace(binding, on_error=data.on_error)

    # -- wiring --------------------------------------------------------------------------
    def producers(self, port_type: type, infos: dict[str, StageInfo], exclude: str) -> str:
        names = [s for s, i in infos.items()
                 if i.output is not None and issubclass(i.output, port_type) and s != exclude]
        return f" ({known(names)})" if names else ""

    def pair_inputs(self, sid: str, stage: StageSpec, info: StageInfo) -> list[tuple[Port, str, tuple]]:
        """(input port, upstream id, key path) for each entry of ``from``."""
        inputs, path = info.edge_inputs, _stage_path(sid) + ("from",)
        names = [p.name for p in inputs]
        if isinstance(stage.from_, dict):
            pairs = []
            for name, ref in stage.from_.items():
                port = next((p for p in inputs if p.name == name), None)
                if port is not None:
                    pairs.append((port, ref, path + (name,)))
                elif any(p.name == name for p in info.inputs):
                    self.problem(path + (name,),
                                 f"input `{name}` of `{stage.use}` is fed by the runtime, not by a stage",
                                 f"remove `{name}` from `from`")
                else:
                    self.problem(path + (name,), f"`{stage.use}` has no input `{name}`",
                                 did_you_mean(name, names) or f"its inputs are {known(names) or 'none'}")
            return pairs
        refs = stage.sources()
        if len(refs) > len(inputs):
            self.problem(path, f"`{stage.use}` takes {len(inputs)} input(s) ({known(names) or 'none'}), "
                               f"`from` lists {len(refs)}", "remove the extra upstream stages")
        if isinstance(stage.from_, str):  # one upstream: the first required input
            return [(p, r, path) for p, r in zip(sorted(inputs, key=lambda p: not p.required), refs)]
        return [(p, r, path + (i,)) for i, (p, r) in enumerate(zip(inputs, refs))]

    def bind(self, sid: str, stage: StageSpec, info: StageInfo, infos: dict[str, StageInfo]) -> list[Binding]:
        if info.in_flight:  # no inputs; a `from` is reported by check_controller
            return []
        pairs = self.pair_inputs(sid, stage, info)
        bindings = []
        for port, ref, where in pairs:
            source = self.spec.loops[ref].until if ref in self.spec.loops else ref
            if source not in infos:  # unknown upstream: reported by check_references
                continue
            binding = self.check_edge(sid, port, source, infos, where)
            if binding is not None:
                bindings.append(binding)
            self.references.append((source, sid, binding or Binding(port.name, source, port.type,
                                                                    self.is_feedback(source, sid))))
        bound = {port.name for port, _, _ in pairs}
        for port in info.edge_inputs:
            if port.required and port.name not in bound:
                self.problem(_stage_path(sid) + (("from",) if stage.from_ is not None else ()),
                             f"input `{port.name}: {port.type.__name__}` of `{sid}` ({stage.use}) is not connected",
                             f"add `from: {{{port.name}: <stage>}}` naming a stage that outputs {port.type.__name__}"
                             + self.producers(port.type, infos, sid))
        return bindings

    def check_edge(self, sid: str, port: Port, source: str, infos: dict[str, StageInfo], where: tuple) -> Binding | None:
        src = infos[source]
        if src.output is None:
            self.problem(where, f"`{source}` ({src.alias}) is an in-flight controller: it has no output to read",
                         f"remove it from `from`; attach it to a generate stage with `in_flight: [{source}]`")
            return None
        if not issubclass(src.output, port.type):
            self.problem(where,
                         f"type mismatch: `{sid}` ({infos[sid].alias}) reads input `{port.name}` of type "
                         f"{port.type.__name__}, but `{source}` ({src.alias}) outputs {src.output.__name__}",
                         f"read `{port.name}` from a stage that outputs {port.type.__name__}"
                         + self.producers(port.type, infos, sid))
            return None
        src_loop = self.loop_of.get(source)
        if src_loop is not None and src_loop != self.loop_of.get(sid) and source != self.spec.loops[src_loop].until:
            self.problem(where, f"`{sid}` reads `{source}`, which is inside loop block `{src_loop}`; outside a "
                                f"loop only its until stage `{self.spec.loops[src_loop].until}` is visible",
                         f"read `from: {src_loop}` (the loop's output) instead")
            return None
        return Binding(port.name, source, port.type, self.is_feedback(source, sid))

    def is_feedback(self, source: str, sid: str) -> bool:
        """An edge from a loop's until stage back into the same loop reads the previous round."""
        loop = self.loop_of.get(source)
        return loop is not None and loop == self.loop_of.get(sid) and source == self.spec.loops[loop].until

    # -- in-flight controllers ---------------------------------------------------------------
    def attach_in_flight(self, infos: dict[str, StageInfo]) -> dict[str, str]:
        """Check every ``in_flight`` list and every controller; controller id -> its host id."""
        hosts: dict[str, list[str]] = {}
        for sid, stage in self.spec.all_stages().items():
            info = infos.get(sid)
            if stage.in_flight and info is not None and not info.hosts_in_flight:
                self.problem(_stage_path(sid) + ("in_flight",),
                             f"`{sid}` ({info.alias}) cannot host in-flight controllers: it has no "
                             "`attach_in_flight(controllers)` method",
                             "move `in_flight` to a generate stage that hosts controllers, e.g. `generate.sample`")
            for i, ref in enumerate(stage.in_flight):
                ctrl = infos.get(ref)
                if ctrl is not None and not ctrl.in_flight:
                    self.problem(_stage_path(sid) + ("in_flight", i),
                                 f"`{ref}` ({ctrl.alias}) is not an in-flight controller (no `every` and `steer`)",
                                 f"name a controller stage in `in_flight`, {IN_FLIGHT_EXAMPLE}; "
                                 f"wire `{ref}` with `from` instead")
                elif ctrl is not None:
                    hosts.setdefault(ref, []).append(sid)
        for sid, info in infos.items():
            if info.in_flight:
                self.check_controller(sid, info, hosts.get(sid, []))
        return {c: h[0] for c, h in hosts.items() if len(h) == 1}

    def check_controller(self, sid: str, info: StageInfo, hosts: list[str]) -> None:
        stage, path = self.spec.all_stages()[sid], _stage_path(sid)
        if stage.from_ is not None:
            self.problem(path + ("from",), f"`{sid}` ({info.alias}) is an in-flight controller: it reads what the "
                                           "engine is generating, not another stage's output",
                         "remove `from`; the generate stage that lists it in `in_flight` feeds it")
        if sid in self.loop_of:
            self.problem(path, f"`{sid}` ({info.alias}) is an in-flight controller, inside loop block "
                               f"`{self.loop_of[sid]}`", "remove it from the loop's `stages`; it goes with its host")
        if not hosts:
            self.problem(path, f"`{sid}` ({info.alias}) is an in-flight controller, but no generate stage lists it",
                         f"add `in_flight: [{sid}]` to the generate stage it should steer")
        elif len(hosts) > 1:
            self.problem(path, f"`{sid}` ({info.alias}) is attached to {len(hosts)} generate stages "
                               f"({known(hosts)}); a controller steers one",
                         f"give each generate stage its own controller (a copy of `{sid}` under another id)")

    # -- structure -----------------------------------------------------------------------
    def check_loops(self, infos: dict[str, StageInfo]) -> None:
        for name, loop in self.spec.loops.items():
            info = infos.get(loop.until)
            if info is not None and not info.can_end_loop:
                self.problem(("loops", name, "until"),
                             f"`{loop.until}` ({info.alias}) cannot end a loop: it has no `done()` method",
                             "make the until stage one that decides when enough is collected, "
                             "e.g. `filter.dynamic_sampling` (`gfcr stages` lists them under can_end_loop)")

    def check_cycles(self, graph: nx.MultiDiGraph) -> bool:
        forward = nx.DiGraph([(u, v) for u, v, fb in graph.edges(data="feedback") if not fb])
        forward.add_nodes_from(graph)
        ok = True
        for component in nx.strongly_connected_components(forward):
            if len(component) < 2:
                continue
            ok = False
            members = sorted(component, key=self.order.get)
            cycle = nx.find_cycle(forward.subgraph(component), source=members[0])
            chain = " -> ".join([cycle[0][0]] + [v for _, v in cycle])
            loops = {self.loop_of.get(m) for m in members}
            if len(loops) == 1 and None not in loops:
                message = f"cycle inside loop block `{loops.pop()}` that does not pass through its until stage: {chain}"
            else:
                message = f"cycle outside a loop block: {chain}"
            self.problem(_stage_path(members[0]) + ("from",), message, LOOP_FIX)
        return ok

    def check_outputs(self, graph: nx.MultiDiGraph, infos: dict[str, StageInfo]) -> None:
        for sid in graph:
            readers = [v for _, v, fb in graph.out_edges(sid, data="feedback") if not fb]
            if sid != UPDATE_ID and not readers and not infos[sid].in_flight:
                self.problem(_stage_path(sid), f"the output of `{sid}` is not read by any stage",
                             f"connect it (`from: {sid}` on a later stage, or the update) or remove the stage")

    def check_pipelines(self, graph: nx.MultiDiGraph, infos: dict[str, StageInfo],
                        configs: dict[str, BaseModel | None]) -> None:
        """Each stage's own requirements on the pipeline around it (``check_pipeline``)."""
        for sid, info in infos.items():
            if not has_role(info.cls, ChecksPipeline) or configs.get(sid) is None:
                continue
            for p in info.cls.check_pipeline(configs[sid], self.view(sid, graph, infos, configs)):
                self.problem(_stage_path(sid) + ("with",) + tuple(p.key), p.message, p.fix)

    def check_upstream(self, graph: nx.MultiDiGraph, infos: dict[str, StageInfo],
                       configs: dict[str, BaseModel | None]) -> None:
        """Each stage that reads what only some stages make (``UPSTREAM_NEEDS``: rewards from a
        verifier) has such a stage upstream of it; a stage that ends loops is inside a loop block."""
        lacking: dict[Any, set[str]] = {need: set() for need in UPSTREAM_NEEDS}
        for sid in sorted(configs, key=lambda s: self.order[s]):
            config = configs[sid]
            needs = [n for n in UPSTREAM_NEEDS if isinstance(config, n.needs) and getattr(config, _flag(n.needs))]
            if not needs:
                continue
            view = self.view(sid, graph, infos, configs)
            generator = next(iter(view.in_family("generate", upstream=True)), "<generate stage>")
            for need in needs:
                # the first reader on a path is told; those after it are fixed by the same verifier
                if not view.having(need.provider, upstream=True) and not lacking[need] & {u for u, _ in view.upstream}:
                    lacking[need].add(sid)
                    self.problem(self.upstream_path(sid), f"`{sid}` ({infos[sid].alias}) {need.what}",
                                 need.fix.format(stage=sid, generator=generator))
        for sid, info in infos.items():
            if info.can_end_loop and sid not in self.loop_of:
                self.problem(_stage_path(sid) + ("use",),
                             f"`{sid}` ({info.alias}) ends a loop block (it decides when enough is collected), but it "
                             "is in none: outside a loop it runs once a step and only truncates the batch",
                             self.loop_fix(sid, graph))

    def upstream_path(self, sid: str) -> tuple:
        """Where a missing upstream stage is reported: the stage's ``from``, else the stage."""
        stage = self.spec.all_stages()[sid]
        return _stage_path(sid) + (("from",) if stage.from_ is not None else ())

    def loop_fix(self, sid: str, graph: nx.MultiDiGraph) -> str:
        body = sorted(nx.ancestors(graph, sid) - {UPDATE_ID} | {sid}, key=self.order.get)
        readers = sorted({v for _, v in graph.out_edges(sid)}, key=self.order.get)
        read = f", and `from: collect` on {known(readers)}" if readers else ""
        return (f"make it the until stage of a loop block: `loops: {{collect: {{stages: [{', '.join(body)}], "
                f"until: {sid}, max_rounds: 3}}}}`{read}")

    def check_own_engine_calls(self, configs: dict[str, Any]) -> None:
        """A stage that calls the engine with a controller of its own (``SteersItsEngineCalls``) runs
        in one process with the engine: the Ray executor's replicas take no controller."""
        if self.spec.executor.kind != "ray":
            return
        for sid, config in configs.items():
            if isinstance(config, SteersItsEngineCalls) and config.steers_engine_calls:
                self.problem(_stage_path(sid) + ("use",),
                             f"`{sid}` calls the engine itself with an in-flight controller of its own (a deadline), "
                             "and with `executor: {kind: ray}` the engine is replica actors that take no controller",
                             "run this pipeline with `executor: {kind: prefect}` (or `local`)")

    def check_engine(self, infos: dict[str, StageInfo], configs: dict[str, BaseModel | None]) -> None:
        """Each stage whose Config needs of the engine what ``policy.engine`` lacks, at the key it comes from."""
        if self.spec.policy is None:  # no policy: the stages bring their own (fake) engine
            return
        engine, stages = self.spec.policy.engine, self.spec.all_stages()
        for sid, config in configs.items():
            for need in sorted(config.engine_needs) if isinstance(config, NeedsOfEngine) else ():
                lack = ENGINE_LACKS[engine].get(need)
                if lack is None:
                    continue
                path = _stage_path(sid) + (("with", lack.key) if lack.key in stages[sid].with_ else ())
                self.problem(path, f"`{sid}` ({infos[sid].alias}) needs {ENGINE_NEEDS[need]}, which "
                                   f"`policy.engine: {engine}` cannot give: {lack.why}", lack.fix.format(stage=sid))

    @staticmethod
    def view(sid: str, graph: nx.MultiDiGraph, infos: dict[str, StageInfo],
             configs: dict[str, BaseModel | None]) -> PipelineView:
        upstream, seen, frontier = [], {sid}, [sid]
        while frontier:
            nxt = []
            for node in frontier:
                for u, _, fb in graph.in_edges(node, data="feedback"):
                    if not fb and u not in seen:
                        seen.add(u)
                        upstream.append(u)
                        nxt.append(u)
            frontier = nxt
        fixed = next((u for u in upstream if isinstance(configs.get(u), FixesGroupSize)), None)
        return PipelineView(tuple((u, infos[u].alias) for u in upstream),
                            configs[fixed].rollouts_per_prompt if fixed else None, fixed,
                            {s: info.alias for s, info in infos.items()}, dict(configs),
                            _update_needs(upstream, infos, configs), {s: info.family for s, info in infos.items()})

    def plan(self, graph: nx.MultiDiGraph, infos: dict[str, StageInfo]) -> tuple[PlanItem, ...] | None:
        """Units (stages, loop blocks) in dependency order, ties in the author's order; an ingest
        stage (a ``StepOutputs`` input) as late as its readers allow, so it sees the whole step."""
        runs = [sid for sid in graph if not infos[sid].in_flight]
        unit = {sid: self.loop_of.get(sid, sid) for sid in runs}
        condensed = nx.DiGraph()
        condensed.add_nodes_from(set(unit.values()))
        condensed.add_edges_from((unit[u], unit[v]) for u, v, fb in graph.edges(data="feedback")
                                 if not fb and u in unit and v in unit and unit[u] != unit[v])
        late = len(self.order)  # after every stage the author wrote

        def key(sid: str) -> int:
            return self.order[sid] + (late if any(p.type is StepOutputs for p in infos[sid].inputs) else 0)

        first = {u: min(key(s) for s in runs if unit[s] == u) for u in condensed}
        if not nx.is_directed_acyclic_graph(condensed):
            for name in self.spec.loops:
                if any(name in c and len(c) > 1 for c in nx.strongly_connected_components(condensed)):
                    self.problem(("loops", name), f"loop block `{name}` depends on its own output through "
                                                  "stages outside it", LOOP_FIX)
            return None
        items: list[PlanItem] = []
        for u in nx.lexicographical_topological_sort(condensed, key=first.get):
            if u in self.spec.loops:
                loop = self.spec.loops[u]
                body = graph.subgraph(loop.stages)
                forward = nx.DiGraph([(a, b) for a, b, fb in body.edges(data="feedback") if not fb])
                forward.add_nodes_from(loop.stages)
                order = tuple(nx.lexicographical_topological_sort(forward, key=key))
                items.append(LoopBlock(u, order, loop.until, loop.max_rounds, loop.max_seconds))
            else:
                items.append(u)
        return tuple(items)

    def compile(self) -> CompiledPipeline:
        # specs built in Python skip the loader: check their references here too
        self.problems += check_references(self.spec, self.spec.source)
        self.checker.plugins(self.spec.plugins)
        if self.problems:
            raise GraphError(self.problems)
        all_stages = self.spec.all_stages()
        resolved = {sid: self.checker.stage(sid, s.use, s.with_) for sid, s in all_stages.items()}
        infos = {sid: r[0] for sid, r in resolved.items() if r is not None}
        data, eval_data = self.resolve_data("data"), self.resolve_data("eval")
        configs = {sid: r[1] for sid, r in resolved.items() if r is not None}
        self.spec = with_engine_chosen(self.spec, {need for c in configs.values() if isinstance(c, NeedsOfEngine)
                                                   for need in c.engine_needs})  # `policy.engine: auto`
        self.check_engine(infos, configs)
        for path, message, fix in placement_problems(self.spec):  # `executor: {kind: ray}`
            self.problem(path, message, fix)
        self.check_own_engine_calls(configs)
        if UPDATE_ID in infos:  # the update's trainer ranks
            for path, message, fix in trainer_problems(self.spec, infos[UPDATE_ID].cls,
                                                          configs.get(UPDATE_ID)):
                self.problem(path, message, fix)
        for path, message, fix in lifecycle_problems(self.spec, {sid: info.alias for sid, info in infos.items()},
                                                     {sid: c for sid, c in configs.items() if c is not None}):
            self.problem(path, message, fix)
        bindings = {sid: self.bind(sid, all_stages[sid], info, infos) for sid, info in infos.items()}
        self.check_loops(infos)
        host_of = self.attach_in_flight(infos)
        graph = nx.MultiDiGraph()
        for sid, info in infos.items():
            graph.add_node(sid, family=info.family, use=info.alias, loop=self.loop_of.get(sid))
        for source, sid, b in self.references:
            graph.add_edge(source, sid, param=b.param, type=b.type.__name__, feedback=b.feedback)
        for ctrl, host in host_of.items():
            graph.add_edge(ctrl, host, param="in_flight", type="in flight", feedback=False, in_flight=True)
        plan = None
        if len(infos) == len(all_stages) and self.check_cycles(graph):
            self.check_outputs(graph, infos)
            self.check_pipelines(graph, infos, {sid: r[1] for sid, r in resolved.items() if r is not None})
            self.check_upstream(graph, infos, configs)
            plan = self.plan(graph, infos)
        if self.problems or plan is None or data is None:
            raise GraphError(self.problems)
        order = [s for item in plan for s in (item.body if isinstance(item, LoopBlock) else (item,))]
        order += [sid for sid in all_stages if infos[sid].in_flight]  # built and set up, never run
        nodes = {sid: Node(sid, infos[sid], resolved[sid][1], all_stages[sid], self.loop_of.get(sid),
                           tuple(bindings[sid]), tuple(all_stages[sid].in_flight)) for sid in order}
        for path, message, fix in streaming_problems(self.spec, plan, nodes):  # `lifecycle.stream_groups`
            self.problem(path, message, fix)
        if self.problems:
            raise GraphError(self.problems)
        return CompiledPipeline(self.spec, nodes, plan, graph, data, eval_data)


def compile_pipeline(spec: PipelineSpec, stages: Registry[type] = STAGES,
                     data_sources: Registry[type] = DATA_SOURCES) -> CompiledPipeline:
    """Resolve, validate, wire and type-check ``spec``; raise GraphError with every problem."""
    return _Compiler(spec, stages, data_sources).compile()


def load_pipeline(path: str | Path, overrides: Iterable[str] = (), stages: Registry[type] = STAGES,
                  data_sources: Registry[type] = DATA_SOURCES, plugins: Iterable[str] = ()) -> CompiledPipeline:
    """Read, validate and compile a pipeline file: what ``gfcr validate`` does. ``plugins`` (the
    CLI's ``--plugin``) join the spec's own ``plugins``, so a run directory's spec keeps them.

    When the schema fails, stage names and configs are checked too, so one run of
    ``gfcr validate`` shows both kinds of problems; wiring is checked once the schema holds.
    """
    raw_checks = functools.partial(entry_problems, stages=stages, data_sources=data_sources)
    spec = load_spec(path, overrides, raw_checks=raw_checks, plugins=plugins,
                     config_keys=functools.partial(config_keys, stages=stages),
                     path_keys=functools.partial(declared_paths, stages=stages, data_sources=data_sources))
    return compile_pipeline(spec, stages, data_sources)


def declared_paths(kind: str, name: str, stages: Registry[type] = STAGES,
                   data_sources: Registry[type] = DATA_SOURCES) -> list[tuple[str, ...]]:
    """The ``with`` keys of stage (``kind`` "stage") or data source ("data") ``name`` that hold
    paths (``FilePath`` fields), for ``gfcr.spec.loader.resolve_paths``; none for an unknown name
    (the compiler reports it)."""
    try:
        config = stage_info(name, stages).config if kind == "stage" else data_sources.get(name).Config
    except RegistryError:
        return []
    return path_keys(config)


def config_keys(alias: str, stages: Registry[type] = STAGES) -> frozenset[str] | None:
    """The ``with`` keys stage ``alias`` accepts (None for an alias the registry does not know:
    the compiler reports it), for a stage swap by ``--set`` (``gfcr.spec.overrides``)."""
    try:
        fields = stage_info(alias, stages).config.model_fields
    except RegistryError:
        return None
    return frozenset(f.alias or name for name, f in fields.items())
