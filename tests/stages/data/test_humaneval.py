"""The humaneval data source: the packaged 164 problems, the code verifier's spec, bad rows."""

from __future__ import annotations

import gzip
import json

import pytest
from pydantic import ValidationError

from gfcr.errors import DataError
from gfcr.registry import DATA_SOURCES
from gfcr.stages.data.humaneval import HumanEvalSource

ROW = {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n", "entry_point": "add",
       "canonical_solution": "    return a + b\n", "test": "\n\ndef check(candidate):\n    assert candidate(1, 2) == 3\n"}


def test_the_packaged_problems_become_chat_prompts_for_the_code_verifier():
    assert DATA_SOURCES.get("humaneval") is HumanEvalSource
    pool = HumanEvalSource(HumanEvalSource.Config()).load()
    assert len(pool) == 164 and pool.name == "humaneval/test"
    first = pool[0]
    assert first.prompt_id == "humaneval:test:0" and first.metadata["task_id"] == "HumanEval/0"
    assert first.verifier.name == "code" and first.verifier.ground_truth.lstrip().startswith("METADATA")
    assert {k: v for k, v in first.verifier.options.items() if k != "prompt"} == {
        "entry_point": "has_close_elements", "timeout_s": 3.0, "memory_mb": 512, "file_size_kb": 1024,
        "sandbox": "auto"}
    assert first.verifier.options["prompt"].startswith("from typing import List\n\n\ndef has_close_elements(")
    assert first.messages[0]["content"].endswith("```python\n" + first.verifier.options["prompt"] + "```")


def test_a_plain_or_gzipped_file_its_limits_and_template(tmp_path):
    plain = tmp_path / "he.jsonl"
    plain.write_text(json.dumps(ROW) + "\n\n", encoding="utf-8")
    packed = tmp_path / "he.jsonl.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as handle:
        handle.write(json.dumps(ROW) + "\n")
    config = dict(template="{prompt}", timeout_s=1.5, memory_mb=256, file_size_kb=0, sandbox="guard")
    for path in (plain, packed):
        (prompt,) = HumanEvalSource(HumanEvalSource.Config(path=str(path), **config)).load()
        assert prompt.messages == [{"role": "user", "content": ROW["prompt"]}]
        assert prompt.verifier.options == {"entry_point": "add", "prompt": ROW["prompt"], "timeout_s": 1.5,
                                           "memory_mb": 256, "file_size_kb": 0, "sandbox": "guard"}
        assert prompt.verifier.ground_truth == ROW["test"]  # not stripped: a completion continues it exactly


def test_bad_rows_are_reported_with_file_and_line(tmp_path):
    path = tmp_path / "he.jsonl"
    path.write_text(json.dumps(ROW) + "\nnot json\n" + json.dumps({**ROW, "test": ""}) + "\n", encoding="utf-8")
    with pytest.raises(DataError) as info:
        HumanEvalSource(HumanEvalSource.Config(path=str(path))).load()
    assert [p.where.line for p in info.value.problems] == [2, 3]
    assert len(HumanEvalSource(HumanEvalSource.Config(path=str(path))).load(on_error="skip")) == 1
    with pytest.raises(DataError, match="does not exist"):
        HumanEvalSource(HumanEvalSource.Config(path=str(tmp_path / "missing.jsonl"))).load()


def test_misconfigured_limits_and_templates_are_loud():
    with pytest.raises(ValidationError, match="must use `{prompt}`"):
        HumanEvalSource.Config(template="{question}")
    with pytest.raises(ValidationError, match="greater than 0"):
        HumanEvalSource.Config(timeout_s=0)
    with pytest.raises(ValidationError, match="greater than or equal to 64"):
        HumanEvalSource.Config(memory_mb=8)
