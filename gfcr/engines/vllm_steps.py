"""In-flight control on the vLLM engine: one generate call driven step by step through vLLM's
request-level engine (``LLM.llm_engine``: ``add_request``, ``step``, ``abort_request``), so an
``InFlightController`` sees every row every ``controller.every`` engine steps and can abort,
prune, exit or stop rows, and ``max_in_flight`` bounds the rows vLLM holds, refilled from
gfcr's own queue as rows end (the transformers engine's decode loop, ``gfcr.engines.decode``,
does the same with its own batch).

Each row is a vLLM request of its own (``n = 1``) seeded ``request_seed(seed, request_id) + i``,
the seed vLLM gives the i-th sample of an ``n``-sample request, so a call with a controller
draws what the same call without one does, up to batch-composition rounding. Rows are
``gfcr.engines.decode.Row`` records and the controller's ``Steer`` is applied by the decode
loop's own ``apply_steer``; rows it ends are then aborted in vLLM.

In-flight weight updates (``weights``, the async lifecycle's ``in_flight: true``, docs/async.md):
after every engine step the call asks ``weights.newer(decoded)`` whether a newer policy version
is ready; if one is, every running row is aborted in vLLM, ``weights.publish(version)`` reloads
vLLM with it (and resets its prefix cache), and each row is added again as a continuation of its
tokens so far, so vLLM recomputes the row's prefix under the new weights: a kept KV cache, computed
by the old weights, would give tokens that match neither version's forward pass (docs/async.md,
"In-flight updates on vLLM"). Each row records where each version's tokens start
(``Row.versions``, ``Completion.versions``), from which the stage cuts one segment per version.
A continued row draws with a seed of its own (``continuation_seed``): vLLM restarts a request's
generator, and the same seed would replay the row's first draws.

Deviations from the decode loop: ``every`` counts vLLM engine steps (a step decodes one token
for every running row; a row's prefill step yields its first token), not positions; entropy is
not recorded yet (vLLM returns no full distribution).
"""

from __future__ import annotations

import contextlib
import itertools
import zlib
from collections import deque
from dataclasses import replace
from typing import Any, Callable, ContextManager, Protocol, Sequence

import torch

from gfcr.engines.decode import Row, apply_steer, call_view, first_stop
from gfcr.stages.engine import Completion, GenerationRequest, InFlightController

_CALLS = itertools.count()  # vLLM wants request ids unique over the engine's life
NO_UNIFORMS = torch.zeros(0, dtype=torch.float64)  # vLLM draws; the rows keep no uniforms


class InFlightWeights(Protocol):
    """Where a generate call takes a newer policy version between its engine steps (the async
    lifecycle's schedule, ``gfcr.runtime.loop.lifecycle.AsyncSchedule``, with ``in_flight: true``)."""

    def newer(self, decoded: int) -> int | None:
        """After ``decoded`` engine steps of the call: a version newer than vLLM's, ready to publish
        (None: keep sampling with the one vLLM holds)."""
        ...

    def publish(self, version: int) -> None:
        """Reload vLLM with ``version``'s weights (every row of the call is aborted by then)."""
        ...


