"""generate.partial (APRIL's partial buffer, CoPRIS's re-queue) on the deterministic fake engine:
which groups go to the buffer and why, how a buffered group resumes (token ids, the budget left,
spliced segments, ids, token counts), the places per call, and the buffer through a checkpoint
tree. Then real tiny-arith runs: every rollout started is accounted for over 20 steps, and a run
stopped and resumed gives the metrics of an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gfcr.engines.fake import FakeEngine
from gfcr.graph import load_pipeline
from gfcr.records import Allocation, AllocationEntry, Origin, Prompt, RolloutStatus, StepContext, StepReport
from gfcr.runtime.store.lineage import read_lineage
from gfcr.runtime.loop.session import Run
from gfcr.runtime.store.state_tree import read_tree, write_tree
from gfcr.stages.control.stop_at_target import StopAtTarget
from gfcr.stages.engine import GenerationRequest, InFlightView, LiveRow, SamplingParams, Steer
from gfcr.stages.generate.partial import TO_BUFFER, Partial
from gfcr.stages.resources import Lent
from tests.conftest import REPO
from tests.engines.test_decode_loop import FakePolicy
from tests.killing import sigkill_after_step

MAX = 12


class StopAfter:
    """TEST: stop everything after ``k`` decode steps (a fixed point, for hand-checkable cases)."""

    def __init__(self, k: int):
        self.every = k

    def steer(self, view):
        return Steer(stop=True)


def stage_on_fake(**config) -> tuple[Partial, FakeEngine]:
    engine = FakeEngine()
    stage = Partial(Partial.Config(max_new_tokens=config.pop("max_new_tokens", MAX), **config))
    stage.setup(Lent(FakePolicy(engine), engine))
    return stage, engine


def allocation(step: int, names: list[str], n: int = 3) -> Allocation:
    return Allocation(step, tuple(AllocationEntry(Prompt(p, text=f"{p[-1]}+{p[-1]}="), n) for p in names))


def ctx(step: int) -> StepContext:
    return StepContext("run", step=step, seed=0, policy_version=0)


def test_a_group_with_an_unfinished_row_goes_whole_to_the_buffer_and_finished_groups_stay():
    stage, _ = stage_on_fake()
    stage.attach_in_flight([StopAfter(3)])
    groups = stage.run(allocation(0, ["p:1", "p:2"]), ctx(0)).groups
    buffered = {b.root for b in stage.buffer}
    for g in groups:
        unfinished = [r for r in g.rollouts if r.status == RolloutStatus.ABORTED_PARTIAL]
        assert (g.group_id in buffered) == bool(unfinished)
        assert g.verdict.included == (not unfinished)
        if unfinished:
            assert g.verdict.reason.startswith(TO_BUFFER)
            assert all(len(r) == 3 for r in unfinished)  # stopped after 3 decode steps
    assert buffered, "a 3-token stop on a 12-token budget leaves some row unfinished"
    assert stage.step_metrics()["to_buffer"] == len(buffered) == stage.step_metrics()["buffered"]


def test_a_resumed_group_continues_its_unfinished_rows_from_their_tokens_with_the_budget_left():
    stage, engine = stage_on_fake()
    stage.attach_in_flight([StopAfter(3)])
    first = stage.run(allocation(0, ["p:1", "p:2"]), ctx(0))
    before = {b.root: [(r.rollout_id, list(r.response_token_ids), r.status, r.behavior_logprobs.copy())
                       for r in b.rollouts] for b in stage.buffer}
    engine.version = 1  # an update happened in between
    stage.attach_in_flight([])
    second = stage.run(allocation(1, ["p:3", "p:4"]), ctx(1))
    resumed = [g for g in second.groups if "~p1" in g.group_id]
    assert [g.group_id for g in resumed] == [f"{root}~p1" for root in before]
    for g in resumed:
        for i, (r, (old_id, old_tokens, old_status, old_lp)) in enumerate(zip(g.rollouts, before[g.group_id[:-3]])):
            assert r.rollout_id == f"{g.group_id}/{i}" and r.group_id == g.group_id and r.resumed_from == old_id
            assert r.response_token_ids[:len(old_tokens)] == old_tokens  # token ids, not re-tokenized text
            assert r.resumed_tokens == len(old_tokens)
            np.testing.assert_array_equal(r.behavior_logprobs[:len(old_tokens)], old_lp)
            if old_status == RolloutStatus.ABORTED_PARTIAL:
                assert r.origin == Origin.RESUMED and r.status != RolloutStatus.ABORTED_PARTIAL
                assert len(r) <= MAX  # the budget caps the whole response
                versions = r.policy_versions()
                assert set(versions[:len(old_tokens)]) <= {0} and set(versions[len(old_tokens):]) <= {1}
                assert r.generated_length == len(r) - len(old_tokens)
            else:  # finished before the stop: carried whole, nothing sampled now
                assert r.status == old_status and r.carried and r.generated_length == 0
    report = StepReport("run", 1, 1, tuple(second.groups), None, {}, {})
    fresh_tokens = sum(len(r) for g in second.groups if "~p" not in g.group_id for r in g.rollouts)
    new_tokens = sum(len(r) - r.resumed_tokens for g in resumed for r in g.rollouts)
    assert report.tokens_generated == fresh_tokens + new_tokens
    assert report.rollouts_generated == sum(not r.carried for g in second.groups for r in g.rollouts)
    assert first.groups  # (the first call's groups are not needed after this)


def test_the_buffer_takes_the_first_places_and_the_rest_of_the_allocation_is_deferred():
    stage, _ = stage_on_fake(groups_in_flight=3)
    stage.attach_in_flight([StopAfter(2)])
    stage.run(allocation(0, ["p:1", "p:2", "p:3"]), ctx(0))
    held = [b.root for b in stage.buffer]
    assert len(held) == 3  # 2 tokens of 12: every group has an unfinished row
    stage.attach_in_flight([])
    out = stage.run(allocation(1, ["p:4", "p:5"]), ctx(1))
    assert [g.group_id for g in out.groups] == [f"{h}~p1" for h in held]
    assert stage.step_metrics()["deferred"] == 2 and stage.step_metrics()["resumed_groups"] == 3


def test_stop_at_target_counts_a_resumed_group_once_all_its_requests_end():
    view = InFlightView(5, (LiveRow("g~p1/0", 0, (1,), np.zeros(1), None, "stop"),
                            LiveRow("g~p1/2", 0, (1,), np.zeros(1), None, None),
                            LiveRow("h", 0, (1,), np.zeros(1), None, "length")),
                        {"g~p1": 2, "h": 1}, {"g~p1/0": "g~p1", "g~p1/2": "g~p1"})
    assert view.complete_groups() == ["h"]
    assert not StopAtTarget(StopAtTarget.Config(groups=2)).steer(view).stop
    done = InFlightView(6, view.rows[:1] + (LiveRow("g~p1/2", 0, (1, 2), np.zeros(2), None, "stop"),) + view.rows[2:],
                        view.group_sizes, view.request_groups)
    assert done.complete_groups() == ["g~p1", "h"] and StopAtTarget(StopAtTarget.Config(groups=2)).steer(done).stop


def test_the_engine_groups_a_resumed_groups_requests_in_its_view():
    engine, seen = FakeEngine(), []

    class Watch:
        every = 1

        def steer(self, view):
            seen.append(view)
            return Steer()

    params = SamplingParams(max_new_tokens=4)
    requests = [GenerationRequest("g/0", engine.encode("1+1="), 1, params, group="g"),
                GenerationRequest("g/1", engine.encode("1+1="), 1, params, group="g"),
                GenerationRequest("h", engine.encode("2+2="), 2, params)]
    engine.generate(requests, Watch())
    assert seen[0].group_sizes == {"g": 2, "h": 2}
    assert seen[-1].complete_groups() == ["g", "h"]


def test_the_buffer_survives_a_checkpoint_tree_exactly(tmp_path):
    stage, _ = stage_on_fake()
    stage.attach_in_flight([StopAfter(3)])
    stage.run(allocation(0, ["p:1", "p:2"]), ctx(0))
    write_tree(stage.state_dict(), tmp_path)
    other, _ = stage_on_fake()
    other.load_state_dict(read_tree(tmp_path, tmp_path))
    for a, b in zip(stage.buffer, other.buffer, strict=True):
        assert (a.root, a.prompt_id, a.prompt_token_ids, a.target_size) == (b.root, b.prompt_id, b.prompt_token_ids,
                                                                              b.target_size)
        for x, y in zip(a.rollouts, b.rollouts, strict=True):
            assert (x.rollout_id, x.response_token_ids, x.status, x.finish_reason, x.text) == (
                y.rollout_id, y.response_token_ids, y.status, y.finish_reason, y.text)
            assert [(s.start, s.end, s.policy_version) for s in x.segments] == [
                (s.start, s.end, s.policy_version) for s in y.segments]
            np.testing.assert_array_equal(x.behavior_logprobs, y.behavior_logprobs)


# --- real runs on tiny-arith -------------------------------------------------------------------

SMALL = ["data.with.n=200", "stages.pick.with.batch_size=8", "stages.budget.with.n=4", "stages.stop.with.groups=4",
         "eval=null", "tracking.mlflow=null", "executor.kind=local"]


def _spec(folder: Path, steps: int, extra: tuple[str, ...] = ()) -> Path:
    path = folder / f"april-{steps}.yaml"
    spec = load_pipeline(REPO / "pipelines" / "april_arith.yaml",
                         SMALL + [f"run.steps={steps}", "run.checkpoint_every=2", *extra]).spec
    path.write_text(spec.to_yaml())
    return path


def _metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "time"}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def twenty_steps(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("april") / "run"
    Run.start(load_pipeline(_spec(run_dir.parent, 20)), run_dir).train()
    return run_dir


def test_every_rollout_started_in_twenty_steps_is_in_an_update_dropped_with_a_reason_or_in_the_buffer(twenty_steps):
    rows = read_lineage(twenty_steps / "lineage").to_pylist()
    by_id = {r["rollout_id"]: r for r in rows}
    continued = {r["resumed_from"]: r["rollout_id"] for r in rows if r["resumed_from"]}
    state = json.loads(next((twenty_steps / "checkpoints" / "step-000020").glob("**/rollout/state.json")).read_text())
    in_buffer = {r["rollout_id"] for b in state["buffer"] for r in b["rollouts"]}
    assert any(r["resumed_from"] for r in rows) and in_buffer, "the run must exercise the buffer"
    fates = {"update": 0, "dropped": 0, "buffer": 0}
    for r in rows:
        if r["status"] == "aborted_partial":  # why it stopped, in the stop's words
            assert r["stop_reason"].startswith("control.stop_at_target: ")
        if r["rollout_id"] in continued:  # it went on under a new id, accounted for there
            assert r["drop_reason"].startswith(TO_BUFFER) and not r["in_update"]
            assert by_id[continued[r["rollout_id"]]]["resumed_tokens"] == r["n_tokens"]
        elif r["in_update"]:
            fates["update"] += 1
        elif r["rollout_id"] in in_buffer:
            assert r["step"] == 19 and r["drop_reason"].startswith(TO_BUFFER)
            fates["buffer"] += 1
        else:
            assert r["dropped_by"] and r["drop_reason"], r
            fates["dropped"] += 1
    assert in_buffer <= set(by_id) and fates["update"] > 0
    # tokens: each is counted once, at the step that sampled it
    metrics = _metrics(twenty_steps)
    assert sum(m["tokens_generated"] for m in metrics) == sum(r["n_tokens"] - r["resumed_tokens"] for r in rows)


def test_a_run_stopped_and_resumed_gives_the_metrics_of_an_uninterrupted_run(twenty_steps, tmp_path):
    Run.start(load_pipeline(_spec(tmp_path, 4)), tmp_path / "part").train()
    Run.resume(tmp_path / "part", steps=6).train()
    assert _metrics(tmp_path / "part") == _metrics(twenty_steps)[:6]


@pytest.mark.slow
def test_a_sigkilled_run_resumes_to_the_metrics_of_an_uninterrupted_run_buffer_included(twenty_steps, tmp_path):
    run_dir = tmp_path / "killed"
    sigkill_after_step(_spec(tmp_path, 6), run_dir, 4, tmp_path)
    assert [r["step"] for r in _metrics(run_dir)] == [0, 1, 2, 3, 4]
    Run.resume(run_dir).train()
    assert _metrics(run_dir) == _metrics(twenty_steps)[:6]
