"""The transformers engine: a KV-cached decode loop on CPU over the policy's own model object.

``generate`` runs ``gfcr.engines.decode.decode_requests`` (rows, per-row seeded sampling,
stop strings, in-flight control, refill) over a ``KVBatch``:

- new rows are prefilled together (left-padded, position ids from the attention mask) into
  a fresh ``DynamicCache``, then merged into the running one (the shorter side is padded on
  the left with zero keys and attention-mask zeros);
- each step feeds one token per live row and computes only the last position's logits
  (``logits_to_keep=1``: ``[B, V]``, never ``[B, T, V]``);
- rows that end leave the batch (``DynamicCache.batch_select_indices``), and cache columns
  that only padded the rows that left are cropped, so they stop costing compute.

``score`` returns the per-token log-probs and entropies of given responses (tempered by the
request's temperature; 0 means untempered, as greedy sampling records), by one of two paths
(``score_path``, the policy spec's ``score_path``):

- ``forward`` (the default): one forward pass per batch of (prompt, response) pairs (at most
  ``max_batch``, and as many as keep the batch's ``[rows, T, V]`` logits under 512 MiB). Fast;
  it sums in another order than the decode step, so on SmolLM2's 30 float32 layers its
  log-probs sit up to ~2e-5 from the sampling ones (tiny-arith: ~1e-7);
- ``decode``: the responses are teacher-forced through the decode loop itself
  (``score_requests``), one KV-cached step per token. Requests scored in the order they were
  sampled get their sampling log-probs bit for bit; it costs a forward step per token.

Each row samples from its own seeded stream, so torch's global generator is not touched;
one lock still serialises generation across threads (``gfcr ablate --parallel``): a
module's forward and its train/eval switch are not thread-safe.
"""

from __future__ import annotations

import inspect
import threading
from typing import Literal, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from gfcr.engines.decode import Ready, decode_requests, entropy_of, first_stop, score_requests  # noqa: F401  (first_stop: vLLM's)
from gfcr.engines.policy import HFPolicy
from gfcr.stages.engine import Completion, GenerationRequest, InFlightController, Scored, ScoreRequest

SCORE_LOGITS = 2**27  # floats of [rows, T, V] logits one score forward may hold (512 MiB)
# one model forward at a time across threads of one process; re-entrant, so an in-flight controller
# may call the engine from inside a generate call (``control.truncate_steps``' trial answers)
_GENERATING = threading.RLock()


ScorePath = Literal["forward", "decode"]


