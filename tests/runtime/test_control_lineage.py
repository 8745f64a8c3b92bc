"""The Control stages' per-prompt reasons in real tiny-arith runs: ``control.greso`` and
``control.beta_thompson`` write, per step, why each candidate prompt was picked or skipped
into ``lineage/control-NNNNNN.parquet``; read back (``read_control_lineage``, ``gfcr lineage``)
they match what the selector did (the prompts rolled out, the streaks and posteriors the run's
own groups imply, the step's ``control`` metrics)."""

from __future__ import annotations

import json
import textwrap
from collections import defaultdict

import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.graph import load_pipeline
from gfcr.runtime.store.lineage import read_control_lineage, read_lineage
from gfcr.runtime.store.rundir import RunDir
from gfcr.runtime.loop.session import Run

cli = CliRunner()

SPEC = textwrap.dedent("""\
    name: {name}
    policy: {{model: tiny-arith}}
    data: {{source: arithmetic, with: {{n: 16, seed: 0, digits: 2, operators: ["+", "-"]}}}}
    stages:
      pick:    {pick}
      budget:  {{use: control.fixed_n, from: pick, with: {{n: 4}}}}
      rollout: {{use: generate.sample, from: budget, with: {{max_new_tokens: 8}}}}
      reward:  {{use: filter.verify, from: rollout}}
    update: {{use: update.grpo, from: reward, with: {{lr: 3.0e-4, loss: {{use: ppo_clip, with: {{clip: [0.2, 0.28]}}}}}}}}
    run: {{steps: {steps}, seed: 0}}
    executor: {{kind: local}}
    tracking: {{mlflow: null}}
    """)
