"""``benchmarks/smollm2_step_time.py`` writes one gfcr pipeline per column (issue 38, Must show
6): each must pass ``gfcr validate`` (the async columns declare their correction), and the
columns differ only in engine and lifecycle. The timed run itself is the benchmark's, not a test's."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import yaml

from gfcr.graph import load_pipeline
from tests.conftest import REPO



def _benchmark():
    path = REPO / "benchmarks" / "smollm2_step_time.py"
    spec = importlib.util.spec_from_file_location("smollm2_step_time", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_gfcr_column_writes_a_pipeline_that_validates(tmp_path):
    bench = _benchmark()
    if not bench.PEERS.is_dir():
        pytest.skip(f"the peer baseline is not at {bench.PEERS}")
    prompts = tmp_path / "peer_prompts.jsonl"
    bench.peer_prompts(prompts)
    sys.path.remove(str(bench.PEERS))
    specs = {}
    for name, (engine, lifecycle) in bench.GFCR_CELLS.items():
        path = tmp_path / f"{len(specs)}.yaml"
        bench.gfcr_pipeline(prompts, path, engine, lifecycle)
        compiled = load_pipeline(path)
        assert compiled.spec.policy.engine == engine, name
        assert compiled.spec.lifecycle.mode == (lifecycle or {"mode": "sync"})["mode"], name
        specs[name] = yaml.safe_load(path.read_text())
    assert {bench.GFCR_CELLS[n][1] is not None for n in specs} == {True, False}
    stale = [s for n, s in specs.items() if bench.GFCR_CELLS[n][1] is not None]
    assert all(s["update"]["with"]["correction"] == {"use": "tis"} for s in stale)
    # apart from engine, lifecycle and correction the columns run the same pipeline
    def rest(s):
        s = yaml.safe_load(yaml.safe_dump(s))
        s["policy"].pop("engine"), s.pop("lifecycle", None), s["update"]["with"].pop("correction", None)
        return s
    assert all(rest(s) == rest(specs["gfcr, transformers, sync"]) for s in specs.values())


def test_the_table_gives_each_runner_its_ratio_to_trl_and_the_hand_loop():
    bench = _benchmark()
    results = {"hand loop": {"steps": [9.0, 10.0, 10.0]}, "TRL GRPOTrainer": {"steps": [30.0, 20.0, 20.0]},
               "gfcr, vLLM-CPU, sync": {"steps": [8.0, 4.0, 6.0]}, "skipped one": {"skipped": "no venv"}}
    lines = bench.table(results, 3).splitlines()
    assert lines[2].startswith("| hand loop | 10.0 | 1.00x | 0.50x |")
    assert lines[4].startswith("| gfcr, vLLM-CPU, sync | 5.0 | 0.50x | 0.25x |")
    assert lines[5] == "| skipped one | no venv | | | |"
    assert results["gfcr, vLLM-CPU, sync"]["median_s"] == 5.0
