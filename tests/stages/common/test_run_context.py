"""common.run_context: the seed a selector draws with, and what its setup must find."""

from __future__ import annotations

import pytest

from gfcr.errors import ModelError
from gfcr.records import StepContext
from gfcr.stages.common.run_context import RunContext
from gfcr.stages.resources import MeteredEngine, Lent


def test_the_configured_seed_wins_and_the_step_follows_before_step():
    free, fixed = RunContext(seed=None), RunContext(seed=5)
    assert (free.step, free.seed, free.policy_version) == (0, 0, 0)  # a stage called directly
    for run in (free, fixed):
        run.before_step(StepContext("r", step=4, seed=9, policy_version=3))
    assert (free.step, free.seed, free.policy_version) == (4, 9, 3)
    assert (fixed.step, fixed.seed) == (4, 5)


def test_setup_takes_only_what_the_stage_needs():
    run = RunContext(seed=None)
    resources = Lent(engine=object())
    run.setup(resources, "control.example", engine=True)
    assert run.lent is resources and run.policy is None
    assert isinstance(run.engine, MeteredEngine)  # scored tokens are charged to the step


def test_a_missing_policy_names_the_stage():
    with pytest.raises(ModelError, match="`control.example` needs a policy"):
        RunContext(seed=None).setup(Lent(), "control.example", policy=True, engine=True)
