"""control.truncate_steps (Step-GRPO's truncated rollouts, DEER's confidence test): where a step ends
and the trial answer's confidence by hand; on the fake engine (TEST/FAKE, one character a token),
that an exited row is the uninterrupted row up to its first step marker, then the inducer and the
engine's own greedy answer with their scored log-probs, and that the caps hold; a real tiny-arith
run through the YAML pipeline (lineage, update, resume); SmolLM2 on GSM8K (slow)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from gfcr.engines.fake import FakeEngine
from gfcr.graph import load_pipeline
from gfcr.records import Allocation, AllocationEntry, Prompt, RolloutStatus, SegmentOrigin, StepContext
from gfcr.runtime.loop.session import Run
from gfcr.stages.control.truncate_steps import TruncateSteps, confidence, cut_at, find_marker
from gfcr.stages.engine import GenerationRequest, SamplingParams, ScoreRequest
from gfcr.stages.generate.sample import Sample
from gfcr.stages.resources import Lent
from tests.conftest import REPO


@pytest.mark.parametrize("text, markers, since, found", [
    ("ab\n\ncd", ["\n\n"], 0, (2, "\n\n")),
    ("ab\n\ncd Wait", ["Wait", "\n\n"], 0, (2, "\n\n")),  # the earliest of any marker
    ("ab\n\ncd Wait", ["Wait", "\n\n"], 4, (7, "Wait")),  # the blank line was seen before
    ("ab\n\ncd", ["\n\n"], 3, (2, "\n\n")),  # half of it was seen: completed by the new text
    ("ab\n\ncd", ["\n\n"], 4, None),
    ("abcd", ["\n"], 0, None),
])
def test_find_marker_gives_the_earliest_occurrence_completed_by_new_text(text, markers, since, found):
    assert find_marker(text, markers, since) == found


@pytest.mark.parametrize("start, lengths, cut", [
    (5, [0, 3, 5, 7, 12], 2),  # tokens end at chars 3, 5, 7: two end at or before 5
    (4, [0, 3, 5, 7, 12], 1),  # the marker starts inside token 2: cut before it
    (0, [0, 3, 5], 0),
    (99, [0, 3, 5], 2),
])
def test_cut_at_keeps_the_tokens_that_end_before_the_marker(start, lengths, cut):
    assert cut_at(start, lengths) == cut


def test_confidence_is_the_geometric_mean_token_probability_by_default():
    logprobs = np.log(np.array([0.5, 1.0, 0.75]))
    assert confidence(logprobs) == pytest.approx((0.5 * 1.0 * 0.75) ** (1 / 3))
    assert confidence(logprobs, rule="mean") == pytest.approx(0.75)  # DEER's avg1
    assert confidence(logprobs, closed=False) == 0.0  # an answer that did not end has none
    assert confidence(np.zeros(0)) == 0.0


# --- on the fake engine --------------------------------------------------------------------------

class FakeTokenizer:
    """TEST/FAKE: the fake engine's one-character tokens behind a tokenizer's two calls."""

    def __init__(self, engine: FakeEngine):
        self.engine = engine

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.engine.encode(text))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.engine.decode(ids)


class FakePolicy:
    """TEST/FAKE: the policy side the stages need (a tokenizer, prompt ids, a version)."""

    name, version = "fake", 0

    def __init__(self, engine: FakeEngine):
        self.engine, self.tokenizer = engine, FakeTokenizer(engine)

    def encode(self, prompt: Prompt) -> list[int]:
        return list(self.engine.encode(prompt.text))


MARKERS = ["a", "e", "i"]  # frequent enough in the fake engine's random text
FAKE = dict(markers=MARKERS, inducer="?", answer_end=["o", "u", "0", "1", "2"])


def _generate(controller: TruncateSteps | None, max_new_tokens: int = 40):
    engine = FakeEngine()
    resources = Lent(FakePolicy(engine), engine)
    stage = Sample(Sample.Config(temperature=1.0, max_new_tokens=max_new_tokens))
    stage.setup(resources)
    if controller is not None:
        controller.setup(resources)
        controller.before_step(None)
        stage.attach_in_flight([controller])
    prompts = [Prompt(f"p:{i}", text=f"{i}+{i}=") for i in range(6)]
    groups = stage.run(Allocation(0, tuple(AllocationEntry(p, 4) for p in prompts)), StepContext("t", 0, 7, 0))
    return {r.rollout_id: r for g in groups.groups for r in g.rollouts}, engine, resources


def _trial(engine: FakeEngine, context: tuple[int, ...], steps) -> object:
    """The greedy trial answer after ``steps`` and the inducer, computed directly."""
    probe = context + tuple(steps) + engine.encode("?")
    (answer,), = engine.generate([GenerationRequest("x", probe, 1, SamplingParams(
        temperature=0.0, max_new_tokens=20, stop=tuple(FAKE["answer_end"])))])
    return answer


def test_an_exited_row_is_the_row_up_to_its_first_marker_then_the_inducer_and_the_greedy_answer():
    whole, _, _ = _generate(None)
    controller = TruncateSteps(TruncateSteps.Config(threshold=0.0, **FAKE))
    cut, engine, resources = _generate(controller)
    exited = [r for r in cut.values() if r.finish_reason == "exited"]
    assert len(exited) >= 6, "the fake text has markers and the greedy answers end"
    for r in exited:
        w = whole[r.rollout_id]
        keep = len(r) - r.forced_tokens
        assert r.response_token_ids[:keep] == w.response_token_ids[:keep]  # the same sample up to the cut
        assert engine.decode([w.response_token_ids[keep]]) in MARKERS  # cut before a marker
        context = engine.encode(f"{r.prompt_id[2:]}+{r.prompt_id[2:]}=")
        # threshold 0: the first trial answer that ends is taken; the ones before it ran to 20 tokens
        earlier = [i for i in range(1, keep) if engine.decode([w.response_token_ids[i]]) in MARKERS]
        assert all(_trial(engine, context, w.response_token_ids[:i]).finish_reason == "length" for i in earlier)
        answer = _trial(engine, context, w.response_token_ids[:keep])
        assert answer.finish_reason == "stop"
        assert tuple(r.response_token_ids[keep:]) == engine.encode("?") + answer.token_ids
        (scored,) = engine.score([ScoreRequest(context + tuple(w.response_token_ids[:keep]),
                                               tuple(r.response_token_ids[keep:]), 1.0)])
        forced = r.segments[-1]
        assert forced.origin == SegmentOrigin.FORCED and (forced.start, forced.end) == (keep, len(r))
        np.testing.assert_allclose(forced.behavior_logprobs, scored.logprobs, atol=1e-6)
        assert r.status == RolloutStatus.COMPLETED
        assert r.stop_reason.startswith("control.truncate_steps: trial answer ")
        assert f"at token {keep} " in r.stop_reason
    for rid, r in cut.items():  # a row that did not exit is the uninterrupted row
        if r.finish_reason != "exited":
            assert r.response_token_ids == whole[rid].response_token_ids and r.forced_tokens == 0
    metrics = controller.step_metrics()
    assert metrics["exits"] == len(exited) and metrics["checks"] >= len(exited)
    assert metrics["forced_tokens"] == sum(r.forced_tokens for r in exited)
    assert metrics["cut_mean"] == pytest.approx(np.mean([len(r) - r.forced_tokens for r in exited]))


def test_no_exit_above_any_confidence_and_the_trial_answers_are_charged_as_generated():
    whole, _, _ = _generate(None)
    controller = TruncateSteps(TruncateSteps.Config(threshold=1.0, **FAKE))
    cut, _, resources = _generate(controller)
    assert all(r.response_token_ids == whole[rid].response_token_ids for rid, r in cut.items())
    metrics = controller.step_metrics()
    assert metrics["exits"] == 0 and metrics["checks"] > 0
    assert resources.tokens_charged == metrics["probe_tokens"] > 0
    assert 0 < metrics["confidence_mean"] < 1


def test_the_caps_hold_exits_per_group_checks_per_row_and_the_budget():
    one, _, _ = _generate(TruncateSteps(TruncateSteps.Config(threshold=0.0, max_exits=1, **FAKE)))
    per_group: dict[str, int] = {}
    for r in one.values():
        per_group[r.group_id] = per_group.get(r.group_id, 0) + (r.finish_reason == "exited")
    assert max(per_group.values()) == 1
    controller = TruncateSteps(TruncateSteps.Config(threshold=1.0, max_checks=1, **FAKE))
    _generate(controller)
    assert 0 < controller.step_metrics()["checks"] <= 24  # 6 prompts x 4 rows, once each at most
    # an inducer as long as the budget never fits: checked, never exited
    controller = TruncateSteps(TruncateSteps.Config(threshold=0.0, **{**FAKE, "inducer": "?" * 12}))
    tight, _, _ = _generate(controller, max_new_tokens=12)
    assert controller.step_metrics()["checks"] > 0
    assert all(r.finish_reason != "exited" and len(r) <= 12 for r in tight.values())


@pytest.mark.slow  # 37-49 s measured on the shared machine at load 45 (two fake-engine generations with a probe per token)
def test_a_row_whose_step_chunks_keep_repeating_exits_whatever_its_confidence():
    """Every letter a marker: consecutive letters make empty step chunks, which repeat each other, so a
    row exits (above any confidence) at the boundary where its third repeat is counted."""
    letters = dict(FAKE, markers=list("abcdefghijklmnopqrstuvwxyz"))
    controller = TruncateSteps(TruncateSteps.Config(threshold=1.0, repeats=3, **letters))
    cut, _, _ = _generate(controller, max_new_tokens=16)  # 8 of the 24 rows exit
    exited = [r for r in cut.values() if r.finish_reason == "exited"]
    assert exited and controller.step_metrics()["repetition_exits"] == len(exited)
    # at the 3rd repeat, or a later one where the answer did not fit the budget at the 3rd
    assert all(int(re.search(r"\((\d+) repeated step chunks\)", r.stop_reason)[1]) >= 3 for r in exited)
    off = TruncateSteps(TruncateSteps.Config(threshold=1.0, repeats=None, **letters))
    _generate(off, max_new_tokens=16)
    assert off.step_metrics()["checks"] > 0 and off.step_metrics()["exits"] == 0


# --- a real run (tiny-arith: its one-line answers have no steps, so a digit stands for a marker) --

ARITH = """
name: truncate-arith
description: the wiring of control.truncate_steps on a real transformer (a digit stands for a step marker)
policy: {model: tiny-arith, engine: hf}
data: {source: arithmetic, with: {n: 200, seed: 0}}
stages:
  pick:    {use: control.uniform, with: {batch_size: 4}}
  budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
  steps:   {use: control.truncate_steps, with: {markers: ["5", "7"], inducer: " Answer:", threshold: 0.0}}
  rollout: {use: generate.sample, from: budget, in_flight: [steps], with: {temperature: 1.0, max_new_tokens: 24}}
  reward:  {use: filter.verify, from: rollout}
