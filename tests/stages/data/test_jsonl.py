"""The jsonl data source: good files, every kind of bad row at file:line, fail and skip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from gfcr.errors import DataError
from gfcr.graph import load_pipeline
from gfcr.stages.data.jsonl import JsonlSource
from tests.conftest import BASE


def write(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines),
                    encoding="utf-8")
    return path


def load(path: Path, on_error: str = "fail", **config):
    return JsonlSource(JsonlSource.Config(path=str(path), **config)).load(on_error=on_error)


def test_a_good_file_loads_with_stable_ids_text_prompts_and_ground_truths(tmp_path):
    path = write(tmp_path / "algebra.jsonl", [{"prompt": "Solve x + 1 = 3.", "answer": "x = 2"},
                                              {"prompt": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"}, "",
                                              {"prompt": "2 * 21?", "answer": 42, "topic": "arith"}])
    first, second = load(path), load(path)
    assert [p.prompt_id for p in first] == ["algebra:train:0", "algebra:train:1", "algebra:train:2"]
    assert [p.prompt_id for p in second] == [p.prompt_id for p in first]
    assert [p.verifier.ground_truth for p in first] == ["x = 2", "\\frac{3}{4}", "42"]
    assert {p.verifier.name for p in first} == {"math"} and first[2].messages is None
    assert first[2].text == "2 * 21?" and first[2].metadata == {"line": 4}  # line 3 is blank
    assert first.name == "algebra/train" and first.skipped == ()


def test_fields_template_name_split_and_limit(tmp_path):
    path = write(tmp_path / "my data.v2.jsonl", [{"q": f"{i} + 1?", "a": str(i + 1), "uid": f"u{i}", "topic": "sums"}
                                                 for i in range(5)])
    pool = load(path, prompt_field="q", answer_field="a", id_field="uid", verifier="arithmetic",
                template="[{topic}] {prompt} Answer:", limit=3, split="eval")
    assert [p.prompt_id for p in pool] == ["my_data.v2:eval:u0", "my_data.v2:eval:u1", "my_data.v2:eval:u2"]
    assert pool[1].text == "[sums] 1 + 1? Answer:" and pool[1].verifier.ground_truth == "2"
    assert load(path, prompt_field="q", answer_field="a", name="sums")[4].prompt_id == "sums:train:4"


def test_relative_paths_start_at_the_current_directory(tmp_path, monkeypatch):
    write(tmp_path / "d.jsonl", [{"prompt": "p", "answer": "1"}])
    monkeypatch.chdir(tmp_path)
    assert len(load(Path("d.jsonl"))) == 1
    with pytest.raises(DataError) as info:
        load(Path("missing.jsonl"))
    (problem,) = info.value.problems
    assert str(problem.where) == "missing.jsonl"
    assert f"{tmp_path / 'missing.jsonl'} (relative to {tmp_path}) does not exist" in problem.message
    assert "fix `path:`" in problem.fix


BAD = [
    {"prompt": "good one", "answer": "1"},                      # 1
    '{"prompt": "x", ',                                         # 2
    {"answer": "3"},                                            # 3
    {"prompt": "   ", "answer": "1"},                           # 4
    {"prompt": "q", "answer": "abc"},                           # 5
    "[1, 2]",                                                   # 6
    "",                                                         # 7
    {"prompt": "q", "answer": None},                            # 8
    {"prompt": "q"},                                            # 9
    {"prompt": "good two", "answer": "-7"},                     # 10
    {"prompt": "no topic", "answer": "2"},                      # 11 (the template needs {topic})
]


def expected_messages(path: Path) -> list[str]:
    return [
        f"{path}:2: invalid JSON: Expecting property name enclosed in double quotes (column 17)",
        f"{path}:3: missing field `prompt` (fields present: `answer`, `topic`)",
        f"{path}:4: field `prompt` is empty",
        f"{path}:5: unusable answer in field `answer`: the arithmetic verifier needs an integer ground truth, "
        "got 'abc'; use the `gsm8k` or `math` verifier for other answers",
        f"{path}:6: expected a JSON object, got a list",
        f"{path}:8: field `answer` is null, expected a string or a number",
        f"{path}:9: missing field `answer` (fields present: `prompt`, `topic`)",
        f"{path}:11: the template needs field `topic`, which the row lacks",
    ]


def bad_file(tmp_path: Path) -> Path:
    """BAD, where every object row but line 11 has the `topic` the template needs."""
    rows = [{**r, "topic": "t"} if isinstance(r, dict) and line != 11 else r for line, r in enumerate(BAD, 1)]
    return write(tmp_path / "bad.jsonl", rows)


def test_fail_reports_every_bad_row_at_once_with_file_and_line(tmp_path):
    path = bad_file(tmp_path)
    with pytest.raises(DataError) as info:
        load(path, verifier="arithmetic", template="{topic}: {prompt}")
    assert [f"{p.where}: {p.message}" for p in info.value.problems] == expected_messages(path)
    text = str(info.value)
    assert text.startswith("8 problems:") and text.count("fix: ") == 8 and "on_error: skip" in text


def test_skip_keeps_the_good_rows_with_their_ids_and_records_the_bad(tmp_path):
    path = bad_file(tmp_path)
    pool = load(path, "skip", verifier="arithmetic", template="{topic}: {prompt}")
    assert [(p.prompt_id, p.text) for p in pool] == [("bad:train:0", "t: good one"), ("bad:train:8", "t: good two")]
    assert list(pool.skipped) == expected_messages(path)


def test_ids_from_a_field_must_be_unique_and_single_words(tmp_path):
    path = write(tmp_path / "ids.jsonl", [{"id": 7, "prompt": "a", "answer": "1"}, {"id": "x y", "prompt": "b", "answer": "1"},
                                          {"id": "7", "prompt": "c", "answer": "1"}, {"prompt": "d", "answer": "1"}])
    with pytest.raises(DataError) as info:
        load(path, id_field="id")
    assert [f"{p.where}: {p.message}" for p in info.value.problems] == [
        f"{path}:2: id 'x y' in field `id` contains whitespace",
        f"{path}:3: duplicate id `7` in field `id` (first at line 1)",
        f"{path}:4: missing field `id` (fields present: `prompt`, `answer`)",
    ]
    assert "set `id_field:`" in info.value.problems[2].fix
    assert [p.prompt_id for p in load(path, "skip", id_field="id")] == ["ids:train:7"]


def test_a_file_with_no_good_row_fails_even_when_skipping(tmp_path):
    path = write(tmp_path / "empty.jsonl", [{"question": "q", "answer": "1"}])
    with pytest.raises(DataError, match="no usable rows") as info:
        load(path, "skip")
    assert "missing field `prompt` (fields present: `question`, `answer`)" in str(info.value)


def test_config_mistakes_are_caught_when_the_spec_is_checked():
    with pytest.raises(ValidationError, match="did you mean `gsm8k`"):
        JsonlSource.Config(path="x.jsonl", verifier="gsm8")
    with pytest.raises(ValidationError, match="is not a field name"):
        JsonlSource.Config(path="x.jsonl", template="{0} {prompt}")
    with pytest.raises(ValidationError, match="not a valid format string"):
        JsonlSource.Config(path="x.jsonl", template="{prompt")


def test_on_error_travels_from_the_spec_to_the_loader(tmp_path, write_spec):
    path = write(tmp_path / "mixed.jsonl", [{"prompt": "a", "answer": "1"}, "not json"])
    data = f"data: {{source: jsonl, with: {{path: {json.dumps(str(path))}, verifier: arithmetic}}, on_error: skip}}"
    pipeline = load_pipeline(write_spec(BASE.replace("data: {source: arithmetic, with: {n: 50}}", data)))
    assert pipeline.data.on_error == "skip"
    pool = pipeline.data.load()
    assert len(pool) == 1 and pool.skipped == (f"{path}:2: invalid JSON: Expecting value (column 1)",)
    strict = load_pipeline(write_spec(BASE.replace("data: {source: arithmetic, with: {n: 50}}",
                                                   data.replace(", on_error: skip", ""))))
    assert strict.data.on_error == "fail"
    with pytest.raises(DataError, match="mixed.jsonl:2: invalid JSON"):
        strict.data.load()


@pytest.mark.parametrize("module", ["gfcr.stages.data.jsonl", "gfcr.stages.data.gsm8k", "gfcr.stages.data.arithmetic_mix",
                                    "gfcr.stages.data.reasoning_gym"])
def test_docstring_example_runs_and_its_yaml_validates(module):
    import doctest
    import importlib
    import re
    import textwrap

    import yaml

    mod = importlib.import_module(module)
    assert doctest.testmod(mod, optionflags=doctest.ELLIPSIS).failed == 0
    (block,) = re.findall(r"\.\. code-block:: yaml\n\n((?:(?:    .*)?\n)+)", mod.__doc__)
    entries = yaml.safe_load(textwrap.dedent(block))
    source = next(cls for cls in vars(mod).values() if isinstance(cls, type) and cls.__module__ == module
                  and hasattr(cls, "load"))
    for entry in entries.values():
        source.Config.model_validate_json(json.dumps(entry["with"]), strict=True)


def test_metadata_fields_feed_the_pvpo_reference_reward(tmp_path):
    from gfcr.stages.testing import scored_group
    from gfcr.stages.components.advantage import AdvantageSpec

    path = write(tmp_path / "anchored.jsonl", [{"prompt": "1 + 1?", "answer": 2, "reference_reward": 0.25},
                                               {"prompt": "2 + 2?", "answer": 4, "reference_reward": 1}])
    pool = load(path, verifier="arithmetic", metadata_fields=["reference_reward"])
    assert [p.metadata for p in pool] == [{"line": 1, "reference_reward": 0.25}, {"line": 2, "reference_reward": 1}]
    group = scored_group(pool[0].prompt_id, [1.0, 0.0])
    out = AdvantageSpec(use="pvpo").build().estimate_batch([group], pool)
    assert out[0].values == (0.75, -0.25)  # r - 0.25, the static anchor, no std


def test_a_missing_metadata_field_is_a_row_error(tmp_path):
    path = write(tmp_path / "anchored.jsonl", [{"prompt": "1 + 1?", "answer": 2, "reference_reward": 0.5},
                                               {"prompt": "2 + 2?", "answer": 4}])
    with pytest.raises(DataError) as err:
        load(path, verifier="arithmetic", metadata_fields=["reference_reward"])
    assert "anchored.jsonl:2" in str(err.value) and "metadata field `reference_reward` is missing" in str(err.value)


def test_past_the_listed_problems_bad_rows_are_counted_and_still_left_out(tmp_path):
    """A file of many bad rows lists the first LISTED and counts the rest; with skip, a row found
    bad after the list is full is still left out (an unusable answer: the row parses)."""
    from gfcr.stages.data.jsonl import LISTED

    rows = [{"prompt": "q", "answer": "abc"}] * (LISTED + 5) + [{"prompt": "ok", "answer": "3"}]
    path = write(tmp_path / "many.jsonl", rows)
    pool = load(path, "skip", verifier="arithmetic")
    assert [p.prompt_id for p in pool] == [f"many:train:{LISTED + 5}"]
    assert len(pool.skipped) == LISTED + 1
    assert pool.skipped[-1] == f"{path}: and 5 more problem(s) not listed (the first {LISTED} are)"
    with pytest.raises(DataError) as info:
        load(path, verifier="arithmetic")
    stopped = info.value.problems[LISTED]  # then "no usable rows": reading stopped before the good one
    assert (str(stopped.where), stopped.message) == (f"{path}:{LISTED + 1}",
                                                     f"reading stopped here after {LISTED} problems; there may be more")


@pytest.mark.parametrize("content, kind, fix", [
    ("{\"prompt\": \"1 + 1?\", \"answer\": 2}\n".encode("utf-16"), "UTF-16 text", "iconv -f UTF-16 -t UTF-8"),
    (b"PAR1\x15\x04\x15", "a Parquet file", "decompress or convert it to JSON lines"),
    (b"\x28\xb5\x2f\xfd\x00\x58", "zstd-compressed", "decompress or convert it to JSON lines"),
    (b"BZh91AY&SY", "bzip2-compressed", "decompress or convert it to JSON lines"),
])
def test_a_file_that_is_not_text_is_named_by_its_first_bytes(tmp_path, content, kind, fix):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    [problem] = JsonlSource(JsonlSource.Config(path=str(path))).check(on_error="skip")
    assert (str(problem.where), problem.message) == (
        f"{path}:1", f"the `jsonl` data file: {path} is a binary file, not JSON lines ({kind})")
    assert fix in problem.fix


def test_a_gzipped_file_is_read_through_gzip_when_its_name_ends_in_gz(tmp_path):
    import gzip

    path = tmp_path / "sums.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"prompt": "1 + 1?", "answer": 2}\n' * 3))
    source = JsonlSource(JsonlSource.Config(path=str(path), verifier="arithmetic"))
    assert source.check() == [] and source.count_prompts(10) == 3
    assert [p.prompt_id for p in source.load()] == ["sums:train:0", "sums:train:1", "sums:train:2"]
    named = tmp_path / "sums.jsonl"  # the same bytes under a plain name: refused, with how to read it
    named.write_bytes(path.read_bytes())
    [problem] = JsonlSource(JsonlSource.Config(path=str(named))).check()
    assert "(gzip-compressed)" in problem.message and "give it a name ending in `.gz`" in problem.fix


def test_rows_that_crash_python_s_json_parser_are_bad_rows_at_their_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"prompt": "1 + 1?", "answer": 2}\n' + "[" * 100_000 + "\n"
                    + '{"prompt": "q", "answer": ' + "1" * 5000 + "}\n")
    pool = load(path, "skip", verifier="arithmetic")
    assert len(pool) == 1 and [s.split(": ", 1)[1] for s in pool.skipped] == [
        "JSON nested too deeply to read",
        "a value JSON cannot be read into: Exceeds the limit (4300 digits) for integer string conversion: "
        "value has 5000 digits"]
    assert [s.split(": ", 1)[0] for s in pool.skipped] == [f"{path}:2", f"{path}:3"]
