"""The stage lifecycle: roles read from the lifecycle Protocols, near-miss method names
refused at registration with a did-you-mean, in-flight controllers without `run`, and the
Replay ports only where they belong."""

from __future__ import annotations

import pytest

from gfcr.errors import RegistryError
from gfcr.records import Allocation, Provided, RolloutGroups, StepContext, StepOutputs, StepReport
from gfcr.registry import (
    BeforeStep, EndsLoop, HostsInFlight, InFlightController, Observes, SetsUp, Stage, StageConfig, Stateful,
    describe_stage, has_role, stage_infos,
)
from gfcr.stages.testing import FakeGenerate, FakeStop


class Filter:
    """TEST STAGE: a filter with every role but the in-flight ones."""

    class Config(StageConfig):
        pass

    def __init__(self, config):
        self.config = config

    def run(self, groups: RolloutGroups, ctx: StepContext) -> RolloutGroups:
        return groups

    def setup(self, resources) -> None: ...
    def before_step(self, ctx: StepContext) -> None: ...
    def observe(self, report: StepReport) -> None: ...
    def state_dict(self) -> dict: return {}
    def load_state_dict(self, state: dict) -> None: ...
    def done(self) -> bool: return True
    def observe_groups(self) -> None: ...  # a helper, not a near miss
    def setup_engine(self) -> None: ...
    def steps(self) -> int: return 0


def with_method(name: str) -> type:
    return type("Bad", (Filter,), {name: lambda self: None})


@pytest.mark.parametrize("name, meant", [
    ("observer", "observe"), ("load_state", "load_state_dict"), ("setup_", "setup"),
    ("state_dicts", "state_dict"), ("before_steps", "before_step"), ("don", "done"),
    ("save_file", "save_files"), ("attach_inflight", "attach_in_flight"), ("update_need", "update_needs"),
])
def test_near_miss_lifecycle_name_fails_registration(name, meant):
    with pytest.raises(RegistryError) as info:
        describe_stage("filter.bad", with_method(name), "test")
    assert f"defines `{name}`" in info.value.message and "never call it" in info.value.message
    assert f"did you mean `{meant}`?" in info.value.fix


def test_helpers_with_lifecycle_like_names_are_fine():
    info = describe_stage("filter.ok", Filter, "test")
    assert info.stateful and info.observes and info.can_end_loop and not info.in_flight
    assert [p.name for p in info.edge_inputs] == ["groups"] and info.inputs[1].from_runtime


def test_no_builtin_stage_trips_the_near_miss_rule():
    infos, broken = stage_infos()
    assert broken == {} and len(infos) >= 14


def test_roles_of_instances_are_protocol_checks():
    stage = Filter(Filter.Config())
    assert all(isinstance(stage, role) for role in (Stage, SetsUp, BeforeStep, Observes, Stateful, EndsLoop))
    assert not isinstance(stage, InFlightController) and not isinstance(stage, HostsInFlight)
    stop = FakeStop(FakeStop.Config(groups=1))
    assert isinstance(stop, InFlightController) and not isinstance(stop, Stage)
    assert isinstance(FakeGenerate(FakeGenerate.Config()), HostsInFlight)
    assert has_role(FakeStop, InFlightController) and not has_role(Filter, InFlightController)


def test_in_flight_controller_registers_without_run():
    info = describe_stage("control.fake_stop", FakeStop, "test")
    assert info.in_flight and info.output is None and info.inputs == ()
    assert info.to_json()["in_flight"] and info.to_json()["output"] == "in flight"


def test_in_flight_controller_must_be_a_control_stage():
    with pytest.raises(RegistryError) as info:
        describe_stage("filter.stop", FakeStop, "test")
    assert "register it as `control.stop`" in info.value.fix


def test_in_flight_controller_has_no_run():
    both = type("Both", (FakeStop,), {"run": lambda self, a: a, "__annotations__": {}})
    with pytest.raises(RegistryError, match="both `steer` and `run`"):
        describe_stage("control.both", both, "test")


def test_in_flight_controller_declares_every():
    class NoEvery:
        class Config(StageConfig):
            pass

        def steer(self, view): ...

    with pytest.raises(RegistryError) as info:
        describe_stage("control.no_every", NoEvery, "test")
    assert "declare `every: int`" in info.value.fix


def _stage(run):
    return type("S", (), {"Config": type("Config", (StageConfig,), {}), "run": run, "__init__": lambda s, c: None})


def test_provided_input_only_on_generate_stages():
    def run(self, groups: RolloutGroups, provided: Provided | None = None) -> RolloutGroups: ...

    with pytest.raises(RegistryError, match="only generate stages take"):
        describe_stage("filter.takes_provided", _stage(run), "test")

    def gen(self, allocation: Allocation, provided: Provided | None = None) -> RolloutGroups: ...

    info = describe_stage("generate.ok", _stage(gen), "test")
    assert [(p.name, p.required) for p in info.edge_inputs] == [("allocation", True), ("provided", False)]


def test_step_outputs_input_only_on_replay_stages():
    def run(self, produced: StepOutputs) -> RolloutGroups: ...

    with pytest.raises(RegistryError, match="only replay stages take"):
        describe_stage("filter.ingest", _stage(run), "test")
    assert describe_stage("replay.ingest", _stage(run), "test").inputs[0].from_runtime


def test_only_replay_stages_output_provided():
    def run(self, allocation: Allocation) -> Provided: ...

    with pytest.raises(RegistryError, match="control stages return Allocation"):
        describe_stage("control.provide", _stage(run), "test")
    assert describe_stage("replay.provide", _stage(run), "test").output is Provided


def test_registering_a_class_with_a_near_miss_name_fails_at_once():
    from gfcr.registry import make_stage_registry

    registry = make_stage_registry(builtins=False, entry_points=False)
    with pytest.raises(RegistryError) as info:
        registry.register("filter.bad", with_method("observer"))
    assert "did you mean `observe`?" in info.value.fix and "filter.bad" not in registry
