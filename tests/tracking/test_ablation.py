"""`gfcr ablate` (issue 5, item 3): the grid runs as MLflow child runs of one parent, as Prefect
subflows, and the report's table equals what the child runs hold in MLflow."""

from __future__ import annotations

import json
from statistics import mean

import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.errors import GfcrError
from gfcr.tracking.ablation import Cell, compile_cells, grid, parse_seeds, parse_vary
from gfcr.tracking.report import write_report
from gfcr.tracking.report_series import RunSeries, StepCounts
from tests.conftest import REPO

QUICKSTART = REPO / "pipelines" / "quickstart.yaml"


def test_the_grid_is_every_combination_for_every_seed():
    vary = parse_vary(["update.with.advantage=mean_std,median", "stages.budget.with.n=4,8"])
    cells = grid(vary, parse_seeds("0,1"))
    assert len(cells) == 8 and len(set(cells)) == 8
    assert cells[0] == Cell((("update.with.advantage", "mean_std"), ("stages.budget.with.n", "4")), 0)
    assert cells[0].overrides() == ["update.with.advantage=mean_std", "stages.budget.with.n=4", "run.seed=0"]
    assert cells[0].slug == "advantage=mean_std-n=4-seed0"


def test_vary_takes_list_and_mapping_values_whole():
    """Issue 30: commas inside brackets, braces and quotes do not split values."""
    (clip, loss, text), = [parse_vary(["update.with.loss.with.clip=[0.2,0.28],[0.2, 0.2]",
                                       "update.with.loss={use: ppo_clip, with: {clip: [0.1,0.2]}},{use: gspo}",
                                       "description='a, b',c"])]
    assert clip == ("update.with.loss.with.clip", ["[0.2,0.28]", "[0.2, 0.2]"])
    assert loss[1] == ["{use: ppo_clip, with: {clip: [0.1,0.2]}}", "{use: gspo}"]
    assert text[1] == ["'a, b'", "c"]
    cells = grid([clip], [0])
    assert [c.overrides()[0] for c in cells] == ["update.with.loss.with.clip=[0.2,0.28]",
                                                "update.with.loss.with.clip=[0.2, 0.2]"]
    assert len({c.slug for c in cells}) == 2
    assert [c.label for c in grid([loss], [0])] == ["loss=ppo_clip", "loss=gspo"]  # a mapping by its alias


def test_stage_swaps_get_readable_variant_names():
    """Issue 40: the folder and row of `--vary stages.pick.use=...` say which stage became what; a
    whole stage given as a mapping is named by its alias; mappings of one alias keep their text."""
    swap = parse_vary(["stages.pick.use=control.uniform,control.greso"])
    assert [(c.label, c.slug) for c in grid(swap, [1])] == [("pick=control.uniform", "pick=control.uniform-seed1"),
                                                           ("pick=control.greso", "pick=control.greso-seed1")]
    whole = parse_vary(["stages.budget={use: control.fixed_n, from: pick, with: {n: 8}},"
                        "{use: control.coba, from: pick, with: {mean_rollouts: 8}}"])
    assert [c.slug for c in grid(whole, [0])] == ["budget=control.fixed_n-seed0", "budget=control.coba-seed0"]
    same = parse_vary(["stages.budget={use: control.fixed_n, with: {n: 4}},{use: control.fixed_n, with: {n: 8}}"])
    assert [c.label for c in grid(same, [0])] == [f"stages.budget={v}" for v in same[0][1]]


def test_a_stage_swap_whose_settings_differ_compiles_in_every_cell():
    """`--vary stages.budget.use=control.fixed_n,control.coba`: the quickstart's `n` is dropped for
    CoBA (which has no such key) and kept for fixed_n; `--vary stages.pick.use=...` likewise."""
    vary = parse_vary(["stages.budget.use=control.fixed_n,control.coba", "stages.pick.use=control.uniform,control.greso"])
    compiled = compile_cells(QUICKSTART, grid(vary, [0]), [])
    budgets = {c.label: p.spec.stages["budget"].with_ for c, p in compiled.items()}
    assert budgets["budget=control.fixed_n, pick=control.greso"] == {"n": 8}
    assert budgets["budget=control.coba, pick=control.uniform"] == {}
    notes = {n for p in compiled.values() for n in p.spec.source.notes}
    assert notes == {"--set stages.budget.use=control.coba: dropped `n` from `stages.budget.with`, which "
                     "`control.coba` does not accept; set its own keys with --set stages.budget.with.KEY=VALUE"}


def _series(variant: str, seed: int, tokens: int) -> RunSeries:
    steps = tuple(StepCounts(i, 16, tokens, 12, tokens - 8, 4, 1, 1.0 + seed, 1.0, tokens - 8, 0) for i in range(3))
    return RunSeries(name=f"{variant}-{seed}", params={"name": "x"}, steps=steps, evals=((0, 0.25), (3, 0.5)),
                     seed=seed, variant=variant, source=f"{variant}{seed}")


