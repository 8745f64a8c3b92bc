"""The embedded Prefect server dies with the gfcr process that started it.

Without ``PREFECT_API_URL``, Prefect starts an ephemeral API server (a ``uvicorn`` child
process, about 200 MB) and stops it at exit (``atexit``). A SIGKILL, an out-of-memory kill or
a crash skips ``atexit``: the server is re-parented to init and runs for ever.

``guard_embedded_server`` wraps the method Prefect starts that child with, so that each server
it starts gets a guard: a tiny Python process (``python -I -S``, standard library only, a few
MB) that is a child of the gfcr process and watches two things:

- the server, through a pidfd (``os.pidfd_open``, Linux 5.3+): when the server ends, the guard
  ends;
- its own parent: when ``os.getppid()`` is no longer the gfcr process (it died, however it
  died), the guard sends the server SIGTERM, then SIGKILL after ``GRACE_S``, and ends.

A pidfd names one process, never a later one with a reused pid, so the guard cannot signal
anything but the server it was started for. Checking ``getppid`` (not ``PR_SET_PDEATHSIG``)
is deliberate: a death signal fires when the *thread* that forked the child exits, and Prefect
may start its server from a short-lived thread. The guard ignores SIGINT: a Ctrl-C is for the
run, which then stops its server itself.

Where pidfds are missing (not Linux, an old kernel) nothing is guarded, as before.

The server also starts in a session of its own (``start_new_session``), out of the terminal's
process group: a Ctrl-C there interrupts the run, which reports its state to the server and
then stops it, instead of taking the server down under the run (uvicorn stops on SIGINT, and
the run's last API calls then fail with connection errors). The guard still ends it however
the run ends.

The other way round, a server that dies under a living run (killed by its pid, by the
out-of-memory killer) is started again: a supervisor thread of the run waits on each server it
started and, unless Prefect is stopping it (``SubprocessASGIServer.stop``, at exit), starts a new
one on the same port and database, at most ``MAX_RESTARTS`` times in a process. The run's Prefect
clients retry a refused connection for about a minute, so the flow run's final state reaches the
new server and the run finishes; the task runs' state events sent while no server was there are
lost to the UI (the run directory has everything). Without a restart, the run's last Prefect call
would fail after its retries, and the process would then spend about 7 s per queued event trying
to send it at exit.

Deviations: this wraps ``SubprocessASGIServer._run_uvicorn_command`` and ``stop``, methods of
Prefect 3 (checked on 3.7 and 3.9; the first is private): ``_run_uvicorn_command`` is called with
the server object and returns the ``subprocess.Popen`` of the server, on ``server.port``. Should a
Prefect release rename it, ``guard_embedded_server`` leaves Prefect as it is (returns ``False``)
rather than fail a run.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time
import types
import weakref
from typing import Any, Callable

GRACE_S = 5.0  # after SIGTERM, how long the server has to stop before SIGKILL
POLL_MS = 250  # how often the guard looks at its parent
MAX_RESTARTS = 3  # embedded servers started again after dying under a run, per process
restarts: list[int] = []  # the pids of the servers started again, in order (what a test or a log reads)
_starting = threading.Condition()  # notified when a restarted server answers (or gives up)
_pending: set[int] = set()  # pids of restarted servers not yet answering
_stopping: weakref.WeakSet[Any] = weakref.WeakSet()  # the Prefect servers Prefect itself is stopping (not a death to recover from)

_GUARD = """\
import os, select, signal, sys
parent, server, grace_ms, poll_ms = (int(a) for a in sys.argv[1:5])
signal.signal(signal.SIGINT, signal.SIG_IGN)
try:
    fd = os.pidfd_open(server)
except OSError:
    sys.exit(0)
ended = select.poll()
ended.register(fd, select.POLLIN)
while os.getppid() == parent:
    if ended.poll(poll_ms):
        sys.exit(0)
