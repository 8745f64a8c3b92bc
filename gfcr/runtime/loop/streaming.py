"""Groups streamed to the per-group stages within a step (``lifecycle: {stream_groups: true}``,
docs/async.md).

A generate stage that ``HandsOverGroups`` gets a sink for its call; each group it hands over
(all its rows ended) goes to a worker thread, which runs the generate stage's *chain*
(``gfcr.graph.streaming.group_chains``: the per-group stages that directly follow it) on that
group alone while the engine decodes the others. When the call returns, the groups it did not
hand over are walked too, the worker is joined, and the step's record is assembled as the barrier
would have left it:

- each chain stage's output is the concatenation of its per-group outputs in the generate
  stage's order (a ``PerGroup`` stage's work on the batch is its work on each group alone);
- who created, dropped and changed what (the runner's ``_stamp``) is stamped per group, in the
  worker, right after each stage ran on it (a stage after it may change the group again), into a
  state of the group's own, then merged stage by stage and group by group, so the step's
  records hold the same entries in the same order as the barrier's;
- the hooks hear ``after_stage`` of the generate stage and then of each chain stage, in plan
  order, once all have run; a chain stage's seconds are the sum of its per-group calls.

An exception in a chain stage ends the worker and is raised, as a ``StageError`` naming that
stage, once the generate call has returned. Under the Prefect runner the generate call is its
task; the chain's per-group calls run in the worker, not as tasks of their own (no retries).
"""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from gfcr.graph import Node
from gfcr.records import RolloutGroup, RolloutGroups

_END = object()  # the queue's last item


@dataclass
class _Stamped:
    """What one stage's ``_stamp`` recorded about one group (and any group it created)."""

    created: dict[str, str] = field(default_factory=dict)
    groups: dict[str, RolloutGroup] = field(default_factory=dict)  # the groups it created
    dropped: dict[str, str] = field(default_factory=dict)
    changed: list[str] = field(default_factory=list)
    added: dict[str, str] = field(default_factory=dict)
    rollout_ids: set[str] = field(default_factory=set)


@dataclass
class _Walked:
    """One group's walk through the chain: each stage's output on it, stamps and seconds."""

    group: RolloutGroup
    outputs: dict[str, RolloutGroups] = field(default_factory=dict)
    stamped: dict[str, _Stamped] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


class ChainWorker:
    """Walks each handed-over group through ``chain`` in a thread of its own."""

    def __init__(self, runner: Any, generate: str, chain: list[Node], state: Any):
        self.runner, self.generate, self.chain, self.state = runner, generate, chain, state
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.walked: dict[str, _Walked] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=contextvars.copy_context().run, args=(self._work,),
                                       name=f"gfcr-stream-{generate}", daemon=True)
        self.thread.start()

    def put(self, group: RolloutGroup) -> None:
        """The generate stage's sink: never blocks."""
        self.queue.put(group)

    def finish(self, output: RolloutGroups) -> list[_Walked]:
        """Walk the groups of ``output`` not handed over, wait for all, and give each group's walk
        in ``output``'s order; raise the first error a chain stage raised."""
        for group in output:
            if not self._walked(group):
                self.put(group)  # a group handed over and still queued is skipped by the worker the 2nd time
        self.close()
        if self.error is not None:
            raise self.error
        return [self.walked[g.group_id] for g in output]

    def close(self) -> None:
        self.queue.put(_END)
        self.thread.join()

    def _walked(self, group: RolloutGroup) -> bool:
        """Whether this very group was walked (a retried generate call hands new groups, same ids)."""
        walked = self.walked.get(group.group_id)
        return walked is not None and walked.group is group

    def _work(self) -> None:
        while (group := self.queue.get()) is not _END:
            if self.error is None and not self._walked(group):
                try:
                    self.walked[group.group_id] = self._walk(group)
                except BaseException as exc:  # raised in the driver by ``finish``
                    self.error = exc

    def _walk(self, group: RolloutGroup) -> _Walked:
        runner, walked = self.runner, _Walked(group)
        own = type(self.state)(self.state.ctx)  # the group's own step record
        current = RolloutGroups([group])
        walked.stamped[self.generate] = _stamp(runner, self.generate, own, current)
        for node in self.chain:
            kwargs = {p.name: runner._runtime_input(p, own) for p in node.runtime_inputs}
            kwargs[node.bindings[0].param] = current
            before = runner._fingerprints(own)
            start = time.perf_counter()
            current = runner._call(node.id, own.ctx, runner.stages[node.id].run, **kwargs)
            walked.seconds[node.id] = time.perf_counter() - start
            walked.outputs[node.id] = current
            walked.stamped[node.id] = _stamp(runner, node.id, own, current, before)
        return walked


def _stamp(runner: Any, sid: str, own: Any, output: Any, before: dict | None = None) -> _Stamped:
    """Stamp ``sid``'s ``output`` into the group's own record ``own``; what it recorded."""
    created, dropped, added = set(own.created_by), set(own.dropped_by), set(own.added_by)
    changes = {gid: len(s) for gid, s in own.changed_by.items()}
    runner._stamp(sid, own, before or {}, output)
    return _Stamped({g: s for g, s in own.created_by.items() if g not in created},
                    {g: own.groups[g] for g in own.created_by if g not in created},
                    {g: s for g, s in own.dropped_by.items() if g not in dropped},
                    [g for g, s in own.changed_by.items() if len(s) > changes.get(g, 0)],
                    {r: s for r, s in own.added_by.items() if r not in added}, set(own.rollout_ids))


def _merge(sid: str, stamped: _Stamped, state: Any) -> None:
    """Add one group's stamps by ``sid`` to the step's record, as the barrier's ``_stamp`` adds them."""
    for gid, group in stamped.groups.items():
        state.groups.setdefault(gid, group)
    state.created_by.update(stamped.created)
    for gid, by in stamped.dropped.items():
        state.dropped_by.setdefault(gid, by)
    for gid in stamped.changed:
        state.changed_by.setdefault(gid, []).append(sid)
    state.added_by.update(stamped.added)
    state.rollout_ids |= stamped.rollout_ids


def run_streamed(runner: Any, generate: Node, chain: list[Node], state: Any) -> None:
    """Run ``generate`` with its groups streamed through ``chain`` (the module docstring)."""
    stage = runner.stages[generate.id]
    worker = ChainWorker(runner, generate.id, chain, state)
    kwargs = runner._inputs(generate, state)
    stage.hand_over(worker.put)
    start = time.perf_counter()
    try:
        output = runner._execute(generate.id, state.ctx, runner._runs(generate.id), kwargs)
    except BaseException:
        worker.close()
        raise
    finally:
        stage.hand_over(None)
    seconds = time.perf_counter() - start
    walks = worker.finish(output)
    for sid in [generate.id] + [node.id for node in chain]:
        for walk in walks:
            _merge(sid, walk.stamped[sid], state)
    runner._ran(generate.id, state, output, seconds)
    for node in chain:
        groups = [g for walk in walks for g in walk.outputs[node.id]]
        runner._ran(node.id, state, RolloutGroups(groups), sum(walk.seconds[node.id] for walk in walks))
