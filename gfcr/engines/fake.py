"""TEST/FAKE engine: a deterministic pseudo-model behind the real Engine protocol, for runtime
and stage tests that need generation without loading a model.

The "model" gives each context (a tuple of token ids) logits that are a hash of the context:
``standard_normal(VOCAB)`` from a generator seeded by crc32 of its ids, with the
end-of-sequence logit raised as the context grows, so responses end at varied lengths. It
runs through the same ``decode_requests`` loop as the transformers engine, so per-request
params, prefixes, stop strings, per-row seeding, in-flight control and refill behave
exactly as there; ``score`` computes the same logits position by position. Tokens decode to
one character each (``FakeEngine.ALPHABET``); id 0 is the end of sequence (decodes to "").

Example:

>>> from gfcr.stages.engine import GenerationRequest, SamplingParams
>>> engine = FakeEngine()
>>> (c,), = engine.generate([GenerationRequest("r", engine.encode("12+3="), 1, SamplingParams(max_new_tokens=6))])
>>> len(c.token_ids) <= 6 and len(c.logprobs) == len(c.token_ids) and c.finish_reason in ("stop", "length")
True
"""

from __future__ import annotations

import time
import zlib
from typing import Sequence

import numpy as np
import torch

from gfcr.engines.decode import Ready, decode_requests, entropy_of
from gfcr.stages.engine import Completion, GenerationRequest, InFlightController, Scored, ScoreRequest


def fake_logits(context: Sequence[int], vocab: int, eos: int = 0) -> torch.Tensor:
    """``[vocab]`` float32 logits, a pure function of the context."""
    rng = np.random.default_rng(zlib.crc32(np.asarray(context, dtype=np.int64).tobytes()))
    logits = rng.standard_normal(vocab).astype(np.float32) * 2.0
    logits[eos] += 0.15 * len(context) - 2.0
    return torch.from_numpy(logits)


class HashBatch:
    """The rows in flight: just their contexts (the fake model has no cache to keep). Each prefill
    and decode step sleeps ``step_s``, standing in for a model's forward pass."""

    def __init__(self, vocab: int, step_s: float = 0.0):
        self.vocab, self.step_s, self.contexts = vocab, step_s, []  # list[list[int]]

    def add(self, contexts: list[tuple[int, ...]]) -> torch.Tensor:
        time.sleep(self.step_s)
        self.contexts += [list(c) for c in contexts]
        return torch.stack([fake_logits(c, self.vocab) for c in contexts])

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        time.sleep(self.step_s)
        for context, token in zip(self.contexts, tokens.tolist()):
            context.append(token)
        return torch.stack([fake_logits(c, self.vocab) for c in self.contexts])

    def keep(self, indices: list[int]) -> None:
        self.contexts = [self.contexts[i] for i in indices]


class FakeEngine:
    """TEST/FAKE: the Engine protocol over ``fake_logits``; ``policy_version`` is settable; ``step_s``:
    seconds each prefill and decode step sleeps (a step time that the machine's load barely moves,
    for tests of wall-clock figures)."""

    ALPHABET = "\0abcdefghijklmnopqrstuvwxyz0123456789+-=? "
    eos_token_id = 0

    def __init__(self, replica: str = "fake-0", max_batch: int = 256, step_s: float = 0.0):
        self.replica, self.max_batch, self.version, self.step_s = replica, max_batch, 0, step_s

    @property
    def policy_version(self) -> int:
        return self.version

    def sync_weights(self, policy_version: int) -> int:
        self.version = policy_version
        return 0

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.ALPHABET.index(ch) for ch in text)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.ALPHABET[i] for i in ids if i != self.eos_token_id)

    def generate(self, requests: Sequence[GenerationRequest], controller: InFlightController | None = None,
                 max_in_flight: int | None = None, ready: Ready | None = None) -> list[list[Completion]]:
        cap = min(self.max_batch, max_in_flight or self.max_batch)
        return decode_requests(requests, HashBatch(len(self.ALPHABET), self.step_s), eos=self.eos_token_id,
                               decode=self.decode, controller=controller, max_in_flight=cap, replica=self.replica,
                               ready=ready)

    def score(self, requests: Sequence[ScoreRequest]) -> list[Scored]:
        out = []
        for r in requests:
            ctx, resp = list(r.prompt_token_ids), list(r.response_token_ids)
            if not resp:
                out.append(Scored(np.zeros(0, np.float32), np.zeros(0, np.float32)))
                continue
            logits = torch.stack([fake_logits(ctx + resp[:t], len(self.ALPHABET)) for t in range(len(resp))])
            logp = torch.log_softmax(logits / (r.temperature or 1.0), dim=-1)  # [T, V]
            out.append(Scored(logp.gather(-1, torch.tensor(resp)[:, None])[:, 0].numpy().astype(np.float32),
                              entropy_of(logp).numpy().astype(np.float32)))
        return out
