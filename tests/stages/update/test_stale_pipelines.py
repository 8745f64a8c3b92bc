"""The shipped pipelines of the stale-data methods run on tiny-arith (4-6 short steps each, eval
off): SAT and SAT-GSPO under the pipelined lifecycle (every token of step t >= 1 is stale),
SAO with one rollout per prompt under the asynchronous lifecycle, the freshness correction on
AR3PO's cache of stale responses, and mu-GRPO's recipe under the asynchronous lifecycle."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run

REPO = Path(__file__).resolve().parents[3]
SHORT = ["executor.kind=local", "tracking.mlflow=null", "eval=null"]


def _train(tmp_path: Path, name: str, sets: list[str]) -> list[dict]:
    compiled = load_pipeline(REPO / "pipelines" / "examples" / f"{name}.yaml", sets + SHORT)
    Run.start(compiled, tmp_path / "run").train()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(not line["update_skipped"] and math.isfinite(line["loss"]) for line in lines)
    return lines


@pytest.mark.parametrize(("name", "sets"), [
    ("sat_pipelined_arith", ["run.steps=4", "stages.pick.with.batch_size=8"]),
    ("sat_gspo_pipelined_arith", ["run.steps=4", "stages.pick.with.batch_size=8", "lifecycle.lag=2"]),
])
def test_the_sat_pipelines_train_on_stale_tokens(tmp_path: Path, name: str, sets: list[str]) -> None:
    lines = _train(tmp_path, name, sets)
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    assert lines[0]["update"]["off_policy_token_fraction"] == 0.0
    assert all(line["update"]["off_policy_token_fraction"] == 1.0 for line in lines[1:])
    assert [sorted(line["staleness"]) for line in lines] == [["0"], ["1"], ["2"], ["2"]]
    assert any(line["update"]["clip_fraction"] > 0.0 for line in lines[1:])  # the (contracted) interval binds


def test_the_sao_pipeline_trains_one_rollout_per_prompt_asynchronously(tmp_path: Path) -> None:
    lines = _train(tmp_path, "sao_single_arith", ["run.steps=4", "stages.pick.with.batch_size=16"])
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    assert all(line["update"]["batch_rollouts"] == 16 == line["update"]["batch_groups"] for line in lines)
    assert all(int(age) <= 4 for line in lines for age in line["staleness"])
    # the batch-mean baseline gives a single rollout an advantage (a group of one has none under GRPO's)
    assert all(line["update"]["advantage_abs_mean"] > 0.0 for line in lines)


def test_the_freshness_pipeline_weighs_cached_responses_by_their_age(tmp_path: Path) -> None:
    lines = _train(tmp_path, "freshness_cache_arith", ["data.with.n=32", "stages.budget.with.n=2", "run.steps=4"])
    assert sum(line["stages"]["cache"]["rollouts_replayed"] for line in lines) > 0
    stale = [line["update"]["off_policy_token_fraction"] for line in lines]
    assert stale[:2] == [0.0, 0.0] and any(f > 0.0 for f in stale[2:]), stale
    # a replayed response weighs less than 1 per token: the batch's token weight is no longer a count
    tokens = [line["update"]["batch_tokens"] for line in lines]
    assert all(t == int(t) for t, f in zip(tokens, stale) if f == 0.0)
    assert any(t != int(t) for t, f in zip(tokens, stale) if f > 0.0), tokens


def test_the_mu_grpo_recipe_trains_on_stale_tokens_asynchronously(tmp_path: Path) -> None:
    lines = _train(tmp_path, "mu_grpo_async_arith", ["run.steps=5", "stages.pick.with.batch_size=8"])
    assert [line["step"] for line in lines] == [0, 1, 2, 3, 4]
    # how far generation runs ahead depends on timing under `async`: only the bound is certain
    assert all(int(age) <= 8 for line in lines for age in line["staleness"])
    assert all(sum(line["staleness"].values()) == line["update"]["batch_tokens"] for line in lines)
