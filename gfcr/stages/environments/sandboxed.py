"""The tool-process boundary: a tool that runs code runs it out of process, under limits.

An environment's tool that executes model-written code (the ``code`` environment's ``python``
tool, its test runs) calls ``run_python``: the code runs in a fresh interpreter through the
``code`` verifier's sandbox (``gfcr.stages.verifiers.code.run_program``: bubblewrap namespaces
where they work here, else the guard alone; ``gfcr.stages.verifiers.sandbox``), with

- a wall-clock limit (``timeout_s``; the CPU rlimit a second past it): a call that sleeps or
  loops forever is killed, with everything it started;
- an address-space limit (``memory_mb``) and a file-size limit (``file_size_kb``; under bwrap
  the private ``/tmp`` and working directory are 64 MiB tmpfs besides): writing 2 GB ends in
  ``OSError``;
- a process limit: no new process (``RLIMIT_NPROC`` 0, an audit hook refusing ``fork`` and
  ``exec``, signals to other processes; under bwrap a PID namespace that sees nothing of this
  machine's processes and ends with the call);
- an output limit (``output_kb``): stdout and stderr are read as they come; past the cap the
  process is killed at once and the output kept so far is what the tool returns.

What the boundary does not hold at the ``guard`` level is stated in ``sandbox``'s docstring
(code that gets past the audit hook); docs/reliability.md has the table.

>>> run = run_python("print(6 * 7)", ToolLimits(timeout_s=5.0))
>>> run.passed, run.output
(True, '42\\n')
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from gfcr.stages.verifiers.code import ProgramRun, run_program
from gfcr.stages.verifiers.sandbox import SandboxLimits


class ToolLimits(SandboxLimits):
    """The code verifier's limits (``timeout_s``, ``memory_mb``, ``file_size_kb``, ``sandbox``) and the
    output a tool call may return."""

    output_kb: Annotated[int, Field(ge=1, le=1 << 20, description="stdout and stderr kept, KiB; past "
                                    "it the process is killed")] = 64


def run_python(source: str, limits: ToolLimits) -> ProgramRun:
    """``source`` run as a program under ``limits``: whether it ran to the end, why not, where it
    failed, and its output (capped at ``output_kb``)."""
    return run_program(source, limits, limits.output_kb << 10)


__all__ = ["ProgramRun", "ToolLimits", "run_python"]
