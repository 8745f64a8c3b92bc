"""The command line: validate, graph, stages and run."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from gfcr.cli.main import app
from tests.conftest import BASE, DAPO, REPO

cli = CliRunner()
HEAVY = ("torch", "prefect", "mlflow", "vllm", "transformers")


def test_validate_ok_prints_the_plan(write_spec):
    result = cli.invoke(app, ["validate", str(write_spec(DAPO))])
    assert result.exit_code == 0, result.output
    assert "plan: [collect x<=3: pick -> budget -> rollout -> keep -> enough] -> update" in result.output


def test_validate_several_files_reports_each(write_spec):
    good = write_spec(BASE, "good.yaml")
    bad = write_spec(BASE.replace("control.uniform", "control.unifrom"), "bad.yaml")
    result = cli.invoke(app, ["validate", str(good), str(bad)])
    assert result.exit_code == 2
    assert "✓" in result.output and "bad.yaml:4:18: stages.pick.use: unknown stage" in result.output


def test_validate_imports_no_heavy_dependency(write_spec):
    """Any attempt to import torch, prefect, mlflow, vllm or transformers fails loudly."""
    code = (
        "import sys, importlib.abc\n"
        f"HEAVY = {HEAVY!r}\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in HEAVY:\n"
        "            raise ImportError('validate must not import ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from gfcr.cli.main import app\n"
        "sys.argv = ['gfcr', 'validate', sys.argv[1]]\n"
        "try:\n"
        "    app()\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in HEAVY))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(write_spec(DAPO))], capture_output=True, text=True,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("[]")


def test_stages_json_lists_every_stage_with_schema():
    result = cli.invoke(app, ["stages", "--json"])
    assert result.exit_code == 0
    stages = {s["alias"]: s for s in json.loads(result.output)}
    assert {"control.uniform", "control.fixed_n", "filter.nonzero_variance", "filter.dynamic_sampling",
            "generate.fake", "update.fake"} <= set(stages)
    ds = stages["filter.dynamic_sampling"]
    assert ds["family"] == "filter" and ds["can_end_loop"] and ds["output"] == "RolloutGroups"
    assert ds["config"]["required"] == ["target_groups"] and ds["origin"] == "gfcr"
    assert stages["generate.fake"]["testing"] and not stages["control.uniform"]["testing"]


def test_stages_table_and_family_filter():
    result = cli.invoke(app, ["stages", "--family", "control"])
    assert result.exit_code == 0 and "control.uniform" in result.output and "filter." not in result.output
    assert cli.invoke(app, ["stages", "--family", "controls"]).exit_code == 2


def test_graph_writes_a_drawing(write_spec, tmp_path):
    result = cli.invoke(app, ["graph", str(write_spec(DAPO)), "--out", str(tmp_path / "g.dot")])
    assert result.exit_code == 0, result.output
    assert "cluster_collect" in (tmp_path / "g.dot").read_text()


def test_run_writes_a_metrics_line_per_step_and_a_summary(write_spec, tmp_path):
    run_dir = tmp_path / "run"
    result = cli.invoke(app, ["run", str(write_spec(DAPO)), "--steps", "3", "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2]
    assert "rollouts generated / in update" in result.output and str(run_dir / "metrics.jsonl") in result.output
    assert sorted(p.name for p in (run_dir / "lineage").iterdir()) == [f"step-00000{i}.parquet" for i in range(3)]
