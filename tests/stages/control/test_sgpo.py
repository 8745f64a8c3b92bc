"""control.sgpo: labels and group-size bucketing on the boundary values (exact fractions), the
unsolved sub-sampling, the curriculum phases, the profile through the real tiny-arith policy
and its charge to the step, checkpoints, and `gfcr validate` refusing a fixed n after it."""

from __future__ import annotations

import json
import numpy as np
import pytest
from pydantic import ValidationError

from gfcr.graph import load_pipeline
from gfcr.records import Prompt, PromptPool, StepContext
from gfcr.stages.control.sgpo import Sgpo, bucket_group_size, profile_label
from tests.conftest import REPO


def pool(n: int) -> PromptPool:
    return PromptPool([Prompt(f"p:{i}", text=str(i)) for i in range(n)])


def stage(**kw) -> Sgpo:
    return Sgpo(Sgpo.Config(**{"batch_size": 2, "phase_steps": [5, 10], "seed": 0, **kw}))


# --- labels and buckets on the boundaries ------------------------------------------------------

@pytest.mark.parametrize("successes, n, p0, group", [
    (1, 8, 0.125, 8),   # 1/p0 = 8 exactly: 8 * 1/8 = 1 >= 1
    (2, 8, 0.25, 4),    # 1/p0 = 4 exactly
    (3, 8, 0.375, 4),   # 1/p0 = 2.67: rounded up to 4 (2 * 3/8 = 0.75 < 1)
    (4, 8, 0.5, 2),     # 1/p0 = 2 exactly
    (6, 8, 0.75, 2),    # the last learnable rate
    (1, 4, 0.25, 4),    # the same boundaries from other sample counts
    (2, 4, 0.5, 2),
    (2, 16, 0.125, 8),
    (1, 16, 0.0625, 8),  # 1/p0 = 16: capped at the largest bucket
])
def test_group_size_is_1_over_p0_rounded_up_onto_the_buckets(successes, n, p0, group):
    assert successes / n == p0
    assert bucket_group_size(successes, n) == group


@pytest.mark.parametrize("successes, n, label", [
    (0, 8, "unsolved"), (1, 8, "learnable"), (6, 8, "learnable"),  # p0 = 0.75 = t: not above t
    (7, 8, "trivial"), (8, 8, "trivial"), (3, 4, "learnable"), (13, 16, "trivial"),
])
def test_labels_at_the_trivial_threshold(successes, n, label):
    assert profile_label(successes, n, 0.75) == label


def test_thresholds_compare_as_written_decimals_not_floats():
    # 7/10 against t = 0.7: equal, so learnable; the float 0.7 is below 7/10 and would make it trivial
    assert profile_label(7, 10, 0.7) == "learnable" and profile_label(8, 10, 0.7) == "trivial"
    with pytest.raises(ValueError, match="9 successes out of 8"):
        profile_label(9, 8, 0.75)


def test_other_buckets():
    assert [bucket_group_size(s, 8, (2, 16)) for s in (1, 3, 5)] == [16, 16, 2]


# --- labelling a profile ---------------------------------------------------------------------

def test_a_profile_labels_every_prompt_and_subsamples_the_unsolved():
    s = stage(unsolved_rate=0.1)
    profile = {f"u:{i}": 0 for i in range(2000)}
    profile.update({"t:0": 7, "t:1": 8, "l:1": 1, "l:2": 2, "l:3": 3, "l:4": 4, "l:6": 6})
    s.use_profile(profile)
    labels = s._labels
    assert labels["t:0"] == labels["t:1"] == ("trivial", 0)
    assert [labels[f"l:{k}"] for k in (1, 2, 3, 4, 6)] == [("learnable", 8), ("learnable", 4), ("learnable", 4),
                                                           ("learnable", 2), ("learnable", 2)]
    kept = sum(labels[f"u:{i}"] == ("unsolved_kept", 0) for i in range(2000))
    assert 0.08 < kept / 2000 < 0.12  # alpha = 10%, a seeded draw per prompt
    again = stage(unsolved_rate=0.1)
    again.use_profile(profile)
    assert again._labels == labels
    none = stage(unsolved_rate=0.0)
    none.use_profile(profile)
    assert not any(v[0] == "unsolved_kept" for v in none._labels.values())


# --- the curriculum ----------------------------------------------------------------------------

