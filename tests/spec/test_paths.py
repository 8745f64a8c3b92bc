"""One rule for every path in a spec (issue 40): relative to the pipeline file's folder (the current
directory for `--set` values and specs built in Python); a data file that cannot be read is
reported at the spec's `file:line:col`, like every other spec error."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.graph import load_pipeline
from gfcr.registry import STAGES, path_keys
from tests.conftest import REPO

SPEC = textwrap.dedent("""\
    name: paths
    policy: {model: models/tiny, engine: hf}
    data: {source: jsonl, with: {path: data/sums.jsonl, verifier: arithmetic}}
    eval: {source: jsonl, with: {path: ../shared-data/eval.jsonl, verifier: arithmetic}, every: 1}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 2}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 2}}
      rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 4}}
      reward:  {use: filter.verify, from: rollout}
    update: {use: update.grpo, from: reward}
    run: {steps: 1}
    tracking: {mlflow: null}
    """)
ROWS = '{"prompt": "2 + 2?", "answer": 4}\n{"prompt": "3 + 5?", "answer": "8"}\n'


@pytest.fixture
def project(tmp_path: Path, monkeypatch) -> Path:
    """A pipeline in project/pipelines/ whose data, eval file and model folder are written relative
    to it; the command runs from elsewhere."""
    folder = tmp_path / "project" / "pipelines"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "sums.jsonl").write_text(ROWS)
    (tmp_path / "project" / "shared-data").mkdir()
    (tmp_path / "project" / "shared-data" / "eval.jsonl").write_text(ROWS)
    (folder / "models").mkdir()
    (folder / "models" / "tiny").symlink_to(REPO / "gfcr" / "assets" / "tiny-arith")
    (folder / "pipe.yaml").write_text(SPEC)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return folder


def test_relative_paths_are_relative_to_the_pipeline_file(project):
    spec = load_pipeline(project / "pipe.yaml").spec
    assert spec.data.with_["path"] == str(project / "data" / "sums.jsonl")
    assert spec.eval.with_["path"] == str(project.parent / "shared-data" / "eval.jsonl")
    assert spec.policy.model == str(project / "models" / "tiny")
    result = CliRunner().invoke(app, ["validate", str(project / "pipe.yaml")])
    assert result.exit_code == 0, result.output


def test_the_run_directory_s_spec_keeps_the_resolved_paths(project):
    """The copy of the spec in the run directory finds the same files (gfcr resume reads it)."""
    text = load_pipeline(project / "pipe.yaml").spec.to_yaml()
    assert str(project / "data" / "sums.jsonl") in text and "models/tiny" in text and str(project) in text


def test_a_set_value_is_relative_to_the_current_directory(project):
    Path("mine.jsonl").write_text(ROWS)
    spec = load_pipeline(project / "pipe.yaml", ["data.with.path=mine.jsonl"]).spec
    assert spec.data.with_["path"] == str(Path.cwd() / "mine.jsonl")


def test_a_missing_data_file_is_reported_at_the_spec_s_line_with_the_rule(project):
    (project / "data" / "sums.jsonl").unlink()
    result = CliRunner().invoke(app, ["validate", str(project / "pipe.yaml")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{project / 'pipe.yaml'}:3:36: data.with.path: the `jsonl` data file: {project / 'data' / 'sums.jsonl'} " \
           "does not exist" in result.output
    assert "a relative path starts at the pipeline file's folder" in result.output


def test_every_path_a_stage_declares_is_found():
    assert path_keys(STAGES.get("replay.rlep").Config) == [("seed_from", "run_dir"), ("seed_from", "jsonl")]
