"""A pool of killable worker processes that run verifiers under a wall-clock and memory limit.

Why processes: a verifier is handed text the policy wrote, and some texts make a verifier
compute for ever (sympy inside math-verify on ``\\boxed{9^{9^{9^{9}}}}`` holds the GIL in C
code for minutes). A thread cannot be stopped in CPython, and ``signal.alarm`` never fires
while C code holds the GIL, so the only timeout that always works is killing the process
doing the work. Each worker is a fresh ``python`` started with ``subprocess`` (not
``fork``: the trainer holds torch and tokenizer threads, and a forked copy could inherit a
held lock), in its own session, so that killing its process group also kills anything it
started (the ``code`` verifier's test program). Why not ``concurrent.futures`` or
``multiprocessing.Pool``: neither can kill one worker on a timeout; killing a worker breaks
the whole ``ProcessPoolExecutor``, and a ``multiprocessing`` spawn re-imports the parent's
``__main__`` script. The protocol here is small (length-prefixed pickles on two pipes).

Per call:

- wall clock: the parent waits ``timeout_s`` for the answer, then sends ``SIGKILL`` to the
  worker's process group, reaps it (no zombie, no abandoned thread, no CPU left burning)
  and starts a replacement; the call raises ``Overran``;
- memory: each worker sets ``RLIMIT_AS`` (its address space) to ``memory_mb`` at start, so an
  allocation past it raises ``MemoryError`` inside the verifier (reported as a verifier
  error), or kills the worker (reported as ``WorkerDied``);
- a worker that dies (a crash, the kernel's OOM killer) raises ``WorkerDied`` and is replaced;
- a worker dies with its parent (``PR_SET_PDEATHSIG``, and end of input on its pipe).

The verifier function travels to the worker once per worker, pickled with ``cloudpickle``
(so closures and test doubles work too); its ``prepare()`` (the ``math`` verifier's slow
first import) runs there once, outside the timeout. Starting a worker costs about 0.3 s
(a Python start and gfcr's verifier imports), paid once per worker and again only after a
kill. ``map`` keeps up to ``workers`` calls in flight at once.

>>> from gfcr.stages.verifiers.arithmetic import verify_arithmetic
>>> with VerifierPool(workers=1) as pool:
...     pool.call(verify_arithmetic, "Answer: 4", "4", {}, timeout_s=5.0).reason
'answer 4 == 4'
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from gfcr.stages.verifiers.base import Score

@runtime_checkable
class Prepared(Protocol):
    """A verifier with a ``prepare()`` attribute: a slow one-off set-up (the ``math`` verifier's
    import of math-verify) that each worker runs once, untimed, before its first call."""

    def prepare(self) -> None: ...


def prepare_once(verifier: object) -> None:
    """Run the verifier's ``prepare()`` when it has one."""
    if isinstance(verifier, Prepared) and callable(verifier.prepare):
        verifier.prepare()


STARTUP_TIMEOUT_S = 120.0  # a worker's start and a verifier's prepare(), untimed by the call's limit
_HEADER = struct.Struct("!Q")


class Overran(Exception):
    """The verifier did not answer within the timeout; its worker was killed."""


class WorkerDied(Exception):
    """The worker process ended while running the verifier (a crash, or killed for memory)."""


@dataclass(frozen=True)
class Call:
    """One verifier call: ``verifier(text, ground_truth, options)``."""

    verifier: Callable[..., Score]
    text: str
    ground_truth: str
    options: dict[str, Any]


def _send(fd: int, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, left = [], n
    while left:
        if deadline is not None:  # past the deadline, take only what is already there
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise Overran()
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError()
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive(fd: int, deadline: float | None) -> Any:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exact(fd, size, deadline))


