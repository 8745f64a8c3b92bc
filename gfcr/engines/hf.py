"""The transformers engine: batched sampling on CPU from the policy's own model object.

Each call flattens the requests into ``sum(n)`` rows, left-pads the prompts, and runs one
``model.generate`` (sampling with ``top_k=0``, so only temperature and top-p shape the
distribution). The behaviour log-probability of each token is taken from the raw logits of
that decoding step, tempered by the temperature and *not* truncated by top-p (the
distribution the update's ratio is computed against). A row ends at the end-of-sequence
token (kept, since the policy chose it) or at a stop string; its padding is cut off.

Sampling is seeded: ``torch.manual_seed(params.seed)`` before each call, so a run that
resumes from a checkpoint samples exactly what an uninterrupted run would. The seed and the
draws use torch's global generator, so one lock serialises sampling across threads: runs in
parallel threads of one process (``gfcr ablate --parallel``) stay reproducible.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import numpy as np
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from gfcr.engines.policy import HFPolicy
from gfcr.stages.resources import Completion, GenerationRequest, SamplingParams


_SAMPLING = threading.Lock()  # torch's global generator: seeding and drawing must not interleave


class TransformersEngine:
    """Samples from ``policy.model`` in-process; ``sync_weights`` has nothing to do."""

    def __init__(self, policy: HFPolicy, replica: str = "hf-0", max_batch: int = 256):
        self.policy, self.replica, self.max_batch = policy, replica, max_batch

    @property
    def policy_version(self) -> int:
        return self.policy.version

    def sync_weights(self, policy_version: int) -> None:
        """The engine shares the trained model object: its weights are always current."""

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[list[Completion]]:
        rows = [r.prompt_token_ids for r in requests for _ in range(r.n)]
        completions: list[Completion] = []
        with _SAMPLING:
            torch.manual_seed(params.seed)
            for start in range(0, len(rows), self.max_batch):
                completions.extend(self._generate_rows(rows[start:start + self.max_batch], params))
        out, i = [], 0
        for r in requests:
            out.append(completions[i:i + r.n])
            i += r.n
        return out

    @torch.no_grad()
    def _generate_rows(self, rows: list[tuple[int, ...]], params: SamplingParams) -> list[Completion]:
        if not rows:
            return []
        tok, model = self.policy.tokenizer, self.policy.model
        input_ids, attention = left_pad(rows, tok.pad_token_id)
        greedy = params.temperature == 0
        kwargs = dict(do_sample=not greedy, max_new_tokens=params.max_new_tokens,
                      eos_token_id=self.policy.eos_token_id, pad_token_id=tok.pad_token_id,
                      return_dict_in_generate=True, output_logits=True)
        if not greedy:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=0)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if params.stop:
            kwargs.update(stopping_criteria=StoppingCriteriaList(
                [StopOnStrings(params.stop, input_ids.shape[1], self.policy.decode)]))
        was_training = model.training
        model.eval()
        try:
            out = model.generate(input_ids=input_ids, attention_mask=attention, **kwargs)
        finally:
            model.train(was_training)
        new = out.sequences[:, input_ids.shape[1]:]  # [B, T]
        logits = torch.stack(out.logits, dim=1).float()  # [B, T, V]
        if not greedy:
            logits = logits / params.temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [B, T]
        return [self._completion(new[b], logprobs[b], params) for b in range(new.shape[0])]

    def _completion(self, tokens: torch.Tensor, logprobs: torch.Tensor, params: SamplingParams) -> Completion:
        """Cut a generated row at its end: a stop string, else the end-of-sequence token (kept),
        else ``max_new_tokens``. Whatever follows is padding (which may equal the EOS id)."""
        ids = tokens.tolist()
        length, reason = len(ids), "length"
        eos = self.policy.eos_token_id
        if eos in ids:
            length, reason = ids.index(eos) + 1, "stop"
        if params.stop:
            stop_at = first_stop(ids[:length], params.stop, self.policy.decode)
            if stop_at is not None:
                length, reason = stop_at, "stop"
        text = self.policy.decode(ids[:length])
        return Completion(tuple(ids[:length]), logprobs[:length].numpy().astype(np.float32), reason, text,
                          self.replica)


def first_stop(ids: list[int], stop: tuple[str, ...], decode: Callable[[list[int]], str]) -> int | None:
    """The length of the shortest prefix of ``ids`` whose text contains a stop string."""
    if not any(s in decode(ids) for s in stop):
        return None
    for end in range(1, len(ids) + 1):
        if any(s in decode(ids[:end]) for s in stop):
            return end
    return None


class StopOnStrings(StoppingCriteria):
    """Per-row stop once the newly generated text contains a stop string. (transformers' own
    ``stop_strings`` needs a tokenizer whose vocabulary it can map to bytes; character-level
    tokenizers such as tiny-arith's fail there.)"""

    def __init__(self, stop: tuple[str, ...], prompt_width: int, decode: Callable[[list[int]], str]):
        self.stop, self.prompt_width, self.decode = stop, prompt_width, decode
        self.window = max(len(s) for s in stop) + 2  # a stop string of n characters spans <= n tokens

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        new = input_ids[:, self.prompt_width:]
        tails = [self.decode(row[-self.window:].tolist()) for row in new]
        return torch.tensor([any(s in t for s in self.stop) for t in tails], dtype=torch.bool)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``[B, L]`` token ids and attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids, mask
