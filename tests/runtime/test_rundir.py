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


def test_only_complete_checkpoints_are_listed_newest_first(tmp_path):
    rd = RunDir(tmp_path)
    rd.checkpoint_dir.mkdir()
    for step in (2, 4, 6):
        rd.checkpoint(step).write_bytes(b"x")
    (rd.checkpoint_dir / ".step-000008.pt.abc.tmp").write_bytes(b"partial")
    assert [s for s, _ in rd.checkpoints()] == [6, 4, 2]
    rd.prune_checkpoints(keep=2)
    assert [s for s, _ in rd.checkpoints()] == [6, 4]
