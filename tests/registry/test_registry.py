"""The generic registry and the stage contract."""

from __future__ import annotations

import pytest

from gfcr.errors import RegistryError
from gfcr.records import Allocation, PromptPool, RolloutGroups, UpdateReport
from gfcr.registry import STAGES, Registry, StageConfig, describe_stage, make_stage_registry, stage_info
from gfcr.registry.catalog import BUILTIN_STAGES


class Good:
    class Config(StageConfig):
        k: int = 1

    def __init__(self, config: Config):
        self.config = config

    def run(self, groups: RolloutGroups, extra: RolloutGroups | None = None) -> RolloutGroups:
        return groups


def test_decorator_and_lookup():
    reg: Registry[type] = Registry("stage")

    @reg.register("filter.good")
    class Mine(Good):
        pass

    assert reg.get("filter.good") is Mine and "filter.good" in reg and reg.names() == ["filter.good"]
    assert reg.origin("filter.good") == "tests"


def test_unknown_name_says_did_you_mean():
    with pytest.raises(RegistryError) as info:
        STAGES.get("filter.nonzero_varaince")
    assert info.value.fix.startswith("did you mean `filter.nonzero_variance`? Or, if `filter.nonzero_varaince` is "
                                     "your own stage, import the module that registers it: `plugins: [my_stages]`")
    with pytest.raises(RegistryError, match="known stages:") as info:
        STAGES.get("zzz.qqq")
    assert "; or, if `zzz.qqq` is your own stage" in info.value.fix and "`gfcr.stages` entry-point group" in info.value.fix


def test_collisions_name_both_origins():
    reg: Registry[type] = Registry("stage")
    reg.register("filter.good", Good, origin="pkg_a")
    reg.register("filter.good", Good, origin="pkg_a")  # the same object again is fine
    with pytest.raises(RegistryError, match="registered twice: by pkg_a .* and by pkg_b"):
        reg.register("filter.good", type("Other", (Good,), {}), origin="pkg_b")
    with pytest.raises(RegistryError, match="registered twice"):
        reg.register_lazy("filter.good", "some.module:Thing", origin="pkg_c")


def test_lazy_entries_import_on_first_lookup():
    reg: Registry[type] = Registry("stage")
    reg.register_lazy("filter.good", "tests.registry.test_registry:Good", origin="tests")
    assert reg._entries["filter.good"].obj is None
    assert reg.get("filter.good") is Good
    reg.register_lazy("filter.broken", "tests.no_such_module:Thing", origin="tests")
    with pytest.raises(RegistryError, match="cannot be imported"):
        reg.get("filter.broken")
    with pytest.raises(RegistryError, match="is not `module:attr`"):
        reg.register_lazy("filter.bad", "no_colon", origin="tests")


def test_builtins_are_lazy_and_entry_points_optional():
    reg = make_stage_registry(entry_points=False)
    assert "control.uniform" in reg and reg._entries["control.uniform"].obj is None
    assert reg.entry_point_group is None


def test_stage_contract_ports():
    info = describe_stage("filter.good", Good, "tests")
    assert [(p.name, p.type, p.required) for p in info.inputs] == [
        ("groups", RolloutGroups, True), ("extra", RolloutGroups, False)]
    assert info.output is RolloutGroups and info.family == "filter"
    pool = stage_info("control.uniform").inputs[0]
    assert pool.type is PromptPool and pool.from_runtime


@pytest.mark.parametrize("alias, cls, message", [
    ("nofamily", Good, "must be `<family>.<name>`"),
    ("control.good", Good, "returns RolloutGroups, but control stages return Allocation"),
    ("filter.noconfig", type("NoConfig", (), {"run": Good.run}), "has no pydantic `Config`"),
])
def test_contract_violations(alias, cls, message):
    with pytest.raises(RegistryError, match=message):
        describe_stage(alias, cls, "tests")


def test_unannotated_and_wrongly_annotated_run():
    class Loose:
        Config = Good.Config

        def run(self, groups):
            return groups

    class Wrong:
        Config = Good.Config

        def run(self, groups: list) -> UpdateReport:
            return UpdateReport(0)

    with pytest.raises(RegistryError, match="has no type annotation"):
        describe_stage("filter.loose", Loose, "tests")
    with pytest.raises(RegistryError, match="not a port type"):
        describe_stage("update.wrong", Wrong, "tests")


def test_soft_configs_are_refused():
    from pydantic import BaseModel

    class Soft:
        class Config(BaseModel):
            k: int = 1

        def run(self, allocation: Allocation) -> Allocation:
            return allocation

    with pytest.raises(RegistryError, match="frozen and forbid unknown keys"):
        describe_stage("control.soft", Soft, "tests")


def test_one_broken_stage_does_not_hide_the_others():
    from gfcr.registry import stage_infos

    reg = make_stage_registry(entry_points=False)
    reg.register_lazy("filter.broken", "tests.no_such_module:Thing", origin="some-plugin")
    infos, broken = stage_infos(reg, family="filter")
    assert {i.alias for i in infos} == {a for a in BUILTIN_STAGES if a.startswith("filter.")}
    assert list(broken) == ["filter.broken"] and "cannot be imported" in str(broken["filter.broken"])


def test_an_entry_point_colliding_with_a_builtin_is_an_error_on_every_lookup(monkeypatch):
    from importlib import metadata

    clash = metadata.EntryPoint("filter.nonzero_variance", "other_pkg.filters:Mine", "gfcr.stages")
    monkeypatch.setattr(metadata, "entry_points", lambda group: [clash] if group == "gfcr.stages" else [])
    reg = make_stage_registry()
    for _ in range(2):
        with pytest.raises(RegistryError, match="`filter.nonzero_variance` is registered twice: by gfcr"):
            reg.get("control.uniform")
