"""The gsm8k data source: chat prompts, the #### ground truth, bad rows, and the real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from gfcr.errors import DataError
from gfcr.stages.data.gsm8k import DEFAULT_TEMPLATE, Gsm8kSource, final_answer

GSM8K_DIR = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "gsm8k"


def write(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines),
                    encoding="utf-8")
    return path


def row(question: str, solution: str) -> dict:
    return {"question": question, "answer": solution}


def test_rows_become_chat_prompts_with_the_number_after_the_hashes(tmp_path):
    path = write(tmp_path / "test.jsonl", [row("How many eggs?", "16 - 3 = <<16-3=13>>13\n#### 13"),
                                           row("How much money?", "It costs $1,200.\n#### 1,200")])
    pool = Gsm8kSource(Gsm8kSource.Config(path=str(path), split="test")).load()
    assert [p.prompt_id for p in pool] == ["gsm8k:test:0", "gsm8k:test:1"] and pool.name == "gsm8k/test"
    assert [(p.verifier.name, p.verifier.ground_truth) for p in pool] == [("gsm8k", "13"), ("gsm8k", "1200")]
    assert pool[0].text is None
    assert pool[0].messages == [{"role": "user", "content": DEFAULT_TEMPLATE.format(question="How many eggs?")}]
    assert pool[1].metadata["solution"].endswith("#### 1,200")


def test_final_answer():
    assert final_answer("a\n#### 72") == "72"
    assert final_answer("a\n####  -3 \n") == "-3"
    assert final_answer("#### 1 ... #### $1,000") == "1000"
    assert final_answer("#### 2.5") == "2.5"
    assert final_answer("no hashes, 72") is None and final_answer("#### seventy") is None


def test_bad_rows_are_all_reported_with_file_and_line_or_skipped(tmp_path):
    path = write(tmp_path / "train.jsonl", [
        row("ok", "#### 1"),
        row("no hashes", "the answer is 4"),
        {"question": "no answer"},
        row("", "#### 2"),
        row("not a number", "#### four"),
        "{oops",
        row("ok too", "#### 5"),
    ])
    source = Gsm8kSource(Gsm8kSource.Config(path=str(path)))
    expected = [
        f"{path}:2: answer has no `#### <number>` line (it ends 'the answer is 4')",
        f"{path}:3: missing field `answer` (fields present: `question`)",
        f"{path}:4: field `question` is empty",
        f"{path}:5: answer has no `#### <number>` line (it ends '#### four')",
        f"{path}:6: invalid JSON: Expecting property name enclosed in double quotes (column 2)",
    ]
    with pytest.raises(DataError) as info:
        source.load()
    assert [f"{p.where}: {p.message}" for p in info.value.problems] == expected
    assert "GSM8K rows are" in info.value.problems[1].fix
    pool = source.load(on_error="skip")
    assert [p.prompt_id for p in pool] == ["gsm8k:train:0", "gsm8k:train:6"] and list(pool.skipped) == expected


def test_the_default_file_comes_from_the_environment_variable(tmp_path, monkeypatch):
    write(tmp_path / "test.jsonl", [row(f"q{i}", f"#### {i}") for i in range(4)])
    monkeypatch.setenv("GFCR_GSM8K_DIR", str(tmp_path))
    pool = Gsm8kSource(Gsm8kSource.Config(split="test", limit=2)).load()
    assert [p.verifier.ground_truth for p in pool] == ["0", "1"]
    with pytest.raises(DataError) as info:
        Gsm8kSource(Gsm8kSource.Config(split="train")).load()
    (problem,) = info.value.problems
    assert f"the GSM8K train file: {tmp_path / 'train.jsonl'} does not exist" in problem.message
    assert "GFCR_GSM8K_DIR" in problem.fix


def test_the_template_must_use_the_question_only():
    assert Gsm8kSource.Config(template="Q: {question}\nA:").template == "Q: {question}\nA:"
    with pytest.raises(ValidationError, match="must use `{question}` and no other field"):
        Gsm8kSource.Config(template="{prompt}")


@pytest.mark.skipif(not (GSM8K_DIR / "train.jsonl").is_file(), reason=f"GSM8K is not at {GSM8K_DIR}")
@pytest.mark.parametrize("split, size", [("train", 7473), ("test", 1319)])
def test_the_real_files_load(split, size):
    pool = Gsm8kSource(Gsm8kSource.Config(path=str(GSM8K_DIR / f"{split}.jsonl"), split=split)).load()
    assert len(pool) == size and pool.skipped == ()
    assert pool[17].prompt_id == f"gsm8k:{split}:17"
    assert all(p.verifier.ground_truth.lstrip("-").isdigit() for p in pool)  # GSM8K answers are integers
    if split == "test":
        assert pool[0].verifier.ground_truth == "18" and "Janet" in pool[0].messages[0]["content"]
