"""Compiling specs: type checks between stages, plans, loop blocks and drawings."""

from __future__ import annotations

import shutil

import pytest

from gfcr.errors import GfcrError, GraphError
from gfcr.graph import LoopBlock, compile_pipeline, load_pipeline
from gfcr.graph.draw import FAMILY_COLOURS, render, to_dot
from gfcr.spec import load_spec_text
from tests.conftest import BASE, DAPO

GENERATE_INTO_CONTROL = BASE.replace(
    "  keep:    {use: filter.nonzero_variance, from: rollout}\n",
    "  keep:    {use: filter.nonzero_variance, from: rollout}\n"
    "  regroup: {use: control.fixed_n, from: rollout, with: {n: 2}}\n",
)


def test_generate_output_into_an_allocation_input_fails_at_compile():
    spec = load_spec_text(GENERATE_INTO_CONTROL, "p.yaml")
    with pytest.raises(GraphError) as info:
        compile_pipeline(spec)
    (problem,) = [p for p in info.value.problems if "type mismatch" in p.message]
    assert str(problem.where) == "p.yaml:8:41" and problem.path == "stages.regroup.from"
    assert "`regroup` (control.fixed_n)" in problem.message and "`rollout` (generate.fake)" in problem.message
    assert "of type Allocation" in problem.message and "outputs RolloutGroups" in problem.message


def test_plan_follows_dependencies_then_author_order():
    text = BASE.replace("  pick:    {use: control.uniform, with: {batch_size: 4}}\n", "").replace(
        "update:", "  pick:    {use: control.uniform, with: {batch_size: 4}}\nupdate:")
    pipeline = compile_pipeline(load_spec_text(text))
    assert pipeline.plan == ("pick", "budget", "rollout", "keep", "update")
    assert list(pipeline.nodes) == ["pick", "budget", "rollout", "keep", "update"]


def test_loop_block_is_one_plan_item():
    pipeline = compile_pipeline(load_spec_text(DAPO))
    (loop,) = [item for item in pipeline.plan if isinstance(item, LoopBlock)]
    assert loop == LoopBlock("collect", ("pick", "budget", "rollout", "keep", "enough"), "enough", 3)
    assert pipeline.plan[-1] == "update"
    assert pipeline.nodes["update"].bindings[0].source == "enough"


def test_a_loop_feeding_itself_through_the_outside_is_refused():
    text = DAPO.replace("  enough:", "  outside: {use: filter.nonzero_variance, from: collect}\n  enough:").replace(
        "from: keep, with: {target_groups: 4}", "from: {groups: keep}, with: {target_groups: 4}").replace(
        "{use: filter.nonzero_variance, from: rollout}", "{use: filter.nonzero_variance, from: outside}").replace(
        "from: collect}\ntracking", "from: outside}\ntracking")
    with pytest.raises(GraphError) as info:
        compile_pipeline(load_spec_text(text))
    assert any("cycle" in p.message or "depends on its own output" in p.message for p in info.value.problems)


def test_shipped_pipelines_compile(tmp_path):
    from tests.conftest import REPO

    files = sorted((REPO / "pipelines").rglob("*.yaml"))
    assert files
    for file in files:
        load_pipeline(file)


def test_dot_colours_families_and_boxes_loops():
    dot = to_dot(compile_pipeline(load_spec_text(DAPO))).source
    assert "subgraph cluster_collect" in dot and "until enough, at most 3 rounds" in dot
    assert FAMILY_COLOURS["control"] in dot and FAMILY_COLOURS["update"] in dot
    assert "(test stage)" in dot and "PromptPool" in dot


@pytest.mark.parametrize("suffix, magic", [("dot", b"digraph"), ("svg", b"<svg"), ("png", b"\x89PNG")])
def test_render_formats(tmp_path, suffix, magic):
    if suffix != "dot" and shutil.which("dot") is None:
        pytest.skip("Graphviz's dot is not installed (make sysdeps installs it)")
    out = render(compile_pipeline(load_spec_text(DAPO)), tmp_path / f"g.{suffix}")
    assert magic in out.read_bytes()[:400]


def test_render_refuses_unknown_formats(tmp_path):
    with pytest.raises(GfcrError, match="unknown format `pdf`"):
        render(compile_pipeline(load_spec_text(DAPO)), tmp_path / "g.pdf")