SELECTORS = {  # 16 prompts: GRESO's second epoch (step 2 on) meets the streaks of the first
    "greso": ("{use: control.greso, with: {batch_size: 8}}", 4),
    "thompson": ("{use: control.beta_thompson, with: {batch_size: 2, candidate_ratio: 4}}", 3),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each selector's short run: its directory, metrics lines, rollout rows and control rows."""
    out = {}
    for name, (pick, steps) in SELECTORS.items():
        base = tmp_path_factory.mktemp(name)
        spec = base / f"{name}.yaml"
        spec.write_text(SPEC.format(name=name, pick=pick, steps=steps), encoding="utf-8")
        Run.start(load_pipeline(spec), base / "run").train()
        rd = RunDir(base / "run")
        out[name] = (rd.path, rd.read_metrics(), read_lineage(rd.lineage_dir).to_pylist(),
                     read_control_lineage(rd.lineage_dir))
    return out


def _groups(rollouts: list[dict]) -> dict[tuple[int, str], list[bool]]:
    """(step, prompt id) -> the correctness of its rollouts."""
    groups = defaultdict(list)
    for r in rollouts:
        groups[(r["step"], r["prompt_id"])].append(bool(r["correct"]))
    return groups


def _check_rolled_out_prompts_are_the_picked_ones(records, rollouts, decisions):
    for record in records:
        step = record["step"]
        rows = [d for d in decisions if d["step"] == step]
        assert {d["stage_id"] for d in rows} == {"pick"}  # control.fixed_n passes the entries on: no row
        picked = [d["prompt_id"] for d in rows if d["decision"] == "picked"]
        assert all(d["n_rollouts"] == 1 for d in rows if d["decision"] == "picked")  # as the selector set it
        assert all(d["n_rollouts"] == 0 for d in rows if d["decision"] == "skipped")
        assert sorted(picked) == sorted({r["prompt_id"] for r in rollouts if r["step"] == step})
        assert record["rollouts_generated"] == 4 * len(picked)


def test_greso_s_reasons_are_its_skip_rule_on_the_run_s_own_streaks(runs):
    _, records, rollouts, decisions = runs["greso"]
    _check_rolled_out_prompts_are_the_picked_ones(records, rollouts, decisions)
    groups = _groups(rollouts)
    skipped = [d for d in decisions if d["decision"] == "skipped"]
    assert skipped, "this seed skips prompts in the second epoch"
    for d in decisions:
        q, step = d["quantities"] or {}, d["step"]
        before = [groups[(s, d["prompt_id"])] for s in range(step) if (s, d["prompt_id"]) in groups]
        if d["code"] == "no_streak":
            assert d["decision"] == "picked" and d["value_name"] == "p_skip" and d["value"] == 0.0
            assert not before or (any(before[-1]) and not all(before[-1]))  # never seen, or last group mixed
            continue
        kind = d["code"].removesuffix("_streak")
        assert kind in ("easy", "hard") and d["value_name"] == "p_skip"
        # the streak: the prompt's latest groups were all correct (easy) or all wrong (hard)
        assert all(all(g) if kind == "easy" else not any(g) for g in before[-int(q["streak"]):])
        p = records[step]["control"]["pick"][f"p_{kind}"]
        assert q[f"p_{kind}"] == p and d["value"] == pytest.approx(1 - max(p ** q["streak"], 0.01))
        assert (d["decision"] == "skipped") == (q["draw"] < d["value"])  # GRESO's Bernoulli draw
        assert d["reason"].startswith("greso: skip" if d["decision"] == "skipped" else "greso: keep")
    for record in records:  # the reasons add up to the step's control metrics
        rows = [d for d in decisions if d["step"] == record["step"]]
        control = record["control"]["pick"]
        assert control["candidates"] == len(rows)
        assert control["kept"] == sum(d["decision"] == "picked" for d in rows)
        assert control["skipped_easy"] == sum(d["decision"] == "skipped" and d["code"] == "easy_streak" for d in rows)
        assert control["skipped_hard"] == sum(d["decision"] == "skipped" and d["code"] == "hard_streak" for d in rows)


def test_beta_thompson_s_reasons_are_the_draws_nearest_the_target_under_the_run_s_posteriors(runs):
    _, records, rollouts, decisions = runs["thompson"]
    _check_rolled_out_prompts_are_the_picked_ones(records, rollouts, decisions)
    groups = _groups(rollouts)
    for record in records:
        step = record["step"]
        rows = [d for d in decisions if d["step"] == step]
        assert len(rows) == 8 and sum(d["decision"] == "picked" for d in rows) == 2  # candidate_ratio 4, batch 2
        for d in rows:
            q = d["quantities"]
            assert d["value_name"] == "draw" and q["distance"] == pytest.approx(abs(d["value"] - 0.5))
            # Beta(1, 1) plus every earlier group of the prompt (decay 1: nothing forgotten)
            earlier = [c for s in range(step) for c in groups.get((s, d["prompt_id"]), [])]
            assert (q["alpha"], q["beta"]) == (1 + sum(earlier), 1 + len(earlier) - sum(earlier))
            assert q["posterior_mean"] == pytest.approx(q["alpha"] / (q["alpha"] + q["beta"]))
        picked = [d for d in rows if d["decision"] == "picked"]
        skipped = [d for d in rows if d["decision"] == "skipped"]
        assert all(d["code"] == "closest_to_target" for d in picked)
        assert all(d["code"] == "farther_from_target" for d in skipped)
        cutoff = max(d["quantities"]["distance"] for d in picked)
        assert all(d["quantities"]["cutoff_distance"] == pytest.approx(cutoff) for d in rows)
        assert all(d["quantities"]["distance"] >= cutoff for d in skipped)
        assert sorted(d["quantities"]["rank"] for d in picked) == [1.0, 2.0]
        control = record["control"]["pick"]
        assert control["draw_mean"] == pytest.approx(sum(d["value"] for d in picked) / 2)
        assert control["posterior_mean"] == pytest.approx(sum(d["quantities"]["posterior_mean"] for d in picked) / 2)
    assert any(d["quantities"]["alpha"] + d["quantities"]["beta"] > 2 for d in decisions), \
        "the second epoch (step 2) meets prompts the first one observed"


def test_gfcr_lineage_shows_why_a_prompt_was_skipped_and_why_a_rollout_s_prompt_was_picked(runs):
    run_dir, _, rollouts, decisions = runs["greso"]
    skip = next(d for d in decisions if d["decision"] == "skipped")
    result = cli.invoke(app, ["lineage", str(run_dir), skip["prompt_id"]])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"prompt {skip['prompt_id']}" in text and "pick (control.greso)" in text
    assert f"skipped: {skip['code']}, p_skip={skip['value']:.4g}" in text
    history = json.loads(cli.invoke(app, ["lineage", str(run_dir), skip["prompt_id"], "--json"]).output)
    assert [(d["step"], d["decision"], d["code"]) for d in history["decisions"]] == \
        [(d["step"], d["decision"], d["code"]) for d in decisions if d["prompt_id"] == skip["prompt_id"]]

    row = rollouts[-1]  # a rollout of the last step: its prompt was picked there
    pick = next(d for d in decisions if d["step"] == row["step"] and d["prompt_id"] == row["prompt_id"])
    result = cli.invoke(app, ["lineage", str(run_dir), row["rollout_id"]])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"pick (control.greso): picked: {pick['code']}, p_skip={pick['value']:.4g}" in text
    chain = json.loads(cli.invoke(app, ["lineage", str(run_dir), row["rollout_id"], "--json"]).output)
    assert [(d["stage_id"], d["decision"]) for d in chain["decisions"]] == [("pick", "picked")]
