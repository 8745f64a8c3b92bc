"""Run-directory writes: atomic replacement, metrics truncation on resume, checkpoint listing."""

from __future__ import annotations

import json

import pytest

from gfcr.runtime.rundir import RunDir, atomic_path, write_text


def test_a_failed_atomic_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "spec.yaml"
    write_text(target, "old\n")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half a new fi")
            raise RuntimeError("killed")
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


def test_metrics_are_cut_back_to_the_checkpoint_and_a_torn_last_line_is_ignored(tmp_path):
    rd = RunDir(tmp_path)
    for step in range(5):
        rd.append_metrics({"step": step, "reward_mean": step / 10})
    with open(rd.metrics, "a") as f:
        f.write('{"step": 5, "rew')  # a kill in the middle of a line
    assert [r["step"] for r in rd.read_metrics()] == [0, 1, 2, 3, 4]
    rd.truncate_metrics(3)
    assert [json.loads(line)["step"] for line in rd.metrics.read_text().splitlines()] == [0, 1, 2]


def test_checkpoint_directories_are_listed_newest_first_and_pruned(tmp_path):
    rd = RunDir(tmp_path)
    rd.checkpoint_dir.mkdir()
    for step in (2, 4, 6):
        rd.checkpoint(step).mkdir()
        (rd.checkpoint(step) / "manifest.json").write_text("{}")
    (rd.checkpoint_dir / ".step-000008.abc.tmp").mkdir()  # a write a kill cut short
    (rd.checkpoint_dir / "step-000001.pt").write_bytes(b"format 1")
    assert rd.checkpoint(6).name == "step-000006"
    assert [s for s, _ in rd.checkpoints()] == [6, 4, 2]
    assert [s for s, _ in rd.legacy_checkpoints()] == [1]
    rd.prune_checkpoints(keep=2)
    assert [s for s, _ in rd.checkpoints()] == [6, 4]
    assert sorted(p.name for p in rd.checkpoint_dir.iterdir()) == ["step-000001.pt", "step-000004", "step-000006"]
