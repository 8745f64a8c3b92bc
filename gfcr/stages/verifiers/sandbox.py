"""Where the ``code`` verifier's program runs: inside a bubblewrap namespace sandbox, or under the guard alone.

Two levels, both with ``code_runner``'s guard (rlimits and an audit hook) inside:

- ``guard``: a fresh ``python -I -S -B`` in a new temporary directory on this machine. It stops a
  policy's accidents and dumb hostility, but it is no boundary: code that gets past the audit
  hook (a C-level fork such as ``_posixsubprocess.fork_exec``, which raises no audit event; an
  unblocked C extension; a CPython bug) sees the machine as the run's user sees it, network,
  run directory and home included, and a process it starts outlives the verdict when the run's
  user is root (``RLIMIT_NPROC`` does not bind root).
- ``bwrap``: the same, run by bubblewrap (``bwrap``, Debian/Ubuntu package ``bubblewrap``) in new
  user, PID, network, IPC, UTS and cgroup namespaces with every capability dropped: no network
  device but a loopback of its own (this machine's loopback services are out of reach); a
  filesystem of its own holding only a read-only view of the system's ``/usr`` (and ``/bin``,
  ``/lib*``, ``/sbin``) and of the Python installation, a private ``/dev``, and two size-capped
  tmpfs, ``/tmp`` and the working directory ``/sandbox`` (holding a read-only ``program.py``);
  so the run directory, the home directory and the rest of the disk do not exist in there.
  ``--die-with-parent`` and the PID namespace end every process it started when the runner ends
  or is killed; ``--new-session`` detaches it from the terminal; ``--disable-userns`` (where this
  bwrap has it) forbids nested user namespaces.
- ``auto`` (the default): ``bwrap`` where it works on this machine (checked once per process by
  running ``python -c pass`` in that sandbox), else ``guard``; ``gfcr validate`` warns when it
  falls back (``isolation_warning``) and says how to get the stronger level.

bubblewrap needs unprivileged user namespaces (``kernel.unprivileged_userns_clone``, Ubuntu's
AppArmor ``kernel.apparmor_restrict_unprivileged_userns``) when the run's user is not root.
docs/reliability.md has the table of what each level stops.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from typing import Annotated, Literal

from pydantic import Field

from gfcr.stages.verifiers.base import VerifierOptions

SandboxLevel = Literal["auto", "bwrap", "guard"]

INSIDE_WORKDIR = "/sandbox"  # the program's working directory, inside the bwrap sandbox
INSIDE_RUNNER = "/gfcr/code_runner.py"
TMPFS_BYTES = 64 << 20  # each of /tmp and /sandbox: a program cannot fill the disk, or memory past this
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")  # the interpreter's shared libraries
INSTALL_FIX = ("install bubblewrap (`apt-get install bubblewrap`, or `make sysdeps`); as a user other than root "
               "it also needs unprivileged user namespaces (`sysctl kernel.unprivileged_userns_clone=1`; on Ubuntu "
               "`sysctl kernel.apparmor_restrict_unprivileged_userns=0`)")


class SandboxLimits(VerifierOptions):
    """Where and under which limits a program runs (``gfcr.stages.verifiers.code.run_program``): the code
    verifier's options, and the tool-process limits of the environments that run code
    (``gfcr.stages.environments.sandboxed``)."""

    timeout_s: Annotated[float, Field(gt=0.0, le=600.0, description="wall-clock seconds for the program")] = 3.0
    memory_mb: Annotated[int, Field(ge=64, le=1 << 20, description="address-space limit, MiB")] = 512
    file_size_kb: Annotated[int, Field(ge=0, le=1 << 30, description="largest file it may write, KiB")] = 1024
    sandbox: SandboxLevel = Field("auto", description="bwrap (a namespace sandbox), guard (rlimits and an audit "
                                  "hook alone), or auto (bwrap where it works)")


class SandboxUnavailable(RuntimeError):
    """``sandbox: bwrap`` was asked for and bubblewrap cannot run a sandbox on this machine: why, and the fix."""

    def __init__(self, message: str, fix: str):
        super().__init__(f"{message}; fix: {fix}")
        self.message, self.fix = message, fix


def interpreter() -> str:
    """The real Python binary (a venv's ``bin/python`` is a link into the installation, which is what is mounted)."""
    return os.path.realpath(sys.executable)


def python_roots() -> list[str]:
    """The Python installation's directories, each mounted read-only at its own path."""
    roots: list[str] = []
    for path in sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
                       | {os.path.dirname(interpreter())}):
        if not any(path == r or path.startswith(r + os.sep) for r in (*roots, *SYSTEM_DIRS)):
            roots.append(path)
    return roots


