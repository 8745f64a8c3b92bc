"""The top-level examples work: the Python-built pipeline runs, and the third-party stage
package installs with pip, its two stages are listed by `gfcr stages --json` and pass the
conformance checks, `control.skip_solved` runs a few steps on the fake engine and
docs/writing-a-stage.md shows exactly the package's code and what `gfcr stages` and
`gfcr validate` print for it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, install_package

EXAMPLES = REPO / "examples"
PACKAGE = EXAMPLES / "gfcr-stage-example"
STAGE_FILE = PACKAGE / "gfcr_stage_example" / "max_mean_length.py"
SELECTOR_FILE = PACKAGE / "gfcr_stage_example" / "skip_solved.py"
SELECTOR_SPEC = PACKAGE / "skip_solved_arith.yaml"
DOC = REPO / "docs" / "writing-a-stage.md"
GFCR = Path(sys.executable).with_name("gfcr")
ALIAS = "filter.max_mean_length"
SELECTOR = "control.skip_solved"


def test_python_pipeline_runs_two_steps():
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(EXAMPLES / "python_pipeline.py")], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 1"]
    assert "groups 12" in lines[0] and "policy_version" in lines[0]


@pytest.fixture(scope="module")
def package_env(tmp_path_factory):
    return install_package(PACKAGE, tmp_path_factory)


def test_package_stage_is_listed(package_env):
    out = subprocess.run([str(GFCR), "stages", "--json"], env=package_env, check=True, capture_output=True, text=True)
    stage = {s["alias"]: s for s in json.loads(out.stdout)}[ALIAS]
    assert stage["origin"] == "gfcr-stage-example" and stage["family"] == "filter"
    assert stage["inputs"] == [{"name": "groups", "type": "RolloutGroups", "required": True, "from_runtime": False}]
    assert stage["output"] == "RolloutGroups"
    assert stage["config"]["properties"]["max_tokens"]["type"] == "integer"


@pytest.mark.parametrize("alias", [ALIAS, SELECTOR])
def test_package_stage_passes_the_conformance_checks(package_env, alias, tmp_path):
    """The shipped conformance kit (``python -m gfcr.testing``), run on the installed stage from a
    folder outside the repository: ports, Config round-trip through the docstring's YAML, the
    doctest, Deviations, Fidelity."""
    out = subprocess.run([sys.executable, "-m", "gfcr.testing", alias], env=package_env, cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == [f"✓ {alias}: {check}" for check in
                                       ("check_ports", "check_config_round_trip", "check_docstring_example",
                                        "check_deviations", "check_fidelity")]


def test_writing_a_stage_shows_the_package_code():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    stage_blocks = [b for b in blocks if b.startswith('"""filter.max_mean_length')]
    assert stage_blocks == [STAGE_FILE.read_text(encoding="utf-8")]


def _blocks(language: str) -> list[str]:
    """The guide's fenced blocks of ``language`` ("" for the plain ones), in order."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", DOC.read_text(encoding="utf-8"), re.S | re.M)
    return [body for lang, body in blocks if lang == language]


def test_writing_a_stage_shows_the_selector_and_its_pipeline():
    assert [b for b in _blocks("python") if b.startswith(f'"""{SELECTOR}')] == [SELECTOR_FILE.read_text("utf-8")]
    assert [b for b in _blocks("yaml") if b.startswith("name: skip-solved")] == [SELECTOR_SPEC.read_text("utf-8")]
    entry_points = [b for b in _blocks("toml") if SELECTOR in b]
    assert len(entry_points) == 1 and entry_points[0] in (PACKAGE / "pyproject.toml").read_text("utf-8")


def test_selector_is_listed_with_its_roles(package_env):
    out = subprocess.run([str(GFCR), "stages", "--json"], env=package_env, check=True, capture_output=True, text=True)
    stage = {s["alias"]: s for s in json.loads(out.stdout)}[SELECTOR]
    assert stage["origin"] == "gfcr-stage-example" and stage["output"] == "Allocation"
    assert [(p["type"], p["from_runtime"]) for p in stage["inputs"]] == [("PromptPool", True)]
    assert stage["observes"] and stage["stateful"] and stage["config"]["required"] == ["batch_size"]


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("│").split("│")]


