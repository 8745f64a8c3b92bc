"""GDRO's pass@k classifier and Rollout-GDRO (``control.gdro_rollout``): hysteresis on a hand
sequence, the exact-budget dynamic program (hand case, and a property test against brute
force over many seeds), one EXP3P step and one dual step by hand, checkpoint state, and loud
misconfiguration."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.records import Allocation, AllocationEntry, Prompt, StepReport
from gfcr.stages.common.passk_bins import PassKBins
from gfcr.stages.control.gdro_rollout import GdroRollout, arm_probabilities, best_arms
from gfcr.stages.testing import scored_group
from tests.conftest import REPO


def _window(bins: PassKBins, prompt: str, hits: int) -> float:
    """Fill the prompt's window (50) with ``hits`` ones: pass@k = hits / 50."""
    for i in range(bins.window):
        bins.record(prompt, i < hits)
    return bins.passk(prompt)


def test_hysteresis_on_a_hand_sequence():
    bins = PassKBins(edges=(0.4, 0.75), window=50, margin=0.03)
    assert bins.assign("p") == 0  # unseen: pass@k 0
    # (hits, pass@k, bin): a move needs pass@k past the crossed edge by 0.03
    sequence = [
        (20, 0.40, 0),  # on the edge 0.4, raw bin 1, but 0.40 < 0.43: stays in 0
        (22, 0.44, 1),  # 0.44 >= 0.43: up
        (38, 0.76, 1),  # raw bin 2, but 0.76 < 0.78: stays in 1
        (40, 0.80, 2),  # up
        (37, 0.74, 2),  # raw bin 1, but 0.74 > 0.72: stays in 2
        (19, 0.38, 1),  # raw bin 0: past 0.75 by far, but not past 0.4 by 0.03: only down to 1
        (10, 0.20, 0),  # down
    ]
    for hits, p, expected in sequence:
        assert _window(bins, "p", hits) == pytest.approx(p)
        assert bins.assign("p") == expected, (p, expected)


def test_a_first_assignment_takes_the_raw_bin_and_a_value_on_an_edge_belongs_above_it():
    bins = PassKBins(edges=(0.4, 0.75), window=50, margin=0.03)
    _window(bins, "q", 20)  # 0.40, never assigned before: no hysteresis yet
    assert bins.assign("q") == 1 and bins.raw_bin(0.75) == 2 and bins.raw_bin(0.0) == 0
    assert bins.num_bins == 3


def test_the_window_keeps_the_last_h_indicators_and_the_state_round_trips():
    bins = PassKBins(edges=(0.5,), window=3, margin=0.0)
    for hit in (1, 1, 0, 0):  # the first 1 falls out
        bins.record("p", hit)
    assert bins.passk("p") == pytest.approx(1 / 3)
    bins.assign("p")
    again = PassKBins(edges=(0.5,), window=3, margin=0.0)
    again.load_state_dict(json.loads(json.dumps(bins.state_dict())))
    again.record("p", 1)  # the window still holds 3 after the round trip: [0, 0, 1]
    assert again.passk("p") == pytest.approx(1 / 3) and again.bins == {"p": 0}


def test_the_dp_picks_the_combination_of_maximum_joint_log_probability_on_a_hand_case():
    # bins a (3 prompts), b (1 prompt); arms 2..5; budget 3 * 4 + 4 = 16.
    # Feasible (n_a, n_b): (2, 10) no: arm max 5; (3, 7) no; (4, 4); (5, 1) no. Only 3*n_a + n_b = 16
    # with n_b in 2..5: n_b = 4 -> n_a = 4; n_b = 1 -> no. So one combination: (4, 4).
    log_probs = {"a": [0.0, -1.0, -5.0, -1.0], "b": [-1.0, -1.0, -1.0, 0.0]}
    assert best_arms({"a": 3, "b": 1}, (2, 3, 4, 5), log_probs, 16, prefer=4) == {"a": 4, "b": 4}
    # two bins of 2 prompts, budget 16: n_a + n_b = 8 -> (3, 5), (4, 4), (5, 3)
    # log p: (3, 5): -1 + 0 = -1; (4, 4): -5 - 1 = -6; (5, 3): -1 - 1 = -2. Best: (3, 5).
    assert best_arms({"a": 2, "b": 2}, (2, 3, 4, 5), log_probs, 16, prefer=4) == {"a": 3, "b": 5}


def test_the_dp_breaks_ties_toward_the_mean():
    flat = {"a": [0.0] * 11, "b": [0.0] * 11}
    assert best_arms({"a": 5, "b": 3}, tuple(range(2, 13)), flat, 32, prefer=4) == {"a": 4, "b": 4}


