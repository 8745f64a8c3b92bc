"""The decode loop shared by the transformers engine and the fake engine.

A ``Batch`` (the model side) holds the rows in flight and answers, for each, the logits of
the next token: ``add`` prefills new rows and appends them, ``step`` feeds one token per
row, ``keep`` drops the rows that ended so they stop costing compute. ``decode_requests``
(this module) owns everything else, identically for every backend:

- rows: request ``r``'s ``n`` samples, queued in request order; at most ``max_in_flight``
  are in the batch, and a freed slot is refilled from the queue at the next step;
- sampling: the sampled token's log-prob under the tempered, untruncated distribution
  (greedy: untempered), top-p truncation for drawing only, entropy on request. Each row
  draws by inverse-CDF from its own uniforms, ``torch.rand`` of a generator seeded with
  ``row_seed(seed, request_id, i)`` and indexed by the token's position in the whole
  response, so a sample depends neither on the batch, nor on aborts, nor on resumption;
- ends: the end-of-sequence token (kept), a stop string (the response is cut at the shortest
  prefix whose text contains one, as before), ``max_new_tokens`` for the whole response
  (prefix included), or a controller's ``Steer`` (aborted, pruned, stop all, or ``exit``: cut back
  and answered with the controller's own tokens, ``exited``);
- hand-over: with ``ready``, a request's completions go to ``ready`` as soon as all its rows have
  ended (``Handover``), while the other rows decode on (``lifecycle: {stream_groups: true}``).

``score_requests`` runs given responses through the same loop, teacher-forced: each row takes
its response's next token instead of drawing one and records that token's log-prob and
entropy. A batch scored in the order it was sampled meets the same prefills, steps and
departures as its sampling did, so its scores are its sampling log-probs bit for bit (a full
forward pass sums in another order: ~1e-5 apart on SmolLM2's 30 float32 layers).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from gfcr.stages.engine import (
    Completion, Exit, GenerationRequest, InFlightController, InFlightView, LiveRow, SamplingParams, Scored,
    ScoreRequest, Steer, row_seed,
)

Decode = Callable[[Sequence[int]], str]
Ready = Callable[[int, list[Completion]], None]  # a request's index and completions, once all its rows ended


class Batch(Protocol):
    """The rows in flight, on the model side."""

    def add(self, contexts: list[tuple[int, ...]]) -> torch.Tensor:
        """Prefill new rows, appended after the current ones; their next-token logits ``[k, V]``."""
        ...

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (``[B]``); the next-token logits ``[B, V]``."""
        ...

    def keep(self, indices: list[int]) -> None:
        """Keep only these rows, in this order."""
        ...


@dataclass(eq=False)
class Row:
    request: GenerationRequest
    index: int
    uniforms: torch.Tensor  # [max_new_tokens] float64, this row's draws by response position
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    finish: str | None = None
    forced: int = 0  # trailing tokens a controller appended (``Steer.exit``)
    given: tuple[int, ...] | None = None  # teacher-forced response (``score_requests``): taken, not drawn
    versions: list[tuple[int, int]] = field(default_factory=list)  # (first new token, policy version), in flight

    @property
    def prefix(self) -> tuple[int, ...]:
        return self.request.prefix.token_ids if self.request.prefix else ()

    def response(self) -> list[int]:
        return list(self.prefix) + self.tokens

    def live(self) -> LiveRow:
        ent = np.array(self.entropy, np.float32) if self.request.params.entropy else None
        return LiveRow(self.request.request_id, self.index, tuple(self.tokens),
                       np.array(self.logprobs, np.float32), ent, self.finish)

    def completion(self, decode: Decode, replica: str) -> Completion:
        ent = np.array(self.entropy, np.float32) if self.request.params.entropy else None
        return Completion(tuple(self.tokens), np.array(self.logprobs, np.float32), self.finish or "aborted",
                          decode(self.response()), replica, ent, self.forced, versions=tuple(self.versions))

    def exit(self, ex: Exit) -> None:
        """End as ``exited``: keep the first ``ex.cut`` new tokens, then the controller's own."""
        keep = min(ex.cut, len(self.tokens))
        ent = ex.entropy if ex.entropy is not None else np.full(len(ex.token_ids), np.nan, np.float32)
        del self.tokens[keep:], self.logprobs[keep:], self.entropy[keep:]
        self.tokens += list(ex.token_ids)
        self.logprobs += [float(x) for x in ex.logprobs]
        if self.request.params.entropy:
            self.entropy += [float(x) for x in ent]
        self.forced, self.finish = len(ex.token_ids), "exited"


def make_rows(requests: Sequence[GenerationRequest]) -> list[Row]:
    rows = []
    for r in requests:
        for i in range(r.n):
            g = torch.Generator().manual_seed(row_seed(r.params.seed, r.request_id, i))
            rows.append(Row(r, i, torch.rand(max(r.params.max_new_tokens, 1), generator=g, dtype=torch.float64)))
    return rows