class _Worker:
    """One worker process and its two pipes."""

    def __init__(self, memory_mb: int | None):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [_package_root(),
                                                                         os.environ.get("PYTHONPATH")] if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from gfcr.stages.verifiers.pool import _serve; _serve()",
             str(memory_mb or 0)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True, env=env, close_fds=True)
        self.to_fd, self.from_fd = self.process.stdin.fileno(), self.process.stdout.fileno()
        self.loaded: set[int] = set()  # ids of the verifiers this worker holds
        self.deadline: float | None = None

    def start_load(self, key: int, verifier: Callable[..., Score]) -> None:
        import cloudpickle

        blob = cloudpickle.dumps(verifier)  # raises here, in the parent, if it cannot pickle
        _send(self.to_fd, ("load", key, blob))
        self.deadline = time.monotonic() + STARTUP_TIMEOUT_S

    def start_call(self, key: int, call: Call, timeout_s: float) -> None:
        _send(self.to_fd, ("call", key, call.text, call.ground_truth, dict(call.options)))
        self.deadline = time.monotonic() + timeout_s

    def finish_call(self) -> Any:
        outcome = _receive(self.from_fd, self.deadline)
        self.deadline = None
        return outcome

    def kill(self) -> None:
        """SIGKILL the worker's process group (it and anything it started) and reap it."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def died(self) -> str:
        code = self.process.wait()
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class VerifierPool:
    """Up to ``workers`` verifier processes, each under ``memory_mb`` of address space."""

    def __init__(self, workers: int = 1, memory_mb: int | None = 2048):
        if workers < 1:
            raise ValueError(f"a verifier pool needs at least 1 worker, got {workers}")
        self.workers, self.memory_mb = workers, memory_mb
        self._idle: list[_Worker] = []
        self._keys: dict[int, Callable[..., Score]] = {}  # keeps each shipped verifier alive, so ids stay unique
        self._lock = threading.Lock()  # one map at a time (evaluation and a stage may share a pool)

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, verifier: Callable[..., Score], text: str, ground_truth: str, options: dict[str, Any],
             timeout_s: float) -> Score:
        """``verifier(text, ground_truth, options)`` in a worker; Overran, WorkerDied, or what it raised."""
        (outcome,) = self.map([Call(verifier, text, ground_truth, options)], timeout_s)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def map(self, calls: Sequence[Call], timeout_s: float) -> list[Score | BaseException]:
        """Each call's Score, or the exception it ended with (Overran, WorkerDied, or the
        verifier's own), in order; up to ``workers`` at once, each under ``timeout_s``.

        One event loop over the workers' pipes: a worker first loads the call's verifier (if
        it does not hold it yet; untimed by the call's limit, bounded by STARTUP_TIMEOUT_S),
        then runs the call; no step waits on one worker while another's deadline passes."""
        with self._lock:
            results: list[Score | BaseException | None] = [None] * len(calls)
            pending = list(enumerate(calls))[::-1]
            busy: dict[int, tuple[_Worker, int, bool]] = {}  # from_fd -> (worker, call index, loading)
            while pending or busy:
                while pending and len(busy) < self.workers:
                    index, call = pending.pop()
                    worker = self._take()
                    started = self._begin(worker, index, call, timeout_s, results)
                    if started is not None:
                        busy[worker.from_fd] = (worker, index, started)
                soonest = min(w.deadline for w, _, _ in busy.values())
                ready = select.select(list(busy), [], [], max(0.0, soonest - time.monotonic()))[0]
                now = time.monotonic()
                for fd in list(busy):
                    worker, index, loading = busy[fd]
                    if fd not in ready and worker.deadline > now:
                        continue
                    del busy[fd]
                    if loading:
                        if self._loaded(worker, index, calls[index], timeout_s, results):
                            busy[worker.from_fd] = (worker, index, False)
                    else:
                        results[index] = self._finish(worker, timeout_s)
            return results  # type: ignore[return-value]

    def _begin(self, worker: _Worker, index: int, call: Call, timeout_s: float,
               results: list) -> bool | None:
        """Send the load (True: loading) or the call (False: calling); None if it failed at once."""
        try:
            key = self._key(call.verifier)
            if key in worker.loaded:
                worker.start_call(key, call, timeout_s)
                return False
            worker.start_load(key, call.verifier)
            return True
        except (EOFError, OSError):  # the worker is gone
            results[index] = WorkerDied(f"verifier worker failed to start ({worker.died()})")
            worker.kill()
        except Exception as exc:  # the verifier does not pickle
            results[index] = exc
            self._idle.append(worker)
        return None

    def _loaded(self, worker: _Worker, index: int, call: Call, timeout_s: float, results: list) -> bool:
        """Read the answer to a load; on success start the call (True)."""
        try:
            status, detail = worker.finish_call()
        except Overran:
            worker.kill()
            results[index] = Overran(f"verifier start and prepare() ran past {STARTUP_TIMEOUT_S:g}s (worker killed)")
            return False
        except (EOFError, OSError):
            results[index] = WorkerDied(f"verifier worker failed to start ({worker.died()}); "
                                        f"memory limit {self.memory_mb} MB")
            worker.kill()
            return False
        if status != "loaded":
            results[index] = RuntimeError(f"the verifier worker could not load "
                                          f"{getattr(call.verifier, '__name__', call.verifier)}: {detail}")
            self._idle.append(worker)
            return False
        key = self._key(call.verifier)
        worker.loaded.add(key)
        try:
            worker.start_call(key, call, timeout_s)
        except (EOFError, OSError):
            results[index] = WorkerDied(f"verifier worker died ({worker.died()})")
            worker.kill()
            return False
        return True

    def _finish(self, worker: _Worker, timeout_s: float) -> Score | BaseException:
        """Read the answer to a call; past its deadline, kill the worker (a fresh one starts at once)."""
        try:
            status, value = worker.finish_call()
        except Overran:
            worker.kill()
            self._idle.append(_Worker(self.memory_mb))  # its replacement starts at once, in the background
            return Overran(f"verifier timeout after {timeout_s:g}s (worker killed)")
        except (EOFError, OSError):
            reason = worker.died()
            worker.kill()
            self._idle.append(_Worker(self.memory_mb))
            return WorkerDied(f"verifier worker died ({reason}); memory limit {self.memory_mb} MB")
        self._idle.append(worker)
        if status == "ok":
            *fields, seconds = value
            if seconds > timeout_s:  # answered, but later than allowed
                return Overran(f"verifier timeout after {timeout_s:g}s (answered after {seconds:.3g}s)")
            return Score(*fields)
        kind, message = value
        return _RemoteError(kind, message)

    def _take(self) -> _Worker:
        while self._idle:
            worker = self._idle.pop()
            if worker.process.poll() is None:
                return worker
            worker.kill()
        return _Worker(self.memory_mb)

    def _key(self, verifier: Callable[..., Score]) -> int:
        self._keys.setdefault(id(verifier), verifier)
        return id(verifier)

    def pids(self) -> list[int]:
        """The idle workers' process ids (for tests and clean-up checks)."""
        return [w.process.pid for w in self._idle]

    def close(self) -> None:
        """End every worker (and anything it started)."""
        while self._idle:
            self._idle.pop().kill()


class _RemoteError(Exception):
    """An exception the verifier raised in the worker, by type name and message."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message

    def __reduce__(self):
        return (_RemoteError, (self.kind, self.message))


def describe(exc: BaseException) -> str:
    """``TypeName: message`` of an exception a verifier call ended with."""
    return str(exc) if isinstance(exc, _RemoteError) else f"{type(exc).__name__}: {exc}"


_POOLS: dict[tuple[int, int | None], VerifierPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(workers: int, memory_mb: int | None) -> VerifierPool:
    """This process's pool for ``(workers, memory_mb)``, started on first use, closed at exit."""
    with _POOLS_LOCK:
        key = (workers, memory_mb)
        if key not in _POOLS:
            _POOLS[key] = VerifierPool(workers, memory_mb)
        return _POOLS[key]


def close_shared_pools() -> None:
    with _POOLS_LOCK:
        while _POOLS:
            _POOLS.popitem()[1].close()


atexit.register(close_shared_pools)


def default_workers() -> int:
    """Two workers, or one on a one-CPU machine: verification is cheap next to generation."""
    return max(1, min(2, os.cpu_count() or 1))


# --- the worker side ------------------------------------------------------------------------

def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: end of input on the pipe still ends the worker
        pass


def _serve() -> None:
    """The worker's loop: ``load`` a verifier (and prepare it), ``call`` it; answer each."""
    import resource

    _die_with_parent()
    memory_mb = int(sys.argv[1])
    into, out = sys.stdin.fileno(), os.dup(sys.stdout.fileno())
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # a verifier's prints must not corrupt the protocol
    if memory_mb:
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, hard))  # soft: a child may set its own
    import cloudpickle  # noqa: F401  (loads verifiers pickled by value)

    verifiers: dict[int, Callable[..., Score]] = {}
    while True:
        try:
            message = _receive(into, None)
        except EOFError:
            return
        if message[0] == "load":
            _, key, blob = message
            try:
                verifier = pickle.loads(blob)
                prepare_once(verifier)
                verifiers[key] = verifier
                _send(out, ("loaded", None))
            except BaseException as exc:  # noqa: BLE001  (reported to the parent)
                _send(out, ("failed", f"{type(exc).__name__}: {exc}"))
            continue
        _, key, text, ground_truth, options = message
        try:
            start = time.monotonic()
            score = verifiers[key](text, ground_truth, options)
            seconds = time.monotonic() - start
            _send(out, ("ok", (bool(score.correct), bool(score.formatted), score.answer, score.reason, seconds)))
        except BaseException as exc:  # noqa: BLE001  (a verifier error scores 0 with its reason)
            _send(out, ("error", (type(exc).__name__, str(exc)[:2000])))
