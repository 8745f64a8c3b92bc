"""Issue 31, Build 5: hostile data at scale. A 20 MB row (50 MB in the benchmark), a JSON array
written on one line, invalid UTF-8, a binary line (a gzip blob pasted in), a gzip file cut short and a file of a
million rows, each written here, are read through the command a user would type (`gfcr
validate`) and through the data source's ``load``. Each is refused with file:line and the fix,
or read, in bounded memory: the operations of a test run in one fresh child process, which
reports after each its result, its seconds and its peak RSS (the kernel's high-water mark,
VmHWM, reset before each op through ``/proc/self/clear_refs``: getrusage's ``ru_maxrss`` cannot
be reset, so gfcr's import, about 160 MB, would hide what an op takes); every op is held to
``BOUND_MB`` of growth over the RSS before it.
The seconds are printed, not asserted (figures: benchmarks/hostile_data.py, docs/reliability.md).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gfcr.stages.data.jsonl import LISTED
from tests.conftest import BASE, REPO

GOOD = b'{"prompt": "1 + 1?", "answer": 2}\n'
BOUND_MB = 48  # one row of up to the 8 MiB cap, read, decoded and parsed, and the pool of a few rows
MILLION = 1_000_000

CHILD = textwrap.dedent("""\
    import json, re, resource, sys, time
    from pathlib import Path
    from typer.testing import CliRunner
    from gfcr.cli.main import app
    from gfcr.errors import GfcrError
    from gfcr.registry import DATA_SOURCES

    def status_mb(key):
        return int(re.search(key + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024

    def reset_peak():
        try:  # Linux: VmHWM starts again from the RSS now (getrusage's ru_maxrss cannot be reset)
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass  # the peak is then the process's so far: a looser bound, never a lower figure

    def run(op):
        if "validate" in op:
            result = CliRunner().invoke(app, ["validate", op["validate"]])
            return {"exit": result.exit_code, "output": result.output}
        cls = DATA_SOURCES.get(op["load"])
        try:
            pool = cls(cls.Config(**op["config"])).load(on_error=op.get("on_error", "fail"))
        except GfcrError as exc:
            return {"error": str(exc), "type": type(exc).__name__}
        return {"prompts": len(pool), "skipped": list(pool.skipped), "last": pool[-1].prompt_id}

    for op in json.loads(Path(sys.argv[1]).read_text()):
        before = status_mb("VmRSS")
        reset_peak()
        start, cpu = time.perf_counter(), time.process_time()
        out = run(op)
        seconds, cpu, peak = time.perf_counter() - start, time.process_time() - cpu, status_mb("VmHWM")
        print(json.dumps({**out, "s": seconds, "cpu_s": cpu, "rss_before_mb": before, "peak_mb": peak,
                          "process_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)
    """)


def run_child(ops: list[dict], folder: Path, timeout: float = 300) -> list[dict]:
    """Runs ``ops`` in one fresh process, in order; each op's result, seconds, the RSS before it
    and its peak RSS (the process's high-water mark, reset before the op)."""
    (folder / "ops.json").write_text(json.dumps(ops))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(folder / "ops.json")], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=folder)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(ops), done.stdout + done.stderr
    return lines


def spec_for(folder: Path, data: Path, name: str) -> str:
    """A pipeline reading ``data`` with the `jsonl` source."""
    spec = folder / f"{name}.yaml"
    spec.write_text(BASE.replace("source: arithmetic, with: {n: 50}",
                                 f"source: jsonl, with: {{path: {json.dumps(str(data))}, verifier: arithmetic}}"))
    return str(spec)


def jsonl(data: Path, **config) -> dict:
    return {"path": str(data), "verifier": "arithmetic", **config}


# the hostile files: each maker writes one into a folder and returns its path (a million rows in
# one write: about 35 MB, a second or two)
def big_row(folder: Path, mb: int = 50) -> Path:
    """A row of ``mb`` MB (one long prompt) on line 2, between good rows."""
    path = folder / "big-row.jsonl"
    with path.open("wb") as f:
        for piece in (GOOD + b'{"prompt": "', b"x" * (mb << 20), b'", "answer": 1}\n' + GOOD * 5):
            f.write(piece)
    return path


def one_line_array(folder: Path, mb: int = 10) -> Path:
    """A JSON array of rows written on one line, with no newline at all: ``mb`` MB."""
    path = folder / "array.jsonl"
    path.write_bytes(b"[" + b", ".join([GOOD.strip()] * ((mb << 20) // len(GOOD))) + b"]")
    return path


def latin1(folder: Path) -> Path:
    """Line 2 in Latin-1, not UTF-8."""
    path = folder / "latin1.jsonl"
    path.write_bytes(GOOD + '{"prompt": "café: 1 + 1?", "answer": 2}\n'.encode("latin-1") + GOOD * 5)
    return path


def gzip_blob(folder: Path) -> Path:
    """A gzip blob (another file's bytes) pasted in as line 2."""
    path = folder / "blob.jsonl"
    path.write_bytes(GOOD + gzip.compress(GOOD * 100, mtime=0) + b"\n" + GOOD * 5)
    return path


def cut_gzip(folder: Path, name: str = "cut.jsonl.gz", row: bytes = GOOD) -> Path:
    """A gzip file of 20,000 rows cut short (a download or a copy that stopped)."""
    path = folder / name
    whole = gzip.compress(row * 20_000, mtime=0)
    path.write_bytes(whole[: len(whole) // 2])
    return path


def many_rows(folder: Path, rows: int = MILLION, last: bytes = GOOD, row: bytes = GOOD, name: str = "rows") -> Path:
    """``rows`` rows written at once (about 35 MB for a million), the last one ``last``."""
    path = folder / f"{name}.jsonl"
    path.write_bytes(row * (rows - 1) + last)
    return path


@dataclass
class Op:
    id: str
    op: dict
    says: list[str] = field(default_factory=list)  # substrings of the output or the error; {file} is the data file
    exit: int | None = None  # a validate's exit status
    prompts: int | None = None  # a load's pool size (None: the load must fail)


def check(op: Op, result: dict, file: Path) -> None:
    text = result.get("output") or result.get("error") or "\n".join(result.get("skipped", []))
    if op.exit is not None:
        assert result["exit"] == op.exit, (op.id, text)
    elif op.prompts is None:
        assert result.get("type") == "DataError", (op.id, result)
    else:
        assert result.get("prompts") == op.prompts, (op.id, result)
    for says in op.says:
        assert says.format(file=file) in text, (op.id, says.format(file=file), text)
    assert "Traceback" not in text, (op.id, text)


def growth_mb(result: dict) -> float:
    return result["peak_mb"] - result["rss_before_mb"]


def report(ops: list[tuple[Op, Path]], results: list[dict]) -> str:
    return "\n".join(f"{op.id}: {r['s']:.2f} s, peak RSS {r['peak_mb']:.0f} MB, {growth_mb(r):+.0f} MB over the "
                     f"{r['rss_before_mb']:.0f} MB before it" for (op, _), r in zip(ops, results))


def baseline(folder: Path) -> list[tuple[Op, Path]]:
    """A good file of 7 rows, validated and loaded first: the figures to hold the others against
    (and the CLI's own lazy imports, paid here, not by the first hostile case)."""
    good = folder / "good.jsonl"
    good.write_bytes(GOOD * 7)
    return [(Op("baseline: validate 7 good rows", {"validate": spec_for(folder, good, "good")}, [], exit=0), good),
            (Op("baseline: load 7 good rows", {"load": "jsonl", "config": jsonl(good)}, [], prompts=7), good)]


def hostile_ops(folder: Path, big_mb: int = 20) -> dict[str, list[tuple[Op, Path]]]:
    """The hostile files and what each op on them must do, grouped by the test that holds them;
    the long row is ``big_mb`` MB (20 here, 50 in the benchmark: the same refusal past the cap)."""
    big, array, bad_text, blob = big_row(folder, big_mb), one_line_array(folder), latin1(folder), gzip_blob(folder)
    cut, rows = cut_gzip(folder), many_rows(folder)
    he_row = json.dumps({"task_id": "HumanEval/0", "prompt": "def add(a, b):\n", "entry_point": "add",
                         "test": "def check(f):\n    assert f(1, 2) == 3\n"}).encode() + b"\n"
    he_cut = cut_gzip(folder, "he.jsonl.gz", row=he_row)
    other = b'{"question": "1 + 1?", "solution": 2}\n'
    wrong = many_rows(folder, row=other, last=other, name="wrong")
    too_long = "{file}:2: the row is longer than 8 MiB, the most a row may have (`max_row_mb: 8`)"
    return {"rows": [
        (Op(f"validate: a {big_mb} MB row", {"validate": spec_for(folder, big, "big")},
            [too_long, "raise `max_row_mb:` in the source's `with:`"], exit=2), big),
        (Op(f"load: a {big_mb} MB row", {"load": "jsonl", "config": jsonl(big)}, [too_long]), big),
        (Op(f"load, skip: a {big_mb} MB row", {"load": "jsonl", "config": jsonl(big), "on_error": "skip"}, [too_long],
            prompts=6), big),
        (Op("validate: a 10 MB JSON array on one line", {"validate": spec_for(folder, array, "array")},
            ["{file}:1: the row is longer than 8 MiB", "jq -c '.[]' {file}"], exit=2), array),
        (Op("validate: invalid UTF-8", {"validate": spec_for(folder, bad_text, "latin1")},
            ["{file}:2: not UTF-8 text (invalid continuation byte at byte 16 of the line)", "save the file as UTF-8"],
            exit=2), bad_text),
        (Op("load, skip: invalid UTF-8", {"load": "jsonl", "config": jsonl(bad_text), "on_error": "skip"},
            ["{file}:2: not UTF-8 text"], prompts=6), bad_text),
        (Op("validate: a gzip blob on line 2", {"validate": spec_for(folder, blob, "blob")},
            ["{file}:2: the `jsonl` data file: {file} holds binary data on line 2 (a NUL byte), not JSON text",
             "remove the line"], exit=2), blob),
        (Op("load: a gzip blob on line 2", {"load": "jsonl", "config": jsonl(blob)},
            ["{file}:2: binary data, not JSON text (a NUL byte at byte 4 of the line)"]), blob),
        (Op("validate: a .jsonl.gz cut short", {"validate": spec_for(folder, cut, "cut")},
            ["the gzip data of {file} is damaged or cut short", "re-create or re-download the file"], exit=2), cut),
        (Op("load: a .jsonl.gz cut short", {"load": "jsonl", "config": jsonl(cut)},
            ["{file}:", "the gzip data of {file} is damaged or cut short (Compressed file ended"]), cut),
    ], "sources": [
        (Op("humaneval: a .jsonl.gz cut short", {"load": "humaneval", "config": {"path": str(he_cut)}},
            ["the gzip data of {file} is damaged or cut short"]), he_cut),
        (Op("humaneval: invalid UTF-8", {"load": "humaneval", "config": {"path": str(bad_text)}},
            ["{file}:2: not UTF-8 text"]), bad_text),
        (Op(f"gsm8k: a {big_mb} MB row", {"load": "gsm8k", "config": {"path": str(big)}},
            ["{file}:2: the row is longer than 8 MiB"]), big),
    ], "million": [
        (Op("validate: a million rows", {"validate": spec_for(folder, rows, "million")}, [], exit=0), rows),
        (Op("load, limit 1000: a million rows", {"load": "jsonl", "config": jsonl(rows, limit=1000)}, [],
            prompts=1000), rows),
        (Op("load: a million rows of the wrong file", {"load": "jsonl", "config": jsonl(wrong)},
            [f"{{file}}:{LISTED // 2}: missing field `answer`", f"{{file}}:{LISTED // 2 + 1}: reading stopped here "
             f"after {LISTED} problems"]), wrong),
    ], "raised": [  # last: the row it holds stays in the child's RSS
        (Op(f"load, max_row_mb 64: a {big_mb} MB row", {"load": "jsonl", "config": jsonl(big, max_row_mb=64)}, [],
            prompts=7), big),
    ]}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, list[tuple[Op, Path, dict]]]:
    """Every op of ``hostile_ops``, after the baseline, in one child: ``{group: [(op, file, result)]}``."""
    folder = tmp_path_factory.mktemp("hostile")
    groups = {"baseline": baseline(folder), **hostile_ops(folder)}
    ops = [entry for entries in groups.values() for entry in entries]
    results = iter(run_child([op.op for op, _ in ops], folder))
    measured = {name: [(op, file, next(results)) for op, file in entries] for name, entries in groups.items()}
    print("\n" + report(ops, [r for entries in measured.values() for _, _, r in entries]))
    return measured


def held(entries: list[tuple[Op, Path, dict]], bound_mb: float = BOUND_MB, over: float | None = None) -> list[dict]:
    """Each op did what it says, growing the RSS by less than ``bound_mb``, and (given ``over``, the
    baseline's peak) peaking less than ``BOUND_MB`` above ``over``; their results."""
    for op, file, result in entries:
        check(op, result, file)
    text = report([(op, file) for op, file, _ in entries], [r for _, _, r in entries])
    assert all(growth_mb(r) < bound_mb for _, _, r in entries), text
    assert over is None or all(r["peak_mb"] - over < BOUND_MB for _, _, r in entries), (over, text)
    return [r for _, _, r in entries]


def baseline_peak(measured) -> float:
    return max(r["peak_mb"] for r in held(measured["baseline"]))


def test_hostile_rows_are_refused_at_file_and_line_with_the_fix_in_bounded_memory(measured):
    results = held(measured["rows"], over=baseline_peak(measured))
    cut = measured["rows"][-1][1]
    cut_at = results[-1]["error"].split(f"{cut}:", 1)[1].split(":", 1)[0]
    assert 1 < int(cut_at) < 20_000, results[-1]  # the line the stream broke on, past the rows it read


def test_the_sources_that_share_the_reader_refuse_the_same_files(measured):
    """HumanEval read text with Python's own decoder and raised a traceback on these before."""
    held(measured["sources"], over=baseline_peak(measured))


def test_a_million_rows_are_read_only_as_far_as_needed(measured):
    """`gfcr validate` reads the head and counts rows up to the batch; ``limit`` stops the read;
    a million bad rows (the wrong file, two problems a row) stop the load after the first
    ``LISTED`` problems."""
    held(measured["million"], bound_mb=16, over=baseline_peak(measured))


def test_a_longer_cap_reads_the_long_row_when_asked(measured):
    """The fix the refusal names works: with ``max_row_mb: 64`` the 20 MB row loads, and is held."""
    [result] = held(measured["raised"], bound_mb=400)
    assert growth_mb(result) > 20


@pytest.mark.slow
def test_a_million_rows_load_whole_in_memory_proportional_to_the_rows(tmp_path):
    """The whole pool of a million rows (no ``limit``): under 1.2 KB a prompt (its id, text,
    verifier, line and index entry); and a bad row at the very end is found at its line and skipped."""
    rows = many_rows(tmp_path, last=b'{"prompt": "caf\xe9", "answer": 1}\n')
    entries = baseline(tmp_path) + [
        (Op("load, skip: a million rows, the last in Latin-1",
            {"load": "jsonl", "config": jsonl(rows), "on_error": "skip"},
            [f"{{file}}:{MILLION}: not UTF-8 text"], prompts=MILLION - 1), rows),
    ]
    results = run_child([op.op for op, _ in entries], tmp_path, timeout=600)
    print("\n" + report(entries, results))
    [result] = held([(op, file, r) for (op, file), r in zip(entries, results)][2:], bound_mb=MILLION * 1200 / 1e6)
    assert result["last"] == f"rows:train:{MILLION - 2}"


def test_gfcr_run_refuses_a_bad_row_past_those_validate_reads_and_writes_nothing(tmp_path):
    """`gfcr validate` judges the first 20 rows; a Latin-1 row on line 30 is found by `gfcr run`
    when it loads the data, before the run directory exists: exit 2 with file:line and the fix."""
    from typer.testing import CliRunner

    from gfcr.cli.main import app

    data = tmp_path / "deep.jsonl"
    data.write_bytes(GOOD * 29 + b'{"prompt": "caf\xe9", "answer": 2}\n')
    spec = spec_for(tmp_path, data, "deep")
    assert CliRunner().invoke(app, ["validate", spec]).exit_code == 0
    result = CliRunner().invoke(app, ["run", spec, "--run-dir", str(tmp_path / "run"), "--executor", "local"])
    assert result.exit_code == 2, result.output
    assert f"{data}:30: not UTF-8 text" in result.output and "save the file as UTF-8" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()