def decode_requests(requests: Sequence[GenerationRequest], batch: Batch, *, eos: int, decode: Decode,
                    controller: InFlightController | None = None, max_in_flight: int | None = None,
                    replica: str = "0", ready: Ready | None = None) -> list[list[Completion]]:
    """Generate every request's completions through ``batch`` (see the module docstring); ``ready``:
    called with each request's index and completions as soon as all its rows have ended."""
    rows = make_rows(requests)
    fixed = call_view(requests) if controller is not None else None
    handover = Handover(requests, rows, lambda row: row.completion(decode, replica), ready) if ready else None
    run_rows(rows, batch, eos=eos, decode=decode, controller=controller, fixed=fixed, max_in_flight=max_in_flight,
             after_step=handover)
    out, i = [], 0
    for r in requests:
        out.append([row.completion(decode, replica) for row in rows[i:i + r.n]])
        i += r.n
    return out


def score_requests(requests: Sequence[ScoreRequest], batch: Batch, *, eos: int, decode: Decode,
                   max_in_flight: int | None = None) -> list[Scored]:
    """Each response's per-token log-probs and entropies, teacher-forced through ``batch`` by the
    decode loop itself (see the module docstring), at most ``max_in_flight`` rows at once."""
    rows = [Row(GenerationRequest(f"score{i}", r.prompt_token_ids, 1, scoring_params(r)), 0,
                torch.zeros(0, dtype=torch.float64), given=tuple(r.response_token_ids))
            for i, r in enumerate(requests)]
    run_rows(rows, batch, eos=eos, decode=decode, max_in_flight=max_in_flight)
    return [Scored(np.array(r.logprobs, np.float32), np.array(r.entropy, np.float32)) for r in rows]


def scoring_params(r: ScoreRequest) -> SamplingParams:
    """The params of a teacher-forced row: the request's temperature, room for its response, entropy."""
    return SamplingParams(temperature=r.temperature, max_new_tokens=max(1, len(r.response_token_ids)), entropy=True)


class Handover:
    """Hands each request's completions to ``ready(index, completions)`` once all its rows have ended
    (a row that has ended never changes again), in the order requests end; called after every decode
    step, and once more at the end. A row is turned into its completion twice (here and at the end
    of the call): the same rows give the same completions."""

    def __init__(self, requests: Sequence[GenerationRequest], rows: list[Row],
                 completion: Callable[[Row], Completion], ready: Ready):
        starts = np.cumsum([0] + [r.n for r in requests])
        self.pending = {k: rows[starts[k]:starts[k + 1]] for k in range(len(requests))}
        self.completion, self.ready = completion, ready

    def __call__(self) -> None:
        for k in [k for k, rows in self.pending.items() if all(r.finish is not None for r in rows)]:
            self.ready(k, [self.completion(r) for r in self.pending.pop(k)])


def run_rows(rows: list[Row], batch: Batch, *, eos: int, decode: Decode, controller: InFlightController | None = None,
             fixed: InFlightView | None = None, max_in_flight: int | None = None,
             after_step: Callable[[], None] | None = None) -> None:
    """Decode ``rows`` to their ends through ``batch``: refill, choose, end, steer, leave, (hand
    over,) step."""
    queue = deque(r for r in rows if not _out_of_budget(r))
    cap = max(1, max_in_flight or len(rows) or 1)
    live: list[Row] = []
    logits: torch.Tensor | None = None  # [len(live), V]
    decoded = 0
    while True:
        if queue and len(live) < cap:
            new = [queue.popleft() for _ in range(min(cap - len(live), len(queue)))]
            fresh = batch.add([r.request.context for r in new]).float()
            logits = fresh if logits is None else torch.cat([logits, fresh])
            live += new
        if not live:
            break
        tokens = choose(logits, live)
        for row, token in zip(live, tokens):
            row.finish = end_of(row, eos, decode)
        decoded += 1
        if controller is not None and decoded % max(1, controller.every) == 0:
            assert fixed is not None, "a controller needs the call's fixed view (call_view)"
            now = replace(fixed, decoded=decoded, rows=tuple(r.live() for r in rows))
            apply_steer(controller.steer(now), rows, queue)
        kept = [i for i, r in enumerate(live) if r.finish is None]
        if len(kept) < len(live):
            batch.keep(kept)
            tokens, live = [tokens[i] for i in kept], [live[i] for i in kept]
            if after_step is not None:
                after_step()
        logits = batch.step(torch.tensor(tokens, dtype=torch.long)).float() if live else None
    if after_step is not None:  # rows that never decoded (out of budget, or ended in the queue)
        after_step()


def _out_of_budget(row: Row) -> bool:
    """A prefix that already fills ``max_new_tokens`` ends at once, with no new token (so does an
    empty response to score)."""
    if len(row.prefix) >= row.request.params.max_new_tokens or row.given == ():
        row.finish = "length"
        return True
    return False


