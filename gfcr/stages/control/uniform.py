"""control.uniform: draw a batch of prompts uniformly, without replacement within an epoch.

Each epoch is a fresh seeded permutation of the pool; a batch never spans two epochs: when
fewer than ``batch_size`` prompts are left in an epoch, the next epoch starts (PyTorch's
``DataLoader(drop_last=True)`` behaviour), so no prompt appears twice in one batch.

Selection only: every chosen prompt gets ``n_rollouts`` (default 1); a budget stage such as
``control.fixed_n`` downstream sets the real count. Each entry's ``ControlReason`` (the
control lineage) is ``next_in_epoch`` with its ``position`` in the epoch's permutation and
the ``epoch``: nothing else decides, so there is no per-step metric to report.

Deviations: none from the usual trainer data loader (verl, TRL: a shuffled sampler with
``drop_last=True``); the permutation comes from numpy seeded by ``(seed, epoch)``, so the
order is reproducible from the step alone after a restart.

Fidelity: gfcr's own: the uniform baseline every method is compared against (a trainer's shuffled
data loader, as in verl and TRL).

Example:

>>> from gfcr.records import Prompt, PromptPool
>>> pool = PromptPool([Prompt(f"p:{i}", text=str(i)) for i in range(10)])
>>> stage = UniformControl(UniformControl.Config(batch_size=4, seed=0))
>>> first, second = stage.run(pool), stage.run(pool)
>>> len(first), len({e.prompt_id for e in first} | {e.prompt_id for e in second})
(4, 8)

YAML:

.. code-block:: yaml

    pick: {use: control.uniform, with: {batch_size: 16}}
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from gfcr.records import Allocation, AllocationEntry, ControlReason, PromptPool, StepContext
from gfcr.registry import Seed, StageConfig
from gfcr.stages.common.epochs import epoch_order, start_batch
from gfcr.stages.common.run_context import RunContext


class UniformControl:
    """Uniform prompt selection without replacement within an epoch, seeded."""

    class Config(StageConfig):
        batch_size: Annotated[int, Field(ge=1, description="prompts per step")]
        n_rollouts: Annotated[int, Field(ge=1, description="rollouts marked per chosen prompt")] = 1
        seed: Seed | None = Field(None, description="permutation seed; default: the run's seed")

    def __init__(self, config: Config):
        self.config = config
        self.epoch, self.cursor = 0, 0
        self.run_ctx = RunContext(config.seed)

    def before_step(self, ctx: StepContext) -> None:
        self.run_ctx.before_step(ctx)

    def run(self, pool: PromptPool) -> Allocation:
        size = self.config.batch_size
        self.epoch, self.cursor = start_batch(self.epoch, self.cursor, size, len(pool))
        picked = epoch_order(self.run_ctx.seed, self.epoch, len(pool))[self.cursor : self.cursor + size]
        start, self.cursor = self.cursor, self.cursor + size
        entries = tuple(
            AllocationEntry(pool[int(i)], self.config.n_rollouts, reason=f"uniform(epoch={self.epoch})",
                            why=ControlReason("next_in_epoch", "position", start + k, {"epoch": self.epoch}))
            for k, i in enumerate(picked)
        )
        return Allocation(step=self.run_ctx.step, entries=entries)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
