"""The pipelined lifecycle's schedule: generation for step t samples with the weights the policy
had at the start of step t - lag (``lifecycle: {mode: pipelined, lag: K}``, docs/async.md).

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

from dataclasses import dataclass, field
from typing import Any

from gfcr.errors import CheckpointError


@dataclass
class WeightHistory:
    """The policy's weights (CPU tensors) and version at the start of recent steps."""

    keep: int  # records kept: lag + 1
    records: dict[int, tuple[int, dict[str, Any]]] = field(default_factory=dict)  # step -> (version, weights)

    def record(self, step: int, version: int, model: Any) -> None:
        """Copy ``model``'s weights as they are at the start of ``step``; forget the oldest past ``keep``."""
        self.records[step] = (version, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
        for old in sorted(self.records)[:-self.keep]:
            del self.records[old]

    def at(self, step: int) -> tuple[int, dict[str, Any]]:
        if step not in self.records:
            raise CheckpointError(f"the pipelined lifecycle needs the weights of step {step}, and holds those of "
                                  f"steps {sorted(self.records)}", "resume from a checkpoint this gfcr wrote")
        return self.records[step]

    def state_dict(self) -> dict[str, Any]:
        return {"keep": self.keep, "steps": [{"step": s, "version": v, "weights": w}
                                             for s, (v, w) in sorted(self.records.items())]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.keep = int(state["keep"])
        self.records = {int(r["step"]): (int(r["version"]), dict(r["weights"])) for r in state["steps"]}


class PipelinedSchedule:
    """Generation on ``generation`` (a second copy of ``trained``), lagging ``lag`` steps behind."""

    def __init__(self, lag: int, trained: Any, generation: Any):
        self.lag, self.trained, self.generation = lag, trained, generation
        self.history = WeightHistory(lag + 1)
        self.loaded_step: int | None = None  # the step whose weights ``generation`` holds

    def start_step(self, step: int) -> int:
        """Record the trained weights as the start of ``step``, load those of ``step - lag`` into
        the generation copy, and return the version generation samples with."""
        if step not in self.history.records:
            self.history.record(step, self.trained.version, self.trained.model)
        source = max(0, step - self.lag)
        version, weights = self.history.at(source)
        if self.loaded_step != source:
            self.generation.model.load_state_dict(weights)
            self.loaded_step = source
        self.generation.version = version
        return version

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.load_state_dict(state["history"])
        self.loaded_step = None  # the next start_step loads the generation copy from the history
