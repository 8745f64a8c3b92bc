"""`gfcr report` on hand-written run directories: variants and labels, the table's numbers
computed by hand, the curves, the files and the command line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.errors import GfcrError
from gfcr.tracking.report import markdown_table, series_from_run_dirs, write_report
from tests.conftest import BASE
from gfcr.tracking.report_variants import default_target, eval_curve, group_variants, table_row, tokens_curve

cli = CliRunner()


def write_run(path: Path, *, seed: int, n: int, tokens: list[int], evals: dict[int, float],
              final: float | None, step_s: float = 1.0, eval_s: float = 0.5, zero_variance=None,
              in_update=None, spec: dict | None = None) -> Path:
    """A run directory as `gfcr run` writes it: spec.yaml (the fake pipeline with ``n`` rollouts
    per prompt), metrics.jsonl and summary.json, with 8 rollouts and 2 groups per step."""
    spec = spec or yaml.safe_load(BASE)
    if "stages" in spec:
        spec["stages"]["budget"]["with"]["n"] = n
    spec["run"] = {"steps": len(tokens), "seed": seed, "checkpoint_every": 1 + seed}  # the latter is ignored
    zero_variance = zero_variance or [0] * len(tokens)
    in_update = in_update or [(8, t) for t in tokens]
    path.mkdir(parents=True)
    (path / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    lines = []
    for step, (t, zv, (ru, tu)) in enumerate(zip(tokens, zero_variance, in_update)):
        record = {"step": step, "rollouts_generated": 8, "tokens_generated": t, "rollouts_in_update": ru,
                  "tokens_in_update": tu, "groups": 2, "zero_variance_groups": zv, "time": {"step_s": step_s}}
        if step in evals:
            record["eval_accuracy"] = evals[step]
            record["time"]["eval_s"] = eval_s
        lines.append(json.dumps(record) + "\n")
    (path / "metrics.jsonl").write_text("".join(lines))
    (path / "summary.json").write_text(json.dumps({"steps": len(tokens), "eval_accuracy_after": final}))
    return path


def toy_runs(base: Path) -> list[Path]:
    """Two variants: n=4 with seeds 0 and 1, n=8 with seed 0 (4 steps, evals at 0 and 2, final at 4)."""
    return [
        write_run(base / "a0", seed=0, n=4, tokens=[40, 50, 60, 70], evals={0: 0.1, 2: 0.3},
                  final=0.4, zero_variance=[0, 1, 0, 2], in_update=[(8, 40), (4, 20), (8, 60), (0, 0)]),
        write_run(base / "a1", seed=1, n=4, tokens=[30, 30, 30, 30], evals={0: 0.1, 2: 0.2},
                  final=0.3, step_s=2.0, eval_s=0.0),
        write_run(base / "b0", seed=0, n=8, tokens=[10, 10, 10, 10], evals={0: 0.1, 2: 0.2},
                  final=0.25),
    ]


def test_seeds_group_into_variants_labelled_by_the_keys_that_differ(tmp_path):
    variants = group_variants(series_from_run_dirs(toy_runs(tmp_path)))
    assert [v.label for v in variants] == ["stages.budget.with.n=4", "stages.budget.with.n=8"]
    assert [v.seeds for v in variants] == [(0, 1), (0,)]  # run.checkpoint_every differs and is ignored
    assert variants[0].runs[0].params["stages.pick.with.seed"] == "None"  # resolved: defaults included


def test_an_old_spec_groups_by_its_keys_as_written_and_a_variant_tag_wins(tmp_path):
    """Specs this gfcr no longer accepts still group; a key one variant lacks shows as unset."""
    old = {"name": "old", "tracking": {"backend": "none"}}
    runs = series_from_run_dirs([
        write_run(tmp_path / "x", seed=0, n=4, tokens=[1], evals={}, final=None, spec=dict(old)),
        write_run(tmp_path / "y", seed=0, n=4, tokens=[1], evals={}, final=None, spec={**old, "eval": {"every": 5}}),
    ])
    assert [v.label for v in group_variants(runs)] == ["eval.every=(unset)", "eval.every=5"]
    assert [v.label for v in group_variants([replace(runs[0], variant="baseline")])] == ["baseline"]


def test_the_table_matches_numbers_computed_by_hand(tmp_path):
    variants = group_variants(series_from_run_dirs(toy_runs(tmp_path)))
    a, b = (table_row(v, 0.3) for v in variants)
    # final: (0.4 + 0.3) / 2; seed 0 reaches 0.3 at the step-2 eval, after steps 0-1: 16 rollouts, 40+50 tokens;
    # seed 1 only at the final eval, after all 4 steps: 32 rollouts, 120 tokens
    assert a.final_accuracy == pytest.approx(0.35) and (a.final_min, a.final_max) == (0.3, 0.4)
    assert (a.rollouts_to_target, a.tokens_to_target, a.seeds_reaching) == (24, 105, 2)
    assert a.wall_seconds == pytest.approx(((4 * 1.0 + 2 * 0.5) + 4 * 2.0) / 2)
    assert (b.final_accuracy, b.rollouts_to_target, b.tokens_to_target, b.seeds_reaching) == (0.25, None, None, 0)
    assert table_row(variants[0], 0.1).rollouts_to_target == 0  # reached by the eval before any step


def test_the_default_target_is_the_highest_accuracy_every_run_reaches(tmp_path):
    variants = group_variants(series_from_run_dirs(toy_runs(tmp_path)))
    assert default_target(variants) == 0.25  # the runs peak at 0.4, 0.3 and 0.25
    b = table_row(variants[1], default_target(variants))
    assert (b.rollouts_to_target, b.tokens_to_target) == (32, 40)  # the final eval, after all four steps


def test_curves_average_seeds_point_by_point(tmp_path):
    mean_std = group_variants(series_from_run_dirs(toy_runs(tmp_path)))[0]
    rollouts = eval_curve(mean_std, "rollouts_generated")
    assert rollouts.x == (0, 16, 32)
    assert rollouts.y == pytest.approx((0.1, 0.25, 0.35))
    assert (rollouts.lo, rollouts.hi) == ((0.1, 0.2, 0.3), (0.1, 0.3, 0.4))
    assert eval_curve(mean_std, "tokens_generated").x == (0, (90 + 60) / 2, (220 + 120) / 2)
    tokens = tokens_curve(mean_std)  # (used, generated) after each step; seed 0 drops some, seed 1 none
    assert tokens.x[:3] == (0, (40 + 30) / 2, (60 + 60) / 2) and tokens.y[-1] == (220 + 120) / 2


def test_write_report_writes_the_page_the_table_and_four_plots(tmp_path):
    paths = write_report(series_from_run_dirs(toy_runs(tmp_path / "runs")), tmp_path / "report", target=0.3)
    assert sorted(p.name for p in tmp_path.joinpath("report").iterdir()) == sorted(
        ["index.html", "report.md", "report.json", "accuracy_vs_rollouts.png", "accuracy_vs_tokens.png",
         "zero_variance.png", "tokens_generated_vs_used.png"])
    table = markdown_table(paths.rows, 0.3)
    assert "| stages.budget.with.n=4 | 0, 1 | 0.350 (0.300-0.400) | 24 | 105 | 6.5 |" in table
    assert "| stages.budget.with.n=8 | 0 | 0.250 | not reached (0/1 seeds) | not reached (0/1 seeds) |" in table
    assert table in paths.markdown.read_text()
    page = paths.html.read_text()
    assert all(f'<img src="{p.name}"' in page for p in paths.plots.values()) and "not reached (0/1 seeds)" in page
    assert json.loads(paths.json.read_text())["rows"][0]["tokens_to_target"] == 105
    for png in paths.plots.values():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_cli_report_prints_the_paths_and_the_table(tmp_path):
    runs = toy_runs(tmp_path / "runs")
    result = cli.invoke(app, ["report", *map(str, runs), "--target", "0.3"])
    assert result.exit_code == 0, result.output
    assert f"wrote {tmp_path / 'runs' / 'report' / 'index.html'}" in result.output  # beside the first run
    assert "| stages.budget.with.n=4 | 0, 1 | 0.350 (0.300-0.400) | 24 | 105 | 6.5 |" in result.output


@pytest.mark.parametrize("args, message", [
    ([], "give either run directories or --experiment NAME"),
    (["somewhere", "--experiment", "x"], "give either run directories or --experiment NAME"),
    (["somewhere", "--parent", "abc"], "--parent selects runs of an MLflow experiment"),
])
def test_cli_report_rejects_ambiguous_sources(args, message):
    result = cli.invoke(app, ["report", *args])
    assert result.exit_code == 2 and message in result.output


def test_a_folder_without_metrics_says_what_to_pass(tmp_path):
    with pytest.raises(GfcrError, match="not a gfcr run directory with metrics \\(no spec.yaml\\)"):
        series_from_run_dirs([tmp_path])
    result = cli.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2 and "fix: pass folders that `gfcr run` printed" in result.output
