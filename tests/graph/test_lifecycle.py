"""The declared lifecycle (``lifecycle:``, gfcr.graph.lifecycle): how stale a pipeline may be is
written in the spec and checked by ``gfcr validate``. The golden cases (file, line, message, fix)
are in tests/spec/test_golden_errors.py; this file holds what is accepted, and docs/async.md's table."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.errors import GfcrError, GraphError
from gfcr.graph import load_pipeline
from gfcr.graph.lifecycle import lifecycle_table, under_lifecycles
from gfcr.registry import STAGES, NeedsSyncLifecycle, declares, stage_info
from gfcr.spec import LifecycleSpec, load_spec_text
from tests.conftest import BASE, REPO

QUICK = REPO / "pipelines" / "quickstart.yaml"
MEDS = REPO / "pipelines" / "meds_arith.yaml"


def test_sync_is_the_default_and_each_mode_has_its_bound():
    assert load_spec_text(BASE).lifecycle == LifecycleSpec()
    assert LifecycleSpec().staleness_bound() == 0
    assert LifecycleSpec(mode="pipelined").staleness_bound() == 1  # verl's one-step-off-policy
    assert LifecycleSpec(mode="pipelined", lag=3).staleness_bound() == 3
    assert LifecycleSpec(mode="async", max_staleness=2).staleness_bound() == 2
    assert LifecycleSpec(mode="async", max_staleness=2).describe() == "async, max_staleness 2"


def test_a_lifecycle_round_trips_through_yaml():
    spec = load_spec_text(BASE + "lifecycle: {mode: pipelined, lag: 2}\n")
    assert spec.lifecycle == LifecycleSpec(mode="pipelined", lag=2)
    assert load_spec_text(spec.to_yaml()) == spec
    assert "lifecycle" not in load_spec_text(BASE).to_data()  # the default is not written back


@pytest.mark.parametrize("overrides", [
    ["lifecycle.mode=pipelined", "update.with.correction.use=tis"],
    ["lifecycle.mode=pipelined", "lifecycle.lag=2", "update.with.correction.use=decoupled_clip"],
    ["lifecycle.mode=async", "lifecycle.max_staleness=8", "update.with.correction.use=none"],  # opting out, declared
    ["lifecycle.mode=async", "lifecycle.max_staleness=0"],  # AReaL's eta = 0: nothing stale, nothing to correct
])
def test_a_stale_lifecycle_with_a_declared_correction_compiles(overrides):
    pipeline = load_pipeline(QUICK, overrides)
    assert pipeline.spec.lifecycle.mode == overrides[0].split("=")[1]


def test_the_default_correction_is_not_a_declaration():
    with pytest.raises(GraphError) as info:
        load_pipeline(QUICK, ["lifecycle.mode=pipelined"])
    assert [p.path for p in info.value.problems] == ["lifecycle.mode"]
    with pytest.raises(GraphError):  # `none` by default is not `none` written out
        load_pipeline(QUICK, ["lifecycle.mode=async", "lifecycle.max_staleness=1", "update.with.lr=1.0e-4"])


def test_a_sync_only_stage_runs_under_sync_and_is_refused_under_the_others():
    load_pipeline(MEDS)
    for overrides in (["lifecycle.mode=pipelined"], ["lifecycle.mode=async", "lifecycle.max_staleness=1"]):
        with pytest.raises(GraphError) as info:
            load_pipeline(MEDS, overrides + ["update.with.correction.use=tis"])
        assert [p.path for p in info.value.problems] == ["stages.meds.use"]


def test_the_stages_that_forward_the_trained_policy_declare_it():
    declared = {alias for alias in STAGES.names() if declares(STAGES.get(alias).Config, NeedsSyncLifecycle)}
    assert declared == {"control.depo", "control.dots", "control.early_exit", "control.gps", "filter.meds"}


def test_every_stage_says_what_it_does_under_each_lifecycle():
    for alias in STAGES.names():
        pipelined, asynchronous = under_lifecycles(stage_info(alias))
        assert pipelined and asynchronous, alias


def test_validate_and_run_refuse_what_the_runtime_cannot_run_yet(tmp_path):
    stale = ["--set", "lifecycle.mode=async", "--set", "lifecycle.max_staleness=1",
             "--set", "update.with.correction.use=tis"]
    assert CliRunner().invoke(app, ["validate", str(QUICK), *stale]).exit_code == 0
    vllm = ["--set", "policy.engine=vllm", "--set", "policy.device=cpu", "--set", "policy.model=tiny-arith-h64"]
    assert CliRunner().invoke(app, ["validate", str(QUICK), *stale, *vllm]).exit_code == 0  # the vLLM engine runs it
    result = CliRunner().invoke(app, ["validate", str(REPO / "pipelines" / "april_arith.yaml"), *stale, *vllm])
    assert result.exit_code == 2 and "stages.rollout.in_flight" in result.output, result.output  # not its controllers
    assert "in-flight controllers cannot step its rows there yet" in result.output, result.output
    ray = ["--set", "executor.kind=ray"]
    result = CliRunner().invoke(app, ["validate", str(QUICK), *stale, *ray])
    assert result.exit_code == 0, result.output  # replicas on the transformers engine run it (test_ray_lifecycle)
    for mode in (stale, ["--set", "lifecycle.mode=pipelined", "--set", "update.with.correction.use=tis"]):
        result = CliRunner().invoke(app, ["validate", str(QUICK), *mode, *ray, *vllm])
        assert result.exit_code == 0, result.output  # and vLLM replicas (test_ray_vllm_lifecycle)
    in_flight = ["--set", "lifecycle.in_flight=true"]
    for engine in (vllm, []):  # not yet: a version that reaches the replicas mid-call
        for command in (["validate", str(QUICK)], ["run", str(QUICK), "--run-dir", str(tmp_path / "run")]):
            result = CliRunner().invoke(app, [*command, *stale, *ray, *engine, *in_flight])
            assert result.exit_code == 2 and "lifecycle.in_flight" in result.output, result.output
            assert "takes no version mid-call yet" in result.output, result.output
            assert "or run it on vLLM with `executor: {kind: prefect}` (or `local`)" in result.output
    assert not (tmp_path / "run").exists()
    result = CliRunner().invoke(app, ["validate", str(REPO / "pipelines" / "april_arith.yaml"), *stale, *ray, *vllm])
    assert result.exit_code == 2 and "stages.rollout.in_flight" in result.output, result.output  # nor controllers
    assert "in-flight control across Ray engine replicas is not supported yet" in result.output, result.output


def test_in_flight_updates_are_the_async_lifecycles_on_vllm_and_refused_elsewhere(tmp_path):
    """``lifecycle.in_flight: true`` (docs/async.md, "In-flight updates on vLLM"): accepted under
    ``async`` on vLLM; refused, with the fix, off vLLM (validate and run, exit 2), under another
    mode, and with in-flight controllers (vLLM's stale lifecycles refuse those already)."""
    stale = ["--set", "lifecycle.mode=async", "--set", "lifecycle.max_staleness=1",
             "--set", "update.with.correction.use=tis", "--set", "lifecycle.in_flight=true"]
    vllm = ["--set", "policy.engine=vllm", "--set", "policy.device=cpu", "--set", "policy.model=tiny-arith-h64"]
    assert CliRunner().invoke(app, ["validate", str(QUICK), *stale, *vllm]).exit_code == 0
    assert load_pipeline(QUICK, [a for a in stale + vllm if a != "--set"]).spec.lifecycle.in_flight is True
    for command in (["validate", str(QUICK)], ["run", str(QUICK), "--run-dir", str(tmp_path / "run")]):
        result = CliRunner().invoke(app, [*command, *stale])  # the transformers engine
        assert result.exit_code == 2 and "lifecycle.in_flight" in result.output, result.output
        assert "which only the vLLM engine does so far" in result.output
        assert "set `policy.engine: vllm`" in result.output
    assert not (tmp_path / "run").exists()
    result = CliRunner().invoke(app, ["validate", str(REPO / "pipelines" / "april_arith.yaml"), *stale, *vllm])
    assert result.exit_code == 2 and "in-flight controllers cannot step its rows there yet" in result.output
    result = CliRunner().invoke(app, ["validate", str(QUICK), *stale, *vllm, "--set", "executor.kind=ray"])
    assert result.exit_code == 2 and "takes no version mid-call yet" in result.output, result.output  # not on Ray
    with pytest.raises(GfcrError) as info:  # the spec's own error (a SpecError)
        load_pipeline(QUICK, ["lifecycle.mode=pipelined", "lifecycle.in_flight=true", "update.with.correction.use=tis"])
    assert "`lifecycle.in_flight` is the asynchronous lifecycle's" in str(info.value)
    assert load_spec_text(BASE).lifecycle.in_flight is None  # off by default, and not written back
    assert "in_flight" not in str(load_spec_text(BASE + "lifecycle: {mode: async, max_staleness: 1}\n").to_data())


BEGIN, END = "<!-- lifecycle table: begin -->\n", "<!-- lifecycle table: end -->\n"


def test_the_docs_table_is_the_rendered_one():
    docs = REPO / "docs" / "async.md"
    head, rest = docs.read_text().split(BEGIN, 1)
    table, tail = rest.split(END, 1)
    expected = lifecycle_table([stage_info(alias) for alias in STAGES.names()])
    if os.environ.get("GFCR_WRITE_DOCS"):
        docs.write_text(head + BEGIN + expected + END + tail)
        return
    assert table == expected, ("docs/async.md's table is out of date; rewrite it with "
                               "GFCR_WRITE_DOCS=1 pytest tests/graph/test_lifecycle.py -k docs_table\n" + expected)
