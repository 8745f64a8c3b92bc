"""generate.speculative (SPEC-RL): the acceptance rule with fixed uniforms, the cut and the
continuation on the deterministic fake engine against a hand computation, token accounting
(accepted tokens not generated, draft tokens scored), a first sampling equal to generate.sample's,
the draft store through a checkpoint tree, and a real tiny-arith run that resumes exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from gfcr.engines.fake import FakeEngine
from gfcr.graph import load_pipeline
from gfcr.records import Allocation, AllocationEntry, Origin, Prompt, SegmentOrigin, StepContext, StepReport
from gfcr.runtime.loop.session import Run
from gfcr.runtime.store.state_tree import read_tree, write_tree
from gfcr.stages.common.seeds import step_seed
from gfcr.stages.engine import ScoreRequest, row_seed
from gfcr.stages.generate.sample import Sample
from gfcr.stages.generate.speculative import Speculative, accepted_length
from gfcr.stages.resources import Lent
from tests.conftest import REPO
from tests.engines.test_decode_loop import FakePolicy


@pytest.mark.parametrize("u, lenience, cut", [
    ([0.1, 0.1, 0.1, 0.1], 0.0, 4),      # u below every ratio min(1, p_new/p_old)
    ([0.1, 0.51, 0.1, 0.1], 0.0, 1),     # token 1: ratio 0.5 < u
    ([0.1, 0.49, 0.1, 0.1], 0.0, 4),     # ... u just under it: accepted
    ([0.1, 0.1, 0.99, 0.1], 0.0, 4),     # token 2: p_new > p_old, ratio capped at 1: always accepted
    ([0.1, 0.1, 0.1, 0.3], 0.0, 3),      # token 3: ratio 0.25
    ([0.1, 0.99, 0.1, 0.49], math.log(2), 4),  # lenience e^l = 2: ratios 1, 1, 1, 0.5
    ([0.1, 0.1, 0.1, 0.51], math.log(2), 3),
    ([0.6, 0.1, 0.1, 0.1], math.log(0.5), 0),  # lenience below 1 can reject a token the policy kept
])
def test_the_acceptance_rule_with_fixed_uniforms(u, lenience, cut):
    old = np.log([0.4, 0.4, 0.2, 0.4])
    new = np.log([0.4, 0.2, 0.6, 0.1])  # ratios 1, 0.5, 3, 0.25
    assert accepted_length(new, old, lenience, np.array(u)) == cut


def test_lenience_zero_is_standard_speculative_acceptance_in_frequency():
    """Accept with probability min(1, p_new / p_old): 0.3 here, over many uniforms."""
    rng = np.random.default_rng(0)
    hits = [accepted_length(np.log([0.15]), np.log([0.5]), 0.0, rng.random(1)) for _ in range(20000)]
    assert np.mean(hits) == pytest.approx(0.3, abs=0.01)


def stage_on_fake(**config) -> tuple[Speculative, Lent]:
    engine = FakeEngine()
    resources = Lent(FakePolicy(engine), engine)
    stage = Speculative(Speculative.Config(max_new_tokens=config.pop("max_new_tokens", 10), **config))
    stage.setup(resources)
    return stage, resources


def alloc(step: int, n: int = 4) -> Allocation:
    return Allocation(step, (AllocationEntry(Prompt("p:1", text="1+1="), n), AllocationEntry(Prompt("p:2", text="2+2="), n)))


def ctx(step: int) -> StepContext:
    return StepContext("run", step=step, seed=0, policy_version=0)


def test_a_prompts_first_sampling_is_generate_samples_exactly():
    stage, _ = stage_on_fake()
    engine = FakeEngine()
    sample = Sample(Sample.Config(max_new_tokens=10))
    sample.setup(Lent(FakePolicy(engine), engine))
    ours, theirs = stage.run(alloc(0), ctx(0)), sample.run(alloc(0), ctx(0))
    assert [[(r.rollout_id, r.response_token_ids) for r in g.rollouts] for g in ours.groups] == \
           [[(r.rollout_id, r.response_token_ids) for r in g.rollouts] for g in theirs.groups]


def test_drafts_are_cut_where_a_hand_computation_cuts_them_and_continued_from_their_tokens():
    lenience = -1.5  # below 0: some draft tokens are rejected even though the policy is unchanged
    stage, resources = stage_on_fake(lenience=lenience)
    first = stage.run(alloc(0), ctx(0))
    drafts = {r.rollout_id: r for g in first.groups for r in g.rollouts}
    resources.take_tokens_scored()
    second = stage.run(alloc(1), ctx(1))
    seed = step_seed(0, 1, 0)
    engine, cuts = FakeEngine(), []
    for g, old in zip(second.groups, first.groups):
        for i, (r, d) in enumerate(zip(g.rollouts, old.rollouts)):
            scored = engine.score([ScoreRequest(tuple(engine.encode(f"{g.prompt_id[-1]}+{g.prompt_id[-1]}=")),
                                                tuple(d.response_token_ids))])[0].logprobs
            u = np.random.default_rng(row_seed(seed, f"{g.group_id}~spec", i)).random(len(d))
            accept = (scored - d.behavior_logprobs + lenience >= 0) | (np.log(u) <= scored - d.behavior_logprobs + lenience)
            cut = int(np.argmin(accept)) if not accept.all() else len(d)
            cuts.append(cut)
            assert r.response_token_ids[:cut] == d.response_token_ids[:cut]
            assert r.draft_tokens == cut and (r.draft_from == d.rollout_id) == (cut > 0)
            assert r.generated_length == len(r) - cut
            if cut:
                head = r.segments[0]
                assert (head.start, head.end, head.origin) == (0, cut, SegmentOrigin.DRAFT_ACCEPTED)
                np.testing.assert_allclose(head.behavior_logprobs, scored[:cut], atol=1e-6)
                assert r.origin == Origin.DRAFT_ACCEPTED
            if cut == len(d):
                assert r.response_token_ids == d.response_token_ids and r.status == d.status
    assert 0 < sum(cuts) < sum(len(d) for d in drafts.values()), "the case must cut some drafts, not all"
    metrics = stage.step_metrics()
    assert metrics["accepted_tokens"] == sum(cuts)
    assert metrics["draft_tokens"] == sum(len(d) for d in drafts.values()) == resources.take_tokens_scored()
    report = StepReport("run", 1, 1, tuple(second.groups), None, {}, {})
    assert report.tokens_generated == sum(len(r) for r in second.rollouts()) - sum(cuts)


def test_an_unchanged_policy_at_lenience_zero_accepts_every_draft_whole():
    stage, _ = stage_on_fake(lenience=0.0)
    first = stage.run(alloc(0), ctx(0))
    second = stage.run(alloc(1), ctx(1))
    assert stage.step_metrics()["acceptance_rate"] == 1.0 and stage.step_metrics()["fully_accepted"] == 8
    for g, old in zip(second.groups, first.groups):
        assert [r.response_token_ids for r in g.rollouts] == [r.response_token_ids for r in old.rollouts]
        assert all(r.sampled_nothing for r in g.rollouts)
    assert StepReport("run", 1, 1, tuple(second.groups), None, {}, {}).rollouts_generated == 0


def test_the_draft_store_survives_a_checkpoint_tree(tmp_path):
    stage, _ = stage_on_fake(lenience=-1.0)
    stage.run(alloc(0), ctx(0))
    write_tree(stage.state_dict(), tmp_path)
    other, _ = stage_on_fake(lenience=-1.0)
    other.load_state_dict(read_tree(tmp_path, tmp_path))
    a, b = stage.run(alloc(1), ctx(1)), other.run(alloc(1), ctx(1))
    assert [r.response_token_ids for r in a.rollouts()] == [r.response_token_ids for r in b.rollouts()]
    assert stage.step_metrics() == other.step_metrics()


SMALL = ["data.with.n=24", "stages.pick.with.batch_size=8", "stages.budget.with.n=4", "eval=null",
         "tracking.mlflow=null", "executor.kind=local", "run.checkpoint_every=3"]


def _spec(folder: Path, steps: int) -> Path:
    path = folder / f"spec-{steps}.yaml"
    path.write_text(load_pipeline(REPO / "pipelines" / "spec_rl_arith.yaml", SMALL + [f"run.steps={steps}"]).spec.to_yaml())
    return path


def _metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "time"}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_real_run_reuses_drafts_from_the_second_epoch_and_resumes_exactly(tmp_path):
    Run.start(load_pipeline(_spec(tmp_path, 6)), tmp_path / "whole").train()
    whole = _metrics(tmp_path / "whole")
    spec = [m["stages"]["rollout"] for m in whole]
    assert [s["drafts"] for s in spec[:3]] == [0, 0, 0] and all(s["drafts"] == 32 for s in spec[3:])
    assert all(m["tokens_scored"] == s["draft_tokens"] for m, s in zip(whole, spec))
    assert sum(s["accepted_tokens"] for s in spec[3:]) > 0
    Run.start(load_pipeline(_spec(tmp_path, 3)), tmp_path / "part").train()
    Run.resume(tmp_path / "part", steps=6).train()
    assert _metrics(tmp_path / "part") == whole
