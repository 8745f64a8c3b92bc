"""control.early_exit (ARRoL-style): the survivor rule by hand, when a group is checked, the
head learning from the step's final rewards, and a real tiny-arith run where the pruned rows
leave their groups, every update group has ``keep`` rows, and a resumed run matches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gfcr.graph import load_pipeline
from gfcr.records import RolloutGroup, RolloutStatus, StepReport
from gfcr.runtime.loop.session import Run
from gfcr.stages.control.early_exit import EarlyExit
from gfcr.stages.engine import InFlightView, LiveRow
from gfcr.stages.testing import scored_group
from tests.conftest import REPO


def controller(p: list[float], **config) -> EarlyExit:
    """A controller whose head predicts ``p`` for the candidates, in order (features are their index)."""
    stage = EarlyExit(EarlyExit.Config(**{"at_tokens": 2, "keep": 4, "min_examples": 0, **config}))
    logits = np.log(np.array(p) / (1 - np.array(p)))
    stage._features = lambda rows, view: np.array([[logits[i]] for i in range(len(rows))])
    stage.head.weights, stage.head.bias = np.array([1.0]), 0.0
    stage.center, stage.scale = np.zeros(1), np.ones(1)
    return stage


def rows(lengths: list[int], finish: list[str | None] | None = None, rid: str = "g") -> tuple[LiveRow, ...]:
    finish = finish or [None] * len(lengths)
    return tuple(LiveRow(rid, i, tuple(range(n)), np.zeros(n), None, f) for i, (n, f) in enumerate(zip(lengths, finish)))


@pytest.mark.parametrize("p, keep, ratio, pruned", [
    ([0.9, 0.8, 0.7, 0.6, 0.4, 0.3, 0.2, 0.1], 4, 0.5, [2, 3, 4, 5]),  # keep 2 highest (0, 1), 2 lowest (6, 7)
    ([0.9, 0.8, 0.7, 0.6, 0.4, 0.3, 0.2, 0.1], 4, 0.75, [3, 4, 5, 6]),  # 3 highest, 1 lowest
    ([0.9, 0.8, 0.7, 0.6, 0.4, 0.3, 0.2, 0.1], 4, 0.0, [0, 1, 2, 3]),  # the 4 lowest only
    ([0.5, 0.5, 0.5, 0.5, 0.5, 0.5], 4, 0.5, [2, 3]),  # ties: the earlier rows count as higher
    ([0.9, 0.1, 0.5], 4, 0.5, []),  # fewer candidates than places
])
def test_the_survivors_are_the_highest_and_lowest_predictions_in_the_target_ratio(p, keep, ratio, pruned):
    stage = controller(p, keep=keep, target_ratio=ratio)
    steer = stage.steer(InFlightView(2, rows([2] * len(p)), {"g": len(p)}))
    assert sorted(i for _, i in steer.prune) == pruned


def test_rows_that_ended_before_the_checkpoint_are_kept_and_take_places():
    stage = controller([0.9, 0.8, 0.2, 0.1], keep=4)
    view = InFlightView(2, rows([1, 1, 2, 2, 2, 2], ["stop", "stop", None, None, None, None]), {"g": 6})
    assert sorted(i for _, i in stage.steer(view).prune) == [3, 4]  # 2 places left: rows 2 (0.9) and 5 (0.1)


def test_a_group_is_checked_once_when_all_its_rows_reach_the_checkpoint():
    stage = controller([0.9, 0.8, 0.7, 0.6, 0.4, 0.3], keep=2)
    assert stage.steer(InFlightView(1, rows([2, 2, 1, 2, 2, 2]), {"g": 6})).prune == ()  # row 2 not there yet
    assert len(stage.steer(InFlightView(2, rows([3, 3, 2, 3, 3, 3]), {"g": 6})).prune) == 4
    assert stage.steer(InFlightView(3, rows([4, 4, 3, 4, 4, 4]), {"g": 6})).prune == ()  # decided already


def test_a_cold_head_prunes_nothing_but_records_the_candidates_to_learn_from():
    stage = EarlyExit(EarlyExit.Config(at_tokens=2, keep=2, min_examples=4))
    stage._features = lambda rs, view: np.array([[float(r.sample_index)] for r in rs])
    steer = stage.steer(InFlightView(2, rows([2, 2, 2, 2]), {"g": 4}))
    assert steer.prune == () and len(stage._pending) == 4


def test_the_head_learns_from_the_final_rewards_of_the_rows_it_checked():
    stage = EarlyExit(EarlyExit.Config(at_tokens=2, keep=4, min_examples=4, fit_steps=200, learning_rate=2.0))
    stage._features = lambda rs, view: np.array([[1.0 if r.sample_index % 2 == 0 else -1.0] for r in rs])
    stage.before_step(None)
    stage.steer(InFlightView(2, rows([2, 2, 2, 2], rid="p:0@s0"), {"p:0@s0": 4}))
    group = scored_group("p:0", [1.0, 0.0, 1.0, 0.0])  # even rows right: the feature separates them
    stage.observe(StepReport("run", 0, 1, (group,), None, {}, {}))
    assert stage.ready and stage.step_metrics()["head_examples"] == 4.0
    assert "brier" not in stage.step_metrics()  # the cold head predicted nothing to calibrate
    x = stage._standardise(np.array([[1.0], [-1.0]]))
    p_even, p_odd = stage.head.predict(x)
    assert p_even > 0.8 and p_odd < 0.2


# --- a real run ----------------------------------------------------------------------------

SMALL = ["data.with.n=200", "stages.pick.with.batch_size=4", "stages.prune.with.min_examples=16", "eval=null",
         "tracking.mlflow=null", "executor.kind=local", "run.checkpoint_every=2"]


def _spec(folder: Path, steps: int) -> Path:
    path = folder / f"early-exit-{steps}.yaml"
    spec = load_pipeline(REPO / "pipelines" / "early_exit_arith.yaml", SMALL + [f"run.steps={steps}"]).spec
    path.write_text(spec.to_yaml())
    return path


def _metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "time"}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_real_run_prunes_to_keep_rows_per_group_and_resumes_exactly(tmp_path):
    from gfcr.runtime.store.lineage import read_lineage

    Run.start(load_pipeline(_spec(tmp_path, 5)), tmp_path / "whole").train()
    whole = _metrics(tmp_path / "whole")
    prune = [m["stages"]["prune"] for m in whole]
    assert prune[0]["head_ready"] == 0.0 and prune[0]["pruned"] == 0  # no examples yet
    assert any(p["pruned"] > 0 for p in prune[1:]), prune
    rows = read_lineage(tmp_path / "whole" / "lineage").to_pylist()
    pruned = [r for r in rows if r["finish_reason"] == "pruned"]
    assert pruned and all(not r["in_update"] and r["dropped_by"] == "gone" and r["reward"] is None for r in pruned)
    assert all(r["stop_reason"].startswith("control.early_exit: predicted success ") for r in pruned)
    pruned_steps = {r["step"] for r in pruned}
    for step in pruned_steps:
        sizes = {}
        for r in rows:
            if r["step"] == step and r["finish_reason"] != "pruned":
                sizes[r["group_id"]] = sizes.get(r["group_id"], 0) + 1
        assert all(n >= 8 for n in sizes.values())  # keep 8 (rows that ended before the checkpoint may add)
    Run.start(load_pipeline(_spec(tmp_path, 2)), tmp_path / "part").train()
    Run.resume(tmp_path / "part", steps=5).train()
    assert _metrics(tmp_path / "part") == whole