update: {use: update.grpo, from: reward, with: {lr: 3.0e-4}}
tracking: {mlflow: null}
executor: {kind: local}
run: {steps: STEPS, seed: 0, checkpoint_every: 2}
"""


def _metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "time"}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_real_tiny_arith_run_exits_rows_into_the_update_and_resumes_exactly(tmp_path, write_spec):
    from gfcr.runtime.store.lineage import read_lineage

    Run.start(load_pipeline(write_spec(ARITH.replace("STEPS", "4"), "whole.yaml")), tmp_path / "whole").train()
    whole = _metrics(tmp_path / "whole")
    assert sum(m["stages"]["steps"]["exits"] for m in whole) > 0
    rows = read_lineage(tmp_path / "whole" / "lineage").to_pylist()
    exited = [r for r in rows if r["finish_reason"] == "exited"]
    assert exited and all(r["forced_tokens"] > 0 and r["in_update"] and r["reward"] is not None for r in exited)
    assert all(r["stop_reason"].startswith("control.truncate_steps: trial answer ") for r in exited)
    Run.start(load_pipeline(write_spec(ARITH.replace("STEPS", "2"), "part.yaml")), tmp_path / "part").train()
    Run.resume(tmp_path / "part", steps=4).train()
    assert _metrics(tmp_path / "part") == whole


@pytest.mark.slow
def test_smollm2_on_gsm8k_exits_at_a_line_with_a_boxed_answer(tmp_path):
    from gfcr.runtime.store.lineage import read_lineage

    pipeline = REPO / "pipelines" / "truncate_steps_gsm8k_smollm2.yaml"
    data = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
    if not data.exists():
        pytest.skip("needs ../shared/data/gsm8k")
    overrides = ["stages.pick.with.batch_size=2", "stages.budget.with.n=2", "stages.rollout.with.max_new_tokens=96",
                 "stages.steps.with.threshold=0.0", "eval=null", "tracking.mlflow=null", "run.steps=1",
                 f"data.with.path={data}"]
    Run.start(load_pipeline(pipeline, overrides), tmp_path / "run").train()
    rows = read_lineage(tmp_path / "run" / "lineage").to_pylist()
    exited = [r for r in rows if r["finish_reason"] == "exited"]
    assert exited, [r["finish_reason"] for r in rows]
    assert all("before step marker '\\n'" in r["stop_reason"] for r in exited)


def test_composed_controllers_unite_their_exits_and_keep_the_first_for_a_row():
    from gfcr.stages.engine import Exit, InFlightView, LiveRow, Steer
    from gfcr.stages.generate.sample import Composed

    class Says:  # TEST: a controller with a fixed answer
        every = 1

        def __init__(self, steer: Steer):
            self.answer = steer

        def steer(self, view):
            return self.answer

    first = Exit(1, (5,), np.array([-0.1]))
    composed = Composed([Says(Steer(exit={("r", 0): first}, why={("r", 0): "first"})),
                         Says(Steer(exit={("r", 0): Exit(2, (6,), np.array([-0.2])), ("r", 1): first},
                                    prune=(("r", 2),)))])
    rows = tuple(LiveRow("r", i, (1, 2), np.zeros(2), None, None) for i in range(3))
    steer = composed.steer(InFlightView(1, rows, {"r": 3}))
    assert steer.exit == {("r", 0): first, ("r", 1): first} and steer.prune == (("r", 2),)
    assert composed.why == {("r", 0): "first"}
