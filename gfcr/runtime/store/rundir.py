"""The run directory: everything a run leaves behind, written atomically.

    runs/<name>-<YYYYmmdd-HHMMSS>/
      spec.yaml              the resolved spec (overrides applied); ``gfcr resume`` reads it
      run.json               run id, gfcr version, start time, command line
      run.log                the engine's own output (vLLM's log), appended to: gfcr/engines/run_log.py
      metrics.jsonl          one JSON object per step
      lineage/step-000007.parquet   one row per rollout of step 7
      lineage/control-000007.parquet  one row per prompt a Control stage picked or skipped in step 7
      checkpoints/step-000008/      the state after 8 steps (policy, optimizer, stages, RNG):
                                    a directory with a manifest, see gfcr/runtime/store/checkpoint.py
      summary.json           the closing summary (eval before/after, totals, where things are)

Every file is written to a temporary name in the same folder, flushed and fsynced, then
renamed over its final name, so a process killed at any moment leaves either the old file
or the new one. A checkpoint directory is built the same way: in a hidden temporary sibling,
then renamed. ``metrics.jsonl`` grows by whole lines; a resumed run first cuts it back to
the steps its checkpoint covers.

``metrics.jsonl`` is validated on read: one JSON object a line, each with an integer ``step``,
the steps 0, 1, 2, ... in order. A damaged line (cut mid-line by a kill or a full disk, or
edited) or a missing step is a ``RunDirError`` at ``file:line`` (``gfcr report`` refuses the
file); a resume repairs a damaged end of the file when it lies after the checkpoint's step
(those steps are run again), and otherwise says which steps are lost, never dropping them
silently.
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

from gfcr.errors import RunDirError
from gfcr.runtime.store.rundir_lock import only_the_lock

CHECKPOINT = re.compile(r"^step-(\d{6})$")
LEGACY_CHECKPOINT = re.compile(r"^step-(\d{6})\.pt$")  # format 1 (a pickle): found to explain, never loaded
LINEAGE = re.compile(r"^(?:step|control)-(\d{6})\.parquet$")
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
    """A new, empty ``base/<name>-<time>`` folder, made here: runs started in the same second
    (several at once on one machine) each get their own, ``-2``, ``-3``... (``mkdir`` is atomic)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base.mkdir(parents=True, exist_ok=True)
    path, suffix = base / f"{name}-{stamp}", 1
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            suffix += 1
            path = base / f"{name}-{stamp}-{suffix}"


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
        """Append one step's line, whole or not at all: a write that fails (a full disk) is cut
        off again, so the file still ends with the previous step."""
        line = memoryview((json.dumps(record, sort_keys=True) + "\n").encode("utf-8"))
        with open(self.metrics, "ab", buffering=0) as f:  # unbuffered: nothing left to flush at close
            size = f.seek(0, os.SEEK_END)
            try:
                while line:
                    line = line[f.write(line):]
                os.fsync(f.fileno())
            except OSError:
                os.ftruncate(f.fileno(), size)
                raise

    def read_metrics(self) -> list[dict[str, Any]]:
        """Every step's record, in order; a RunDirError at ``file:line`` if a line is damaged or
        a step is missing (see the module docstring)."""
        records, damage = self._scan_metrics()
        if damage is not None:
            raise RunDirError(damage, f"`gfcr resume {self.path}` repairs a damaged end of {self.metrics.name} when "
                              "the newest checkpoint is older than the damage; otherwise restore the file, or delete "
                              "this line and those after it and resume from a checkpoint at or before its step")
        return records

    def recorded_steps(self) -> int:
        """How many steps ``metrics.jsonl`` records, up to its first damaged line (never raises)."""
        return len(self._scan_metrics()[0])

    def _scan_metrics(self) -> tuple[list[dict[str, Any]], str | None]:
        """The records before the first damaged line, and what is wrong there (None: nothing)."""
        if not self.metrics.is_file():
            return [], None
        records: list[dict[str, Any]] = []
        with open(self.metrics, "rb") as f:
            for number, raw in enumerate(f, start=1):
                where = f"{self.metrics}:{number}"
                try:
                    record = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    cut = "cut short (a write stopped mid-line)" if not raw.endswith(b"\n") else "not JSON"
                    return records, f"{where}: a damaged line: {cut}"
                step = record.get("step") if isinstance(record, dict) else None
                if not isinstance(step, int) or isinstance(step, bool):
                    return records, f"{where}: a damaged line: not a step record (no integer `step`)"
                if step != len(records):
                    return records, f"{where}: step {step} where step {len(records)} was expected (a step is missing)"
                records.append(record)
        return records, None

    def truncate_metrics(self, before_step: int) -> None:
        """Keep the metrics of steps ``< before_step`` (a resumed run rewrites the rest). A damaged
        line after them is repaired so (dropped, its step run again); a RunDirError, with nothing
        written, if any of those steps is damaged or missing."""
        records, damage, kept = self.check_metrics(before_step)
        if damage is not None or len(records) > before_step:
            write_text(self.metrics, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))

    def check_metrics(self, before_step: int) -> tuple[list[dict[str, Any]], str | None, list[dict[str, Any]]]:
        """What ``truncate_metrics(before_step)`` reads, without writing: the records, the damage
        (None: none) and the records it keeps; its RunDirError if a step before ``before_step`` is lost."""
        records, damage = self._scan_metrics()
        kept = records[:before_step]
        if len(kept) < before_step:
            lost = f"step {len(kept)}" + (f" to {before_step - 1}" if before_step - 1 > len(kept) else "")
            why = damage or f"{self.metrics} ends after {len(kept)} step(s)"
            older = [step for step, _ in self.checkpoints() if step <= len(kept)]
            fix = (f"delete the checkpoints after step {older[0]} under {self.checkpoint_dir} and resume again, so "
                   f"that steps {older[0]} on run again" if older else
                   f"no checkpoint is at or before step {len(kept)}: start the run again with `gfcr run`")
            raise RunDirError(f"{why}; the checkpoint at step {before_step} covers {lost}, whose metrics are lost",
                              fix + f" (or restore {self.metrics.name} from a copy)")
        return records, damage, kept

    def truncate_lineage(self, before_step: int) -> None:
        """Delete the lineage files of steps ``>= before_step`` (a resumed run writes them again)."""
        if not self.lineage_dir.is_dir():
            return
        for path in self.lineage_dir.iterdir():
            if (m := LINEAGE.match(path.name)) and int(m.group(1)) >= before_step:
                path.unlink()

    def prune_checkpoints(self, keep: int) -> None:
        """Keep the newest ``keep`` checkpoints; delete older ones and the leftovers of killed writes."""
        for _, path in self.checkpoints()[keep:]:
            shutil.rmtree(path, ignore_errors=True)
        if self.checkpoint_dir.is_dir():
            for path in self.checkpoint_dir.iterdir():
                if TEMPORARY.match(path.name):
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def check_new_run_dir(path: Path) -> None:
    """A RunDirError unless ``path`` can hold a new run: missing, or an empty folder. Cheap (no
    torch): ``gfcr run`` calls it before it loads anything."""
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run directory {path} is a file", "pick another --run-dir")
    if path.is_dir() and any(path.iterdir()) and not only_the_lock(path):
        if RunDir(path).spec.is_file():  # a gfcr run: `gfcr resume` continues it, checkpointed or not
            raise RunDirError(f"run directory {path} is not empty",
                              f"pick another --run-dir, or continue that run with `gfcr resume {path}`")
        raise RunDirError(f"run directory {path} is not empty (and not a gfcr run directory)",
                          "pick another --run-dir, or an empty folder")
