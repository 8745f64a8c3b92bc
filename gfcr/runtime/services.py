"""What only the runtime uses, beside what it lends to stages (DESIGN.md section 12, "Who owns
what").

``RuntimeServices`` holds the stages' ``Lent`` (policy, metered engine, map, charge counters,
the stores of ``OwnsStore`` stages) and, for the runtime alone: the weight mover, how to start
trainer ranks, the clean-up run at the end (stopping engine actors, a Ray cluster gfcr started)
and the runtime's own per-step metrics (``ray``: the engine replicas restarted). Stages never see
it: the runner hands them ``lent``.

``build_services(spec)`` (``gfcr.runtime.loop.session``) makes the run's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from gfcr.registry import OwnsStore, Trains
from gfcr.runtime.training import LocalTrainer, RankTrainer, TrainerGroup, WeightMover
from gfcr.runtime.weights import make_mover
from gfcr.stages.resources import Lent

StartTrainers = Callable[[type, Any], TrainerGroup]
"""``start_trainers(stage_class, config)``: the update's trainer ranks, each holding
``stage_class(config)`` set up over its own copy of the policy."""


@dataclass
class RuntimeServices:
    """The stages' ``lent`` and what only the runtime uses. Without a ``mover``, the engine's own
    ``sync_weights`` brings it up to date after each update (``reload``), as where no spec chose one."""

    lent: Lent = field(default_factory=Lent)
    mover: WeightMover | None = None
    start_trainers: StartTrainers | None = None  # set where the update runs as trainer ranks (Ray)
    closers: list[Callable[[], None]] = field(default_factory=list)
    # the runtime's own numbers for each step's metrics line, by key; the session calls each once a step
    runtime_metrics: dict[str, Callable[[], dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mover is None:
            self.mover = make_mover("reload" if self.lent.engine is not None else "none", self.lent.engine)

    def lend_stores(self, stages: dict[str, Any]) -> None:
        """Lend the stages the stores that ``OwnsStore`` stages own (the owners themselves stay unlent)."""
        self.lent.stores = {sid: stage.owned_store for sid, stage in stages.items() if isinstance(stage, OwnsStore)}

    def trainer_for(self, stage: Any) -> LocalTrainer:
        """The trainer of the update ``stage``: over trainer ranks where they are configured (the
        ranks start here, each building the stage from its class and Config), else in this process."""
        if self.start_trainers is not None and isinstance(stage, Trains) and self.lent.policy is not None:
            return RankTrainer(self.lent.policy, self.start_trainers(type(stage), stage.config), self.mover)
        return LocalTrainer(self.lent.policy, self.mover)

    def close(self) -> None:
        """Run the closers, newest first, once (a second call does nothing)."""
        while self.closers:
            self.closers.pop()()
