"""The child side of the ``code`` verifier's sandbox: run ``program.py`` under limits, report.

Run as a script, never imported by gfcr: ``python -I -S -B code_runner.py VERDICT_FD WORKDIR
MEMORY_BYTES CPU_SECONDS FILE_BYTES``, with ``WORKDIR`` (a fresh temporary directory holding
``program.py``, or ``/sandbox`` inside bubblewrap) as its working directory and an empty
environment. Before the program runs:

1. ``resource.setrlimit``, soft and hard: ``RLIMIT_AS`` (address space), ``RLIMIT_CPU`` (CPU
   seconds; the kernel kills past it), ``RLIMIT_FSIZE`` (largest file it may write; Python
   ignores ``SIGXFSZ``, so a longer write raises ``OSError``), ``RLIMIT_NPROC`` 0 (no new
   processes, for a non-root user), ``RLIMIT_CORE`` 0, ``RLIMIT_NOFILE`` 64;
2. the parent's death kills it (``PR_SET_PDEATHSIG``);
3. an audit hook (PEP 578, ``sys.addaudithook``; it cannot be removed) refuses: any socket,
   any new process (``os.fork``, ``os.system``, ``subprocess.Popen``, ``os.exec*``,
   ``os.posix_spawn``), signals to other processes, ``ctypes``, opening a file for writing
   outside ``WORKDIR``, opening a file for reading outside ``WORKDIR`` and Python's own
   installation (so the run directory, the home directory and the rest of the disk are out
   of reach), and removing, renaming or creating paths outside ``WORKDIR``. The first refusal
   is written to the verdict pipe at once, so the program fails even if it catches the
   ``PermissionError``.

The verdict is one JSON line on the pipe ``VERDICT_FD``: ``{"passed": true}`` or
``{"passed": false, "reason": "...", "line": N, "source": "..."}``: where the program failed (the
innermost line of ``program.py`` in the traceback, or a syntax error's line), when there is one
(the code environment shows it to the model as test feedback).

This is a guard against accidents and against the hostile-but-dumb output of a policy
being trained (infinite loops, huge allocations, fork bombs, stray writes, network calls),
NOT a security boundary against a determined attacker: code in the same interpreter can
write to the verdict pipe's descriptor, and a CPython bug, an unaudited C function
(``_posixsubprocess.fork_exec``) or an unblocked C extension can escape the audit hook. At the
``bwrap`` level (``gfcr.stages.verifiers.sandbox``) this runner runs inside a bubblewrap
namespace sandbox, which holds what gets past the hook: no network, no view of the disk
beyond the Python installation, nothing left running. Run untrusted code from the internet in
a container or VM all the same.
"""

import json
import os
import resource
import sys


def _limits(memory: int, cpu: int, file_size: int) -> None:
    for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu),
                         (resource.RLIMIT_FSIZE, file_size), (resource.RLIMIT_NPROC, 0),
                         (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 64)):
        resource.setrlimit(limit, (value, value))


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def _where(exc: BaseException, program_path: str, lines: list) -> dict:
    """``{"line", "source"}`` of the innermost line of the program the exception passed through, or {}."""
    lineno = exc.lineno if isinstance(exc, SyntaxError) else None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == program_path:
            lineno = tb.tb_lineno
        tb = tb.tb_next
    if not isinstance(lineno, int) or not 1 <= lineno <= len(lines):
        return {}
    return {"line": lineno, "source": lines[lineno - 1].strip()[:300]}


def main() -> None:
    verdict_fd, workdir = int(sys.argv[1]), os.path.realpath(sys.argv[2])
    memory, cpu, file_size = (int(a) for a in sys.argv[3:6])
    _die_with_parent()
    program_path = os.path.join(workdir, "program.py")
    with open(program_path, encoding="utf-8") as handle:
        source = handle.read()
    readable = tuple({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                     sys.base_exec_prefix)} | {workdir})
    devices = frozenset({"/dev/null", "/dev/urandom", "/dev/random", "/dev/zero"})
    refused: list = []

    def report(reason: str) -> None:
        os.write(verdict_fd, (json.dumps({"passed": False, "reason": reason}) + "\n").encode())

    def inside(path: object, roots: tuple) -> bool:
        if isinstance(path, int):
            return True  # an already-open descriptor
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            return False
        real = os.path.realpath(os.path.join(workdir, path))
        return real in devices or any(real == r or real.startswith(r + os.sep) for r in roots)

    def refuse(what: str) -> None:
        if not refused:
            refused.append(what)
            report(f"sandbox refused {what}")
        raise PermissionError(f"gfcr code sandbox: {what} is not allowed")

    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    blocked_prefixes = ("socket.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "ctypes.")
    blocked = {"os.fork", "os.forkpty", "os.system", "os.kill", "os.killpg", "signal.pthread_kill",
               "pty.spawn", "os.startfile", "resource.setrlimit", "resource.prlimit", "sys.addaudithook"}
    path_events = {"os.remove", "os.rmdir", "os.rename", "os.replace", "os.mkdir", "os.chmod", "os.chown",
                   "os.symlink", "os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move",
                   "shutil.copyfile", "shutil.copytree", "os.chdir", "os.chroot"}
    network_modules = {"socket", "_socket", "ssl", "_ssl", "ctypes", "_ctypes", "multiprocessing"}

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, 0))[:3]
            writing = any(c in (mode or "") for c in "wax+") or bool((flags or 0) & writes)
            if not inside(path, (workdir,) if writing else readable):
                refuse(f"{'writing' if writing else 'reading'} {path!r} outside the sandbox directory")
        elif event == "import" and args and args[0] in network_modules:
            refuse(f"importing {args[0]} (no network, no ctypes, no processes)")
        elif event in blocked or event.startswith(blocked_prefixes):
            refuse(f"{event} (no network, no new processes, no signals)")
        elif event in path_events and not all(inside(a, (workdir,)) for a in args[:2]
                                              if isinstance(a, (str, bytes))):
            refuse(f"{event} on {args[:2]!r} outside the sandbox directory")

    lines = source.splitlines()
    _limits(memory, cpu, file_size)
    try:
        code = compile(source, program_path, "exec")
    except (SyntaxError, ValueError) as exc:
        outcome = {"passed": False, "reason": f"{type(exc).__name__}: {exc}", **_where(exc, program_path, lines)}
        os.write(verdict_fd, (json.dumps(outcome) + "\n").encode())
        return
    sys.addaudithook(hook)
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except MemoryError as exc:
        outcome = {"passed": False, "reason": f"memory limit: MemoryError past {memory >> 20} MB",
                   **_where(exc, program_path, lines)}
    except AssertionError as exc:
        said = f": {str(exc)[:200]}" if str(exc) else ""
        outcome = {"passed": False, "reason": f"a test failed: AssertionError{said}", **_where(exc, program_path, lines)}
    except BaseException as exc:  # noqa: BLE001  (SystemExit too: the program must reach the end)
        outcome = {"passed": False, "reason": f"{type(exc).__name__}: {str(exc)[:300]}",
                   **_where(exc, program_path, lines)}
    else:
        outcome = {"passed": True}
    if refused:
        outcome = {"passed": False, "reason": f"sandbox refused {refused[0]}"}
    os.write(verdict_fd, (json.dumps(outcome) + "\n").encode())


if __name__ == "__main__":
    main()
