"""``code``: write a program, see the tests fail, fix it (a code task with test feedback between turns).

The prompt is a code problem scored by the ``code`` verifier (the ``humaneval`` data source, or
any source whose prompts carry ``VerifierSpec("code", <test code>, {entry_point, prompt,
timeout_s, memory_mb, file_size_kb, sandbox})``). Each model turn is either

- a **submission**: the code is read from the turn as the ``code`` verifier reads it (the fenced
  block defining ``entry_point``, else the first fenced block, else the whole turn; a bare body
  completes the prompt's stub) and run with the tests (HumanEval's ``check(<entry_point>)``)
  through the tool-process boundary (``gfcr.stages.environments.sandboxed``: out of process,
  under the prompt's time, memory and file limits, no new processes, output capped at
  ``output_kb``). All tests pass: the episode ends with reward 1. They fail: the observation is
  the failure (``Failed: <the failing line> (<the reason>)``, the program's output, and "Fix the
  code and reply with the whole function."), cut at ``feedback_chars``, and the model tries
  again; after ``max_attempts`` failed submissions the
  episode ends with reward 0;
- a **tool call** ``python`` (with a tool parser, ``hermes``:
  ``<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>``): the code runs
  through the same boundary, without the tests; the observation is its output (capped) and how
  it ended. More than ``max_tool_calls`` calls end the episode with reward 0. Any other tool
  name (or a block that is not a call, ``invalid``) is answered with what was wrong, and counts
  as a call.

The reward comes from the tests alone, on the last submission: 1 or 0 (``Observation.reward``
on the final turn; none on the others). ``metadata`` says ``correct``, the ``reason`` (the
verifier's), ``attempts`` and ``tool_calls``.

Deviations: the feedback shows the failing test's line (HumanEval's tests are all visible: there
is no held-out test set, so a policy can read the expected values off the feedback); the
failure shown is the first failing assertion, as HumanEval's ``check`` stops there.

Fidelity: gfcr's own: test feedback between turns in the manner of multi-turn code RL
environments (verifiers' ``ToolEnv`` with a code tool, verl's sandbox-fusion tool); the tests
run by the ``code`` verifier (HumanEval's protocol); no reference run.
"""

from __future__ import annotations

from typing import Any

from gfcr.records import Prompt
from gfcr.stages.environments.base import Action, Observation
from gfcr.stages.environments.sandboxed import ProgramRun, ToolLimits, run_python
from gfcr.stages.environments.tools import INVALID
from gfcr.stages.verifiers.base import parse_options
from gfcr.stages.verifiers.code import CodeOptions, build_program, extract_code

TOOL = "python"
FIX = "Fix the code and reply with the whole function.\n"


class Code:
    """A code problem with test feedback between turns (see the module docstring)."""

    def __init__(self, max_attempts: int = 3, max_tool_calls: int = 3, output_kb: int = 16,
                 feedback_chars: int = 1000):
        for name, value, least in (("max_attempts", max_attempts, 1), ("max_tool_calls", max_tool_calls, 0),
                                   ("output_kb", output_kb, 1), ("feedback_chars", feedback_chars, 8)):
            if value < least:
                raise ValueError(f"code: {name} is {value}; it must be {least} or more")
        self.max_attempts, self.max_tool_calls = max_attempts, max_tool_calls
        self.output_kb, self.feedback_chars = output_kb, feedback_chars
        self.tests, self.options, self.limits = "", None, None
        self.attempts = self.calls = 0

    def reset(self, prompt: Prompt, seed: int) -> None:
        spec = prompt.verifier
        if spec is None or spec.name != "code":
            raise ValueError(f"code: prompt {prompt.prompt_id} is not a code problem (its verifier is "
                             f"{spec.name if spec else 'none'}); use a data source of code problems (`humaneval`)")
        self.options = parse_options(CodeOptions, dict(spec.options), "code")
        limits = {k: getattr(self.options, k) for k in ("timeout_s", "memory_mb", "file_size_kb", "sandbox")}
        self.limits = ToolLimits(**limits, output_kb=self.output_kb)
        self.tests, self.attempts, self.calls = spec.ground_truth, 0, 0

    def step(self, action: Action) -> Observation:
        if action.tool_call is None:
            return self._submit(action.text)
        self.calls += 1
        if self.calls > self.max_tool_calls:
            return self._end(0.0, f"more than {self.max_tool_calls} tool calls")
        call = action.tool_call
        if call.name != TOOL:
            why = call.arguments.get("error") if call.name == INVALID else f"there is no tool `{call.name}`"
            return Observation(fit(f"Tool call failed: {why}. ", "", f"The tool is `{TOOL}`, with arguments "
                                   "{\"code\": \"...\"}.\n", self.feedback_chars), metadata={"tool": call.name})
        run = run_python(str(call.arguments.get("code", "")), self._limits())
        ended = "ran to the end" if run.passed else run.reason
        return Observation(fit("Output:\n", run.output, f"\nExit: {ended}.\n", self.feedback_chars),
                           metadata={"tool": TOOL, "passed": run.passed, "reason": run.reason})

    def _submit(self, text: str) -> Observation:
        options = self._options()
        self.attempts += 1
        code, _ = extract_code(text, options.entry_point)
        run = (run_python(build_program(code, self.tests, options), self._limits()) if code.strip()
               else ProgramRun(False, "no code found"))
        if run.passed:
            return self._end(1.0, run.reason)
        if self.attempts >= self.max_attempts:
            return self._end(0.0, run.reason)
        return Observation(feedback(run, self.feedback_chars),
                           metadata={"reason": run.reason, "attempt": self.attempts})

    def _end(self, reward: float, reason: str) -> Observation:
        return Observation(done=True, reward=reward, metadata={
            "correct": reward == 1.0, "reason": reason, "attempts": self.attempts, "tool_calls": self.calls})

    def _options(self) -> CodeOptions:
        assert self.options is not None, "step before reset"
        return self.options

    def _limits(self) -> ToolLimits:
        assert self.limits is not None, "step before reset"
        return self.limits


def feedback(run: ProgramRun, limit: int) -> str:
    """What the model reads after a failed submission: the failing line and the reason, the output
    (cut so the whole fits in ``limit`` characters), what to do."""
    failed = f"Failed: {run.source} ({run.reason})\n" if run.source else f"Failed: {run.reason}\n"
    if not run.output.strip():
        return fit(failed, "", FIX, limit)
    return fit(failed + "Output:\n", run.output.rstrip() + "\n", FIX, limit)


def fit(head: str, body: str, tail: str, limit: int) -> str:
    """``head + body + tail`` in at most ``limit`` characters: the body is cut first (marked `` ...``),
    then the whole."""
    room = limit - len(head) - len(tail)
    if len(body) > room:
        body = body[:max(0, room - 5)] + " ...\n" if room >= 5 else ""
    text = head + body + tail
    return text if len(text) <= limit else text[:max(0, limit - 5)] + " ...\n"
