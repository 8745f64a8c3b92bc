"""The shipped arith-mix task: its YAML has exactly a task's keys, ships as package data, and
its sections drop into a pipeline (quickstart's stages) that compiles, with a held-out eval."""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path

import yaml

from gfcr.graph import load_pipeline

REPO = Path(__file__).resolve().parents[2]
TASK = resources.files("gfcr.tasks") / "arith-mix.yaml"


def task() -> dict:
    return yaml.safe_load(TASK.read_text(encoding="utf-8"))


def test_the_task_file_has_a_task_s_keys():
    data = task()
    assert list(data) == ["name", "description", "policy", "data", "eval"]
    assert data["name"] == "arith-mix" and data["policy"] == {"model": "tiny-arith-mix", "engine": "hf"}
    assert data["data"]["with"]["split"] == "train" and data["eval"]["with"]["split"] == "eval"
    assert data["eval"]["with"]["n"] >= 200 and data["eval"]["max_new_tokens"] == 8


def test_the_task_and_its_policy_ship_as_package_data():
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "*.yaml" in package_data["gfcr.tasks"] and "tiny-arith-mix/*" in package_data["gfcr.assets"]
    assert (resources.files("gfcr.assets") / "tiny-arith-mix" / "model.safetensors").is_file()


def test_its_sections_compile_into_the_quickstart_pipeline(tmp_path):
    pipeline = yaml.safe_load((REPO / "pipelines" / "quickstart.yaml").read_text())
    pipeline |= {k: v for k, v in task().items() if k in ("policy", "data", "eval")}
    path = tmp_path / "arith-mix-quickstart.yaml"
    path.write_text(yaml.safe_dump(pipeline, sort_keys=False))
    compiled = load_pipeline(path)
    assert compiled.spec.policy.model == "tiny-arith-mix"
    train, held = compiled.data.load(), compiled.eval.load()
    assert len(train) == task()["data"]["with"]["n"] and len(held) == task()["eval"]["with"]["n"]
    assert not {p.metadata["expr"] for p in train} & {p.metadata["expr"] for p in held}
    assert {p.metadata["category"] for p in held} == {p.metadata["category"] for p in train}
