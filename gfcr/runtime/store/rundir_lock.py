"""One process at a time in a run directory: an exclusive ``flock`` on ``<run dir>/.lock``.

``gfcr run`` and ``gfcr resume`` take the lock before anything in the directory is read for
writing (and before torch loads); a second one on the same directory is refused at once with a
``RunDirLocked`` naming the process that holds it (its pid, command and start time, which the
holder writes into the lock file).

Why ``fcntl.flock`` (and not a pid file, nor the ``filelock`` package): the kernel holds the
lock for the open file, and drops it when the holder exits *however* it exits (SIGKILL, an
out-of-memory kill, a crash). A lock file left by a killed process is therefore never "stale":
it is a file nobody holds a lock on, and the next run takes it at once, with no guessing from
pids (which are reused) and no race between "is it dead?" and "take it". ``filelock``'s
``FileLock`` is the same ``flock`` underneath, but a holder's metadata (who holds it) is not
part of it; the few lines here add that. The file itself stays, holding the last holder's
metadata; nothing is deleted (deleting a lock file while another process opens it is the
classic way two processes end up "holding" one lock).

Limits: ``flock`` is per machine; on NFS it is emulated with POSIX locks by Linux, which works
between clients with lockd but is not something gfcr tests. A worker process forked by the run
(a verifier) inherits the open file, so the lock lasts until the run's last process has ended.

Within one process the lock is re-entrant: ``lock_run_dir`` on a directory this process already
holds returns the held lock (the CLI locks before it checks a run, ``Run.resume`` locks again).
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from gfcr.errors import RunDirError

LOCK_NAME = ".lock"


class RunDirLocked(RunDirError):
    """Another process holds the run directory."""


class RunDirLock:
    """The held lock of one run directory (see the module docstring)."""

    def __init__(self, path: Path, fd: int, previous: dict[str, Any] | None):
        self.path, self._fd = path, fd
        self.previous = previous  # the metadata a killed holder left, if any: the lock was taken over

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the file drops the flock
            self._fd = -1
        _HELD.pop(self.path, None)


_HELD: dict[Path, RunDirLock] = {}


def lock_run_dir(run_dir: Path) -> RunDirLock:
    """Take ``run_dir``'s lock (creating the folder if needed), or raise ``RunDirLocked``."""
    path = Path(run_dir).resolve()
    if path in _HELD:
        return _HELD[path]
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise RunDirError(f"cannot lock the run directory {run_dir}: {exc.strerror}",
                          "pick a --run-dir in a folder you can write to") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read(fd)
        os.close(fd)
        raise RunDirLocked(f"run directory {run_dir} is in use by {_describe(holder)}",
                           "wait for that run to finish, or stop it"
                           + (f" (kill {holder['pid']})" if holder.get("pid") else "")
                           + "; a run of its own needs another --run-dir") from None
    previous = _read(fd) or None
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(_me()) + "\n").encode(), 0)
    os.fsync(fd)
    lock = _HELD[path] = RunDirLock(path, fd, previous)
    return lock


def release_run_dir(run_dir: Path) -> None:
    """Drop this process's lock on ``run_dir`` (nothing if it holds none)."""
    held = _HELD.get(Path(run_dir).resolve())
    if held is not None:
        held.release()


def only_the_lock(path: Path) -> bool:
    """Whether ``path``'s only entry is the lock file (a folder a run locked, then left unwritten)."""
    return [p.name for p in path.iterdir()] == [LOCK_NAME]


def _me() -> dict[str, Any]:
    return {"pid": os.getpid(), "command": " ".join(["gfcr", *sys.argv[1:]]) if sys.argv else "gfcr",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _read(fd: int) -> dict[str, Any]:
    try:
        value = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "{}")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder.get("pid"):
        return "another process (it is starting: no pid written yet)"
    return f"process {holder['pid']} (`{holder.get('command', '?')}`, started {holder.get('started', '?')})"
