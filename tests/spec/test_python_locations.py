"""A pipeline built in Python reports its problems at the user's lines (issue 30: they cited
``<python>:8:10``, a line of YAML the user never saw): a stage's at the line that built it, the
others at the ``PipelineSpec(...)`` call, overrides at ``--set``."""

from __future__ import annotations

import inspect

import pytest

from gfcr.api import _compile
from gfcr.errors import GraphError, SpecError
from gfcr.graph import compile_pipeline
from gfcr.spec import PipelineSpec, StageSpec

HERE = __file__


def _spec(pick: StageSpec) -> tuple[PipelineSpec, int]:
    line = inspect.currentframe().f_lineno + 1
    spec = PipelineSpec(name="py", data={"source": "arithmetic", "with": {"n": 20}},
                        stages={"pick": pick, "budget": StageSpec(use="control.fixed_n", from_="pick", with_={"n": 4}),
                                "rollout": {"use": "generate.fake", "from": "budget"}},
                        update=StageSpec(use="update.fake", from_="rollout"), tracking={"mlflow": None})
    return spec, line


def test_a_stage_problem_points_at_the_line_that_built_the_stage():
    pick_line = inspect.currentframe().f_lineno + 1
    spec, _ = _spec(StageSpec(use="control.unifrom", with_={"batch_size": 4}))
    with pytest.raises(GraphError) as info:
        compile_pipeline(spec)
    (problem,) = info.value.problems
    assert str(problem.where) == f"{HERE}:{pick_line}" and problem.path == "stages.pick.use"
    assert "did you mean `control.uniform`?" in problem.fix


def test_a_config_problem_of_a_dict_stage_points_at_the_pipeline_call():
    spec, line = _spec(StageSpec(use="control.uniform", with_={"batch_size": 4}))
    bad = PipelineSpec(**{**spec.model_dump(by_alias=True), "name": "py2",
                          "stages": {**spec.model_dump(by_alias=True)["stages"],
                                     "rollout": {"use": "generate.fake", "from": "budget", "with": {"lenght": 4}}}})
    bad_line = inspect.currentframe().f_lineno - 3
    with pytest.raises(GraphError) as info:
        compile_pipeline(bad)
    (problem,) = info.value.problems
    assert str(problem.where) == f"{HERE}:{bad_line}" and problem.path == "stages.rollout.with.lenght"
    assert "<python>" not in str(info.value)


def test_overrides_of_a_python_spec_keep_the_users_lines_and_name_the_option():
    pick_line = inspect.currentframe().f_lineno + 1
    spec, line = _spec(StageSpec(use="control.unifrom", with_={"batch_size": 4}))
    with pytest.raises((SpecError, GraphError)) as info:
        _compile(spec, ["run.steps=0"])
    where = {p.path: str(p.where) for p in info.value.problems}
    assert where["run.steps"] == "--set run.steps=0"
    assert "<python>" not in str(info.value)
    with pytest.raises(GraphError) as info:
        _compile(spec, ["run.steps=2"])
    assert [str(p.where) for p in info.value.problems] == [f"{HERE}:{pick_line}"]