def curriculum_stage(**kw) -> Sgpo:
    s = stage(batch_size=2, unsolved_rate=1.0, **kw)
    # p:0 trivial, p:1..p:3 G = 2, p:4 p:5 G = 4, p:6 G = 8, p:7 unsolved (kept: rate 1)
    s.use_profile({"p:0": 8, "p:1": 4, "p:2": 5, "p:3": 6, "p:4": 2, "p:5": 3, "p:6": 1, "p:7": 0})
    return s


def call(s: Sgpo, step: int, data: PromptPool):
    s.before_step(StepContext("run", step, 0, step))
    return s.run(data)


def test_phases_run_easy_to_hard_with_the_unsolved_mixed_in_at_the_phase_s_g():
    s, data = curriculum_stage(), pool(8)
    seen = {}
    for step in range(12):
        alloc = call(s, step, data)
        for e in alloc:
            seen.setdefault(alloc.controller_state["phase"], set()).add((e.prompt_id, e.n_rollouts))
        assert alloc.controller_state["phase"] == (0 if step < 5 else 1 if step < 10 else 2)
    assert seen[0] == {("p:1", 2), ("p:2", 2), ("p:3", 2), ("p:7", 2)}
    assert seen[1] == {("p:4", 4), ("p:5", 4), ("p:7", 4)}
    assert seen[2] == {("p:6", 8), ("p:7", 8)}
    assert all("p:0" not in {pid for pid, _ in v} for v in seen.values())  # trivial: never dispatched


def test_within_a_phase_batches_follow_a_seeded_permutation_per_epoch():
    s, data = curriculum_stage(), pool(8)
    batches = [[e.prompt_id for e in call(s, step, data)] for step in range(4)]
    ids = ["p:1", "p:2", "p:3", "p:7"]
    epoch0, epoch1 = (np.random.default_rng([0, 0, e]).permutation(4) for e in (0, 1))
    assert batches[0] + batches[1] == [ids[i] for i in epoch0]
    assert batches[2] + batches[3] == [ids[i] for i in epoch1]
    last = call(s, 10, data)  # phase 2 has two prompts: one batch of both
    assert sorted(e.prompt_id for e in last) == ["p:6", "p:7"]
    state = last.controller_state
    assert (state["group_size"], state["phase_prompts"], state["chosen"], state["chosen_unsolved"]) == (8, 2, 2, 1)
    assert state["predicted_success"] == pytest.approx((1 / 8 + 0) / 2)
    assert (state["trivial"], state["unsolved"], state["unsolved_kept"]) == (1, 1, 1)
    assert (state["learnable_g2"], state["learnable_g4"], state["learnable_g8"]) == (3, 2, 1)


def test_an_empty_phase_is_skipped():
    s = stage(batch_size=2, unsolved_rate=0.0)
    s.use_profile({"p:0": 4, "p:1": 1, "p:2": 0})  # nothing with G = 4
    data = pool(3)
    assert call(s, 6, data).controller_state["phase"] == 2 and [e.n_rollouts for e in call(s, 6, data)] == [8]


def test_config_checks_the_phases_against_the_buckets():
    with pytest.raises(ValidationError, match="phase_steps needs 2 steps"):
        Sgpo.Config(batch_size=2, phase_steps=[5])
    with pytest.raises(ValidationError, match="increasing"):
        Sgpo.Config(batch_size=2, phase_steps=[5, 5])
    with pytest.raises(ValidationError, match="ascending"):
        Sgpo.Config(batch_size=2, group_sizes=[4, 2, 8])
    assert Sgpo.Config(batch_size=2, group_sizes=[2, 8], phase_steps=[3]).group_sizes == [2, 8]


# --- the profile through the real policy ------------------------------------------------------