@pytest.mark.parametrize("seed", range(200))
def test_the_dp_spends_the_budget_exactly_and_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    arms = tuple(range(2, 13))
    mean = int(rng.integers(2, 13))
    counts = {b: int(rng.integers(1, 21)) for b in range(int(rng.integers(1, 4)))}
    log_probs = {b: np.log(rng.dirichlet(np.ones(len(arms)))).tolist() for b in counts}
    budget = mean * sum(counts.values())
    chosen = best_arms(counts, arms, log_probs, budget, prefer=mean)
    assert sum(counts[b] * chosen[b] for b in counts) == budget
    assert all(chosen[b] in arms for b in counts)
    best = max(sum(log_probs[b][arms.index(n)] for b, n in zip(counts, combo))
               for combo in itertools.product(arms, repeat=len(counts))
               if sum(counts[b] * n for b, n in zip(counts, combo)) == budget)
    got = sum(log_probs[b][arms.index(chosen[b])] for b in counts)
    assert got == pytest.approx(best, abs=1e-12)


def test_the_dp_refuses_an_unreachable_budget():
    with pytest.raises(ValueError, match="spends exactly 7"):
        best_arms({"a": 2}, (2, 3), {"a": [0.0, 0.0]}, 7, prefer=2)


def _allocation(*prompts: str, step: int = 0) -> Allocation:
    return Allocation(step, tuple(AllocationEntry(Prompt(p, text=p), 1) for p in prompts))


def test_one_exp3p_step_and_one_dual_step_by_hand():
    stage = GdroRollout(GdroRollout.Config())
    out = stage.run(_allocation("p:0", "p:1"))
    assert [e.n_rollouts for e in out] == [4, 4]  # both unseen (bin 0), uniform arms: tie -> n_bar
    assert stage.step_metrics() == {"budget": 8, "spent": 8, "mu": 0.0, "prompts_bin0": 2, "n_bin0": 4,
                                    "prompts_bin1": 0, "n_bin1": 0, "prompts_bin2": 0, "n_bin2": 0}
    # p:1 came back with 2 of its 4 rollouts: losses 1 - r over the bin's 6 scored rollouts
    # [0, 1, 1, 1] + [0, 1] -> mean 4/6, J_0 = -2/3; mu = 0 at scoring time:
    # s_0(4) -= J_0 + 0 * (4 - 4) -> s_0(4) = 2/3
    groups = (scored_group("p:0", [1, 0, 0, 0]), scored_group("p:1", [1, 0]))
    stage.observe(StepReport("run", 0, 1, groups, None, {}, {}))
    arm4 = stage.config.arms.index(4)
    assert stage.scores[0, arm4] == pytest.approx(2 / 3) and stage.pulls[0, arm4] == 1
    assert np.count_nonzero(stage.scores) == 1
    # n_hat = 6 rollouts / 2 prompts = 3: mu <- 0 + 0.05 * (3 - 4) = -0.05
    assert stage.mu == pytest.approx(-0.05)
    # p_0(4) = 0.99 * e^(0.65 * 2/3) / (10 + e^(0.65 * 2/3)) + 0.01 / 11
    e = math.exp(0.65 * 2 / 3)
    assert stage.arm_probabilities(0)[arm4] == pytest.approx(0.99 * e / (10 + e) + 0.01 / 11)
    assert stage.arm_probabilities(0).sum() == pytest.approx(1.0)
    # the classifier learnt: p:0 and p:1 each have one any-correct indicator (pass@k 1.0)
    assert stage.classifier.passk("p:0") == 1.0


def test_the_next_step_uses_the_bins_learnt_from_the_previous_one_and_spends_exactly():
    stage = GdroRollout(GdroRollout.Config())
    stage.run(_allocation("easy", "hard", "mid"))
    stage.observe(StepReport("run", 0, 1, (scored_group("easy", [1, 1, 1, 1]), scored_group("hard", [0, 0, 0, 0]),
                                           scored_group("mid", [0, 1, 0, 0])), None, {}, {}))
    stage.scores[2] = 0.0
    stage.scores[2, stage.config.arms.index(2)] = 10.0  # bin 2 (easy) now strongly prefers 2 rollouts
    out = stage.run(_allocation("easy", "hard", "other", step=1))
    n = {e.prompt_id: e.n_rollouts for e in out}
    # easy: pass@k 1 -> bin 2 -> 2 rollouts; hard (0.0) and other (unseen) in bin 0 share 12 - 2 = 10: 5 each
    assert n == {"easy": 2, "hard": 5, "other": 5}
    assert stage.step_metrics()["spent"] == stage.step_metrics()["budget"] == 12


