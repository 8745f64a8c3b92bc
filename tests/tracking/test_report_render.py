"""A report of real tiny-arith runs, checked against their run directories, and the HTML page
rendered by headless Chromium with every plot loaded (skipped without a Chromium binary)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from statistics import mean

import pytest
from matplotlib.image import imread
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run
from gfcr.tracking.report import series_from_run_dirs, write_report
from tests.conftest import REPO
from tests.tracking.test_report import toy_runs

cli = CliRunner()
SMALL = ["run.steps=3", "eval.every=2", "eval.with.n=8", "stages.pick.with.batch_size=4", "stages.budget.with.n=4",
         "executor.kind=local", "tracking.mlflow=null"]
CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome", "chrome")
                 if shutil.which(name)), None)
PROBE = ('<script>window.addEventListener("load", () => { const imgs = [...document.images];'
         ' document.body.setAttribute("data-plots", imgs.filter(i => i.complete && i.naturalWidth > 0).length'
         ' + "/" + imgs.length); });</script></body>')


def _read(run_dir: Path) -> tuple[list[dict], dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], json.loads((run_dir / "summary.json").read_text())


def _expected_to_target(run_dir: Path, target: float) -> tuple[int, int] | None:
    """Straight from the files: rollouts and tokens of the steps before the first eval >= target."""
    records, summary = _read(run_dir)
    evals = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    for step, accuracy in evals + [(summary["steps"], summary["eval_accuracy_after"])]:
        if accuracy >= target:
            before = [r for r in records if r["step"] < step]
            return sum(r["rollouts_generated"] for r in before), sum(r["tokens_generated"] for r in before)
    return None


def test_a_report_of_real_runs_holds_what_their_directories_hold(tmp_path):
    """Two advantage estimators x two seeds of a 3-step quickstart on tiny-arith (evals at 0, 2, 3)."""
    dirs = []
    for advantage in ("mean_std", "median"):
        for seed in (0, 1):
            overrides = [*SMALL, f"update.with.advantage.use={advantage}", f"run.seed={seed}"]
            dirs.append(tmp_path / f"{advantage}-{seed}")
            Run.start(load_pipeline(REPO / "pipelines" / "quickstart.yaml", overrides), dirs[-1]).train()
    result = cli.invoke(app, ["report", *map(str, dirs), "--out", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    target = data["target"]
    assert [r["variant"] for r in data["rows"]] == ["update.with.advantage.use=mean_std", "update.with.advantage.use=median"]
    for row, pair in zip(data["rows"], (dirs[:2], dirs[2:])):
        finals = [_read(d)[1]["eval_accuracy_after"] for d in pair]
        assert row["seeds"] == [0, 1] and row["final_accuracy"] == pytest.approx(mean(finals))
        hits = [_expected_to_target(d, target) for d in pair]
        expected = None if None in hits else mean(h[0] for h in hits)
        assert row["rollouts_to_target"] == expected and row["seeds_reaching"] == sum(h is not None for h in hits)
        steps = [r["time"]["step_s"] + r["time"].get("eval_s", 0.0) for d in pair for r in _read(d)[0]]
        assert row["wall_seconds"] == pytest.approx(sum(steps) / 2)
    assert f"| {data['rows'][0]['variant']} | 0, 1 |" in result.output


def _chromium(page: Path, profile: Path, *args: str) -> str:
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", "--hide-scrollbars", "--virtual-time-budget=5000", *args, page.as_uri()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium binary on PATH (Debian: apt-get install chromium; "
                                            "`make sysdeps` installs it when run as root)")
def test_the_page_renders_in_headless_chromium_with_every_plot_loaded(tmp_path):
    paths = write_report(series_from_run_dirs(toy_runs(tmp_path / "runs")), tmp_path / "report", target=0.3)
    probe = paths.out_dir / "probe.html"  # the page plus a script that counts the images that loaded
    probe.write_text(paths.html.read_text().replace("</body>", PROBE))
    assert 'data-plots="4/4"' in _chromium(probe, tmp_path / "profile", "--dump-dom")
    paths.plots["zero_variance"].unlink()  # the probe does notice a plot that fails to load
    assert 'data-plots="3/4"' in _chromium(probe, tmp_path / "profile", "--dump-dom")

    shot = tmp_path / "shot.png"
    _chromium(paths.html, tmp_path / "profile", "--window-size=1400,1300", f"--screenshot={shot}")
    pixels = imread(shot)[..., :3]  # [H, W, 3] floats in 0..1
    blue = (abs(pixels - (0x1F / 255, 0x77 / 255, 0xB4 / 255)).max(axis=-1) < 0.02).sum()  # tab10's first colour
    assert pixels.shape[:2] == (1300, 1400) and (pixels.min(axis=-1) < 0.9).mean() > 0.05 and blue > 500