def choose(logits: torch.Tensor, rows: list[Row]) -> list[int]:
    """Draw each row's next token from ``logits`` (``[B, V]``); record its log-prob (and entropy)."""
    temps = torch.tensor([r.request.params.temperature or 1.0 for r in rows], dtype=logits.dtype)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)  # [B, V]
    entropy = entropy_of(logp) if any(r.request.params.entropy for r in rows) else None
    tokens = []
    for b, row in enumerate(rows):
        p = row.request.params
        if row.given is not None:
            token = row.given[len(row.tokens)]
        elif p.temperature == 0:
            token = int(torch.argmax(logp[b]))
        else:
            token = draw(logp[b], p.top_p, float(row.uniforms[len(row.prefix) + len(row.tokens)]))
        row.tokens.append(token)
        row.logprobs.append(float(logp[b, token]))
        if entropy is not None:
            row.entropy.append(float(entropy[b]))
        tokens.append(token)
    return tokens


def entropy_of(logp: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` log-probs -> ``[...]`` entropies (nats)."""
    return -(logp.exp() * logp).sum(-1)


def draw(logp: torch.Tensor, top_p: float, u: float) -> int:
    """Inverse-CDF draw with uniform ``u`` from ``exp(logp)`` (``[V]``), truncated to the top-p nucleus."""
    probs = logp.double().exp()
    order = None
    if top_p < 1.0:
        probs, order = probs.sort(descending=True)
        probs = probs * ((probs.cumsum(0) - probs) < top_p)  # keep tokens whose preceding mass is below top_p
    cdf = probs.cumsum(0)
    i = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True)[0])
    i = min(i, len(cdf) - 1)
    return int(order[i]) if order is not None else i


def end_of(row: Row, eos: int, decode: Decode) -> str | None:
    """Why the row ends after its newest token, or None. A stop string cuts the row; a
    teacher-forced row ends with its response, whatever tokens it holds."""
    if row.given is not None:
        return "length" if len(row.tokens) == len(row.given) else None
    p = row.request.params
    if p.stop and _tail_has_stop(row, decode):
        cut = first_stop(row.response(), p.stop, decode, start=len(row.prefix) + 1)
        if cut is not None:
            keep = cut - len(row.prefix)
            del row.tokens[keep:], row.logprobs[keep:], row.entropy[keep:]
            return "stop"
    if row.tokens[-1] == eos:
        return "stop"
    if len(row.prefix) + len(row.tokens) >= p.max_new_tokens:
        return "length"
    return None


def _tail_has_stop(row: Row, decode: Decode) -> bool:
    """Cheap check on the last few tokens (a stop string of n characters spans at most n tokens)."""
    window = max(len(s) for s in row.request.params.stop) + 2
    tail = decode(row.response()[-window:])
    return any(s in tail for s in row.request.params.stop)


def first_stop(ids: Sequence[int], stop: tuple[str, ...], decode: Decode, start: int = 1) -> int | None:
    """The length (at least ``start``) of the shortest prefix of ``ids`` whose text contains a stop string."""
    ids = list(ids)
    if not any(s in decode(ids) for s in stop):
        return None
    for end in range(max(start, 1), len(ids) + 1):
        if any(s in decode(ids[:end]) for s in stop):
            return end
    return None


def call_view(requests: Sequence[GenerationRequest]) -> InFlightView:
    """What a controller's view holds that is fixed for the whole call (no rows yet): group sizes,
    groups, contexts, params and budgets, built once and shared by every ``steer``."""
    sizes: dict[str, int] = {}
    for r in requests:
        sizes[r.group_key] = sizes.get(r.group_key, 0) + r.n
    groups = {r.request_id: r.group for r in requests if r.group is not None}
    return InFlightView(0, (), sizes, groups,
                        {r.request_id: r.context for r in requests}, {r.request_id: r.params for r in requests},
                        {r.request_id: r.params.max_new_tokens - len(r.prefix.token_ids if r.prefix else ())
                         for r in requests})


def apply_steer(steer: Steer, rows: list[Row], queue: deque[Row]) -> None:
    """End the rows a controller named (queued ones too: they end with no tokens)."""
    by_key = {(r.request.request_id, r.index): r for r in rows}
    ends = [(key, "aborted") for key in steer.abort] + [(key, "pruned") for key in steer.prune]
    if steer.stop:
        ends += [(key, "aborted") for key, r in by_key.items() if r.finish is None]
    for key, ex in steer.exit.items():
        row = by_key.get(tuple(key))
        if row is not None and row.finish is None:
            row.exit(ex)
    for key, reason in ends:
        row = by_key.get(tuple(key))
        if row is not None and row.finish is None:
            row.finish = reason
    if any(r.finish is not None for r in queue):
        kept = [r for r in queue if r.finish is None]
        queue.clear()
        queue.extend(kept)
