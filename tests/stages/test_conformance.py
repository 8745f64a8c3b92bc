"""Every registered stage honours the contract: its ports are annotated, its Config
round-trips through YAML, its docstring's example runs (and its YAML snippet names it), and it
states its deviations. The checks are the shipped kit, ``gfcr.testing``, that a user's own
stage is checked with too."""

from __future__ import annotations

import pytest

from gfcr import testing
from gfcr.registry import STAGES

ALIASES = STAGES.names()


@pytest.mark.parametrize("alias", ALIASES)
def test_ports_are_annotated(alias):
    testing.check_ports(alias)


@pytest.mark.parametrize("alias", ALIASES)
def test_config_round_trips_through_yaml(alias):
    testing.check_config_round_trip(alias)


@pytest.mark.parametrize("alias", ALIASES)
def test_docstring_example_runs(alias):
    testing.check_docstring_example(alias)


@pytest.mark.parametrize("alias", ALIASES)
def test_docstring_states_deviations_or_is_a_test_stage(alias):
    testing.check_deviations(alias)


@pytest.mark.parametrize("alias", ALIASES)
def test_docstring_states_fidelity_or_is_a_test_stage(alias):
    testing.check_fidelity(alias)