class TransformersEngine:
    """Samples from ``policy.model`` in-process; ``sync_weights`` has nothing to do.
    ``max_batch`` caps the rows decoded at once (and the rows one ``score`` pass holds);
    ``score_path`` picks how ``score`` runs (the module docstring)."""

    def __init__(self, policy: HFPolicy, replica: str = "hf-0", max_batch: int = 256,
                 score_path: ScorePath = "forward"):
        self.policy, self.replica, self.max_batch, self.score_path = policy, replica, max_batch, score_path

    @property
    def policy_version(self) -> int:
        return self.policy.version

    def sync_weights(self, policy_version: int) -> int:
        """The engine shares the trained model object: its weights are always current."""
        return 0

    @torch.no_grad()
    def generate(self, requests: Sequence[GenerationRequest], controller: InFlightController | None = None,
                 max_in_flight: int | None = None, ready: Ready | None = None) -> list[list[Completion]]:
        cap = min(self.max_batch, max_in_flight or self.max_batch)
        with _GENERATING, evaluating(self.policy.model):
            batch = KVBatch(self.policy.model, self.policy.tokenizer.pad_token_id)
            return decode_requests(requests, batch, eos=self.policy.eos_token_id, decode=self.policy.decode,
                                   controller=controller, max_in_flight=cap, replica=self.replica, ready=ready)

    @torch.no_grad()
    def score(self, requests: Sequence[ScoreRequest]) -> list[Scored]:
        if self.score_path == "decode":
            with _GENERATING, evaluating(self.policy.model):
                batch = KVBatch(self.policy.model, self.policy.tokenizer.pad_token_id)
                return score_requests(requests, batch, eos=self.policy.eos_token_id, decode=self.policy.decode,
                                      max_in_flight=self.max_batch)
        out: list[Scored] = []
        width = max((len(r.response_token_ids) for r in requests), default=0) + 1
        rows = max(1, min(self.max_batch, SCORE_LOGITS // (width * self.policy.model.config.vocab_size)))
        with _GENERATING, evaluating(self.policy.model):
            for start in range(0, len(requests), rows):
                out += score_batch(self.policy.model, requests[start:start + rows], self.policy.tokenizer.pad_token_id)
        return out


class evaluating:
    """Eval mode for the duration (no dropout), then the model's previous mode."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.was_training = model, model.training

    def __enter__(self) -> None:
        self.model.eval()

    def __exit__(self, *exc: object) -> None:
        self.model.train(self.was_training)


class KVBatch:
    """The rows in flight: one ``DynamicCache`` and its left-padded attention mask (``[B, L]``)."""

    def __init__(self, model: torch.nn.Module, pad_id: int):
        self.model, self.pad_id = model, pad_id
        self.device = next(model.parameters()).device
        self.cache_kw = cache_keyword(model)
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [B, L] long

    def add(self, contexts: list[tuple[int, ...]]) -> torch.Tensor:
        ids, mask = left_pad(contexts, self.pad_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=True,
                         logits_to_keep=1, **{self.cache_kw: cache})
        self._merge(cache, mask)  # the forward pass filled ``cache`` in place
        return out.logits[:, -1].float().cpu()  # [k, V]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.mask is not None
        position = self.mask.sum(-1, keepdim=True)  # [B, 1]: real tokens so far
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        out = self.model(input_ids=tokens[:, None].to(self.device), attention_mask=self.mask, position_ids=position,
                         use_cache=True, logits_to_keep=1, **{self.cache_kw: self.cache})
        return out.logits[:, -1].float().cpu()  # [B, V]

    def keep(self, indices: list[int]) -> None:
        if not indices:
            self.cache = self.mask = None
            return
        assert self.cache is not None and self.mask is not None
        index = torch.tensor(indices, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        unused = int((self.mask.sum(0) == 0).long().cumprod(0).sum())  # leading columns no kept row needs
        if unused:
            self.mask = self.mask[:, unused:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., unused:, :], layer.values[..., unused:, :]

    def _merge(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        if self.cache is None or self.mask is None:
            self.cache, self.mask = cache, mask
            return
        width = max(self.mask.shape[1], mask.shape[1])
        self.mask = torch.cat([pad_left(self.mask, width, dim=1), pad_left(mask, width, dim=1)])
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([pad_left(mine.keys, width, dim=2), pad_left(theirs.keys, width, dim=2)])
            mine.values = torch.cat([pad_left(mine.values, width, dim=2), pad_left(theirs.values, width, dim=2)])


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward argument that takes the KV cache: ``cache`` since transformers renamed it,
    ``past_key_values`` before. Passing the other name is no error there: it would be swallowed
    by ``**kwargs`` and every step would run without its context."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Zero-pad ``t`` on the left of ``dim`` up to ``width``."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [missing, 0]
    return F.pad(t, pad)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows: 0 at each row's first real token."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def score_batch(model: torch.nn.Module, requests: Sequence[ScoreRequest], pad_id: int) -> list[Scored]:
    """Per-token log-probs and entropies of each response, one forward pass for the batch."""
    width = max((len(r.response_token_ids) for r in requests), default=0)
    if width == 0:
        return [Scored(np.zeros(0, np.float32), np.zeros(0, np.float32)) for _ in requests]
    device = next(model.parameters()).device
    ids, mask = left_pad([r.prompt_token_ids + r.response_token_ids for r in requests], pad_id)
    ids, mask = ids.to(device), mask.to(device)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                   logits_to_keep=width + 1).logits.float()  # [B, width + 1, V]
    out = []
    for b, r in enumerate(requests):
        n = len(r.response_token_ids)
        logp = torch.log_softmax(logits[b, width - n:width] / (r.temperature or 1.0), dim=-1)  # [n, V]
        target = torch.tensor(r.response_token_ids, dtype=torch.long, device=device)
        out.append(Scored(logp.gather(-1, target[:, None])[:, 0].cpu().numpy().astype(np.float32),
                          entropy_of(logp).cpu().numpy().astype(np.float32)))
    return out


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