try:
    signal.pidfd_send_signal(fd, signal.SIGTERM)
    if not ended.poll(grace_ms):
        signal.pidfd_send_signal(fd, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


def guards_available() -> bool:
    """Whether this system can guard a process (a Linux with pidfds)."""
    return hasattr(os, "pidfd_open") and sys.platform.startswith("linux")


def start_guard(server_pid: int) -> subprocess.Popen | None:
    """Start a guard that stops ``server_pid`` when this process dies; None where unsupported."""
    if not guards_available():
        return None
    return subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _GUARD, str(os.getpid()), str(server_pid),
         str(int(GRACE_S * 1000)), str(POLL_MS)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)


@functools.cache
def guard_embedded_server() -> bool:
    """Give every embedded Prefect server this process starts from now on a guard (once).
    Imports Prefect's server module (the Prefect client imports it anyway to start one)."""
    if not guards_available():
        return False
    from prefect.server.api.server import SubprocessASGIServer

    launch = getattr(SubprocessASGIServer, "_run_uvicorn_command", None)
    if launch is None:
        return False

    @functools.wraps(launch)
    def guarded(self: Any) -> Any:
        process = launch(self)
        pid = getattr(process, "pid", None)
        if isinstance(pid, int):
            start_guard(pid)
            _supervise(self, process, lambda: guarded(self))
        return process

    stop = SubprocessASGIServer.stop

    @functools.wraps(stop)
    def stopping(self: Any) -> None:
        _stopping.add(self)  # Prefect ends it (at exit): not a death to recover from
        stop(self)

    SubprocessASGIServer._run_uvicorn_command = guarded
    SubprocessASGIServer.stop = stopping
    _own_session(sys.modules[SubprocessASGIServer.__module__])
    return True


def _supervise(server: Any, process: subprocess.Popen, relaunch: Callable[[], subprocess.Popen]) -> None:
    """Start a daemon thread that starts ``server`` again (``relaunch``) if ``process`` dies while
    Prefect still uses it; the new server gets the dead one's CPU priority."""

    def watch() -> None:
        priority = 0
        while process.poll() is None:
            try:
                priority = os.getpriority(os.PRIO_PROCESS, process.pid)
            except OSError:
                pass
            time.sleep(POLL_MS / 1000)
        if process.returncode == 3:  # uvicorn found its port taken at start-up: Prefect picks another itself
            return
        if server in _stopping or server.server_process is not process:
            return
        if len(restarts) >= MAX_RESTARTS or not server.running:
            return
        new = relaunch()
        server.server_process = new
        restarts.append(new.pid)
        try:
            os.setpriority(os.PRIO_PROCESS, new.pid, priority)
        except OSError:
            pass
        with _starting:
            _pending.add(new.pid)
        try:
            _await_health(f"{server.api_url}/health", new)
        finally:
            with _starting:
                _pending.discard(new.pid)
                _starting.notify_all()

    threading.Thread(target=watch, name="gfcr-prefect-server-supervisor", daemon=True).start()


def _await_health(url: str, process: subprocess.Popen, timeout: float = 600.0) -> None:
    """Return once the server at ``url`` answers (or has died, or ``timeout`` passed)."""
    import urllib.request

    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1: never through a proxy
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            with direct.open(url, timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)


def wait_for_restarts(timeout: float) -> None:
    """Wait (at most ``timeout`` s) until every embedded server started again answers, so that the
    run's last Prefect calls (the flow run's final state) find one, however slowly it starts."""
    with _starting:
        _starting.wait_for(lambda: not _pending, timeout=timeout)


def _own_session(module: Any) -> None:
    """Make ``module``'s ``subprocess.Popen`` start its children in a new session: ``module``'s
    reference to ``subprocess`` becomes a copy whose ``Popen`` sets ``start_new_session``."""
    own = types.SimpleNamespace(**vars(subprocess))
    own.Popen = functools.partial(subprocess.Popen, start_new_session=True)
    module.subprocess = own
