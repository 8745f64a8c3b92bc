"""control.mc_grpo: G + 1 rollouts per selected prompt, and its pairing with the ``mc_grpo``
advantage estimator under ``gfcr validate`` (accepted, a mismatched ``g``, another estimator,
``control.fixed_n`` after it; ``control.fixed_n`` with ``n: G + 1`` still pairs)."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.records import Allocation, AllocationEntry, Prompt
from gfcr.stages.control.mc_grpo import McGrpo
from tests.conftest import REPO

PIPELINE = REPO / "pipelines" / "mc_grpo_arith.yaml"


def validate(path, *overrides):
    result = CliRunner().invoke(app, ["validate", str(path)] + [a for o in overrides for a in ("--set", o)])
    assert "Traceback" not in result.output
    return result


def test_g_plus_one_per_selected_prompt_with_reasons_and_budget():
    stage = McGrpo(McGrpo.Config(g=2))
    alloc = Allocation(0, tuple(AllocationEntry(Prompt(p, text=p), 0 if p == "b" else 1, reason="r")
                                for p in ("a", "b", "c")))
    out = stage.run(alloc)
    assert [e.n_rollouts for e in out] == [3, 0, 3]
    assert out.entries[1].reason == "r" and out.entries[1].why is None  # a skip stays a skip
    why = out.entries[0].why
    assert (why.code, why.name, why.value, dict(why.quantities)) == ("g_plus_pivot", "g", 2.0, {"pivot": 1.0})
    # 2 prompts x (2 + 1): 6 spent, 2 of them pivots, 4 trained
    assert stage.step_metrics() == {"prompts": 2, "budget": 6, "spent": 6, "pivot_rollouts": 2, "trained_rollouts": 4}
    assert McGrpo.Config(g=8).rollouts_per_prompt == 9
    with pytest.raises(ValidationError):
        McGrpo.Config(g=0)


def test_the_shipped_pairing_validates():
    assert validate(PIPELINE).exit_code == 0


def test_a_mismatched_g_is_an_error_naming_both_keys():
    result = validate(PIPELINE, "stages.budget.with.g=4")
    assert result.exit_code == 2, result.output
    assert re.search(r"mc_grpo_arith\.yaml:\d+:\d+: update\.with\.advantage\.with\.g: MC-GRPO with `g: 7` needs "
                     r"G \+ 1 = 8 rollouts per prompt, but stage `budget` allocates 5", result.output), result.output
    assert "set `g: 7` on `budget` (--set stages.budget.with.g=7), or set `g: 4`" in result.output
    # without g on the estimator, G is whatever the allocator gives: 4
    assert validate(PIPELINE, "stages.budget.with.g=4", "update.with.advantage.with.g=null").exit_code == 0


def test_another_estimator_after_the_g_plus_one_allocator_is_an_error():
    result = validate(PIPELINE, "update.with.advantage.use=mean_std", "update.with.advantage.with={}")
    assert result.exit_code == 2, result.output
    assert "stages.budget.with.g: control.mc_grpo allocates G + 1 = 8 rollouts for MC-GRPO's median pivot, " \
           "but the update's advantage is `mean_std`" in result.output
    assert "or use `control.fixed_n` with `n: 8`" in result.output


def test_fixed_n_after_it_is_refused_and_fixed_n_alone_still_pairs(tmp_path):
    text = PIPELINE.read_text()
    spec = tmp_path / "twice.yaml"
    spec.write_text(text.replace("  rollout: {use: generate.sample, from: budget,",
                                 "  again:   {use: control.fixed_n, from: budget, with: {n: 8}}\n"
                                 "  rollout: {use: generate.sample, from: again,"))
    result = validate(spec)
    assert result.exit_code == 2, result.output
    assert "`budget` (control.mc_grpo) upstream sets each prompt's group size itself" in result.output
    plain = tmp_path / "fixed.yaml"
    plain.write_text(text.replace("{use: control.mc_grpo, from: pick, with: {g: 7}}",
                                  "{use: control.fixed_n, from: pick, with: {n: 8}}"))
    assert validate(plain).exit_code == 0
    mismatch = validate(plain, "stages.budget.with.n=9")
    assert mismatch.exit_code == 2 and "set `n: 8` on `budget`" in mismatch.output
