"""The reasoning_gym data source: stated proportions, stable seeded ids, the lineage fields each
prompt carries, templates, and the validation errors (unknown task, bad difficulty key)
(its docstring example runs in test_jsonl.py, with the other sources')."""

from __future__ import annotations

from collections import Counter

import pytest
from pydantic import ValidationError

from gfcr.registry import DATA_SOURCES
from gfcr.stages.data.reasoning_gym import ReasoningGymSource

TEMPLATE = "What is {expression}? Answer:"


def terms(n: int, digits: int) -> dict[str, int]:
    return {"min_terms": n, "max_terms": n, "min_digits": digits, "max_digits": digits}


TASKS = [
    {"task": "chain_sum", "weight": 3.0, "levels": [
        {"name": "2x1d", "share": 1.0, "config": terms(2, 1)},
        {"name": "2x2d", "share": 2.0, "config": terms(2, 2)}]},
    {"task": "products", "levels": [{"name": "1-2d", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                                 "max_digits": 2}}]},
]


def config(**kwargs) -> ReasoningGymSource.Config:
    return ReasoningGymSource.Config(**{"n": 40, "seed": 0, "tasks": TASKS, "template": TEMPLATE, **kwargs})


def load(**kwargs):
    return ReasoningGymSource(config(**kwargs)).load()


def test_registered_as_a_data_source():
    assert DATA_SOURCES.get("reasoning_gym") is ReasoningGymSource


def test_the_stated_proportions_hold_exactly():
    pool = load()
    counts = Counter((p.metadata["task"], p.metadata["level"]) for p in pool)
    # chain_sum 3/4 of 40 = 30, split 1:2 -> 10 and 20; products 10
    assert counts == {("chain_sum", "2x1d"): 10, ("chain_sum", "2x2d"): 20, ("products", "1-2d"): 10}
    odd = Counter((p.metadata["task"], p.metadata["level"]) for p in load(n=7))  # 1.75, 3.5, 1.75: largest remainder
    assert sum(odd.values()) == 7 and odd[("chain_sum", "2x2d")] in (3, 4)


def test_ids_and_items_are_stable_and_seeded():
    first, again, other = load(), load(), load(seed=1)
    assert [(p.prompt_id, p.text, p.verifier) for p in first] == [(p.prompt_id, p.text, p.verifier) for p in again]
    assert first[0].prompt_id.startswith("reasoning_gym:") and first[0].prompt_id.endswith(
        f".0:{first[0].metadata['index']}")
    assert {p.prompt_id for p in first} & {p.prompt_id for p in other} == set()
    assert [p.text for p in first] != [p.text for p in other]
    # a cell's items do not depend on the other cells: dropping products leaves chain_sum's as they were
    alone = load(n=30, tasks=TASKS[:1])
    chain = {p.prompt_id: p.text for p in first if p.metadata["task"] == "chain_sum"}
    assert {p.prompt_id: p.text for p in alone} == chain


def test_each_prompt_records_its_task_and_difficulty_for_lineage():
    pool = load()
    for prompt in pool:
        meta = prompt.metadata
        assert set(meta) == {"task", "level", "settings", "seed", "index", "difficulty", "drawn"}
        level = next(lv for t in TASKS if t["task"] == meta["task"] for lv in t["levels"] if lv["name"] == meta["level"])
        assert meta["settings"] == level["config"]
        assert prompt.verifier.name == "reasoning_gym"
        assert prompt.verifier.options == {"task": meta["task"], "index": meta["index"],
                                           "settings": {**level["config"], "seed": meta["seed"],
                                                        "size": prompt.verifier.options["settings"]["size"]}}
        assert prompt.text == TEMPLATE.format(expression=meta["drawn"]["expression"])
        assert meta["difficulty"]["num_digits"] == [level["config"]["min_digits"], level["config"]["max_digits"]]
    ranged = [p.metadata["drawn"]["num_digits"] for p in pool if p.metadata["level"] == "1-2d"]
    assert set(ranged) == {1, 2}  # drawn within the level's range, and recorded


def test_the_default_template_is_the_question_and_chat_makes_a_user_turn():
    plain = load(template="{question}", n=3)
    assert all(p.text.startswith(("State the final answer", "Solve the following multiplication")) for p in plain)
    chat = load(template="{question}", n=3, chat=True)
    assert [p.messages for p in chat] == [[{"role": "user", "content": p.text}] for p in plain]


