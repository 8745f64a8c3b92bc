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

Deviations: this wraps ``SubprocessASGIServer._run_uvicorn_command``, a private method of
Prefect 3 (checked on 3.9): it is called with the server object and returns the
``subprocess.Popen`` of the server. Should a Prefect release rename it, ``guard_embedded_server``
leaves Prefect as it is (returns ``False``) rather than fail a run.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import types
from typing import Any

GRACE_S = 5.0  # after SIGTERM, how long the server has to stop before SIGKILL
POLL_MS = 250  # how often the guard looks at its parent

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
        return process

    SubprocessASGIServer._run_uvicorn_command = guarded
    _own_session(sys.modules[SubprocessASGIServer.__module__])
    return True


def _own_session(module: Any) -> None:
    """Make ``module``'s ``subprocess.Popen`` start its children in a new session: ``module``'s
    reference to ``subprocess`` becomes a copy whose ``Popen`` sets ``start_new_session``."""
    own = types.SimpleNamespace(**vars(subprocess))
    own.Popen = functools.partial(subprocess.Popen, start_new_session=True)
    module.subprocess = own
