"""The seeded metrics of the shipped pipelines are a contract: quickstart, greso_arith and
dapo_arith, run for a few steps on the local runner, give the recorded ``metrics.jsonl``
(every key but ``time``): every count, id, reward, accuracy and flag exactly, every float
(losses, norms, means of log-probs) to rounding (``assert_same_run``).

Why floats are not compared bit for bit: the same wheel of torch picks its matrix kernels by
CPU (AVX2, AVX-512, AVX-512-VNNI ...), so two machines sum a forward pass in different orders.
Measured on 2026-12-01: on an AMD EPYC of CPU family 26 the quickstart's step-0 loss is
0.0063225875 against the recording machine's 0.0063225985, and every other float moves in the
7th digit or later, while all 8 steps of all three pipelines draw exactly the same samples.

A change that moves them re-records them on purpose, and says why in its commit:

    GFCR_RECORD_FIXTURES=1 .venv/bin/python -m pytest tests/runtime/test_metric_fixtures.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "metrics"
STEPS = 8
OVERRIDES = [f"run.steps={STEPS}", "eval.every=4", "executor.kind=local", "tracking.mlflow=null"]


def seeded_metrics(pipeline: str, run_dir: Path, overrides: list[str] = (), max_batch: int | None = None) -> list[dict]:
    """The metrics lines of a short seeded run of a shipped pipeline, without ``time``; with
    ``max_batch``, the engine decodes at most that many rows at once."""
    compiled = load_pipeline(REPO / "pipelines" / f"{pipeline}.yaml", OVERRIDES + list(overrides))
    run = Run.start(compiled, run_dir)
    if max_batch is not None:
        run.services.lent.engine.max_batch = max_batch
    run.train()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        line.pop("time")
    return lines


def assert_same_run(got: list[dict], expected: list[dict], rel: float = 1e-4) -> None:
    """Two seeded runs that sampled the same tokens: every count, id and flag equal, every float
    (losses, norms, means of log-probs) equal up to ``rel`` (or 1e-6 absolute: a loss near zero). Batching rows differently changes
    the float rounding of a forward pass (a matrix product over 7 rows is not summed in the same
    order as over 128), so the behaviour log-probs and the loss move in the 7th digit; the
    samples, which are drawn per row, do not."""
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert _flat(g).keys() == _flat(e).keys()
        for key, value in _flat(e).items():
            if isinstance(value, float) and not isinstance(value, bool):
                assert _flat(g)[key] == pytest.approx(value, rel=rel, abs=1e-6), f"step {e['step']} {key}"
            else:
                assert _flat(g)[key] == value, f"step {e['step']} {key}"


def _flat(record: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize("pipeline", ["quickstart", "greso_arith", "dapo_arith"])
def test_seeded_metrics_equal_the_fixture(pipeline: str, tmp_path: Path) -> None:
    got = seeded_metrics(pipeline, tmp_path / "run")
    fixture = FIXTURES / f"{pipeline}.jsonl"
    if os.environ.get("GFCR_RECORD_FIXTURES"):
        fixture.parent.mkdir(parents=True, exist_ok=True)
        fixture.write_text("".join(json.dumps(line, sort_keys=True) + "\n" for line in got))
    expected = [json.loads(line) for line in fixture.read_text().splitlines()]
    assert len(got) == len(expected) == STEPS
    assert_same_run(got, expected)


def test_a_smaller_engine_batch_gives_the_same_metrics(tmp_path: Path) -> None:
    """Each row samples from its own seeded stream, so how the engine batches rows (here 7 rows
    at a time instead of all 128) changes no sample; floats agree to rounding (see assert_same_run)."""
    got = seeded_metrics("quickstart", tmp_path / "run", max_batch=7)
    expected = [json.loads(line) for line in (FIXTURES / "quickstart.jsonl").read_text().splitlines()]
    assert_same_run(got, expected)
