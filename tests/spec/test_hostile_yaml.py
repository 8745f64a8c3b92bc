"""Hostile YAML costs `gfcr validate` little: an alias bomb ("billion laughs") and 100,000 nested
brackets each exit 2 with ``file:line:col`` and the fix, within 5 s and 200 MB (the whole process,
Python and gfcr's imports included), and a spec that uses aliases within the cap still loads.

Before the caps, a 400-byte bomb took 58 s and 3.9 GB, and deep brackets raised RecursionError."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from gfcr.errors import GraphError
from gfcr.graph import load_pipeline
from gfcr.spec.yaml_source import MAX_VALUES, parse_yaml
from tests.conftest import BASE, REPO
from tests.spec.test_golden_errors import BOMB, DEEP

# the child reports its own peak RSS (KiB) after running the CLI in-process: VmHWM, as getrusage's
# ru_maxrss survives exec and would report the forking test process's
_CHILD = textwrap.dedent("""\
    import re, sys
    from pathlib import Path
    from typer.testing import CliRunner
    from gfcr.cli.main import app
    result = CliRunner().invoke(app, ["validate", sys.argv[1]])
    print(result.output)
    peak = re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)
    print("exit", result.exit_code, "maxrss_kib", peak)
    """)

BIGGER_BOMB = "".join(f"b{i}: &b{i} [" + ",".join([f"*b{i - 1}"] * 30 if i else ["lol"] * 30) + "]\n"
                      for i in range(12))  # 30^12 = 5e17 values


@pytest.mark.parametrize("tail, where, says", [
    (BOMB, ":20:10:", "aliases would expand this document to 4,412,961,572 values"),
    (BIGGER_BOMB, ":22:12:", "aliases would expand this document to 568,724,019,024,970,341 values"),
    (f"x: {DEEP}\n", ":11:68:", "the document nests deeper than 64 levels"),
], ids=["alias bomb", "bigger alias bomb", "100,000 nested brackets"])
def test_hostile_yaml_exits_2_within_5_s_and_200_mb(tail, where, says, tmp_path):
    spec = tmp_path / "hostile.yaml"
    spec.write_text(BASE + tail)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(spec)], capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO)
    out = done.stdout
    assert "exit 2 maxrss_kib" in out, out + done.stderr
    assert f"{spec}{where} {says}" in out and "fix: " in out and "Traceback" not in out, out
    assert int(out.rsplit("maxrss_kib", 1)[1]) < 200 * 1024, out
    # time is measured in-process: a loaded test machine makes the child's imports slow
    import time

    start = time.perf_counter()
    _, _, problems = parse_yaml(spec.read_text(), str(spec))
    assert time.perf_counter() - start < 5.0 and problems


def test_aliases_within_the_cap_still_work(write_spec):
    text = BASE.replace("with: {batch_size: 4}", "with: &pick {batch_size: 4}") + "notes: [*pick, *pick]\n"
    data, _, problems = parse_yaml(text)
    assert problems == [] and data["notes"] == [{"batch_size": 4}] * 2
    shared = BASE.replace("with: {batch_size: 4}", "with: &b {batch_size: 4}").replace("with: {n: 4}", "with: *b")
    with pytest.raises(GraphError, match="unknown key `batch_size`"):  # the alias expanded where it was used
        load_pipeline(write_spec(shared))


def test_the_cap_counts_expanded_values_not_written_ones():
    # values: the root, `a`, its list of 9,000 + 1, `b`, its list + n * 9,001 aliased
    nine_k = "a: &a [" + ",".join(["1"] * 9_000) + "]\n"
    assert parse_yaml(nine_k + "b: [" + ",".join(["*a"] * 9) + "]\n")[2] == []  # 90,014 values
    problems = parse_yaml(nine_k + "b: [" + ",".join(["*a"] * 11) + "]\n")[2]  # 108,016
    assert len(problems) == 1 and f"more than {MAX_VALUES:,}" in problems[0].message
    assert str(problems[0].where) == "<python>:2:5"
