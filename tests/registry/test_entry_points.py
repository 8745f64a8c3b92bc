"""A third-party package registers a stage through the `gfcr.stages` entry point only: it is
installed for real (pip, into a temporary target), listed by `gfcr stages --json`, and runs
inside a pipeline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, install_package

PLUGIN = REPO / "tests" / "fixtures" / "gfcr_plugin_example"
GFCR = Path(sys.executable).with_name("gfcr")

PIPELINE = """\
name: with-plugin
data: {source: arithmetic, with: {n: 40}}
stages:
  pick:    {use: control.uniform, with: {batch_size: 8}}
  budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
  rollout: {use: generate.fake, from: budget}
  good:    {use: filter.min_mean_reward, from: rollout, with: {threshold: 0.5}}
update: {use: update.fake, from: good}
run: {steps: 2}
"""


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    return install_package(PLUGIN, tmp_path_factory)


def test_plugin_stage_is_listed_with_its_origin(plugin_env):
    out = subprocess.run([str(GFCR), "stages", "--json"], env=plugin_env, check=True, capture_output=True, text=True)
    stages = {s["alias"]: s for s in json.loads(out.stdout)}
    plugin = stages["filter.min_mean_reward"]
    assert plugin["origin"] == "gfcr-plugin-example" and plugin["family"] == "filter"
    assert plugin["inputs"] == [{"name": "groups", "type": "RolloutGroups", "required": True, "from_runtime": False}]
    assert plugin["config"]["properties"]["threshold"]["type"] == "number"
    assert stages["control.uniform"]["origin"] == "gfcr"


def test_plugin_stage_runs_in_a_pipeline(plugin_env, tmp_path):
    spec = tmp_path / "p.yaml"
    spec.write_text(PIPELINE)
    code = (
        "import sys\n"
        "from gfcr.graph import load_pipeline\n"
        "from gfcr.runtime import LocalRunner\n"
        "reports = LocalRunner(load_pipeline(sys.argv[1])).run()\n"
        "for r in reports:\n"
        "    dropped = [g.verdict.dropped_by for g in r.groups if not g.verdict.included]\n"
        "    kept = [g.stats.reward_mean for g in r.groups if g.verdict.included]\n"
        "    assert set(dropped) <= {'good'} and all(m >= 0.5 for m in kept)\n"
        "    print(r.step, len(dropped), len(kept))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(spec)], env=plugin_env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = [list(map(int, line.split())) for line in out.stdout.split("\n") if line]
    assert [step for step, _, _ in lines] == [0, 1]
    assert sum(dropped for _, dropped, _ in lines) > 0 and sum(kept for _, _, kept in lines) > 0


def test_without_the_plugin_the_alias_is_unknown():
    out = subprocess.run([str(GFCR), "stages", "--json"], capture_output=True, text=True, check=True)
    assert "filter.min_mean_reward" not in {s["alias"] for s in json.loads(out.stdout)}
