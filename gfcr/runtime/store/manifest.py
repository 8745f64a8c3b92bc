"""A checkpoint directory's manifest, read and checked without torch: the kind and format, every
listed file present with its size and (``verify_checkpoint``) its sha256, no file a pickle.

``gfcr resume`` checks a run directory with these before it loads torch or the policy, so a
damaged checkpoint is refused in a fraction of a second and a small process; ``checkpoint.py``
writes checkpoints and loads them (after ``verify_checkpoint``), and re-exports these names.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from gfcr.errors import CheckpointError
from gfcr.runtime.store.rundir import RunDir

KIND = "gfcr-checkpoint"
FORMAT = 2
MANIFEST, RUNNER, POLICY = "manifest.json", "runner.json", "policy.safetensors"
_DAMAGED = ("the checkpoint is damaged or incomplete: delete {path} to resume from an older checkpoint, "
            "or start the run again with `gfcr run` in a new run directory")
_ZIP = b"PK\x03\x04"  # torch.save's container: a zip holding data.pkl
NOT_GFCR_FIX = ("a gfcr checkpoint holds JSON and safetensors only; this one was written by something else or "
                "altered, and gfcr never unpickles it (loading a pickle runs any code it carries). Resume only "
                "run directories you trust: delete {checkpoint} to resume from an older checkpoint, or start the "
                "run again with `gfcr run`")


def is_pickle(head: bytes) -> bool:
    """Whether a file starting with ``head`` is a pickle: protocol 2-5's PROTO opcode, or the zip
    ``torch.save`` writes (a protocol 0/1 pickle is plain text, which no JSON or safetensors reader takes)."""
    return head.startswith(_ZIP) or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def refuse_pickle(file: Path, checkpoint: Path) -> None:
    """Raise the "not a gfcr checkpoint" ``CheckpointError`` if ``file`` is a pickle (read: 4 bytes)."""
    with open(file, "rb") as f:
        head = f.read(4)
    if is_pickle(head):
        raise CheckpointError(
            f"{checkpoint} is not a gfcr checkpoint: {file} is a pickle (as torch.save or pickle writes), not JSON or safetensors",
            NOT_GFCR_FIX.format(checkpoint=checkpoint))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint directory ``path``, checked: the right kind and format, and every
    listed file present with its size (``CheckpointError`` naming the file, else)."""
    manifest_file = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory", _DAMAGED.format(path=path))
    if not manifest_file.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint: it has no {MANIFEST}", _DAMAGED.format(path=path))
    try:
        manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{manifest_file} is truncated or corrupt: {exc}", _DAMAGED.format(path=path)) from None
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND or not isinstance(manifest.get("files"), list):
        raise CheckpointError(f"{manifest_file} is not a gfcr checkpoint manifest", _DAMAGED.format(path=path))
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{manifest_file}: checkpoint format {manifest.get('format')!r} (written by gfcr {manifest.get('gfcr')}); "
            f"this gfcr reads format {FORMAT}",
            "resume it with the gfcr version that wrote it, or start the run again with `gfcr run` in a new run "
            "directory")
    for entry in manifest["files"]:
        _check_size(path, entry)
    return manifest


def _check_size(root: Path, entry: Any) -> None:
    try:
        file, size = root / entry["path"], int(entry["bytes"])
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(f"{root / MANIFEST}: a bad file entry {entry!r}", _DAMAGED.format(path=root)) from None
    if not file.is_file():
        raise CheckpointError(f"{file} is missing (listed in {root / MANIFEST})", _DAMAGED.format(path=root))
    refuse_pickle(file, root)
    if file.stat().st_size != size:
        raise CheckpointError(f"{file} has {file.stat().st_size} bytes, the manifest says {size}",
                              _DAMAGED.format(path=root))


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """``read_manifest`` plus every file's sha256: the manifest of a checkpoint safe to load."""
    manifest = read_manifest(path)
    for entry in manifest["files"]:
        if _sha256(path / entry["path"]) != entry["sha256"]:
            raise CheckpointError(f"{path / entry['path']} is corrupt: its sha256 differs from the manifest's",
                                  _DAMAGED.format(path=path))
    return manifest


def latest_checkpoint(run_dir: RunDir) -> Path | None:
    """The newest complete checkpoint: a directory whose manifest reads and whose listed files all
    exist with the right sizes. A damaged newer one is skipped (``checkpoint_problems`` says why)."""
    for _, path in run_dir.checkpoints():
        try:
            read_manifest(path)
        except CheckpointError:
            continue
        return path
    return None


def checkpoint_problems(run_dir: RunDir) -> list[CheckpointError]:
    """Why each checkpoint newer than the latest complete one cannot be used, newest first."""
    problems = []
    for _, path in run_dir.checkpoints():
        try:
            read_manifest(path)
        except CheckpointError as exc:
            problems.append(exc)
            continue
        break
    return problems


def intact_checkpoint(run_dir: RunDir) -> tuple[Path | None, list[tuple[Path, CheckpointError]]]:
    """The newest checkpoint that is intact (its manifest, every file's size and sha256, its
    ``runner.json``), and each newer one with why it is not, newest first. This is what ``gfcr resume``
    continues from: a checkpoint damaged after it was written (a bit flipped, a file cut or
    edited, a stage's files of its own among them) is passed over for the next older one."""
    damaged: list[tuple[Path, CheckpointError]] = []
    for _, path in run_dir.checkpoints():
        try:
            verify_checkpoint(path)
            checkpoint_step(path)
        except CheckpointError as exc:
            damaged.append((path, exc))
            continue
        return path, damaged
    return None, damaged


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint was written after (its ``runner.json``)."""
    try:
        step = json.loads((path / RUNNER).read_text(encoding="utf-8"))["step"]
        if isinstance(step, int) and not isinstance(step, bool):
            return step
        raise TypeError(f"step is {step!r}")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path / RUNNER}: cannot read it: {exc}", _DAMAGED.format(path=path)) from None


def strict_refusal(damaged: list[tuple[Path, CheckpointError]]) -> CheckpointError:
    """``gfcr resume --strict``'s error when the newest checkpoint is damaged."""
    first = damaged[0][1]
    return CheckpointError(f"the newest checkpoint is damaged: {first.message}",
                           "resume without --strict to continue from the newest intact checkpoint (the steps after "
                           "it run again), or restore the damaged files from a copy")


def check_resumable(run_dir: RunDir, strict: bool = False) -> None:
    """What ``Run.resume`` would refuse in ``run_dir``'s files, found without torch: with
    ``strict``, a damaged newest checkpoint; metrics lost before the step of the checkpoint it
    would continue from; checkpoints that are all damaged. Nothing is written."""
    checkpoint, damaged = intact_checkpoint(run_dir)
    if strict and damaged:
        raise strict_refusal(damaged)
    if checkpoint is None and damaged:
        raise no_intact_checkpoint(run_dir, damaged)
    if checkpoint is not None:
        run_dir.check_metrics(checkpoint_step(checkpoint))


def no_intact_checkpoint(run_dir: RunDir, damaged: list[tuple[Path, CheckpointError]]) -> CheckpointError:
    """The error of a run directory whose checkpoints are all damaged: the newest one's problem."""
    first = damaged[0][1]
    return CheckpointError(f"{run_dir.path} has no complete checkpoint to resume from: {first.message}", first.fix)
