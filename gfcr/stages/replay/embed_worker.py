"""The replay store's embedder in a worker process of its own (``embed_in: process``).

A sentence-transformers model embedding beside the policy in the same process competes with it
for the interpreter lock and the cores, whether it runs inline or in a background thread. Here
the model runs in a separate Python process, started once per process and model folder (the
first time a store with ``embed_in: process`` is set up) and shared by every such store, like
the in-process model of ``load_embedder``. The worker:

- runs the model on one torch thread (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``) at a
  lower priority (``os.nice(NICE)``, and Linux's ``SCHED_IDLE`` where allowed), so it uses the
  cores the step leaves idle;
- reads requests (texts, batch size) from a pipe and answers float32 ``[n, dim]`` unit rows and the
  CPU seconds the encode took; the store's own thread waits on the pipe without holding the lock;
- dies with its parent: it exits when the request pipe reaches end of file (the parent's end is
  closed, as by any death of the parent), when its parent pid changes (a watchdog thread polls it
  every ``WATCH_SECONDS``), and, when started from the main thread, on ``PR_SET_PDEATHSIG`` (Linux
  sends it SIGKILL when the parent thread exits; not used from another thread, which may end first);
- is stopped cleanly (a stop request, then SIGKILL after ``STOP_SECONDS``) by ``close`` or at exit.

Failures are ``ModelError``s naming the worker: a model that will not load (the worker's own
message), an encode that raised (its exception), a worker that died (its exit code or signal).

Determinism: the worker encodes exactly the batches the store sends, on one thread, as the
in-process embedder does in its thread, so the vectors are the same bytes in either mode (a test
checks it) and a resumed run embeds as an uninterrupted one.

>>> from gfcr.stages.replay.embed_worker import worker_embedder
>>> embedder = worker_embedder("all-MiniLM-L6-v2")  # doctest: +SKIP
>>> embedder.encode(["2 + 2 = 4"]).shape  # doctest: +SKIP
(1, 384)
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
import weakref
from pathlib import Path
from typing import IO, Any, Sequence

import numpy as np

from gfcr.errors import ModelError
from gfcr.stages.common.embedding import resolve_embedder

NICE = 10  # added to the worker's niceness: it yields the cores to the step
WATCH_SECONDS = 0.5  # how often the worker checks that its parent is alive
STOP_SECONDS = 10.0  # how long ``close`` waits for a stop request before SIGKILL
_PR_SET_PDEATHSIG = 1
_HEADER = struct.Struct("<Q")
_FIX_DIED = ("the worker's own messages are above on stderr; set `embed_in: thread` to embed in this process "
             "instead")

_WORKERS: dict[str, "WorkerEmbedder"] = {}
_LOCK = threading.Lock()


def _send(stream: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _recv(stream: IO[bytes]) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the pipe was closed")
    size = _HEADER.unpack(header)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the pipe was closed mid-message")
    return pickle.loads(data)


class WorkerEmbedder:
    """``encode(texts) -> float32 [n, dim]`` unit rows, computed in a worker process (module docstring)."""

    def __init__(self, name: str, nice: int = NICE):
        self.name, self.folder, self.nice = name, resolve_embedder(name), nice  # a missing model: ModelError here
        self._lock = threading.Lock()  # one request at a time on the pipe
        self._dim: int | None = None
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        main = threading.current_thread() is threading.main_thread()
        root = str(Path(__file__).resolve().parents[3])  # the folder holding the gfcr package
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "gfcr.stages.replay.embed_worker", str(to_worker_r), str(from_worker_w),
                 str(self.folder), name, str(nice), str(os.getpid()), "1" if main else "0"],
                pass_fds=(to_worker_r, from_worker_w), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
        finally:
            os.close(to_worker_r)
            os.close(from_worker_w)
        self._to, self._from = os.fdopen(to_worker_w, "wb"), os.fdopen(from_worker_r, "rb")
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._to, self._from)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def dim(self) -> int:
        """The embedding size (waits for the worker to load its model)."""
        if self._dim is None:
            with self._lock:
                self._ready()
        assert self._dim is not None
        return self._dim

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None and self._finalizer.alive

    def encode(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:  # [n, dim] float32
        return self.encode_with_cpu(texts, batch_size)[0]

    def encode_with_cpu(self, texts: Sequence[str], batch_size: int = 64) -> tuple[np.ndarray, float]:
        """The vectors and the CPU seconds the worker spent computing them."""
        with self._lock:
            self._ready()
            assert self._dim is not None
            if not texts:
                return np.zeros((0, self._dim), dtype=np.float32), 0.0
            reply = self._ask((list(texts), int(batch_size)))
        if reply[0] == "error":
            raise ModelError(f"embedder `{self.name}` (worker process {self.pid}) failed to encode "
                             f"{len(texts)} texts: {reply[1]}", "see the traceback the worker printed above; "
                             "set `embed_in: thread` to embed in this process instead")
        return np.ascontiguousarray(reply[1], dtype=np.float32), float(reply[2])

    def close(self) -> None:
        """Stop the worker (a stop request, SIGKILL if it does not exit in ``STOP_SECONDS``)."""
        self._finalizer()

    def _ready(self) -> None:
        if self._dim is not None:
            return
        try:
            reply = _recv(self._from)
        except (EOFError, OSError, ValueError):
            raise self._died("while loading its model") from None
        if reply[0] == "error":
            raise ModelError(f"embedder `{self.name}` (worker process {self.pid}): {reply[1]}", reply[2])
        self._dim = int(reply[1])

    def _ask(self, request: Any) -> Any:
        try:
            _send(self._to, request)
            return _recv(self._from)
        except (EOFError, OSError, ValueError):  # ValueError: a pipe closed by ``close``
            raise self._died("while encoding") from None

    def _died(self, doing: str) -> ModelError:
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        how = ("is not answering" if code is None else f"was killed by signal {-code}" if code < 0
               else f"exited with code {code}")
        return ModelError(f"embedder `{self.name}`: the embedding worker process {self.pid} {how} {doing}",
                          _FIX_DIED)


def _stop(proc: subprocess.Popen, to: IO[bytes], from_: IO[bytes]) -> None:
    try:
        _send(to, None)
    except (OSError, ValueError):
        pass
    for stream in (to, from_):
        try:
            stream.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def worker_embedder(name: str) -> WorkerEmbedder:
    """The worker embedding with ``name`` (started once per process and folder; a dead one is replaced)."""
    key = str(resolve_embedder(name).resolve())
    with _LOCK:
        found = _WORKERS.get(key)
        if found is None or not found.alive:
            _WORKERS[key] = found = WorkerEmbedder(name)
        return found


def close_workers() -> None:
    """Stop every worker this process started."""
    with _LOCK:
        workers = list(_WORKERS.values())
        _WORKERS.clear()
    for worker in workers:
        worker.close()


# --- the worker process -----------------------------------------------------------------------------


def _die_with(parent: int, deathsig: bool) -> None:
    if deathsig and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog below still ends the worker
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_SECONDS)
        os._exit(0)

    threading.Thread(target=watch, name="gfcr-embed-watchdog", daemon=True).start()


def _idle_priority() -> None:
    """Linux's SCHED_IDLE: the worker runs only on a core nothing else wants, and is preempted
    at once when the step's threads wake (a nice value only shares the core less). Elsewhere,
    or where the policy is refused, the nice value alone applies."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def _serve(argv: list[str]) -> None:
    inbox_fd, outbox_fd, folder, name, nice, parent, deathsig = argv
    _die_with(int(parent), deathsig == "1")
    inbox, outbox = os.fdopen(int(inbox_fd), "rb"), os.fdopen(int(outbox_fd), "wb")
    os.nice(int(nice))
    _idle_priority()
    try:
        import torch

        from gfcr.stages.common.embedding import Embedder, load_model

        torch.set_num_threads(1)
        embedder = Embedder(name, Path(folder), load_model(Path(folder), name))
    except ModelError as exc:
        _send(outbox, ("error", exc.message, exc.fix))
        return
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        traceback.print_exc()
        _send(outbox, ("error", f"cannot load {folder}: {type(exc).__name__}: {exc}",
                       "point `embedder:` at a complete sentence-transformers folder"))
        return
    _send(outbox, ("ready", embedder.dim))
    while True:
        try:
            request = _recv(inbox)
        except EOFError:  # the parent is gone, or closed its end
            return
        if request is None:
            return
        texts, batch_size = request
        cpu = time.process_time()
        try:
            reply = ("ok", embedder.encode(texts, batch_size=batch_size), time.process_time() - cpu)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
            traceback.print_exc()
            reply = ("error", f"{type(exc).__name__}: {exc}")
        try:
            _send(outbox, reply)
        except (BrokenPipeError, OSError):
            return


if __name__ == "__main__":
    try:
        _serve(sys.argv[1:])
    except (BrokenPipeError, KeyboardInterrupt):
        pass
    # no interpreter shutdown: tearing down torch takes a second of CPU, which a low-priority
    # worker on a busy machine may not get for a long while after its parent is gone
    sys.stderr.flush()
    os._exit(0)