def test_writing_a_stage_shows_the_gfcr_stages_row(package_env):
    (shown,) = [line for b in _blocks("") for line in b.splitlines() if line.startswith(f"│ {SELECTOR} ")]
    out = subprocess.run([str(GFCR), "stages", "--family", "control"], env={**package_env, "COLUMNS": "400"},
                         check=True, capture_output=True, text=True)
    (real,) = [line for line in out.stdout.splitlines() if line.startswith(f"│ {SELECTOR} ")]
    assert _cells(shown) == _cells(real)


def _validate_cases(tmp_path: Path) -> dict[str, str]:
    """The files the guide validates: the package's pipeline, without its verifier, with 12 prompts."""
    spec = SELECTOR_SPEC.read_text("utf-8")
    no_verifier = spec.replace("  reward:  {use: filter.verify, from: rollout}\n", "").replace("from: reward", "from: rollout")
    files = {SELECTOR_SPEC.name: spec, "no_verifier.yaml": no_verifier, "small_data.yaml": spec.replace("n: 400", "n: 12")}
    assert len(set(files.values())) == 3
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return files


def test_writing_a_stage_shows_what_gfcr_validate_prints(package_env, tmp_path):
    cases = _validate_cases(tmp_path)
    shown = {b.splitlines()[0].removeprefix("$ gfcr validate "): b.split("\n", 1)[1]
             for b in _blocks("") if b.startswith("$ gfcr validate ")}
    shown = {name: text for name, text in shown.items() if not name.startswith("not_easy")}  # the plugin's: its own test
    assert sorted(shown) == sorted(cases)
    for name, expected in shown.items():
        out = subprocess.run([str(GFCR), "validate", name], env=package_env, cwd=tmp_path, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert out.returncode == (0 if name == SELECTOR_SPEC.name else 2), out.stdout
        assert out.stdout == expected


FAKE_SPEC = """\
name: skip-solved-fake
data: {source: arithmetic, with: {n: 12}}
stages:
  pick:    {use: control.skip_solved, with: {batch_size: 4, solved_streak: 1}}
  budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
  rollout: {use: generate.fake, from: budget}
update: {use: update.fake, from: rollout}
run: {steps: 9, seed: 0}
executor: {kind: local}
tracking: {mlflow: null}
"""


def test_selector_runs_on_the_fake_engine_and_skips_what_it_saw_solved(package_env, tmp_path):
    (tmp_path / "fake.yaml").write_text(FAKE_SPEC)
    out = subprocess.run([str(GFCR), "run", "fake.yaml", "--run-dir", "run"], env=package_env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(9)) and all(s["prompts"] == 4 for s in steps)
    import pandas as pd

    lineage = pd.concat(pd.read_parquet(p) for p in sorted((tmp_path / "run" / "lineage").glob("control-*.parquet")))
    skipped = lineage[lineage["n_rollouts"] == 0]
    assert len(skipped) > 0 and set(skipped["code"]) == {"solved"}
    assert set(lineage[lineage["n_rollouts"] > 0]["code"]) == {"unsolved"}
    groups = pd.concat(pd.read_parquet(p) for p in sorted((tmp_path / "run" / "lineage").glob("step-*.parquet")))
    all_correct = groups.groupby(["prompt_id", "step"])["correct"].all()
    for row in skipped.itertuples():  # skipped only after its latest group was all correct, and not rolled out
        history = all_correct[row.prompt_id]
        assert history[history.index < row.step].iloc[-1] and row.step not in history.index


def test_gfcr_run_and_resume_from_python_track_to_mlflow(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(EXAMPLES / "run_from_python.py"), str(tmp_path)], env=env,
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^ran 4 steps: eval accuracy 0\.\d+ -> 0\.\d+, \d+ tokens generated$", out.stdout, re.M)
    assert "resumed to 6 steps; metrics.jsonl has steps [0, 1, 2, 3, 4, 5]" in out.stdout
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "quickstart"]
    (tracked,) = client.search_runs([experiment.experiment_id])  # the resume continued the same run
    assert tracked.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(tracked.info.run_id, "reward_mean")] == list(range(6))
