"""The arithmetic_mix data source: stable ids, disjoint splits, categories, exact answers
(its docstring example runs in test_jsonl.py, with the other sources')."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gfcr.registry import DATA_SOURCES
from gfcr.stages.data.arithmetic_mix import CATEGORIES, ArithmeticMixSource, category_of, problems, split_of


def load(**kwargs):
    return ArithmeticMixSource(ArithmeticMixSource.Config(**kwargs)).load()


def test_registered_as_a_data_source():
    assert DATA_SOURCES.get("arithmetic_mix") is ArithmeticMixSource


def test_ids_and_problems_are_stable_and_seeded():
    first, again = load(n=50, seed=3), load(n=50, seed=3)
    assert [p.prompt_id for p in first] == [f"arithmetic_mix:train-3:{i}" for i in range(50)]
    assert [(p.text, p.verifier) for p in first] == [(p.text, p.verifier) for p in again]
    other = load(n=50, seed=4)
    assert [p.text for p in other] != [p.text for p in first]
    assert first.name == "arithmetic_mix/train" and load(n=1, split="eval").name == "arithmetic_mix/eval"


def test_hand_checked_answers_and_categories():
    cases = {  # expression: (answer, category), worked by hand
        "47 * 3": ("141", "2d*1d carry"), "23 * 3": ("69", "2d*1d no carry"), "7 * 8": ("56", "1d*1d"),
        "47 + 15": ("62", "2d+2d carry"), "47 + 12": ("59", "2d+2d no carry"), "7 + 5": ("12", "1d+1d"),
        "47 - 18": ("29", "2d-2d borrow"), "18 - 47": ("-29", "2d-2d borrow"),
        "47 - 12": ("35", "2d-2d no borrow"), "12 - 47": ("-35", "2d-2d no borrow"),
    }
    for expr, (value, category) in cases.items():
        a, op, b = expr.split()
        assert category_of(int(a), op, int(b)) == category, expr
    for expr, (value, category) in cases.items():  # each one is in its category's pool, answered right
        a, op, b = expr.split()
        split = split_of(int(a), op, int(b))
        pool = load(n=len(problems(category, split)), split=split, categories=[category])
        [prompt] = [p for p in pool if p.metadata["expr"] == expr]
        assert prompt.text == f"What is {expr}? Answer:" and prompt.verifier.name == "arithmetic"
        assert prompt.verifier.ground_truth == value and prompt.metadata["category"] == category
    assert category_of(47, "*", 1) is None and category_of(123, "+", 4) is None  # outside every category


def test_every_prompt_is_labelled_with_its_category_in_turn():
    pool = load(n=80, split="eval", seed=1)
    for i, p in enumerate(pool):
        a, op, b = p.metadata["expr"].split()
        assert p.metadata["category"] == list(CATEGORIES)[i % 8] == category_of(int(a), op, int(b))
        assert int(p.verifier.ground_truth) == eval(p.metadata["expr"])  # noqa: S307 (digits and one operator)
    chosen = load(n=6, categories=["2d*1d carry", "1d+1d"])
    assert [p.metadata["category"] for p in chosen] == ["2d*1d carry", "1d+1d"] * 3


def test_train_and_eval_never_share_a_problem():
    for name, cat in CATEGORIES.items():
        train, held = set(problems(name, "train")), set(problems(name, "eval"))
        assert not train & held and held, name
        every = {(a, cat.op, b) for a in cat.left for b in cat.right}
        assert train | held <= every
    # the categories tile their problems: 100 + 100 + 8100 + 8100 + 720 in all
    assert sum(len(problems(n, s)) for n in CATEGORIES for s in ("train", "eval")) == 17120
    assert all(split_of(*p) == "eval" for n in CATEGORIES for p in problems(n, "eval"))
    train_exprs = {p.metadata["expr"] for p in load(n=4000, split="train")}
    eval_exprs = {p.metadata["expr"] for p in load(n=400, split="eval", seed=1)}
    assert not train_exprs & eval_exprs and len(eval_exprs) > 300


def test_config_rejects_repeated_or_unknown_categories():
    with pytest.raises(ValidationError, match="once"):
        ArithmeticMixSource.Config(categories=["1d+1d", "1d+1d"])
    with pytest.raises(ValidationError):
        ArithmeticMixSource.Config(categories=["3d+3d"])
    with pytest.raises(ValidationError):
        ArithmeticMixSource.Config(split="test")