def test_the_ablation_report_notes_identical_variants_as_compare_does(tmp_path):
    runs = [_series(v, seed, 40) for v in ("pick=control.uniform", "pick=control.greso") for seed in (0, 1)]
    runs += [_series("pick=control.dots", seed, 41) for seed in (0, 1)]
    report = write_report(runs, tmp_path)
    (note,) = report.notes
    assert note.startswith("`pick=control.uniform` and `pick=control.greso` gave identical results for every seed")
    assert f"**Note:** {note}" in report.markdown.read_text() and json.loads(report.json.read_text())["notes"] == [note]


def test_vary_values_compile_as_lists():
    """The two clip ranges reach the loss's Config as lists (the override parses each as YAML)."""
    from gfcr.graph import load_pipeline

    (key, values), = parse_vary(["update.with.loss.with.clip=[0.2,0.28],[0.2,0.2]"])
    clips = [load_pipeline(REPO / "pipelines" / "quickstart.yaml", [f"{key}={v}"]).spec.update.with_["loss"]["with"]["clip"]
             for v in values]
    assert clips == [[0.2, 0.28], [0.2, 0.2]]


@pytest.mark.parametrize("vary, message", [
    (["update.with.loss.with.clip=[0.2,0.28],[0.2"], "a bracket or quote is left open"),
    (["a.b=1]"], "a bracket or quote is left open"),
    (["update.with.advantage"], "expected KEY=V1,V2"),
    (["update.with.advantage=a,,b"], "expected KEY=V1,V2"),
    (["a.b=1", "a.b=2"], "varied twice"),
    (["run.seed=1,2"], "--seeds"),
])
def test_bad_vary_options_say_how_to_fix_them(vary, message):
    with pytest.raises(GfcrError, match=message):
        parse_vary(vary)


def test_a_bad_value_in_any_cell_fails_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["ablate", str(REPO / "pipelines" / "quickstart.yaml"),
                                      "--vary", "update.with.advantage.use=mean_std,medain", "--steps", "1"])
    assert result.exit_code == 2
    assert "medain" in result.output and "median" in result.output
    assert not (tmp_path / "runs").exists()


def _history(client, run_id: str, key: str) -> dict[int, float]:
    """The last value logged at each step (a resumed run may log a step twice)."""
    return {m.step: m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)}


def test_ablate_runs_four_child_runs_and_a_report_that_matches_them(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from gfcr.tracking.mlflow_store import resolve_uri

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["ablate", str(REPO / "pipelines" / "quickstart.yaml"),
                                      "--vary", "update.with.advantage.use=mean_std,median", "--seeds", "0,1",
                                      "--steps", "20"])
    assert result.exit_code == 0, result.output
    client = MlflowClient(resolve_uri())
    experiment = client.get_experiment_by_name("quickstart")
    (root,) = (tmp_path / "runs").glob("quickstart-ablation-*")
    (parent,) = client.search_runs([experiment.experiment_id],
                                   f"tags.`gfcr.run_dir` = '{root.resolve()}'")
    assert parent.info.status == "FINISHED"
    children = client.search_runs([experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert len(children) == 4 and all(c.info.status == "FINISHED" for c in children)
    assert {(c.data.tags["gfcr.variant"], c.data.tags["gfcr.seed"]) for c in children} == {
        (f"advantage={a}", s) for a in ("mean_std", "median") for s in ("0", "1")}
    assert {c.data.params["update.with.advantage.use"] for c in children} == {"mean_std", "median"}

    report = json.loads((root / "report" / "report.json").read_text())
    assert (root / "report" / "index.html").is_file() and (root / "report" / "report.md").is_file()
    rows = {row["variant"]: row for row in report["rows"]}
    assert set(rows) == {"advantage=mean_std", "advantage=median"}
    target = report["target"]
    for variant, row in rows.items():
        mine = [c for c in children if c.data.tags["gfcr.variant"] == variant]
        finals = [_history(client, c.info.run_id, "eval_accuracy")[20] for c in mine]  # evaluated after step 20
        assert row["final_accuracy"] == pytest.approx(mean(finals))
        assert (row["final_min"], row["final_max"]) == pytest.approx((min(finals), max(finals)))
        assert sorted(row["seeds"]) == [0, 1]
        reached = []
        for c in mine:
            accuracy = _history(client, c.info.run_id, "eval_accuracy")
            rollouts = _history(client, c.info.run_id, "rollouts_generated")
            first = min((s for s, a in accuracy.items() if a >= target - 1e-9), default=None)
            if first is not None:
                reached.append(sum(v for s, v in rollouts.items() if s < first))
        assert row["seeds_reaching"] == len(reached)
        if len(reached) == len(mine):
            assert row["rollouts_to_target"] == pytest.approx(mean(reached))
    assert "advantage=median" in result.output  # the table is printed too
