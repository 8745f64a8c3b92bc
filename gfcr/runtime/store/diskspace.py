"""A full disk during a run: the write that failed, how much it needed, nothing half-written.

Every file a run writes goes through a write that leaves the previous state when it fails:
checkpoints are built in a hidden temporary directory and renamed (a failed one is removed,
the older checkpoints stay), lineage files and ``summary.json`` are written to a temporary name
and renamed, and a ``metrics.jsonl`` line that cannot be written whole is cut off again
(``RunDir.append_metrics``). The stages' own files (a replay store, a partial-rollout buffer...)
are part of the checkpoint, so they share its fate.

``disk_write`` turns the operating system's "no space" errors, raised at any of those writes,
into a ``DiskFullError``: what was being written, where, about how many bytes it needed and how
many were free. The CLI prints it and exits 1 with the ``gfcr resume`` that continues the run
once space is freed (a full disk is not a mistake in the command: exit 2 is for those).

"No space" is ``ENOSPC`` (the filesystem is full), ``EDQUOT`` (a quota) and ``EFBIG`` (a file
larger than the file size limit, ``ulimit -f``, or than the filesystem allows).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from gfcr.errors import GfcrError

NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class DiskFullError(GfcrError):
    """A write of the run directory failed for lack of space; the state before it is intact."""

    def __init__(self, what: str, path: Path, needed: int | None, free: int | None, strerror: str):
        self.what, self.path, self.needed, self.free = what, path, needed, free
        need = f"about {human(needed)}" if needed is not None else "an unknown amount"
        have = f"{human(free)} free there" if free is not None else "the free space is unknown"
        super().__init__(f"writing the {what} failed: {strerror} ({path}); it needed {need}, {have}",
                         "free some space (or raise the quota or file size limit), then `gfcr resume` the run: "
                         "it continues from its newest checkpoint, which this failure left intact")


@contextmanager
def disk_write(what: str, path: Path, needed: Callable[[], int | None]) -> Iterator[None]:
    """Raise a ``DiskFullError`` (about ``what`` at ``path``) if the block fails for lack of space;
    ``needed()`` says afterwards how many bytes the write wanted."""
    try:
        yield
    except Exception as exc:
        code = _errno_of(exc)
        if code not in NO_SPACE:
            raise
        raise DiskFullError(what, path, _safe(needed), free_bytes(path), os.strerror(code)) from None


def _errno_of(exc: Exception) -> int | None:
    """The OS error number behind ``exc``: an ``OSError``'s, or the "(os error N)" that the
    safetensors writer (Rust) puts in its ``SafetensorError`` message."""
    if isinstance(exc, OSError):
        return exc.errno
    found = re.search(r"\(os error (\d+)\)", str(exc))
    return int(found.group(1)) if found else None


def free_bytes(path: Path) -> int | None:
    """Bytes free to this user on the filesystem holding ``path`` (or its nearest existing parent)."""
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def tree_bytes(path: Path) -> int:
    """The bytes of the files under ``path`` (0 if it is missing)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def human(n: int) -> str:
    """``n`` bytes for a reader: '812 bytes', '3.4 MB'."""
    if n < 1024:
        return f"{n} bytes"
    value, unit = n / 1024, "KB"
    for bigger in ("MB", "GB", "TB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


def _safe(needed: Callable[[], int | None]) -> int | None:
    try:
        return needed()
    except OSError:
        return None
