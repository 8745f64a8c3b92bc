"""In-flight controllers in the DSL: attached to a generate stage by `in_flight`, type-checked,
swappable with `--set`, drawn, and never a node of the plan."""

from __future__ import annotations

from typing import ClassVar

import pytest

from gfcr.errors import GraphError
from gfcr.graph import compile_pipeline
from gfcr.graph.draw import to_dot
from gfcr.records import Allocation
from gfcr.registry import StageConfig, make_stage_registry
from gfcr.spec import load_spec_text
from tests.conftest import BASE

STOP = BASE.replace("  rollout: {use: generate.fake, from: budget}",
                    "  stop:    {use: control.fake_stop, with: {groups: 2}}\n"
                    "  rollout: {use: generate.fake, from: budget, in_flight: [stop]}")

REGISTRY = make_stage_registry(entry_points=False)


@REGISTRY.register("control.test_prune")
class Prune:
    """TEST STAGE: an in-flight controller that prunes nothing."""

    testing: ClassVar[bool] = True
    every = 4

    class Config(StageConfig):
        pass

    def __init__(self, config):
        self.config = config

    def steer(self, view):
        from gfcr.stages.testing import Steer

        return Steer()


def compiled(text=STOP, overrides=(), registry=None):
    spec = load_spec_text(text, "p.yaml", list(overrides))
    return compile_pipeline(spec) if registry is None else compile_pipeline(spec, registry)


def problems(text, overrides=(), registry=None):
    with pytest.raises(GraphError) as info:
        compiled(text, overrides, registry)
    return info.value.problems


def test_controller_is_attached_not_planned():
    pipeline = compiled()
    assert pipeline.plan == ("pick", "budget", "rollout", "keep", "update")
    assert list(pipeline.nodes) == ["pick", "budget", "rollout", "keep", "update", "stop"]
    assert pipeline.nodes["rollout"].in_flight == ("stop",) and not pipeline.nodes["stop"].runs
    assert pipeline.graph.get_edge_data("stop", "rollout")[0]["type"] == "in flight"
    assert pipeline.describe_plan() == "pick -> budget -> rollout (in flight: stop) -> keep -> update"


def test_controller_is_swapped_with_set():
    pipeline = compiled(overrides=["stages.stop.use=control.test_prune", "stages.stop.with={}"], registry=REGISTRY)
    assert pipeline.nodes["stop"].info.alias == "control.test_prune"
    assert pipeline.nodes["stop"].info.in_flight


def test_swapping_in_a_stage_that_is_not_a_controller_fails():
    found = problems(STOP, ["stages.stop.use=control.fixed_n", "stages.stop.with={n: 2}"])
    assert any(p.path == "stages.rollout.in_flight.0" and "not an in-flight controller" in p.message for p in found)


def test_a_controller_steers_one_generate_stage():
    text = STOP.replace("  keep:    {use: filter.nonzero_variance, from: rollout}",
                        "  again:   {use: generate.fake, from: budget, in_flight: [stop]}\n"
                        "  keep:    {use: filter.nonzero_variance, from: [rollout]}\n"
                        "  keep2:   {use: filter.nonzero_variance, from: again}")
    text = text.replace("update: {use: update.fake, from: keep}", "update: {use: update.fake, from: keep}\n")
    found = problems(text)
    (problem,) = [p for p in found if p.path == "stages.stop"]
    assert "attached to 2 generate stages" in problem.message and "a copy of `stop`" in problem.fix
    assert str(problem.where).startswith("p.yaml:")


def test_a_controller_cannot_be_read_by_from():
    text = STOP.replace("from: rollout}", "from: stop}")
    found = problems(text)
    assert any(p.path == "stages.keep.from" and "has no output to read" in p.message for p in found)


def test_controller_is_drawn_with_a_dashed_in_flight_edge():
    source = to_dot(compiled()).source
    assert "stop -> rollout" in source
    line = next(line for line in source.split("\n") if "stop -> rollout" in line)
    assert 'label="in flight"' in line and "dashed" in line


def test_plan_ignores_the_allocation_type_of_controllers():
    assert compiled().nodes["stop"].info.output is None
    assert compiled().nodes["budget"].info.output is Allocation
