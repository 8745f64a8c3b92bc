"""What a Control selector holds of the run: the step, seed and policy version that
``before_step`` gave it last, and what the runtime lent, and the policy and engine that ``setup`` found.

The selectors that draw their own randomness opened with the same lines: a ``seed`` property
(the Config's ``seed``, else the run's), a ``before_step`` keeping ``ctx.step``, ``ctx.seed``
and ``ctx.policy_version``, and, for those that roll out, embed or score prompts themselves
(``control.dots``, ``sgpo``, ``gps``, ``depo``, ``hive``), a ``setup`` asking ``Lent``
for the policy and the engine. Each holds one ``RunContext`` instead and calls it from its own
``setup`` and ``before_step``: composition, so the stage still declares the lifecycle roles it
plays, and a stage called directly (the docstring examples) sees step 0 and run seed 0.

Example:

>>> from gfcr.records import StepContext
>>> run = RunContext(seed=None)
>>> run.before_step(StepContext("run", step=3, seed=7, policy_version=2))
>>> run.step, run.seed, run.policy_version
(3, 7, 2)
>>> RunContext(seed=11).seed  # the Config's seed wins over the run's
11
"""

from __future__ import annotations

from gfcr.records import StepContext
from gfcr.stages.resources import Engine, Policy, Lent


class RunContext:
    """The run as one selector sees it, for a Config ``seed`` (None: the run's seed)."""

    def __init__(self, seed: int | None):
        self.configured_seed = seed
        self.step, self.run_seed, self.policy_version = 0, 0, 0
        self.lent: Lent | None = None
        self.policy: Policy | None = None
        self.engine: Engine | None = None

    @property
    def seed(self) -> int:
        """The stage's seed: its Config's ``seed``, else the run's."""
        return self.run_seed if self.configured_seed is None else self.configured_seed

    def setup(self, lent: Lent, alias: str, *, policy: bool = False, engine: bool = False) -> None:
        """Keep ``lent`` and take the policy and the (metered) engine the stage ``alias``
        needs; a ModelError naming the stage when the pipeline has none."""
        self.lent = lent
        if policy:
            self.policy = lent.require_policy(alias)
        if engine:
            self.engine = lent.require_engine(alias)

    def before_step(self, ctx: StepContext) -> None:
        self.step, self.run_seed, self.policy_version = ctx.step, ctx.seed, ctx.policy_version
