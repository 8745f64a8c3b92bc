"""The ids of an environment turn: what the policy reads between two of its own turns.

The model's own ids are never re-tokenised; only the environment's text is tokenised, on its
own, and appended. What that text becomes depends on the policy's tokenizer:

- no chat template (``tiny-arith``): the observation's text as it is, no special tokens;
- a chat template (SmolLM2 and other instruct models): the template's own rendering of the
  turn boundary, read off a stand-in conversation. With ``user: U``, ``assistant: M``, the
  template renders ``...M<close>`` and, with the observation appended as a ``role`` message and
  the generation prompt, ``...M<close><open role>obs<close><open assistant>``. The environment
  turn is ``<close>`` (the end of the model's turn as the template writes it) followed by the
  rest; when the model's turn already ended with the end-of-sequence token that ``<close>``
  starts with (``<|im_end|>``), that token is not repeated. Special tokens in the text are
  tokenised as the special tokens they name, so the ids are the ones the template gives the
  whole conversation (a test checks it against ``apply_chat_template`` of the whole).
"""

from __future__ import annotations

from typing import Any, Sequence

STAND_IN = "\x00M\x00"  # an assistant message no template rewrites or contains


class TurnBoundary:
    """Tokenises environment turns for one policy (see the module docstring)."""

    def __init__(self, policy: Any, role: str = "user"):
        self.tokenizer, self.role = policy.tokenizer, role
        self.eos_id = int(policy.eos_token_id)
        self.template = self.tokenizer.chat_template is not None  # as the policy's encode decides
        if self.template:
            self.close, self.open = self._boundary()

    def _boundary(self) -> tuple[str, str]:
        """``(close, open)``: the text the template puts after an assistant message, and what it puts
        between that and an observation's text; the observation's own close and the generation
        prompt follow it, rendered per observation (``ids``)."""
        tok, messages = self.tokenizer, [{"role": "user", "content": "U"}, {"role": "assistant", "content": STAND_IN}]
        base = tok.apply_chat_template(messages, tokenize=False)
        if STAND_IN not in base:
            raise ValueError("the policy's chat template does not render an assistant message as written, so the "
                             "boundary between turns cannot be read off it")
        return base[base.index(STAND_IN) + len(STAND_IN):], base

    def text(self, observation: str, model_ids: Sequence[int]) -> str:
        """The text of the environment turn after a model turn whose ids are ``model_ids``."""
        if not self.template:
            return observation
        messages = [{"role": "user", "content": "U"}, {"role": "assistant", "content": STAND_IN},
                    {"role": self.role, "content": observation}]
        full = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not full.startswith(self.open):
            raise ValueError(f"the policy's chat template renders a conversation with a `{self.role}` turn "
                             "differently from its start, so the boundary between turns cannot be read off it")
        delta = self.close + full[len(self.open):]
        eos = self.tokenizer.convert_ids_to_tokens(self.eos_id)
        if model_ids and model_ids[-1] == self.eos_id and delta.startswith(eos):
            delta = delta[len(eos):]  # the model closed its turn itself
        return delta

    def ids(self, observation: str, model_ids: Sequence[int]) -> tuple[list[int], str]:
        """The environment turn's ids and the text they were tokenised from."""
        text = self.text(observation, model_ids)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), text
