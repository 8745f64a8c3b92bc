"""filter.d3s: D^3S's max-Var(A) subset on a hand group (intra- and cross-group), the |A|·H token
mask on hand values, the schedule on hand steps, the entropy scoring path through the real
engine, misconfiguration (Config, `gfcr validate`, run-time), and a few steps of the shipped
pipeline through the runtime."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.graph import compile_pipeline
from gfcr.records import Prompt, PromptPool, Rollout, RolloutGroup, RolloutGroups, Segment, StepContext
from gfcr.runtime import LocalRunner
from gfcr.runtime.loop.session import build_services
from gfcr.spec import load_spec
from gfcr.stages.filter.d3s import D3S
from gfcr.stages.filter.down_sampling import kept_count, linear_ratio, max_variance_subset, top_fraction
from gfcr.stages.testing import scored_group
from gfcr.stages.components.advantage.mean_std import MeanStd

PIPELINE = Path(__file__).resolve().parents[3] / "pipelines" / "d3s_arith.yaml"


def ctx(step: int = 0) -> StepContext:
    return StepContext("r", step, 0, step)


def pool(*prompts: str) -> PromptPool:
    return PromptPool([Prompt(p, text=p) for p in prompts])


def run(groups: list[RolloutGroup], step: int = 0, **config) -> tuple[D3S, RolloutGroups]:
    stage = D3S(D3S.Config(**config))
    out = stage.run(RolloutGroups(groups), pool(*{g.prompt_id for g in groups}), ctx(step))
    return stage, out


def rollout(gid: str, i: int, reward: float, entropy: list[float], mask: list[bool] | None = None) -> Rollout:
    n = len(entropy)
    return Rollout(f"{gid}/{i}", gid, gid, [1] * n, [Segment(0, n, 0, np.zeros(n))], reward=reward,
                   token_entropy=np.array(entropy, np.float32),
                   loss_mask=None if mask is None else np.array(mask))


def ids(rollouts) -> list[str]:
    return [r.rollout_id for r in rollouts]


# --- sample level ---------------------------------------------------------------------------

def test_intra_group_keeps_the_max_variance_half_of_a_hand_group():
    # rewards r = [0, 1, 0, 0, 0.5, 1, 0, 0]; mean_std advantages are affine in r, so the max-Var(A)
    # subset of m = ceil(0.5 * 8) = 4 is the max-Var(r) one. Sorted, the candidates are the k largest
    # and 4 - k smallest: k=0 {0,0,0,0} var 0; k=1 {1,0,0,0} var .25 - .0625 = .1875;
    # k=2 {1,1,0,0} var .25; k=3 {1,1,.5,0} var .5625 - .390625 = .171875; k=4 {1,1,.5,0} the same.
    # k = 2: the two 1s (rollouts 1, 5) and the first two 0s (rollouts 0, 2).
    group = scored_group("p:0", [0.0, 1.0, 0.0, 0.0, 0.5, 1.0, 0.0, 0.0])
    stage, out = run([group], sample_keep_start=0.5, token_keep_start=1.0)
    assert ids(group.rollouts) == ["p:0@s0/0", "p:0@s0/1", "p:0@s0/2", "p:0@s0/5"]
    assert ids(m.rollout for m in group.removed) == ["p:0@s0/3", "p:0@s0/4", "p:0@s0/6", "p:0@s0/7"]
    assert {m.reason for m in group.removed} == {"not in the max-Var(A) subset (4 of 8 kept, keep ratio 0.5)"}
    assert [g.group_id for g in out] == ["p:0@s0"] and group.verdict.included
    # Var(A) of the full group is (G - 1) / G = 7/8 under ddof = 1 normalisation; on the kept subset it
    # is Var(r_S) / std(r)^2 = .25 / (.18359375 * 8 / 7) = 1.19149 (eps = 1e-6 moves the 6th digit)
    m = stage.step_metrics()
    assert m["adv_var_before"] == pytest.approx(0.875, abs=1e-5)
    assert m["adv_var_after"] == pytest.approx(0.25 * 7 / (0.18359375 * 8), abs=1e-5)
    assert (m["rollouts_in"], m["rollouts_kept"], m["groups_dropped"]) == (8, 4, 0)
    # the update re-estimates on the kept subset [0, 1, 0, 1]: mean .5, std (ddof 1) sqrt(1/3) -> +-0.866
    values = MeanStd(MeanStd.Config()).estimate(group).values
    np.testing.assert_allclose(values, [-0.8660, 0.8660, -0.8660, 0.8660], atol=1e-4)
    assert all(r.loss_mask is None for r in group.rollouts)  # token level off


def test_a_group_is_never_cut_below_two_and_small_groups_pass():
    # ceil(0.5 * 3) = 2 of [1, 0, 0]: {1, 0} (k=1, var .25) beats {0, 0}; a group of 1 stays whole
    three, one = scored_group("p:0", [1.0, 0.0, 0.0]), scored_group("p:1", [1.0])
    run([three, one], sample_keep_start=0.5, token_keep_start=1.0)
    assert ids(three.rollouts) == ["p:0@s0/0", "p:0@s0/1"] and len(one.rollouts) == 1
    assert kept_count(0.1, 8, 2) == 2 and kept_count(0.3, 10) == 3 and kept_count(0.51, 8) == 5


def test_cross_group_pools_the_advantages_and_drops_groups_left_below_two():
    # a = [1, 0, 0, 0] -> A = (r - .25) / .5 = [1.5, -.5, -.5, -.5]; b = [1, 1, 1, 0] -> [.5, .5, .5, -1.5];
    # c = [.5, .5] -> [0, 0]. Pooled N = 10, m = ceil(.5 * 10) = 5:
    # k=2 {1.5, .5 | -1.5, -.5, -.5}: mean -.1, var 1.05 - .01 = 1.04; k=3 {1.5, .5, .5 | -1.5, -.5}: mean .1,
    # var 1.04 (a tie: more of the largest wins); k=1 {1.5 | -1.5, -.5, -.5, -.5}: mean -.3, var 1.05 - .09
    # = .96; k=4 {1.5, .5, .5, .5 | -1.5}: .96; k=0 and k=5 lower still.
    # k = 3: a/0, b/0, b/1 (the largest, lower index first) and b/3, a/1 (the smallest).
    a, b, c = scored_group("a", [1, 0, 0, 0]), scored_group("b", [1, 1, 1, 0]), scored_group("c", [0.5, 0.5])
    stage, out = run([a, b, c], scope="cross_group", sample_keep_start=0.5, token_keep_start=1.0)
    assert ids(a.rollouts) == ["a@s0/0", "a@s0/1"] and ids(b.rollouts) == ["b@s0/0", "b@s0/1", "b@s0/3"]
    assert not c.verdict.included and "kept 0 of its 2 rollouts" in c.verdict.reason
    assert [g.group_id for g in out] == ["a@s0", "b@s0"]
    m = stage.step_metrics()
    assert m["groups_dropped"] == 1 and m["rollouts_kept"] == 5
    # pooled Var(A): all ten: mean 0, (2.25 + 2.25 + 6 * .25) / 10 = .6; the kept five: 1.04 (eps: 1e-5)
    assert m["adv_var_before"] == pytest.approx(0.6, abs=1e-5) and m["adv_var_after"] == pytest.approx(1.04, abs=1e-5)


def test_scored_entropy_needs_an_engine_at_setup():
    from gfcr.errors import ModelError
    from gfcr.stages.resources import Lent

    with pytest.raises(ModelError, match="`filter.d3s` needs a policy"):
        D3S(D3S.Config(entropy="scored")).setup(Lent())
    D3S(D3S.Config()).setup(Lent())  # recorded: an engine is borrowed only when there is one


def test_max_variance_subset_matches_exhaustive_search():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        values = np.round(rng.normal(size=n), 1) if rng.random() < 0.5 else rng.integers(0, 2, n).astype(float)
        m = int(rng.integers(1, n + 1))
        best = max(np.var(values[list(s)]) for s in itertools.combinations(range(n), m))
        chosen = max_variance_subset(values, m)
        assert len(set(chosen.tolist())) == m and np.var(values[chosen]) == pytest.approx(best, abs=1e-9)


def test_max_variance_ties_prefer_more_of_the_largest_then_lower_indices():
    # [1,1,1,1,0,0,0,0], m = 3: {1,0,0} and {1,1,0} both have variance 2/9; k = 2 wins
    assert max_variance_subset(np.array([1, 1, 1, 1, 0, 0, 0, 0.0]), 3).tolist() == [0, 1, 4]
    assert max_variance_subset(np.zeros(4), 2).tolist() == [0, 1]
    with pytest.raises(ValueError, match="cannot keep 5 of 4"):
        max_variance_subset(np.zeros(4), 5)


# --- token level ----------------------------------------------------------------------------

def test_token_mask_keeps_the_largest_abs_advantage_times_entropy_across_the_batch():
    # g1 = [1, 0]: A = +-0.7071 (mean .5, std sqrt(.5)); g2 = [1, 0, 0, 0]: A = [1.5, -.5, -.5, -.5].
    # |A|·H: g1/0 [.7071 * 1.0, .7071 * .1] = [.7071, .0707]; g1/1 .7071 * .5 = .3536; g2/0 1.5 * .2 = .3;
    # g2/1 [.5 * .9, masked] = [.45, -]; g2/2 .5 * 0 = 0; g2/3 .5 * 2 = 1.0. Counted T = 7,
    # ceil(.5 * 7) = 4 kept: 1.0, .7071, .45, .3536.
    g1 = RolloutGroup("g1", "g1", 0, 2, [rollout("g1", 0, 1, [1.0, 0.1]), rollout("g1", 1, 0, [0.5])])
    g2 = RolloutGroup("g2", "g2", 0, 4, [rollout("g2", 0, 1, [0.2]), rollout("g2", 1, 0, [0.9, 0.3], [True, False]),
                                         rollout("g2", 2, 0, [0.0]), rollout("g2", 3, 0, [2.0])])
    stage, _ = run([g1, g2], sample_keep_start=1.0, token_keep_start=0.5)
    masks = [r.loss_mask.tolist() for r in g1.rollouts + g2.rollouts]
    assert masks == [[True, False], [True], [False], [True, False], [False], [True]]
    m = stage.step_metrics()
    assert (m["tokens_in"], m["tokens_kept"], m["entropy_tokens_scored"]) == (7, 4, 0)


def test_top_fraction_on_hand_scores():
    assert top_fraction(np.array([0.2, 1.0, 0.6, 0.5]), 0.5).tolist() == [False, True, True, False]
    assert top_fraction(np.array([0.3, 0.3, 0.3]), 0.34).tolist() == [True, True, False]  # ceil(1.02) = 2
    assert top_fraction(np.zeros(0), 0.5).tolist() == []


def test_token_advantages_are_those_of_the_kept_subset():
    # [1, 0, 0, 0] with rho_s = .5 keeps {1, 0} (rollouts 0 and 1): recomputed A = +-0.7071 (not the
    # full group's 1.5 / -.5), so with H = [1] vs [1] the two tokens tie at .7071 and rho_t = .5 keeps
    # the first (batch order)
    g = RolloutGroup("g", "g", 0, 4, [rollout("g", i, r, [1.0]) for i, r in enumerate([1, 0, 0, 0])])
    run([g], sample_keep_start=0.5, token_keep_start=0.5)
    assert ids(g.rollouts) == ["g/0", "g/1"] and [r.loss_mask.tolist() for r in g.rollouts] == [[True], [False]]


# --- schedule -------------------------------------------------------------------------------

@pytest.mark.parametrize("step, rho_s, rho_t, kept", [
    (0, 0.5, 0.2, 4),      # ceil(.5 * 8) = 4
    (25, 0.625, 0.4, 5),   # .5 + .5 * 25/100; .2 + .8 * .25; ceil(.625 * 8) = 5
    (50, 0.75, 0.6, 6),
    (100, 1.0, 1.0, 8),    # relaxed: nothing removed, no mask written
    (250, 1.0, 1.0, 8),
])
def test_the_schedule_on_hand_steps(step, rho_s, rho_t, kept):
    stage = D3S(D3S.Config())
    assert stage.ratios(step) == pytest.approx((rho_s, rho_t))
    group = RolloutGroup("g", "g", 0, 8, [rollout("g", i, i % 2, [1.0]) for i in range(8)])
    stage.run(RolloutGroups([group]), pool("g"), ctx(step))
    assert len(group.rollouts) == kept
    assert (group.rollouts[0].loss_mask is None) == (rho_t == 1.0)


def test_stateless_so_a_resumed_run_continues_the_schedule():
    # no state to checkpoint: a fresh stage at step 30 (a resumed run) decides as one that ran steps 0..29
    assert not hasattr(D3S, "state_dict") and not hasattr(D3S, "observe")
    def decide(stage, step):
        group = RolloutGroup("g", "g", step, 8, [rollout("g", i, i % 3 == 0, [0.1 * i + 0.1]) for i in range(8)])
        stage.run(RolloutGroups([group]), pool("g"), ctx(step))
        return ids(group.rollouts), [r.loss_mask.tolist() for r in group.rollouts]
    running = D3S(D3S.Config())
    for step in range(30):
        decide(running, step)
    assert decide(running, 30) == decide(D3S(D3S.Config()), 30)


def test_linear_ratio_holds_a_constant_schedule():
    assert [linear_ratio(0.3, 0.3, 10, s) for s in (0, 5, 20)] == [0.3, 0.3, 0.3]


# --- entropy through the engine -------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    from gfcr.engines import TransformersEngine, load_policy
    from gfcr.spec import PolicySpec

    policy = load_policy(PolicySpec(model="tiny-arith"))
    return policy, TransformersEngine(policy)


@pytest.mark.parametrize("entropy, drop_recorded", [("recorded", True), ("scored", False)])
def test_entropy_is_scored_through_the_engine_and_charged(tiny, entropy, drop_recorded):
    # recorded: a rollout with no entropy on record (as a replayed one) is scored; scored: every rollout is.
    # Either way the scored entropies equal the sampled ones (same policy, same temperature, no update).
    from gfcr.records import Allocation, AllocationEntry
    from gfcr.stages.generate.sample import Sample
    from gfcr.stages.resources import Lent

    resources = Lent(*tiny)
    prompt = Prompt("a:0", text="What is 12 + 30? Answer:")
    sample = Sample(Sample.Config(max_new_tokens=6, entropy=True))
    sample.setup(resources)
    groups = sample.run(Allocation(0, (AllocationEntry(prompt, 4),)), ctx(0))
    recorded = [r.token_entropy.copy() for r in groups.rollouts()]
    for i, r in enumerate(groups.rollouts()):
        r.reward = float(i % 2)
        if drop_recorded:
            r.token_entropy = None
    stage = D3S(D3S.Config(sample_keep_start=1.0, token_keep_start=0.5, entropy=entropy))
    stage.setup(resources)
    stage.run(groups, PromptPool([prompt]), ctx(0))
    n_tokens = sum(len(r) for r in groups.rollouts())
    assert stage.step_metrics()["entropy_tokens_scored"] == n_tokens
    assert resources.take_tokens_scored() == n_tokens
    rescored = stage._entropies(list(groups.rollouts()), PromptPool([prompt]))[0]
    for a, b in zip(recorded, rescored):
        np.testing.assert_allclose(a, b, atol=1e-3)


# --- misconfiguration -----------------------------------------------------------------------

@pytest.mark.parametrize("config, message", [
    ({"sample_keep_start": 0.8, "sample_keep_end": 0.5}, "`sample_keep_start` (0.8) is above `sample_keep_end` (0.5)"),
    ({"token_keep_start": 0.9, "token_keep_end": 0.4}, "starts aggressive and relaxes"),
    ({"sample_keep_start": 0.0}, "greater than 0"),
    ({"token_keep_end": 1.5}, "less than or equal to 1"),
    ({"ramp_steps": 0}, "greater than or equal to 1"),
    ({"scope": "per_token"}, "'intra_group' or 'cross_group'"),
    ({"advantage": {"use": "mean_sdt"}}, "did you mean `mean_std`"),
])
def test_bad_configs_are_refused(config, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        D3S.Config(**config)


def test_validate_refuses_an_update_with_another_estimator_and_no_recorded_entropy(tmp_path):
    text = PIPELINE.read_text().replace("entropy: true", "entropy: false")
    text = text.replace("with: {lr: 3.0e-4, advantage: {use: mean_std}", "with: {lr: 3.0e-4, advantage: {use: rloo}")
    path = tmp_path / "d3s_bad.yaml"
    path.write_text(text)
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    out = " ".join(result.output.split())
    assert re.search(r"d3s_bad\.yaml:\d+:\d+: stages\.d3s\.with\.advantage: the selection's advantage estimator "
                     r"\(`mean_std`", out)
    assert "stages.d3s.with.token_keep_start" in out and "set `entropy: true` on `rollout`" in out
    assert "Traceback" not in result.output
    scored = text.replace("advantage: {use: rloo}", "advantage: {use: mean_std}").replace(
        "ramp_steps: 100,", "ramp_steps: 100, entropy: scored,")
    path.write_text(scored)
    result = CliRunner().invoke(app, ["validate", str(path)])  # entropy scored: no sampling-time entropy needed
    assert result.exit_code == 0, result.output


def test_the_token_level_off_needs_no_entropy_at_validate_or_run(tmp_path):
    text = PIPELINE.read_text().replace("entropy: true", "entropy: false")
    text = text.replace("token_keep_start: 0.2", "token_keep_start: 1.0")
    path = tmp_path / "d3s_samples_only.yaml"
    path.write_text(text)
    assert CliRunner().invoke(app, ["validate", str(path)]).exit_code == 0
    g = scored_group("p:0", [1, 0, 0, 0])  # no entropy on record, no engine: fine without a token level
    run([g], sample_keep_start=0.5, token_keep_start=1.0)
    assert len(g.rollouts) == 2


def test_missing_entropy_without_an_engine_is_an_error_with_a_fix():
    with pytest.raises(ValueError, match=r"rollout p:0@s0/0 needs its token entropy scored.*set `entropy: true`"):
        run([scored_group("p:0", [1, 0])], token_keep_start=0.5)


def test_unscored_rollouts_are_refused_naming_the_group():
    g = scored_group("p:3", [1, 0])
    g.rollouts[1].reward = None
    with pytest.raises(ValueError, match=r"group p:3@s0: 1 of 2 rewards are NaN.*filter.verify"):
        run([g])


# --- the shipped pipeline -------------------------------------------------------------------

def test_the_pipeline_runs_steps_with_removals_masks_and_metrics():
    # two steps of the shipped pipeline (tiny-arith, 16 prompts x 8 rollouts, entropy recorded)
    pipeline = compile_pipeline(load_spec(PIPELINE))
    runner = LocalRunner(pipeline, services=build_services(pipeline.spec))
    first, second = runner.run_step(), runner.run_step()
    kept = [r for g in first.groups if g.verdict.included for r in g.rollouts]
    removed = [m for g in first.groups for m in g.removed]
    assert len(kept) == len(removed) == 64  # step 0: rho_s = .5, 4 of each group's 8
    assert {m.removed_by for m in removed} == {"d3s"}
    counted = sum(int(r.loss_mask.sum()) for r in kept)
    assert counted == kept_count(0.2, sum(len(r) for r in kept))  # step 0: the top 20% of the tokens
    metrics = first.metrics["d3s"]
    assert (metrics["rollouts_kept"], metrics["tokens_kept"], metrics["entropy_tokens_scored"]) == (64, counted, 0)
    assert metrics["adv_var_after"] >= metrics["adv_var_before"]
    # step 1: rho_s = .5 + .5/100 = .505 -> ceil(4.04) = 5 of 8; rho_t = .2 + .8/100 = .208
    assert second.metrics["d3s"]["sample_keep_ratio"] == pytest.approx(0.505)
    assert second.metrics["d3s"]["rollouts_kept"] == 16 * 5
    assert second.update is not None and not second.update.skipped