def _system_view() -> list[str]:
    """bwrap arguments giving a read-only view of the system directories, links kept as links."""
    args: list[str] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def bwrap_prefix(program: str, runner: str) -> list[str]:
    """The ``bwrap ... --`` words that run a command in the sandbox, ``program`` (a host file) read-only
    at ``/sandbox/program.py`` and ``runner`` at ``/gfcr/code_runner.py``."""
    executable = shutil.which("bwrap") or "bwrap"
    args = [executable, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", *(["--disable-userns"] if _has_disable_userns(executable) else []),
            "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv", *_system_view()]
    for root in python_roots():
        args += ["--ro-bind", root, root]
    args += ["--dev", "/dev", "--size", str(TMPFS_BYTES), "--tmpfs", "/tmp",
             "--size", str(TMPFS_BYTES), "--tmpfs", INSIDE_WORKDIR,
             "--ro-bind", program, f"{INSIDE_WORKDIR}/program.py", "--ro-bind", runner, INSIDE_RUNNER,
             "--chdir", INSIDE_WORKDIR, "--"]
    return args


@functools.cache
def _has_disable_userns(executable: str) -> bool:
    try:
        return "--disable-userns" in subprocess.run([executable, "--help"], capture_output=True, text=True,
                                                    timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False


@functools.cache
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot run the sandbox on this machine, or None when it can (checked once per process)."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (`bwrap`) is not installed"
    probe = [*bwrap_prefix(os.devnull, os.devnull), interpreter(), "-I", "-S", "-c", "pass"]
    try:
        done = subprocess.run(probe, env={}, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bubblewrap failed to start: {exc}"
    if done.returncode != 0:
        said = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return f"bubblewrap cannot make a sandbox here: {said[-1] if said else f'exit status {done.returncode}'}"
    return None


def resolve(level: SandboxLevel) -> Literal["bwrap", "guard"]:
    """The level a program runs at: ``auto`` is ``bwrap`` where it works, else ``guard``.
    ``bwrap`` where it does not work is a SandboxUnavailable saying why and the fix."""
    if level == "guard":
        return "guard"
    problem = bwrap_problem()
    if problem is None:
        return "bwrap"
    if level == "bwrap":
        raise SandboxUnavailable(f"`sandbox: bwrap`, but {problem}", f"{INSTALL_FIX}, or write `sandbox: auto` to "
                                 "fall back to the guard (rlimits and an audit hook, no namespace)")
    return "guard"


def isolation_warning(level: SandboxLevel) -> tuple[str, str] | None:
    """(what, fix) when programs would run under the guard alone, for ``gfcr validate`` to print; None under bwrap.
    Raises SandboxUnavailable for ``sandbox: bwrap`` that cannot be had."""
    if resolve(level) == "bwrap":
        return None
    why = "`sandbox: guard` was asked for" if level == "guard" else bwrap_problem()
    return (f"the `code` verifier's programs run under the guard alone (rlimits and an audit hook in a fresh "
            f"interpreter, no namespace: {why}); it stops a policy's accidents, not code that gets past the "
            "audit hook (docs/reliability.md, 'The code verifier's sandbox')",
            INSTALL_FIX + " and leave `sandbox: auto`" if level == "auto" else "write `sandbox: auto` (the default)")
