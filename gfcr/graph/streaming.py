"""Groups streamed within a step (``lifecycle: {stream_groups: true}``, docs/async.md): which stages
run on each group as its generate stage hands it over, and what ``gfcr validate`` refuses.

A generate stage's *chain* is the run of plan items that directly follows it in which each stage
declares ``PerGroup`` (its Config's ``per_group``), reads one input, the previous stage's output
(the generate stage's, for the first), and of the runtime only the step's context or the prompt
pool (never ``StepOutputs``, the step so far). The chain stops at the first item that is none of
these: a whole-batch filter, a Control stage, a loop block, the update.

Refused with ``stream_groups`` (each with the fix):

- a generate stage whose chain is empty (the stage after it is not per-group, or reads more than
  its output): nothing would stream;
- a generate stage that cannot hand groups over (no ``hand_over``: ``HandsOverGroups``);
- a generate stage inside a loop block (not streamed yet);
- the Ray executor: its engine replicas return a step's generation whole (the engines in this
  process, transformers, vLLM and the fake one, hand groups over).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

from gfcr.graph.model import LoopBlock, Node, PlanItem
from gfcr.records import PromptPool, StepContext
from gfcr.registry import HandsOverGroups, PerGroup, has_role
from gfcr.spec import UPDATE_ID, PipelineSpec

KEY = ("lifecycle", "stream_groups")
OFF = "remove `lifecycle.stream_groups` (the default is `false`: the stages start when generation has returned)"
STREAMED_INPUTS = (StepContext, PromptPool)  # what a streamed stage may read of the runtime


def group_chains(plan: Sequence[PlanItem], nodes: Mapping[str, Node]) -> dict[str, tuple[str, ...]]:
    """Each top-level generate stage of ``plan`` -> the ids of its chain (see the module docstring)."""
    chains: dict[str, tuple[str, ...]] = {}
    for i, item in enumerate(plan):
        if isinstance(item, LoopBlock) or nodes[item].info.family != "generate":
            continue
        chain = [item]
        for after in plan[i + 1:]:
            if isinstance(after, LoopBlock) or why_not_streamed(nodes[after], chain[-1]) is not None:
                break
            chain.append(after)
        chains[item] = tuple(chain[1:])
    return chains


def why_not_streamed(node: Node, previous: str) -> str | None:
    """Why ``node`` cannot run on each group of ``previous``'s output alone (a clause), or None."""
    if not isinstance(node.config, PerGroup) or not node.config.per_group:
        return "is not a per-group stage (its Config does not declare `per_group`: it may read the whole batch)"
    if [b.source for b in node.bindings] != [previous] or any(b.feedback for b in node.bindings):
        return f"reads more than the output of `{previous}`"
    runtime = [p.name for p in node.runtime_inputs if p.type not in STREAMED_INPUTS]
    if runtime:
        return f"reads the step's outputs so far (`{runtime[0]}`)"
    return None


def streaming_problems(spec: PipelineSpec, plan: Sequence[PlanItem],
                       nodes: Mapping[str, Node]) -> Iterator[tuple[tuple, str, str]]:
    """``(path, message, fix)`` for each reason ``lifecycle.stream_groups`` cannot hold here."""
    if not spec.lifecycle.stream_groups:
        return
    if spec.executor.kind == "ray":
        yield (KEY, "`lifecycle.stream_groups` hands groups to the filters within a generate call, and the Ray "
                    "executor's engine replicas return a step's generation whole",
               OFF + ", or use `executor: {kind: local}` or `prefect`")
    for item in plan:
        if isinstance(item, LoopBlock):
            for sid in (s for s in item.body if nodes[s].info.family == "generate"):
                yield (("stages", sid, "use"), f"`{sid}` is in the loop block `{item.name}`, and `lifecycle."
                                               "stream_groups` streams only generate stages outside loop blocks so far",
                       OFF)
    chains = group_chains(plan, nodes)
    for sid, chain in chains.items():
        yield from _generate_problems(sid, chain, plan, nodes)


def _generate_problems(sid: str, chain: tuple[str, ...], plan: Sequence[PlanItem],
                       nodes: Mapping[str, Node]) -> Iterator[tuple[tuple, str, str]]:
    alias = nodes[sid].info.alias
    if not has_role(nodes[sid].info.cls, HandsOverGroups):
        yield (("stages", sid, "use"), f"`{sid}` ({alias}) cannot hand its groups over as they finish (it has no "
                                       "`hand_over`), so `lifecycle.stream_groups` has nothing to stream",
               OFF + ", or use `generate.sample`")
    if chain:
        return
    after = _next_stage(sid, plan)
    if after is None:
        yield (KEY, f"no stage runs on the groups of `{sid}` directly after it, so `lifecycle.stream_groups` has "
                    "nothing to stream", OFF)
        return
    path = (UPDATE_ID, "use") if after == UPDATE_ID else ("stages", after, "use")
    why = why_not_streamed(nodes[after], sid)
    yield (path, f"`{after}` ({nodes[after].info.alias}) runs directly after `{sid}` and {why}, so "
                 "`lifecycle.stream_groups` has nothing to stream",
           OFF + f", or put a per-group stage (`filter.verify`, `filter.finish_reason`, ...) directly after `{sid}`")


def _next_stage(sid: str, plan: Sequence[PlanItem]) -> Any:
    """The plan's next top-level stage after ``sid`` (None at a loop block or the end)."""
    i = list(plan).index(sid)
    after = plan[i + 1] if i + 1 < len(plan) else None
    return after if isinstance(after, str) else None
