"""A damaged newest checkpoint with an older one intact (issue 31, item 2): `gfcr resume` says
which checkpoint is damaged and why, sets it aside, continues from the newest intact one with
metrics.jsonl and lineage/ cut back to its step, and ends with exactly the metrics of an
uninterrupted run; `--strict` refuses instead (exit 2). The damage is real: bytes flipped or
cut in the files on disk, including files a stage owns (its state, its own files).

The fast tests use the fake-engine example (labelled test stages: no model); the slow matrix
runs real tiny-arith pipelines whose stages own files: a replay buffer (DOTS rollout replay),
a partial-rollout buffer (APRIL), a draft store (SPEC-RL) and an error memory (MEDS)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gfcr.errors import CheckpointError
from gfcr.graph import load_pipeline
from gfcr.runtime.store.rundir import RunDir
from gfcr.runtime.loop.session import Run
from tests.conftest import REPO

FAKE = REPO / "pipelines" / "examples" / "fake_dapo.yaml"
GFCR = [sys.executable, "-m", "gfcr.cli.main"]
STEPS = 4


def flip(path: Path) -> None:
    """One bit flipped in the middle: same size, another sha256 (what a bad disk or a stray write does)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def cut(path: Path) -> None:
    """The file cut to half its length (a write that stopped)."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "time"}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _lineage(run_dir: Path) -> dict[str, bytes]:
    """Each lineage file's rows (the parquet file's table, compared as Python values)."""
    import pyarrow.parquet as pq

    return {p.name: pq.read_table(p).to_pylist() for p in sorted((run_dir / "lineage").iterdir())}


def _run(spec: Path, run_dir: Path, overrides: list[str]) -> None:
    Run.start(load_pipeline(spec, overrides), run_dir).train()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The fake example run for STEPS steps, a checkpoint after every step, all kept."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    _run(FAKE, run_dir, [f"run.steps={STEPS}", "run.checkpoint_every=1", f"run.keep_checkpoints={STEPS}",
                         "executor.kind=local"])
    return run_dir


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns(".lock"))
    return copy


@pytest.mark.parametrize("damage, file", [
    (flip, "stages/pick/state.json"),  # a stage's state: same size, another hash
    (cut, "runner.json"),  # (update.fake keeps no state: its version is the runner's)
    (flip, "rng/torch.safetensors"),
    (cut, "manifest.json"),
])
def test_resume_passes_over_a_damaged_newest_checkpoint_and_ends_as_if_uninterrupted(
        uninterrupted, tmp_path, damage, file):
    run_dir = _copy(uninterrupted, tmp_path)
    newest = run_dir / "checkpoints" / f"step-{STEPS:06d}"
    damage(newest / file)
    run = Run.resume(run_dir, steps=STEPS + 1)
    (skipped,) = run.skipped_checkpoints
    assert skipped.message.startswith(str(newest / file))  # which file, then why
    assert run.last_checkpoint == RunDir(run_dir).checkpoint(STEPS - 1)
    assert (run_dir / "checkpoints" / f"damaged-step-{STEPS:06d}").is_dir()  # kept to look at, never loaded
    run.train()
    reference = _copy(uninterrupted, tmp_path / "ref")
    Run.resume(reference, steps=STEPS + 1).train()
    assert _metrics(run_dir) == _metrics(reference)
    assert _lineage(run_dir) == _lineage(reference)


@pytest.mark.slow  # the CLI in a subprocess: about 20 s on 2 busy cores; the same logic runs in-process above
def test_gfcr_resume_says_which_checkpoint_is_damaged_and_where_it_goes_on(uninterrupted, tmp_path):
    run_dir = _copy(uninterrupted, tmp_path)
    target = run_dir / "checkpoints" / f"step-{STEPS:06d}" / "stages" / "pick" / "state.json"
    flip(target)
    done = subprocess.run(GFCR + ["resume", str(run_dir), "--executor", "local"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"skipped a damaged checkpoint: {target} is corrupt: its sha256 differs" in done.stderr
    assert f"continuing from {run_dir / 'checkpoints' / f'step-{STEPS - 1:06d}'}" in done.stderr
    assert _metrics(run_dir) == _metrics(uninterrupted)


def test_two_damaged_checkpoints_are_passed_over_and_the_metrics_and_lineage_cut_back_to_the_third(
        uninterrupted, tmp_path):
    run_dir = _copy(uninterrupted, tmp_path)
    cut(run_dir / "checkpoints" / f"step-{STEPS:06d}" / "stages" / "pick" / "state.json")
    flip(run_dir / "checkpoints" / f"step-{STEPS - 1:06d}" / "runner.json")
    run = Run.resume(run_dir, steps=STEPS)
    newest, second = run.skipped_checkpoints
    assert newest.message.startswith(f"{run_dir}/checkpoints/step-{STEPS:06d}/stages/pick/state.json has ")
    assert second.message.startswith(f"{run_dir}/checkpoints/step-{STEPS - 1:06d}/runner.json is corrupt: its sha256")
    assert run.runner.step == STEPS - 2 and run.last_checkpoint == RunDir(run_dir).checkpoint(STEPS - 2)
    assert len(_metrics(run_dir)) == STEPS - 2  # cut back to the checkpoint: those steps run again
    assert max(int(n[-14:-8]) for n in _lineage(run_dir)) == STEPS - 3
    run.train()
    assert _metrics(run_dir) == _metrics(uninterrupted)
    assert _lineage(run_dir) == _lineage(uninterrupted)


def test_strict_resume_refuses_a_damaged_newest_checkpoint_and_changes_nothing(uninterrupted, tmp_path):
    run_dir = _copy(uninterrupted, tmp_path)
    target = run_dir / "checkpoints" / f"step-{STEPS:06d}" / "stages" / "pick" / "state.json"
    flip(target)
    before = (run_dir / "metrics.jsonl").read_bytes()
    done = subprocess.run(GFCR + ["resume", str(run_dir), "--steps", str(STEPS + 1), "--strict"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    text = done.stderr.replace("\n", "")
    assert "the newest checkpoint is damaged" in text and f"{target} is corrupt: its sha256" in text
    assert "without --strict" in text and "Traceback" not in text
    assert (run_dir / "metrics.jsonl").read_bytes() == before
    assert (run_dir / "checkpoints" / f"step-{STEPS:06d}").is_dir()
    with pytest.raises(CheckpointError, match="the newest checkpoint is damaged"):
        Run.resume(run_dir, steps=STEPS + 1, strict=True)


# --- stages that own files: real tiny-arith pipelines --------------------------------------------

OWNERS = {  # pipeline -> (stage id, the file of its own that is damaged, relative to its stage folder)
    "dots_rr_arith": ("replay", "files/entries.parquet"),  # the replay buffer's rollouts
    "april_arith": ("rollout", "state.json"),  # the partial-rollout buffer
    "spec_rl_arith": ("rollout", "state.json"),  # the draft store
    "meds_arith": ("meds", "state.json"),  # the error memory
}
SMALL = ["run.steps=3", "run.checkpoint_every=1", "run.keep_checkpoints=3", "eval=null", "executor.kind=local",
         "tracking.mlflow=null"]


@pytest.mark.slow  # four real pipelines, each run twice: minutes on 2 cores
@pytest.mark.parametrize("name", sorted(OWNERS))
def test_a_damaged_file_a_stage_owns_is_caught_by_the_manifest_and_the_run_goes_on(name, tmp_path):
    spec = REPO / "pipelines" / f"{name}.yaml"
    sid, own = OWNERS[name]
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    _run(spec, reference, SMALL)
    _run(spec, run_dir, SMALL)
    files = sorted((run_dir / "checkpoints" / "step-000003" / "stages" / sid).rglob("*"))
    target = run_dir / "checkpoints" / "step-000003" / "stages" / sid / own
    assert target in files, [str(f) for f in files]
    flip(target)
    run = Run.resume(run_dir, steps=3)
    (skipped,) = run.skipped_checkpoints
    assert f"{target} is corrupt: its sha256 differs from the manifest's" in skipped.message
    assert run.runner.step == 2
    run.train()
    assert _metrics(run_dir) == _metrics(reference)
