"""The run directory: everything a run leaves behind, written atomically.

    runs/<name>-<YYYYmmdd-HHMMSS>/
      spec.yaml              the resolved spec (overrides applied); ``gfcr resume`` reads it
      run.json               run id, gfcr version, start time, command line
      metrics.jsonl          one JSON object per step
      lineage/step-000007.parquet   one row per rollout of step 7
      lineage/control-000007.parquet  one row per prompt a Control stage picked or skipped in step 7
      checkpoints/step-000008/      the state after 8 steps (policy, optimizer, stages, RNG):
                                    a directory with a manifest, see gfcr/runtime/checkpoint.py
      summary.json           the closing summary (eval before/after, totals, where things are)

Every file is written to a temporary name in the same folder, flushed and fsynced, then
renamed over its final name, so a process killed at any moment leaves either the old file
or the new one. A checkpoint directory is built the same way: in a hidden temporary sibling,
then renamed. ``metrics.jsonl`` grows by whole lines; a resumed run first cuts it back to
the steps its checkpoint covers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

CHECKPOINT = re.compile(r"^step-(\d{6})$")
LEGACY_CHECKPOINT = re.compile(r"^step-(\d{6})\.pt$")  # format 1 (a pickle): found to explain, never loaded
TEMPORARY = re.compile(r"^\.step-\d{6}\..*\.tmp$")  # a checkpoint being written, or one a kill cut short


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success, fsync it and rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def gfcr_version() -> str:
    """The installed gfcr's version (run.json and checkpoint manifests record it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gfcr")
    except PackageNotFoundError:
        return "unknown"


def new_run_dir(name: str, base: Path = Path("runs")) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = base / f"{name}-{stamp}"
    suffix = 1
    while path.exists():
        suffix += 1
        path = base / f"{name}-{stamp}-{suffix}"
    return path


class RunDir:
    """Paths and writers of one run directory."""

    def __init__(self, path: Path):
        self.path = Path(path)

    spec = property(lambda self: self.path / "spec.yaml")
    info = property(lambda self: self.path / "run.json")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    summary = property(lambda self: self.path / "summary.json")
    lineage_dir = property(lambda self: self.path / "lineage")
    checkpoint_dir = property(lambda self: self.path / "checkpoints")

    def lineage(self, step: int) -> Path:
        return self.lineage_dir / f"step-{step:06d}.parquet"

    def control_lineage(self, step: int) -> Path:
        return self.lineage_dir / f"control-{step:06d}.parquet"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoint_dir / f"step-{step:06d}"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Checkpoint directories by their final names, newest first (a killed write leaves only a
        hidden temporary directory, which is not listed). ``latest_checkpoint`` checks completeness."""
        return self._matching(CHECKPOINT, want_dir=True)

    def legacy_checkpoints(self) -> list[tuple[int, Path]]:
        """Format-1 checkpoint files (``step-000008.pt``, pickles) of a run from gfcr before v2."""
        return self._matching(LEGACY_CHECKPOINT, want_dir=False)

    def _matching(self, pattern: re.Pattern, want_dir: bool) -> list[tuple[int, Path]]:
        if not self.checkpoint_dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.checkpoint_dir.iterdir()
                 if (m := pattern.match(p.name)) and p.is_dir() == want_dir]
        return sorted(found, reverse=True)

    def append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.metrics, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics.is_file():
            return []
        lines = self.metrics.read_text(encoding="utf-8").splitlines()
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a kill: everything after it is gone too
                break
        return out

    def truncate_metrics(self, before_step: int) -> None:
        """Keep the metrics of steps ``< before_step`` (a resumed run rewrites the rest)."""
        kept = [r for r in self.read_metrics() if r["step"] < before_step]
        write_text(self.metrics, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))

    def prune_checkpoints(self, keep: int) -> None:
        """Keep the newest ``keep`` checkpoints; delete older ones and the leftovers of killed writes."""
        for _, path in self.checkpoints()[keep:]:
            shutil.rmtree(path, ignore_errors=True)
        if self.checkpoint_dir.is_dir():
            for path in self.checkpoint_dir.iterdir():
                if TEMPORARY.match(path.name):
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
