"""control.fixed_n: give every selected prompt the same number of rollouts (GRPO's group size G).

Prompts an upstream control skipped (``n_rollouts == 0``) stay skipped. ``gfcr validate``
refuses it after a stage that sets each prompt's group size itself (``control.sgpo``,
``control.dars``, ``control.gdro_rollout``, ``control.xrpo``, ``control.coba``,
``control.pilot_commit``, ``control.ar3po``, ``control.mc_grpo``): it would overwrite them.

Deviations: none; this is GRPO's fixed group size (Shao et al., 2024, arXiv 2402.03300).

Fidelity: gfcr's own: GRPO's fixed group size G (arXiv 2402.03300), no method of its own to check.

Example:

>>> from gfcr.records import Allocation, AllocationEntry, Prompt
>>> alloc = Allocation(0, (AllocationEntry(Prompt("p:0", text="0"), 1),
...                        AllocationEntry(Prompt("p:1", text="1"), 0, reason="skip")))
>>> [e.n_rollouts for e in FixedN(FixedN.Config(n=8)).run(alloc)]
[8, 0]

YAML:

.. code-block:: yaml

    budget: {use: control.fixed_n, from: pick, with: {n: 8}}
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any

from pydantic import Field

from gfcr.records import Allocation
from gfcr.registry import PipelineProblem, SizesEachGroup, StageConfig

class FixedN:
    """A fixed group size for every prompt that is not skipped."""

    class Config(StageConfig):
        n: Annotated[int, Field(ge=1, description="rollouts per prompt (the group size)")]

        @property
        def rollouts_per_prompt(self) -> int:
            """The group size this stage fixes (read by ``gfcr validate``'s pairing checks)."""
            return self.n

        def group_size_setting(self, n: int) -> str:
            return f"n={n}"

    @staticmethod
    def check_pipeline(config: "FixedN.Config", view: Any) -> list[PipelineProblem]:
        """A fixed n after a stage that sizes each prompt's group would undo its allocation."""
        return [PipelineProblem(("n",), f"`{sid}` ({alias}) upstream sets each prompt's group size itself; a fixed "
                                       f"n = {config.n} would overwrite them",
                                f"remove this stage and take the rollout stage `from: {sid}`")
                for sid, alias in view.upstream if isinstance(view.configs.get(sid), SizesEachGroup)]

    def __init__(self, config: Config):
        self.config = config

    def run(self, allocation: Allocation) -> Allocation:
        return allocation.with_entries(
            [replace(e, n_rollouts=self.config.n) if e.n_rollouts > 0 else e for e in allocation]
        )
