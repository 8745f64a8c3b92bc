"""``update.grpo``'s ``save_batches``: a seeded run that saves its batches computes exactly what it
computes without saving (the quickstart's recorded metrics), and what it saves adds up to them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from gfcr.stages.training import TrainBatch
from gfcr.stages.update.batch_trace import from_hex, read_steps, save_step, to_hex
from gfcr.stages.update.ranks import ShardOutcome, ShardSums
from tests.runtime.test_metric_fixtures import FIXTURES, assert_same_run, seeded_metrics


def test_a_run_that_saves_its_batches_gives_the_recorded_metrics(tmp_path: Path) -> None:
    folder = tmp_path / "batches"
    got = seeded_metrics("quickstart", tmp_path / "run", [f"update.with.save_batches={folder}"])
    expected = [json.loads(line) for line in (FIXTURES / "quickstart.jsonl").read_text().splitlines()]
    assert_same_run(got, expected)
    steps = read_steps(folder)
    assert [s["version"] for s in steps] == [line["step"] for line in got]
    for step, line in zip(steps, got):
        rollouts = {r["id"]: r for r in step["rollouts"]}
        assert len(rollouts) == line["update"]["batch_rollouts"]
        assert sum(r["length"] for r in step["rollouts"]) == line["update"]["batch_tokens"]
        assert math.isclose(sum(m["loss"] for m in step["micro_batches"]), line["loss"], rel_tol=1e-9, abs_tol=1e-12)
        forwarded = [i for m in step["micro_batches"] for i in m["rows"]]
        assert forwarded == [r["id"] for r in step["rollouts"] if r["forward"]]
        assert len(forwarded) == line["rollouts_in_update"]
        for m in step["micro_batches"]:
            assert [len(from_hex(h)) for h in m["log_prob"]] == [rollouts[i]["length"] for i in m["rows"]]
            assert [float(from_hex(h)[0]) for h in m["advantage"]] == pytest.approx(
                [rollouts[i]["advantage"] for i in m["rows"]], rel=1e-6)
        assert step["update"]["advantage"] == {"use": "mean_std", "with": {
            "eps": 1e-6, "std_ddof": 1, "single_rollout": "zero", "precision": "float64"}}


def test_float32_arrays_round_trip_exactly() -> None:
    values = np.array([0.0, -0.0, 1e-45, -3.4028235e38, np.inf, 0.1, -1.2345678], dtype=np.float32)
    back = from_hex(to_hex(values))
    assert back.dtype == np.float32 and back.tobytes() == values.tobytes()
    assert to_hex([1.0]) == "3f800000"  # big-endian IEEE-754: readable as hex floats


def test_a_folder_of_other_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "batch-000000.json").write_text(json.dumps({"format": "something/else", "version": 0}))
    with pytest.raises(ValueError, match="is not a gfcr.update_batch/1 file"):
        read_steps(tmp_path)


def test_trainer_ranks_micro_batches_follow_in_rank_order(tmp_path: Path) -> None:
    """Under trainer ranks each rank records its own micro-batches; the step's file lists rank 0's,
    then rank 1's, and the loss every rank agrees on."""
    def outcome(rows: list[str]) -> ShardOutcome:
        return ShardOutcome(ShardSums(), 0.5, 1.0, None, None, {}, None, [{"rows": rows, "loss": 0.25}])

    batch = TrainBatch([], [], version=3, saved={"rollouts": []})
    save_step(tmp_path, batch, [outcome(["a", "b"]), outcome(["c"])])
    (step,) = read_steps(tmp_path)
    assert [m["rows"] for m in step["micro_batches"]] == [["a", "b"], ["c"]]
    assert (step["version"], step["loss"], step["skip_reason"]) == (3, 0.5, None)