def test_the_profile_samples_every_prompt_under_the_initial_policy_and_charges_the_step():
    from gfcr.engines import TransformersEngine, load_policy
    from gfcr.records import VerifierSpec
    from gfcr.spec import PolicySpec
    from gfcr.stages.resources import Lent

    policy = load_policy(PolicySpec(model="tiny-arith"))
    resources = Lent(policy, TransformersEngine(policy))
    pairs = [(12 + 7 * i, 30 + 5 * i) for i in range(12)]
    data = PromptPool([Prompt(f"a:{i}", text=f"What is {a} + {b}? Answer:", verifier=VerifierSpec("arithmetic", str(a + b)))
                       for i, (a, b) in enumerate(pairs)])
    s = Sgpo(Sgpo.Config(batch_size=4, profile_samples=4, max_new_tokens=8, seed=0))
    s.setup(resources)
    alloc = call(s, 0, data)
    assert sorted(s.profile) == sorted(p.prompt_id for p in data) and all(0 <= v <= 4 for v in s.profile.values())
    rollouts, tokens = resources.take_generation_charge()
    state = alloc.controller_state
    assert rollouts == 48 == state["profile_rollouts"] and tokens == state["profile_tokens"] and 48 <= tokens <= 48 * 8
    assert resources.take_generation_charge() == (0, 0)
    call(s, 1, data)  # profiled once: nothing more is charged
    assert resources.take_generation_charge() == (0, 0)
    again = Sgpo(Sgpo.Config(batch_size=4, profile_samples=4, max_new_tokens=8, seed=0))
    again.setup(resources)
    call(again, 0, data)
    assert again.profile == s.profile  # seeded sampling: the same profile
    for e in alloc.active():
        k = s.profile[e.prompt_id]
        assert e.reason.endswith(f"p0 {k}/4, G {e.n_rollouts}, phase 0")
        assert (e.why.code, e.why.name, e.why.value) == (s._labels[e.prompt_id][0], "p0", k / 4)
        assert e.why.quantities == {"successes": k, "samples": 4, "group_size": e.n_rollouts, "phase": 0}
    # the call that profiled lists, skipped, every prompt its labels drop for the run, and why
    dropped = {pid for pid, (label, _) in s._labels.items() if label in ("trivial", "unsolved")}
    skipped = [e for e in alloc if e.n_rollouts == 0]
    assert {e.prompt_id for e in skipped} == dropped and alloc.entries[-len(skipped) or len(alloc):] == tuple(skipped)
    for e in skipped:
        k = s.profile[e.prompt_id]
        assert e.why.code == s._labels[e.prompt_id][0] and e.why.value == k / 4
        assert (k / 4 > 0.75) if e.why.code == "trivial" else (k == 0 and e.why.quantities["keep_draw"] >= 0.1)
    assert all(e.n_rollouts > 0 for e in call(s, 1, data))  # listed once: later calls list only the dispatched


# --- state --------------------------------------------------------------------------------------

def test_state_is_plain_json_and_resumes_with_the_run_seed_it_labelled_with():
    data = pool(8)

    def at(s: Sgpo, step: int):
        s.before_step(StepContext("run", step, 5, step))  # the run's seed: 5
        return s.run(data)

    a = Sgpo(Sgpo.Config(batch_size=2, phase_steps=[3, 6], unsolved_rate=0.5))
    a.before_step(StepContext("run", 0, 5, 0))
    a.use_profile({f"p:{i}": s for i, s in enumerate([0, 0, 0, 4, 5, 2, 3, 1])})
    for step in range(4):
        at(a, step)
    state = json.loads(json.dumps(a.state_dict(), allow_nan=False))
    assert state == a.state_dict() and state["profile_seed"] == 5
    b = Sgpo(Sgpo.Config(batch_size=2, phase_steps=[3, 6], unsolved_rate=0.5))
    b.load_state_dict(state)  # before any before_step: the labels must use the saved seed, not 0
    assert b._labels == a._labels
    for step in range(4, 9):
        first, second = at(a, step), at(b, step)
        assert [(e.prompt_id, e.n_rollouts, e.reason) for e in first] == \
               [(e.prompt_id, e.n_rollouts, e.reason) for e in second]
        assert first.controller_state == second.controller_state
    assert a.state_dict() == b.state_dict()


# --- pipelines ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["sgpo_arith.yaml", "examples/sgpo_dapo_arith.yaml"])
def test_the_shipped_sgpo_pipelines_validate(name):
    compiled = load_pipeline(REPO / "pipelines" / name)
    assert compiled.nodes["pick"].info.alias == "control.sgpo"
    assert not any(n.info.alias == "control.fixed_n" for n in compiled.nodes.values())


def test_a_fixed_n_after_sgpo_is_refused_by_validate(tmp_path):
    from gfcr.errors import GfcrError

    text = (REPO / "pipelines" / "sgpo_arith.yaml").read_text().replace(
        "  rollout: {use: generate.sample, from: pick,",
        "  budget:  {use: control.fixed_n, from: pick, with: {n: 8}}\n  rollout: {use: generate.sample, from: budget,")
    spec = tmp_path / "bad.yaml"
    spec.write_text(text)
    with pytest.raises(GfcrError, match=r"stages\.budget\.with\.n: `pick` \(control\.sgpo\) upstream sets each "
                                        r"prompt's group size itself"):
        load_pipeline(spec)
