"""The stale lifecycles' schedules: under ``pipelined`` generation for step t samples with the
weights the policy had at the start of step t - lag (``lifecycle: {mode: pipelined, lag: K}``);
under ``async`` step t starts once the trainer has reached step t - K, with the newest weights
(``lifecycle: {mode: async, max_staleness: K}``; docs/async.md); with ``in_flight: true`` a
version recorded while a step generates reaches vLLM between its decode steps (``AsyncSchedule.newer``,
``publish``: the rows are aborted and continued from their tokens, each token keeping its version).

The trained policy and the policy generation samples from are two copies of one model: the
update steps the first; before each step's generation the runtime loads into the second the
weights recorded at the start of step ``max(0, t - lag)``. ``WeightHistory`` keeps those
records on the CPU, ``lag + 1`` at most, and goes into every checkpoint, so a resumed run loads
exactly the weights the uninterrupted run would have (``state_dict``).

Lag counts steps, not versions: a step whose update is skipped (an empty batch, every advantage
zero) moves no version, so a token's staleness at its update is at most ``lag`` versions, and
exactly ``lag`` when no update was skipped in between.

What stages see (the rule that keeps the schedule deterministic whatever runs concurrently):
each step runs its stages in plan order as under ``sync``, then every ``observe`` stage gets the
step's report *before* the step's update (``StepReport.update`` is None, ``policy_version`` the
generation's), then the update trains on the step's batch. So a stage's state after step t
depends on generation and observation only, never on when an update finished, and a run where
generation of later steps overlaps an update gives the same steps as this sequential order.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from gfcr.errors import CheckpointError


@dataclass
class WeightHistory:
    """The policy's weights (CPU tensors) and version at the start of recent steps."""

    keep: int  # records kept: lag + 1
    records: dict[int, tuple[int, dict[str, Any] | None]] = field(default_factory=dict)  # step -> (version, weights)

    def record(self, step: int, version: int, model: Any) -> None:
        """Copy ``model``'s weights (None: no model, the version alone) as they are at the start of
        ``step``; forget the oldest past ``keep``."""
        weights = None if model is None else {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        self.records[step] = (version, weights)
        for old in sorted(self.records)[:-self.keep]:
            del self.records[old]

    def at(self, step: int) -> tuple[int, dict[str, Any] | None]:
        if step not in self.records:
            raise CheckpointError(f"the pipelined lifecycle needs the weights of step {step}, and holds those of "
                                  f"steps {sorted(self.records)}", "resume from a checkpoint this gfcr wrote")
        return self.records[step]

    def state_dict(self) -> dict[str, Any]:
        return {"keep": self.keep, "steps": [{"step": s, "version": v, "weights": w}
                                             for s, (v, w) in sorted(self.records.items())]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.keep = int(state["keep"])
        self.records = {int(r["step"]): (int(r["version"]), None if r["weights"] is None else dict(r["weights"]))
                        for r in state["steps"]}


class PipelinedSchedule:
    """Generation on ``generation`` (a second copy of ``trained``), lagging ``lag`` steps behind.

    Two sides, which may run in two threads: the trainer records the trained weights at the
    start of each step (``record_start``, after the previous step's update); the producer waits
    for the record of ``step - lag`` and loads it into the generation copy (``generation_for``).
    ``lag + 2`` records are kept, so the producer, at most ``lag`` steps ahead, always finds its.
    Without a policy (the fake engine's pipelines) only the versions are recorded.

    A pipelined run, overlapped or not, runs torch with one intra-op thread per side
    (``gfcr.runtime.loop.session.one_torch_thread``): a matrix product's float sums depend on the
    threads it gets, and two threads of one process share torch's pool unevenly."""

    def __init__(self, lag: int, trained: Any = None, generation: Any = None, engine: Any = None):
        """``engine``: an engine that holds weights of its own (vLLM, or the Ray engine group's
        replicas), over ``generation``: after the weights are loaded into ``generation``,
        ``engine.sync_weights`` copies them in (vLLM's reload, the replicas' weight sync, made by the
        producer before it generates). None: the engine samples from ``generation`` itself (the
        transformers engine in process)."""
        self.lag, self.trained, self.generation, self.engine = lag, trained, generation, engine
        self.moved_s = 0.0  # how long the last ``generation_for`` spent moving weights into ``engine``
        self.history = WeightHistory(lag + 2)
        self.loaded_step: int | None = None  # the step whose weights ``generation`` holds
        self._changed = threading.Condition()
        self.stopped = False  # set by a side that failed: the other stops waiting
        self.waited_s = 0.0  # how long the last ``generation_for`` waited for the trainer

    def record_start(self, step: int, version: int) -> None:
        """The trainer's side: the trained weights (and ``version``) as they are at the start of ``step``."""
        with self._changed:
            if step not in self.history.records:
                self.history.record(step, version, None if self.trained is None else self.trained.model)
            self._changed.notify_all()

    def generation_for(self, step: int) -> int:
        """The producer's side: wait until the trainer has recorded the start of step ``step -
        lag``, load the weights ``source`` picks into the generation copy, and return their version."""
        needed = max(0, step - self.lag)
        waited = time.perf_counter()
        with self._changed:
            self._changed.wait_for(lambda: needed in self.history.records or self.stopped)
            self.waited_s = time.perf_counter() - waited
            if self.stopped:
                raise RuntimeError("the run stopped while generation waited for the trainer")
            chosen = self.source(needed)
            version, weights = self.history.at(chosen)
        if self.generation is not None and self.loaded_step != chosen:
            self.generation.model.load_state_dict(weights)
        if self.generation is not None:
            self.generation.version = version
        self.loaded_step = chosen
        self.moved_s = 0.0
        if self.engine is not None and self.engine.policy_version != version:
            moved = time.perf_counter()
            self.engine.sync_weights(version)  # the engine now samples with exactly these weights
            self.moved_s = time.perf_counter() - moved
        return version

    def source(self, needed: int) -> int:
        """The step whose weights generation samples with: exactly ``step - lag`` (deterministic)."""
        return needed

    def stop(self) -> None:
        with self._changed:
            self.stopped = True
            self._changed.notify_all()

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.load_state_dict(state["history"])
        self.loaded_step = None  # the next generation_for loads the generation copy from the history


class AsyncSchedule(PipelinedSchedule):
    """``lifecycle: {mode: async, max_staleness: K}``: a step starts as soon as the trainer has
    finished the update of step ``t - K - 1`` (AReaL's bound, ``max_head_offpolicyness``, counted
    in steps of one batch: a rollout never starts more than K versions ahead of the trainer), and
    samples with the newest weights recorded by then. Which weights those are depends on timing,
    so an asynchronous run is not deterministic, and its resume goes on from the checkpoint's
    state without reproducing the uninterrupted run's draws."""

    def __init__(self, lag: int, trained: Any = None, generation: Any = None, engine: Any = None,
                 in_flight: bool = False):
        """``in_flight`` (``lifecycle.in_flight: true``, vLLM only): a newer version recorded while a
        step generates reaches ``engine`` between its decode steps (``newer``, ``publish``: the
        engine's ``InFlightWeights``), not only at the next step's start."""
        super().__init__(lag, trained, generation, engine)
        self.generating: int | None = None  # the step whose generation runs (in flight: for the gate)
        # a test hook: called at every in-flight publish point with (step, decoded engine steps) before
        # the schedule looks for a newer version; a test makes a publish land at a chosen decode step
        self.in_flight_gate: Callable[[int, int], None] | None = None
        self._offer: tuple[int, int, Any] | None = None  # (step, version, weights) that `newer` offered
        if in_flight:
            engine.in_flight = self

    def source(self, needed: int) -> int:
        return max(self.history.records)

    def generation_for(self, step: int) -> int:
        self.generating = step
        return super().generation_for(step)

    def newer(self, decoded: int) -> int | None:
        """The engine's side, between two decode steps of a call: the version of the newest weights
        recorded, when newer than those vLLM holds (a step whose update was skipped records the same
        version: nothing to publish)."""
        if self.in_flight_gate is not None and self.generating is not None:
            self.in_flight_gate(self.generating, decoded)
        with self._changed:
            newest = max(self.history.records)
            version, weights = self.history.records[newest]
        if newest == self.loaded_step or version == self.engine.policy_version:
            return None
        self._offer = (newest, version, weights)
        return version

    def publish(self, version: int) -> None:
        """Load the offered weights into the generation copy and reload vLLM from it (the call's
        rows are aborted by then); the seconds count into the step's ``weight_move_s``."""
        assert self._offer is not None and self._offer[1] == version, (self._offer, version)
        (step, _, weights), self._offer = self._offer, None
        moved = time.perf_counter()
        self.generation.model.load_state_dict(weights)
        self.generation.version = version
        self.loaded_step = step
        self.engine.sync_weights(version)
        self.moved_s += time.perf_counter() - moved
