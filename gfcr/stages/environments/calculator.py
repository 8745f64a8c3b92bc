"""``calculator``: an arithmetic question answered with a calculator tool (the tool-using
tiny-arith task of issue 41).

The prompt is an arithmetic question with a ground truth (the ``arithmetic`` data source:
``What is 12 + 30? Answer:``). Each model turn either calls the calculator, with the ``calc``
parser's syntax (a turn ending in ``?``: ``" 12 + 30?"``), or answers. A call is answered with
the value and the answer cue, ``" 42 Answer:"`` (``" nAn Answer:"`` when the expression is not
``a op b`` of integers), and the episode goes on; an answer ends it, scored by the prompt's
verifier (reward 1 when correct, else 0). More than ``max_tool_calls`` calls end the episode
with reward 0. The observation texts keep to the ``tiny-arith`` tokenizer's characters.

``show_result: false`` withholds the tool's result: a call is answered with the answer cue alone
(``" Answer:"``), so the trajectory has the same shape without the tool's help (the contrast run
of issue 41, Must show 3).

Fidelity: gfcr's own: a calculator tool task in the spirit of the tool environments of
``verifiers`` (``ToolEnv``) and OpenEnv; no reference run.
"""

from __future__ import annotations

from gfcr.records import Prompt
from gfcr.stages.environments.base import Action, Observation
from gfcr.stages.environments.tools import calculate


class Calculator:
    """Arithmetic with a calculator tool (see the module docstring)."""

    def __init__(self, max_tool_calls: int = 3, show_result: bool = True):
        if max_tool_calls < 0:
            raise ValueError(f"calculator: max_tool_calls is {max_tool_calls}; it must be 0 or more")
        self.max_tool_calls, self.show_result = max_tool_calls, show_result
        self.prompt: Prompt | None = None
        self.calls = 0

    def reset(self, prompt: Prompt, seed: int) -> None:
        if prompt.verifier is None:
            raise ValueError(f"calculator: prompt {prompt.prompt_id} has no verifier (ground truth) to score "
                             "answers against; use a data source that gives one (`arithmetic`)")
        self.prompt, self.calls = prompt, 0

    def step(self, action: Action) -> Observation:
        call = action.tool_call
        if call is not None and call.name == "calc":
            self.calls += 1
            if self.calls > self.max_tool_calls:
                return Observation(done=True, reward=0.0, metadata={
                    "correct": False, "reason": f"more than {self.max_tool_calls} calculator calls"})
            value = calculate(str(call.arguments.get("expression", "")))
            shown = "nAn" if value is None else str(value)
            if not self.show_result:
                return Observation(" Answer:", metadata={"tool": "calc", "result": "withheld"})
            return Observation(f" {shown} Answer:", metadata={"tool": "calc", "result": shown})
        return self._answer(action.text)

    def _answer(self, text: str) -> Observation:
        from gfcr.stages.verifiers import VERIFIERS  # the verifiers package imports lazily too

        assert self.prompt is not None and self.prompt.verifier is not None, "step before reset"
        spec = self.prompt.verifier
        score = VERIFIERS.get(spec.name)(text, spec.ground_truth, dict(spec.options))
        return Observation(done=True, reward=float(score.correct), metadata={
            "correct": bool(score.correct), "reason": score.reason, "tool_calls": self.calls})
