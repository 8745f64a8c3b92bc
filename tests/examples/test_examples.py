"""The top-level examples work: the Python-built pipeline runs, and the third-party stage
package installs with pip, is listed by `gfcr stages --json` and passes the conformance
checks; docs/writing-a-stage.md shows exactly the package's stage code."""

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
DOC = REPO / "docs" / "writing-a-stage.md"
GFCR = Path(sys.executable).with_name("gfcr")
ALIAS = "filter.max_mean_length"


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


def test_package_stage_passes_the_conformance_checks(package_env):
    """gfcr's own conformance tests (tests/stages/test_conformance.py), called on the installed
    stage: ports, Config round-trip through the docstring's YAML, the doctest, Deviations."""
    code = (
        "from tests.stages import test_conformance as c\n"
        f"for check in (c.test_ports_are_annotated, c.test_config_round_trips_through_yaml,\n"
        f"              c.test_docstring_example_runs, c.test_docstring_states_deviations_or_is_a_test_stage):\n"
        f"    check({ALIAS!r})\n"
        f"    print(check.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=package_env, cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.split()) == 4


def test_writing_a_stage_shows_the_package_code():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    stage_blocks = [b for b in blocks if b.startswith('"""filter.max_mean_length')]
    assert stage_blocks == [STAGE_FILE.read_text(encoding="utf-8")]


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
