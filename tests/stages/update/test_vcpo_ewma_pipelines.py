"""The shipped VCPO and PPO-EWMA pipelines (``pipelines/examples/vcpo_arith.yaml``,
``ppo_ewma_arith.yaml``) run on tiny-arith under the pipelined lifecycle (lag 2: from step 2 on,
every token is 2 versions stale): VCPO's learning rate follows the batch's effective sample
size and its advantages come from per-trajectory gradients; PPO-EWMA's moving average is in the
update's checkpoint, and a resumed run equals an uninterrupted one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run
from gfcr.runtime.store.state_tree import read_tree

REPO = Path(__file__).resolve().parents[3]
SMALL = ["data.with.n=64", "stages.pick.with.batch_size=8", "stages.budget.with.n=4", "executor.kind=local",
         "tracking.mlflow=null", "eval=null", "lifecycle.overlap=false"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _start(name: str, run_dir: Path, overrides: list[str]) -> Run:
    return Run.start(load_pipeline(REPO / "pipelines" / "examples" / name, SMALL + overrides), run_dir)


def test_the_vcpo_pipeline_scales_its_learning_rate_with_the_ess_of_stale_batches(tmp_path: Path) -> None:
    _start("vcpo_arith.yaml", tmp_path / "run", ["run.steps=4"]).train()
    lines = _metrics(tmp_path / "run")
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    trained = [line for line in lines if not line["update_skipped"]]
    assert trained and all(math.isfinite(line["loss"]) for line in trained)
    for line in trained:
        update = line["update"]
        assert 0.0 < update["ess_ratio"] <= 1.0 + 1e-9
        assert update["lr_factor"] == pytest.approx(min(1.0, update["ess_ratio"]) ** 0.5)
    stale = [line["update"] for line in trained if line["update"]["off_policy_token_fraction"] > 0]
    assert stale, "from step 1 on the tokens are stale"
    assert any(u["ess_ratio"] < 1.0 - 1e-6 for u in stale), "stale batches lose effective samples"


def test_the_ppo_ewma_pipeline_checkpoints_its_moving_average_and_resumes_exactly(tmp_path: Path) -> None:
    full, part = tmp_path / "full", tmp_path / "part"
    _start("ppo_ewma_arith.yaml", full, ["run.steps=4", "run.checkpoint_every=2"]).train()
    _start("ppo_ewma_arith.yaml", part, ["run.steps=2", "run.checkpoint_every=2"]).train()
    state = read_tree(part / "checkpoints" / "step-000002" / "stages" / "update")
    assert state["correction"]["total_weight"] == pytest.approx(1 + 0.8 * (1 + 0.8))  # two steps: T = 1 + d(1 + d)
    assert len(state["correction"]["weights"]) > 0
    Run.resume(part, steps=4).train()
    a, b = _metrics(full), _metrics(part)
    for r in a + b:
        r.pop("time")
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    assert a == b
    assert any(r["update"]["off_policy_token_fraction"] > 0 for r in a[2:])
    # from step 2 the moving average has moved off the behaviour policy: pi_ewma / mu is no longer 1
    assert all(abs(r["update"]["is_weight_mean"] - 1.0) > 1e-4 for r in a[2:] if not r["update_skipped"])


def test_the_staleness_benchmark_cells_validate() -> None:
    """``benchmarks/offpolicy_staleness.py``'s every component at every staleness is a valid pipeline
    (the benchmark itself is run by hand; its 1-seed, 2-step miniature ran when it was written)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("offpolicy_staleness", REPO / "benchmarks" / "offpolicy_staleness.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for component, overrides in bench.COMPONENTS.items():
        for lag in (0, 2, 8):
            compiled = load_pipeline(bench.PIPELINE, bench.COMMON + overrides + bench.staleness_overrides(lag))
            assert compiled.spec.lifecycle.staleness_bound() == lag, (component, lag)
