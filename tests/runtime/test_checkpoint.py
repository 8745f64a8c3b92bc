"""Checkpoint v2: state trees round-trip exactly (every leaf type, an AdamW state dict), the
manifest lists every file, nothing is a pickle, damaged checkpoints are skipped, keep-N prunes.

The checkpoints here come from fake-stage pipelines (no policy), so these tests are fast; the
real-policy ones (resume equals uninterrupted, a SIGKILL mid-write) are in test_session.py."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from gfcr.errors import CheckpointError
from gfcr.graph import load_pipeline
from gfcr.runtime.store.checkpoint import (
    MANIFEST, checkpoint_problems, latest_checkpoint, load_checkpoint, read_manifest, save_checkpoint,
)
from gfcr.runtime.loop.local import LocalRunner
from gfcr.runtime.store.rundir import RunDir
from gfcr.runtime.store.state_tree import read_tree, write_tree
from gfcr.stages.resources import Lent
from tests.conftest import BASE, REPO

PICKLE_OPCODES = (b"\x80", b"PK\x03\x04")  # a pickle's PROTO opcode; torch.save's zip container


def assert_same(a, b, path="root"):
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad, path
        assert torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), path
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def test_a_state_tree_with_every_leaf_type_round_trips_exactly(tmp_path):
    tree = {
        "str": "x", "int": 7, "big": 2**62, "float": 0.1, "bool": True, "none": None,
        "nan": math.nan, "inf": math.inf, "-inf": -math.inf,
        "list": [1, "a", [2.5, None]], "tuple": (0.9, 0.999), "empty": {}, "empty_list": [],
        "int_keys": {0: {"a": 1}, 3: "b"}, "reserved": {"__gfcr__": "not a placeholder"},
        "tensor": torch.arange(6, dtype=torch.float32).reshape(2, 3), "scalar_tensor": torch.tensor(4.0),
        "bf16": torch.ones(3, dtype=torch.bfloat16), "int64_tensor": torch.tensor([1, 2], dtype=torch.int64),
        "bool_tensor": torch.tensor([True, False]), "grad": torch.zeros(2, requires_grad=True),
        "empty_tensor": torch.zeros(0, 4), "strided": torch.arange(12.0).reshape(3, 4).t(),
        "array": np.arange(5, dtype=np.int32), "f64": np.linspace(0, 1, 4), "bool_array": np.array([True, False]),
        "np_scalar": np.float32(1.5), "np_int": np.int64(3),
        "dotted": {"a.b": torch.ones(1)}, "a": {"b": torch.zeros(1)},  # the same flattened key path
    }
    written = write_tree(tree, tmp_path / "s")
    assert sorted(p.name for p in written) == ["state.json", "tensors.safetensors"]
    assert_same(tree, read_tree(tmp_path / "s"))
    text = (tmp_path / "s" / "state.json").read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON


def test_a_tree_that_is_not_plain_data_is_refused_with_its_key_path(tmp_path):
    from dataclasses import dataclass

    @dataclass
    class Stats:
        n: int

    with pytest.raises(CheckpointError) as info:
        write_tree({"prompts": {"p1": Stats(1)}}, tmp_path / "s", where="stage `pick`")
    assert "stage `pick`" in str(info.value) and "`prompts.p1`" in str(info.value) and info.value.fix
    with pytest.raises(CheckpointError, match="dtype <U1"):
        write_tree({"names": np.array(["a"])}, tmp_path / "s2")


def _train(model, optimizer, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_an_adamw_state_dict_round_trips_and_resumed_training_is_bit_identical(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    _train(model, opt, 3, seed=1)
    _train(reference, ref_opt, 3, seed=1)
    write_tree({"optimizer": opt.state_dict(), "model": model.state_dict()}, tmp_path / "s")
    restored = read_tree(tmp_path / "s")
    assert_same(opt.state_dict(), restored["optimizer"])  # int keys, tuples (betas), 0-d step tensors
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    fresh.load_state_dict(restored["model"])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)  # the checkpoint's hyper-parameters win
    fresh_opt.load_state_dict(restored["optimizer"])
    _train(fresh, fresh_opt, 3, seed=2)
    _train(reference, ref_opt, 3, seed=2)
    for a, b in zip(fresh.parameters(), reference.parameters()):
        assert torch.equal(a, b)


# --- whole checkpoints of a fake-stage pipeline ---------------------------------------------------

STATEFUL = BASE.replace("run: {steps: 2}", "run: {steps: 6, seed: 5}")


def _runner(write_spec, text=STATEFUL) -> LocalRunner:
    return LocalRunner(load_pipeline(write_spec(text)))


def _saved(write_spec, tmp_path, steps=(2,), keep=2) -> tuple[RunDir, LocalRunner]:
    rd, runner = RunDir(tmp_path / "run"), _runner(write_spec)
    for target in steps:
        while runner.step < target:
            runner.run_step()
        save_checkpoint(rd, runner, Lent(), keep=keep)
    return rd, runner


def test_the_manifest_lists_every_file_with_its_size_and_sha256(write_spec, tmp_path):
    rd, runner = _saved(write_spec, tmp_path)
    path = rd.checkpoint(2)
    manifest = json.loads((path / MANIFEST).read_text())
    assert {k: manifest[k] for k in ("kind", "format", "step", "policy_version")} == \
        {"kind": "gfcr-checkpoint", "format": 2, "step": 2, "policy_version": runner.policy_version}
    assert manifest["gfcr"] and manifest["weights_version"] is None  # no policy in this pipeline
    on_disk = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != MANIFEST)
    assert [f["path"] for f in manifest["files"]] == on_disk
    assert {"runner.json", "rng/torch.safetensors", "rng/numpy.json", "rng/python.json",
            "stages/pick/state.json"} <= set(on_disk)
    assert "stages/update/state.json" not in on_disk  # update.fake keeps no state: the version is the runner's
    assert all(f["bytes"] == (path / f["path"]).stat().st_size and re.fullmatch(r"[0-9a-f]{64}", f["sha256"])
               for f in manifest["files"])


def test_nothing_in_a_checkpoint_is_a_pickle(write_spec, tmp_path):
    rd, _ = _saved(write_spec, tmp_path)
    for file in (p for p in rd.checkpoint(2).rglob("*") if p.is_file()):
        head = file.read_bytes()[:4]
        assert not head.startswith(PICKLE_OPCODES), f"{file} looks like a pickle"
        assert file.suffix in (".json", ".safetensors"), file


# Pickles that never touch a file: messages on pipes between a gfcr process and the worker it
# started itself (the verifier pool, the embedding worker). Nothing read from disk is unpickled.
PIPE_PICKLES = {"gfcr/stages/verifiers/pool.py", "gfcr/stages/replay/embed_worker.py"}


def test_no_code_loads_with_pickle():
    """Loading never executes code: no torch.load without weights_only=True, no pickle module
    outside the worker pipes (PIPE_PICKLES), and those modules open no files to unpickle."""
    offenders, pipes = [], set()
    for file in (REPO / "gfcr").rglob("*.py"):
        rel = file.relative_to(REPO).as_posix()
        text = file.read_text()
        for n, line in enumerate(text.splitlines(), start=1):
            if re.search(r"torch\.load\(", line) and "weights_only=True" not in line:
                offenders.append(f"{rel}:{n}: {line.strip()}")
            if re.search(r"\b(pickle|cloudpickle|dill)\.loads?\(", line):
                if rel in PIPE_PICKLES:
                    pipes.add(rel)
                else:
                    offenders.append(f"{rel}:{n}: {line.strip()}")
        if rel in PIPE_PICKLES:
            assert not re.search(r"(?<![\w.])open\(|read_bytes\(|pickle\.load\(", text), f"{rel} unpickles from a file"
    assert offenders == []
    assert pipes == PIPE_PICKLES  # the exemption names only modules that still need it


def test_a_loaded_checkpoint_continues_exactly(write_spec, tmp_path):
    rd, runner = _saved(write_spec, tmp_path, steps=(3,))
    rest = [r.update for r in runner.run(3)]
    resumed = _runner(write_spec)
    load_checkpoint(rd.checkpoint(3), resumed, Lent())
    assert resumed.step == 3 and resumed.state_dict() == _runner_state_at(write_spec, 3)
    assert [r.update for r in resumed.run(3)] == rest


def _runner_state_at(write_spec, step):
    runner = _runner(write_spec)
    runner.run(step)
    return runner.state_dict()


def test_keep_n_prunes_the_oldest(write_spec, tmp_path):
    rd, _ = _saved(write_spec, tmp_path, steps=(1, 2, 3, 4), keep=2)
    assert [s for s, _ in rd.checkpoints()] == [4, 3]
    assert sorted(p.name for p in rd.checkpoint_dir.iterdir()) == ["step-000003", "step-000004"]


def _damage(path: Path, how: str) -> Path:
    manifest = path / MANIFEST
    if how == "truncated manifest":
        manifest.write_bytes(manifest.read_bytes()[:100])
        return manifest
    if how == "no manifest":
        manifest.unlink()
        return manifest
    if how == "missing file":
        (path / "stages" / "pick" / "state.json").unlink()
        return path / "stages" / "pick" / "state.json"
    if how == "short file":
        target = path / "rng" / "torch.safetensors"
        target.write_bytes(target.read_bytes()[:-10])
        return target
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["truncated manifest", "no manifest", "missing file", "short file"])
def test_latest_checkpoint_skips_a_damaged_one(write_spec, tmp_path, how):
    rd, _ = _saved(write_spec, tmp_path, steps=(2, 4))
    named = _damage(rd.checkpoint(4), how)
    assert latest_checkpoint(rd) == rd.checkpoint(2)
    (problem,) = checkpoint_problems(rd)
    assert str(named) in str(problem) or str(rd.checkpoint(4)) in str(problem)
    assert problem.fix and "delete" in problem.fix


def test_a_corrupt_file_of_the_right_size_fails_loading_by_its_hash(write_spec, tmp_path):
    rd, _ = _saved(write_spec, tmp_path)
    target = rd.checkpoint(2) / "stages" / "pick" / "state.json"
    data = bytearray(target.read_bytes())
    data[5] ^= 1
    target.write_bytes(bytes(data))
    read_manifest(rd.checkpoint(2))  # sizes match: it is still listed as the latest
    with pytest.raises(CheckpointError, match=r"state\.json is corrupt: its sha256"):
        load_checkpoint(rd.checkpoint(2), _runner(write_spec), Lent())


def test_a_checkpoint_without_a_stateful_stage_s_state_names_the_stage(write_spec, tmp_path):
    rd, _ = _saved(write_spec, tmp_path)
    path = rd.checkpoint(2)
    _drop_stage(path, "pick")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, _runner(write_spec), Lent())
    assert "no state for stage `pick`" in str(info.value) and "spec.yaml" in info.value.fix


def _drop_stage(path: Path, sid: str) -> None:
    """Remove a stage's state and rewrite the runner position and manifest as if it never had any."""
    import hashlib
    import shutil

    shutil.rmtree(path / "stages" / sid)
    runner = json.loads((path / "runner.json").read_text())
    runner["stages"].remove(sid)
    (path / "runner.json").write_text(json.dumps(runner))
    manifest = json.loads((path / MANIFEST).read_text())
    files = []
    for f in manifest["files"]:
        if f["path"].startswith(f"stages/{sid}/"):
            continue
        data = (path / f["path"]).read_bytes()
        files.append({"path": f["path"], "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest["files"] = files
    (path / MANIFEST).write_text(json.dumps(manifest))


def test_a_newer_format_is_refused_with_the_version_that_wrote_it(write_spec, tmp_path):
    rd, _ = _saved(write_spec, tmp_path)
    manifest = json.loads((rd.checkpoint(2) / MANIFEST).read_text())
    (rd.checkpoint(2) / MANIFEST).write_text(json.dumps({**manifest, "format": 3, "gfcr": "9.9"}))
    with pytest.raises(CheckpointError, match=r"checkpoint format 3 \(written by gfcr 9.9\); this gfcr reads format 2"):
        read_manifest(rd.checkpoint(2))


class _OwnsFiles:
    """A stateful stage with files of its own (an index), for the save_files/load_files role."""

    def __init__(self):
        self.rows, self.loaded = ["a", "b"], None

    def state_dict(self):
        return {"rows": len(self.rows)}

    def load_state_dict(self, state):
        self.count = state["rows"]

    def save_files(self, directory: Path) -> None:
        (directory / "index.txt").write_text("\n".join(self.rows))

    def load_files(self, directory: Path) -> None:
        self.loaded = (directory / "index.txt").read_text().split("\n")


def test_a_stage_s_own_files_are_saved_listed_and_loaded(write_spec, tmp_path):
    runner = _runner(write_spec)
    runner.stages["keep"] = _OwnsFiles()
    rd = RunDir(tmp_path / "run")
    path = save_checkpoint(rd, runner, Lent())
    manifest = json.loads((path / MANIFEST).read_text())
    assert "stages/keep/files/index.txt" in [f["path"] for f in manifest["files"]]
    other = _runner(write_spec)
    other.stages["keep"] = _OwnsFiles()
    load_checkpoint(path, other, Lent())
    assert other.stages["keep"].loaded == ["a", "b"] and other.stages["keep"].count == 2