@pytest.mark.parametrize("tasks, message", [
    ([{"task": "chain_summ"}], "reasoning-gym has no task `chain_summ`"),
    ([{"task": "leg_counting", "levels": [{"name": "a", "config": {"min_animal": 1}}]}],
     "`leg_counting` has no difficulty setting `min_animal`"),
    ([{"task": "chain_sum", "levels": [{"name": "a", "config": {"seed": 3}}]}], "sets `seed`, which the source sets"),
    ([{"task": "chain_sum", "levels": [{"name": "a", "config": {"min_digits": "2"}}]}], "setting `min_digits` is '2'"),
    ([{"task": "chain_sum", "levels": [{"name": "a", "config": {"min_terms": 4, "max_terms": 2}}]}],
     "reasoning-gym refuses the settings"),
    ([{"task": "chain_sum", "levels": [{"name": "a"}, {"name": "a"}]}], "each level name may appear once"),
    ([{"task": "chain_sum"}, {"task": "chain_sum"}], "each task may be listed once"),
])
def test_bad_tasks_and_settings_are_refused(tasks, message):
    with pytest.raises(ValidationError, match=message.replace("`", ".").replace("(", ".").replace(")", ".")):
        ReasoningGymSource.Config(tasks=tasks, template="{question}")


def test_a_template_field_the_items_lack_is_refused_with_the_fields_they_have():
    with pytest.raises(ValidationError, match=r"not a field of task .leg_counting.'s items.*\{num_animals\}"):
        ReasoningGymSource.Config(tasks=[{"task": "leg_counting"}], template=TEMPLATE)


# --- the shipped pipeline (issue 42 Build 1): a real tiny-arith-mix GRPO run, and its lineage ------------------

@pytest.fixture(scope="module")
def shipped_run(tmp_path_factory):
    """``pipelines/grpo_reasoning_gym.yaml`` for 3 steps (8 prompts a step, eval at steps 0 and 3)."""
    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import Run
    from gfcr.runtime.store.lineage import read_lineage
    from gfcr.runtime.store.rundir import RunDir
    from tests.conftest import REPO

    run_dir = tmp_path_factory.mktemp("rg") / "run"
    overrides = ["run.steps=3", "run.checkpoint_every=3", "tracking.mlflow=null", "executor.kind=local",
                 "stages.pick.with.batch_size=8", "eval.with.n=20", "eval.every=3"]
    Run.start(load_pipeline(REPO / "pipelines" / "grpo_reasoning_gym.yaml", overrides), run_dir).train()
    rd = RunDir(run_dir)
    return run_dir, rd.read_metrics(), read_lineage(rd.lineage_dir).to_pylist()


def test_the_shipped_pipeline_runs_and_scores_with_reasoning_gyms_scorers(shipped_run):
    _, records, rows = shipped_run
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["rollouts_generated"] == 64 for r in records)
    assert all(row["reward_reason"].startswith(("products: score", "chain_sum: score")) for row in rows)
    rewards = [row["reward"] for row in rows]
    assert 0 < sum(rewards) < len(rewards)  # partly solved: some right, some wrong
    assert any(not r["update_skipped"] for r in records)
    assert "eval_accuracy" in records[0] and 0 < records[0]["eval_accuracy"] < 1


def test_lineage_shows_each_rollouts_task_and_difficulty(shipped_run):
    import json

    from typer.testing import CliRunner

    from gfcr.cli.main import app

    run_dir, _, rows = shipped_run
    seen = set()
    for row in rows[::16]:
        result = CliRunner().invoke(app, ["lineage", str(run_dir), row["rollout_id"], "--json"])
        assert result.exit_code == 0, result.output
        meta = json.loads(result.output)["prompt"]["metadata"]
        assert meta["task"] in ("products", "chain_sum") and row["prompt_id"].startswith(
            f"reasoning_gym:{meta['task']}.{meta['level']}.0:")
        assert {"settings", "difficulty", "drawn", "seed", "index"} <= set(meta)
        seen.add((meta["task"], meta["level"]))
    assert len(seen) >= 3


def test_accuracy_by_difficulty_bin_is_read_from_the_lineage(shipped_run):
    from gfcr.tracking.difficulty import accuracy_by_bin

    run_dir, records, rows = shipped_run
    bins = accuracy_by_bin(run_dir)
    assert set(bins) <= {("products", "1d"), ("products", "1-2d"), ("chain_sum", "2x1d"), ("chain_sum", "2x2d"),
                         ("chain_sum", "3x1d")} and len(bins) >= 3
    assert sum(p.rollouts for points in bins.values() for p in points) == len(rows)
    assert sum(p.correct for points in bins.values() for p in points) == sum(bool(r["correct"]) for r in rows)
    for step in (0, 1, 2):
        assert sum(p.rollouts for points in bins.values() for p in points if p.step == step) == 64
    tokens = [sum(r["n_tokens"] for r in rows if r["step"] == s) for s in (0, 1, 2)]
    assert {p.step: p.tokens_before for points in bins.values() for p in points} == {
        0: 0, 1: tokens[0], 2: tokens[0] + tokens[1]}


def test_the_per_bin_plot_is_drawn_with_wilson_bands(shipped_run, tmp_path):
    from gfcr.tracking.difficulty import draw_by_bin, wilson

    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)  # the textbook 5/10 interval
    assert wilson(0, 8)[0] == 0.0 and wilson(8, 8)[1] == 1.0
    path = draw_by_bin(shipped_run[0], tmp_path)
    assert path.name == "accuracy_by_bin.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
