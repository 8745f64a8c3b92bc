"""Run-directory writes: atomic replacement, metrics truncation on resume, checkpoint listing."""

from __future__ import annotations

import json

import pytest

from gfcr.errors import RunDirError
from gfcr.runtime.store.rundir import RunDir, atomic_path, write_text


def test_a_failed_atomic_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "spec.yaml"
    write_text(target, "old\n")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half a new fi")
            raise RuntimeError("killed")
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


def test_metrics_are_cut_back_to_the_checkpoint_and_a_torn_last_line_is_refused_on_read_and_repaired_on_resume(
        tmp_path):
    rd = RunDir(tmp_path)
    for step in range(5):
        rd.append_metrics({"step": step, "reward_mean": step / 10})
    with open(rd.metrics, "a") as f:
        f.write('{"step": 5, "rew')  # a kill in the middle of a line
    with pytest.raises(RunDirError, match=rf"{rd.metrics}:6: a damaged line: cut short \(a write stopped mid-line\)"):
        rd.read_metrics()
    rd.truncate_metrics(3)  # the checkpoint at step 3: steps 3 and 4 run again, the torn line goes
    assert [json.loads(line)["step"] for line in rd.metrics.read_text().splitlines()] == [0, 1, 2]
    assert [r["step"] for r in rd.read_metrics()] == [0, 1, 2]


def _metrics(rd: RunDir, text: str) -> None:
    rd.path.mkdir(parents=True, exist_ok=True)
    rd.metrics.write_text(text)


@pytest.mark.parametrize("text, line, what", [
    ('{"step": 0}\n{"step": 1, "rew\n{"step": 2}\n', 2, "a damaged line: not JSON"),
    ('{"step": 0}\n{"step": 1}\n{"step": 3}\n', 3, "step 3 where step 2 was expected (a step is missing)"),
    ('{"step": 0}\n[1, 2]\n', 2, "a damaged line: not a step record (no integer `step`)"),
    ('{"step": 0}\n\x00\x00\n', 2, "a damaged line: not JSON"),
])
def test_a_damaged_or_missing_step_is_refused_with_its_line(tmp_path, text, line, what):
    rd = RunDir(tmp_path / "run")
    _metrics(rd, text)
    with pytest.raises(RunDirError) as info:
        rd.read_metrics()
    assert info.value.message == f"{rd.metrics}:{line}: {what}" and "gfcr resume" in info.value.fix


def test_a_resume_never_drops_steps_its_checkpoint_covers(tmp_path):
    rd = RunDir(tmp_path / "run")
    _metrics(rd, '{"step": 0}\n{"step": 1}\n{"step": 2, "rew')  # torn at step 2, checkpoint at step 4
    before = rd.metrics.read_bytes()
    with pytest.raises(RunDirError) as info:
        rd.truncate_metrics(4)
    assert info.value.message == (f"{rd.metrics}:3: a damaged line: cut short (a write stopped mid-line); "
                                  "the checkpoint at step 4 covers step 2 to 3, whose metrics are lost")
    assert "no checkpoint is at or before step 2: start the run again with `gfcr run`" in info.value.fix
    for step in (2, 4):
        rd.checkpoint(step).mkdir(parents=True)
    with pytest.raises(RunDirError) as info:
        rd.truncate_metrics(4)
    assert info.value.fix.startswith(f"delete the checkpoints after step 2 under {rd.checkpoint_dir} and resume")
    assert rd.metrics.read_bytes() == before  # nothing written
    _metrics(rd, '{"step": 0}\n')  # whole lines, but too few
    with pytest.raises(RunDirError, match=r"ends after 1 step\(s\); the checkpoint at step 2 covers step 1, "):
        rd.truncate_metrics(2)


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