def generate_steered(llm_engine: Any, requests: Sequence[GenerationRequest], make_params: Callable[[Row], Any],
                     decode: Callable[[Sequence[int]], str], replica: str,
                     controller: InFlightController | None = None,
                     max_in_flight: int | None = None, lora_request: Any = None,
                     weights: InFlightWeights | None = None, version: int = 0,
                     hold: Callable[[], ContextManager] = contextlib.nullcontext) -> list[list[Completion]]:
    """Every request's completions, rows added to ``llm_engine`` at most ``max_in_flight`` at a time;
    ``make_params(row)`` is the row's ``vllm.SamplingParams`` (``n = 1``, delta outputs, continuing
    the row's tokens so far); ``lora_request``: the LoRA adapter every row samples with (None: the
    base weights); ``weights``: where newer versions are published in flight, ``version`` the one
    vLLM holds at the start; ``hold()``: held while rows are added (an engine core in its own
    process would start decoding on the first)."""
    rows = [Row(r, i, NO_UNIFORMS) for r in requests for i in range(r.n)]
    queue = deque(r for r in rows if not _out_of_budget(r))
    fixed = call_view(requests) if controller is not None else None
    live: dict[str, Row] = {}
    call, cap, steps = next(_CALLS), max(1, max_in_flight or len(rows) or 1), 0
    while queue or live:
        if queue and len(live) < cap:
            with hold():
                while queue and len(live) < cap:
                    row = queue.popleft()
                    if weights is not None and (not row.versions or row.versions[-1][1] != version):
                        row.versions.append((len(row.tokens), version))
                    live[_add(llm_engine, row, call, make_params(row), lora_request)] = row
        for output in llm_engine.step():
            _take(live, output, decode)
        steps += 1
        if controller is not None and steps % max(1, controller.every) == 0:
            apply_steer(controller.steer(replace(fixed, decoded=steps, rows=tuple(r.live() for r in rows))),
                        rows, queue)
            _abort_ended(llm_engine, live)
        newer = weights.newer(steps) if weights is not None and live else None
        if newer is not None:
            version = newer
            _publish(llm_engine, live, queue, weights, newer)
    completions = iter(row.completion(decode, replica) for row in rows)
    return [[next(completions) for _ in range(r.n)] for r in requests]


def _publish(llm_engine: Any, live: dict[str, Row], queue: deque, weights: InFlightWeights, version: int) -> None:
    """Abort every running row, reload vLLM with ``version``, and queue the rows again, first, in
    their order: each continues from its tokens so far, its prefix recomputed by the new weights."""
    llm_engine.abort_request(list(live))
    weights.publish(version)
    queue.extendleft(reversed(list(live.values())))
    live.clear()


def continuation_seed(seed: int, row: Row) -> int:
    """The vLLM seed of a row continued in flight after ``len(row.tokens)`` of its tokens (the row's
    own seed when it has none yet, so a call without in-flight updates draws as before)."""
    if not row.tokens:
        return seed
    return zlib.crc32(f"{seed}:{len(row.tokens)}".encode()) & 0x7FFFFFFF


def _out_of_budget(row: Row) -> bool:
    """A prefix that already fills ``max_new_tokens`` ends at once, with no new token."""
    if len(row.prefix) >= row.request.params.max_new_tokens:
        row.finish = "length"
        return True
    return False


def _add(llm_engine: Any, row: Row, call: int, params: Any, lora_request: Any = None) -> str:
    """Add the row (continuing its tokens so far, after an in-flight update) as a vLLM request."""
    from vllm.inputs import TokensPrompt

    again = f".{len(row.versions) - 1}" if len(row.versions) > 1 else ""  # unique per continuation
    request_id = f"gfcr-{call}-{row.request.request_id}#{row.index}{again}"
    llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(row.request.context) + row.tokens),
                           params, lora_request=lora_request)
    return request_id


def _take(live: dict[str, Row], output: Any, decode: Callable[[Sequence[int]], str]) -> None:
    """Append one step's new tokens (vLLM's delta output) to their row; end it if vLLM did."""
    row = live.get(output.request_id)
    if row is None:  # ended by the controller in this step
        return
    sample = output.outputs[0]
    ids = list(sample.token_ids)
    row.tokens += ids
    row.logprobs += [float(step[token].logprob) for step, token in zip(sample.logprobs or [], ids)]
    if output.finished:
        row.finish = "stop" if sample.finish_reason == "stop" else "length"
        _cut_at_stop(row, decode)
        del live[output.request_id]


def _cut_at_stop(row: Row, decode: Callable[[Sequence[int]], str]) -> None:
    """The transformers engine's rule: cut at the shortest prefix whose text holds a stop string."""
    stop = row.request.params.stop
    cut = first_stop(row.response(), stop, decode, start=len(row.prefix) + 1) if stop else None
    if cut is not None:
        keep = cut - len(row.prefix)
        del row.tokens[keep:], row.logprobs[keep:]
        row.finish = "stop"


def _abort_ended(llm_engine: Any, live: dict[str, Row]) -> None:
    """Abort in vLLM the rows the controller ended (their tokens stay with the row)."""
    ended = [request_id for request_id, row in live.items() if row.finish is not None]
    if ended:
        llm_engine.abort_request(ended)
        for request_id in ended:
            del live[request_id]

