"""The strict YAML reader, overrides, the Python front end and the YAML round trip."""

from __future__ import annotations

import pytest

from gfcr.errors import GraphError, SpecError
from gfcr.graph import compile_pipeline, load_pipeline
from gfcr.spec import DataSpec, PipelineSpec, StageSpec, build_spec, load_spec, load_spec_text
from gfcr.spec.yaml_source import parse_yaml
from tests.conftest import BASE, DAPO, REPO


def test_yaml_12_scalars():
    data, _, problems = parse_yaml("a: on\nb: yes\nc: 1e-4\nd: 2026-11-30\ne: True\nf: 0x1F\ng: 1_000\n")
    assert problems == []
    assert data == {"a": "on", "b": "yes", "c": 1e-4, "d": "2026-11-30", "e": True, "f": "0x1F", "g": "1_000"}


def test_positions_point_at_values_on_the_same_line_and_keys_otherwise():
    _, source, _ = parse_yaml("run:\n  steps: 3\nlist:\n  - a\n", "f.yaml")
    assert str(source.locate(("run",))) == "f.yaml:1:1"
    assert str(source.locate(("run", "steps"))) == "f.yaml:2:10"
    assert str(source.locate(("list", 0))) == "f.yaml:4:5"
    assert str(source.locate(("run", "missing", "deeper"))) == "f.yaml:1:1"


def test_all_duplicate_keys_are_reported():
    _, _, problems = parse_yaml("a: 1\nb: 2\na: 3\nb: 4\n", "f.yaml")
    assert [(p.path, p.where.line) for p in problems] == [("a", 3), ("b", 4)]


def test_empty_and_non_mapping_files():
    with pytest.raises(SpecError, match="the file is empty"):
        load_spec_text("", "e.yaml")
    with pytest.raises(SpecError, match="must be a mapping"):
        load_spec_text("- a\n- b\n", "l.yaml")
    with pytest.raises(SpecError, match="cannot read the file"):
        load_spec("/nonexistent/pipeline.yaml")


def test_overrides_are_typed_and_reach_configs(write_spec):
    spec = load_spec(write_spec(BASE), ["run.steps=7", "stages.pick.with.batch_size=16",
                                        "stages.keep.use=filter.overlong",
                                        "stages.keep.with={max_length: 8, buffer: 4}", "eval.source=arithmetic"])
    assert spec.run.steps == 7 and spec.stages["pick"].with_ == {"batch_size": 16}
    assert spec.stages["keep"].use == "filter.overlong" and spec.eval.source == "arithmetic"
    assert str(spec.source.locate(("run", "steps"))) == "--set run.steps=7"
    compile_pipeline(spec)


QUICK = (REPO / "pipelines" / "quickstart.yaml")


def test_a_stage_swap_drops_the_keys_the_new_stage_does_not_accept_and_says_so():
    """Issue 40: `--set stages.budget.use=control.coba` on a pipeline whose budget has `n: 8`."""
    spec = load_pipeline(QUICK, ["stages.budget.use=control.coba"]).spec
    assert spec.stages["budget"].use == "control.coba" and spec.stages["budget"].with_ == {}
    assert spec.source.notes == ["--set stages.budget.use=control.coba: dropped `n` from `stages.budget.with`, "
                                 "which `control.coba` does not accept; set its own keys with "
                                 "--set stages.budget.with.KEY=VALUE"]


def test_a_stage_swap_keeps_the_keys_the_new_stage_accepts_and_those_set_with_it():
    kept = load_pipeline(QUICK, ["stages.pick.use=control.greso"]).spec
    assert kept.stages["pick"].with_ == {"batch_size": 16} and kept.source.notes == []
    given = load_pipeline(QUICK, ["stages.budget.with.n_max=16", "stages.budget.use=control.coba"]).spec
    assert given.stages["budget"].with_ == {"n_max": 16}  # set in the same command: kept, before or after the swap
    with pytest.raises(GraphError, match="unknown key `n`"):  # set with it, so checked, not dropped
        load_pipeline(QUICK, ["stages.budget.use=control.coba", "stages.budget.with.n=4"])
    same = load_pipeline(QUICK, ["stages.budget.use=control.fixed_n"]).spec  # no change of stage, nothing dropped
    assert same.stages["budget"].with_ == {"n": 8} and same.source.notes == []


def test_an_update_swap_follows_the_same_rule():
    spec = load_pipeline(QUICK, ["update.use=update.fake"]).spec
    assert spec.update.use == "update.fake" and spec.update.with_ == {}
    assert spec.source.notes[0].startswith("--set update.use=update.fake: dropped `lr`, `loss` from `update.with`")


def test_without_the_registry_a_swap_keeps_every_key():
    """The spec layer alone (no ``config_keys``) cannot know the new stage's keys: the compiler reports them."""
    spec = load_spec(QUICK, ["stages.budget.use=control.coba"])
    assert spec.stages["budget"].with_ == {"n": 8} and spec.source.notes == []


def test_yaml_round_trip_keeps_the_spec():
    for text in (BASE, DAPO):
        spec = load_spec_text(text, "a.yaml")
        again = load_spec_text(spec.to_yaml(), "b.yaml")
        assert again == spec
        assert again.to_yaml() == spec.to_yaml()


def test_python_front_end_builds_the_same_spec():
    spec = PipelineSpec(
        name="golden",
        data=DataSpec(source="arithmetic", with_={"n": 50}),
        stages={
            "pick": StageSpec(use="control.uniform", with_={"batch_size": 4}),
            "budget": StageSpec(use="control.fixed_n", from_="pick", with_={"n": 4}),
            "rollout": StageSpec(use="generate.fake", from_="budget"),
            "keep": StageSpec(use="filter.nonzero_variance", from_="rollout"),
        },
        update=StageSpec(use="update.fake", from_="keep"),
        run={"steps": 2},
        tracking={"mlflow": None},
    )
    assert spec == load_spec_text(BASE)
    assert load_spec_text(spec.to_yaml()) == spec


def test_python_specs_are_strict_and_checked_at_compile():
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        StageSpec(use="control.uniform", wiht={})
    spec = PipelineSpec(name="x", data={"source": "arithmetic"},
                        stages={"pick": {"use": "control.uniform", "with": {"batch_size": 2}}},
                        update={"use": "update.fake", "from": "nowhere"})
    with pytest.raises(GraphError, match="`nowhere` is not a stage or loop"):
        compile_pipeline(spec)


def test_build_spec_reports_problems_with_key_paths():
    with pytest.raises(SpecError) as info:
        build_spec({"name": "x", "data": {"source": "arithmetic"}, "stages": {}, "update": {"use": "update.fake"},
                    "run": {"steps": 0}})
    assert {p.path for p in info.value.problems} == {"stages", "run.steps"}


def test_override_creates_a_missing_with_block_and_replaces_lists(write_spec):
    spec = load_spec(write_spec(DAPO), ["stages.rollout.with.length=4", "loops.collect.stages=[pick, budget, rollout, keep, enough]"])
    assert spec.stages["rollout"].with_ == {"length": 4}
    compile_pipeline(spec)
