"""The allocators that keep no state across steps (``control.xrpo``, ``control.mc_grpo``,
``control.dars``: each rebuilds its plan from the step's own groups) still resume exactly: a
run stopped after its step-2 checkpoint, by a clean stop or by SIGKILL, and resumed, gives the
metrics of an uninterrupted run (apart from ``time``). Their shipped pipelines on 40 tiny-arith
prompts, 4 a step, 4 steps. (``control.dars``'s clean-stop resume is in test_dars.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run
from tests.conftest import REPO
from tests.killing import sigkill_after_step

SMALL = ["data.with.n=40", "stages.pick.with.batch_size=4", "eval=null", "run.checkpoint_every=2",
         "tracking.mlflow=null", "executor.kind=local"]
PIPELINES = ["xrpo_arith", "mc_grpo_arith", "dars_arith"]


def _spec(name: str, folder: Path, steps: int) -> Path:
    """The shipped pipeline with SMALL and ``steps`` applied, as a file (the killed run reads one)."""
    path = folder / f"{name}-{steps}.yaml"
    path.write_text(load_pipeline(REPO / "pipelines" / f"{name}.yaml", SMALL + [f"run.steps={steps}"]).spec.to_yaml())
    return path


def _metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "time"}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("stateless-allocators")
    runs = {}
    for name in PIPELINES:
        Run.start(load_pipeline(_spec(name, root, 4)), root / name).train()
        runs[name] = _metrics(root / name)
    return runs


@pytest.mark.parametrize("name", PIPELINES[:2])
def test_resume_from_a_checkpoint_gives_the_metrics_of_an_uninterrupted_run(name, uninterrupted, tmp_path):
    Run.start(load_pipeline(_spec(name, tmp_path, 2)), tmp_path / "part").train()
    Run.resume(tmp_path / "part", steps=4).train()
    assert _metrics(tmp_path / "part") == uninterrupted[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", PIPELINES)
def test_a_sigkilled_run_resumes_to_the_metrics_of_an_uninterrupted_run(name, uninterrupted, tmp_path):
    run_dir = tmp_path / "killed"
    sigkill_after_step(_spec(name, tmp_path, 4), run_dir, 2, tmp_path)
    assert [r["step"] for r in _metrics(run_dir)] == [0, 1, 2]
    Run.resume(run_dir).train()
    assert _metrics(run_dir) == uninterrupted[name]
    assert [r["step"] for r in uninterrupted[name]] == [0, 1, 2, 3]