def test_loop_rounds_add_up_in_the_step_metrics_and_each_arm_is_scored_by_its_own_groups():
    stage = GdroRollout(GdroRollout.Config())
    stage.run(_allocation("a", "b"))
    stage.scores[0, stage.config.arms.index(5)] = 20.0  # bin 0 now prefers 5
    stage.classifier.record("e", 1)  # e: pass@k 1 -> bin 2
    # a second round of the same step: c, d in bin 0 and e in bin 2 share 12 rollouts: 2 * 5 + 2
    assert [e.n_rollouts for e in stage.run(_allocation("c", "d", "e"))] == [5, 5, 2]
    metrics = stage.step_metrics()
    assert metrics["budget"] == metrics["spent"] == 8 + 12
    assert (metrics["prompts_bin0"], metrics["prompts_bin2"], metrics["n_bin0"], metrics["n_bin2"]) == (4, 1, 5, 2)
    stage.scores[:] = 0.0
    groups = (scored_group("a", [1, 1, 1, 1]), scored_group("b", [1, 1, 1, 1]), scored_group("c", [0, 0, 0, 0]),
              scored_group("d", [0, 0, 0, 0]), scored_group("e", [0, 0, 0, 0]))
    stage.observe(StepReport("run", 0, 1, groups, None, {}, {}))
    # pulls: (bin 0, n 4) from round 1 with loss 0 -> score 0; (0, 5) and (2, 2) from round 2 with
    # loss 1 -> s -= (J = -1) + mu 0 -> 1 each
    arm = stage.config.arms.index
    assert stage.pulls[0, arm(4)] == stage.pulls[0, arm(5)] == stage.pulls[2, arm(2)] == 1 and stage.pulls.sum() == 3
    assert (stage.scores[0, arm(4)], stage.scores[0, arm(5)], stage.scores[2, arm(2)]) == (0.0, 1.0, 1.0)
    assert stage.step_metrics() == {}


def test_skipped_prompts_stay_skipped_and_do_not_count_in_the_budget():
    stage = GdroRollout(GdroRollout.Config(mean_rollouts=3))
    alloc = Allocation(0, (AllocationEntry(Prompt("a", text="a"), 1), AllocationEntry(Prompt("b", text="b"), 0)))
    assert [e.n_rollouts for e in stage.run(alloc)] == [3, 0]
    assert stage.step_metrics()["budget"] == 3


def test_state_round_trips_through_json():
    stage = GdroRollout(GdroRollout.Config())
    stage.run(_allocation("a", "b"))
    stage.observe(StepReport("run", 0, 1, (scored_group("a", [1, 0, 0, 0]), scored_group("b", [0, 0])), None, {}, {}))
    again = GdroRollout(GdroRollout.Config())
    again.load_state_dict(json.loads(json.dumps(stage.state_dict())))
    assert np.array_equal(again.scores, stage.scores) and np.array_equal(again.pulls, stage.pulls)
    assert again.mu == stage.mu and again.classifier.state_dict() == stage.classifier.state_dict()
    assert [e.n_rollouts for e in again.run(_allocation("a", "b"))] == [e.n_rollouts for e in
                                                                         stage.run(_allocation("a", "b"))]


def test_arm_probabilities_mix_in_uniform_exploration():
    p = arm_probabilities(np.array([0.0, 1000.0]), eta=1.0, gamma=0.2)  # no overflow
    assert p.tolist() == pytest.approx([0.1, 0.9])


@pytest.mark.parametrize("fields, message", [
    ({"mean_rollouts": 1}, "mean_rollouts (1) must lie in [min_rollouts, max_rollouts] = [2, 12]"),
    ({"mean_rollouts": 13}, "mean_rollouts (13) must lie in"),
    ({"edges": (0.75, 0.4)}, "must be strictly increasing values inside (0, 1)"),
    ({"edges": (0.4, 1.0)}, "must be strictly increasing"),
    ({"margin": 0.5}, "less than 0.5"),
])
def test_misconfiguration_is_loud(fields, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        GdroRollout.Config(**fields)


def _pipeline(tmp_path: Path, budget: str) -> Path:
    text = (REPO / "pipelines" / "gdro_arith.yaml").read_text()
    path = tmp_path / "gdro.yaml"
    shipped = next(line for line in text.splitlines() if line.startswith("  budget:"))
    path.write_text(text.replace(shipped, budget))
    return path


def test_validate_reports_a_bad_mean_with_its_key_path(tmp_path):
    path = _pipeline(tmp_path, "  budget:  {use: control.gdro_rollout, from: pick, with: {mean_rollouts: 20}}")
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    assert "stages.budget.with" in result.output and "mean_rollouts (20) must lie in" in result.output
    assert "gdro.yaml:" in result.output and "Traceback" not in result.output


def test_validate_refuses_a_fixed_n_after_the_allocator(tmp_path):
    path = _pipeline(tmp_path, "  gdro:    {use: control.gdro_rollout, from: pick}\n"
                               "  budget:  {use: control.fixed_n, from: gdro, with: {n: 8}}")
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    assert "control.gdro_rollout" in result.output and "would overwrite them" in result.output
