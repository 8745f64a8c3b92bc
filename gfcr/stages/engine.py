"""The Engine protocol (DESIGN.md section 6, contract v2): what a Generate stage asks of an engine.

A call hands the engine a list of requests, each ``n`` samples of one prompt's token ids with
its own ``SamplingParams``, optionally continuing a response (``ResponsePrefix``: its token
ids and the segments that tile them). Each completion holds only the NEW tokens, their
behaviour log-probabilities (the tempered, untruncated distribution; greedy: untempered),
optionally their entropies, and a finish reason (``stop``, ``length``, ``aborted``,
``pruned``, ``exited``). The stage splices the prefix's segments and a new one, so a resumed rollout
keeps the behaviour log-probs of every token it ever sampled. A completion whose row took a newer
policy version mid-call (the async lifecycle's ``in_flight``, docs/async.md) says, in
``versions``, where each version's tokens start, and ``splice`` cuts one segment per version.

Hand-over: an engine that can (the decode loop's, vLLM's) takes ``ready`` and calls it with each
request's completions as soon as all its rows have ended, so a Generate stage can hand that group on
while the engine decodes the rest (``lifecycle: {stream_groups: true}``, docs/async.md).

In-flight control: an ``InFlightController`` (a Control stage attached to a Generate stage)
sees an ``InFlightView`` of every row every ``every`` decode steps and answers a ``Steer``:
rows to abort (kept, resumable), rows to prune (kept, for good), rows to end now with tokens
of its own appended (``Exit``: cut back to a step boundary and answered, ``exited``), or stop
everything.
``max_in_flight`` caps the rows decoded at once; a freed slot is refilled from the queue.

Seeding: row ``i`` of request ``r`` draws from its own stream seeded by
``row_seed(params.seed, r.request_id, i)``, indexed by the token's position in the response,
so samples do not depend on batching, replicas, aborts or resumption.

``score`` returns per-token log-probs and entropies of given responses under the current
policy (SPEC-RL draft verification, replay importance ratios).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Literal, Protocol, Sequence

import numpy as np

from gfcr.records import Segment, SegmentOrigin

FinishReason = Literal["stop", "length", "aborted", "pruned", "exited"]
# a row that ended with a whole response: on its own, or answered by a controller (``exited``)
ENDED_WELL = ("stop", "length", "exited")


def row_seed(seed: int, request_id: str, sample_index: int) -> int:
    """The 31-bit seed of one row (crc32 like ``step_seed``: stable across processes)."""
    return zlib.crc32(f"{seed}:{request_id}:{sample_index}".encode()) & 0x7FFFFFFF


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request. ``temperature == 0`` means greedy. ``max_new_tokens`` caps the
    whole response, a continued prefix included (APRIL's rule: a resumed partial gets the
    budget it has left)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: int = 0
    entropy: bool = False  # record the entropy of the tempered, untruncated distribution per token


@dataclass(frozen=True, slots=True)
class ResponsePrefix:
    """A response to continue: its token ids and the segments that tile them."""

    token_ids: tuple[int, ...]
    segments: tuple[Segment, ...] = ()

    def __post_init__(self) -> None:
        covered = sum(len(s) for s in self.segments)
        if covered != len(self.token_ids):
            raise ValueError(f"the prefix's segments cover {covered} tokens, it has {len(self.token_ids)}")


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """``n`` samples continuing ``prompt_token_ids`` (and ``prefix``, when given)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    n: int = 1
    params: SamplingParams = SamplingParams()
    prefix: ResponsePrefix | None = None
    group: str | None = None  # the group its rows belong to, when a group spans several requests

    @property
    def group_key(self) -> str:
        """The group its rows count toward (``group``, or the request itself): a resumed group
        continues each unfinished rollout from its own prefix, one request per row."""
        return self.group or self.request_id

    @property
    def context(self) -> tuple[int, ...]:
        """What the model conditions on: the prompt and the prefix."""
        return self.prompt_token_ids + (self.prefix.token_ids if self.prefix else ())


@dataclass(frozen=True, slots=True)
class Completion:
    """One sample: the NEW tokens, log mu(token) for each, and why it ended."""

    token_ids: tuple[int, ...]
    logprobs: np.ndarray  # [T] float32, under the sampling distribution (tempered, untruncated)
    finish_reason: FinishReason
    text: str  # the text of the whole response (prefix + new tokens), decoded together
    replica: str = "0"
    entropy: np.ndarray | None = None  # [T] float32, when params.entropy
    forced: int = 0  # the last ``forced`` tokens were appended by a controller (``Exit``), not sampled
    ray_node: str | None = None  # the Ray node id of the replica that sampled it (None in process)
    # where each policy version's new tokens start, ``((0, v0), (k, v1), ...)``, when the row took a newer
    # version mid-call (an in-flight weight update); empty: every new token at the call's version
    versions: tuple[tuple[int, int], ...] = ()


def splice(prefix: ResponsePrefix | None, completion: Completion,
           policy_version: int) -> tuple[list[int], list[Segment]]:
    """The whole response of a completion and its segments: the prefix's own, then one new
    segment of the new tokens at ``policy_version`` (CoPRIS-style spliced behaviour log-probs), or,
    where ``completion.versions`` says the row changed version mid-call, one segment per version
    (the first at ``versions[0]``'s, whatever ``policy_version`` says); tokens a controller appended
    (``completion.forced``) get a segment of their own, origin ``forced``, at the last version."""
    head = list(prefix.token_ids) if prefix else []
    segments = [Segment(s.start, s.end, s.policy_version, s.behavior_logprobs, s.origin)
                for s in (prefix.segments if prefix else ())]
    sampled = len(completion.token_ids) - completion.forced
    spans = _version_spans(completion.versions, sampled) if completion.versions else [(0, sampled, policy_version)]
    if sampled or not (segments or completion.forced):
        segments += [Segment(len(head) + a, len(head) + b, version, completion.logprobs[a:b])
                     for a, b, version in spans if b > a or (a, b) == (0, 0)]
    if completion.forced:
        segments.append(Segment(len(head) + sampled, len(head) + len(completion.token_ids), spans[-1][2],
                                completion.logprobs[sampled:], SegmentOrigin.FORCED))
    return head + list(completion.token_ids), segments


def _version_spans(versions: tuple[tuple[int, int], ...], sampled: int) -> list[tuple[int, int, int]]:
    """``[start, end)`` of each version's sampled tokens, clipped to ``sampled`` (a stop string may
    have cut the row after a version started); an empty span keeps its version only when it is the
    last (forced tokens take it)."""
    starts = [min(start, sampled) for start, _ in versions] + [sampled]
    if any(b < a for a, b in zip(starts, starts[1:])) or starts[0] != 0:
        raise ValueError(f"a completion's versions {versions} must start at token 0 and be in order")
    spans = [(starts[i], starts[i + 1], version) for i, (_, version) in enumerate(versions)]
    return [s for s in spans[:-1] if s[1] > s[0]] + spans[-1:]


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """A response to score under the current policy."""

    prompt_token_ids: tuple[int, ...]
    response_token_ids: tuple[int, ...]
    temperature: float = 1.0  # 0 scores under the untempered distribution, as greedy sampling does


@dataclass(frozen=True, slots=True)
class Scored:
    logprobs: np.ndarray  # [T] float32
    entropy: np.ndarray  # [T] float32


@dataclass(frozen=True, slots=True)
class LiveRow:
    """One row as a controller sees it: the new tokens so far."""

    request_id: str
    sample_index: int
    token_ids: tuple[int, ...]
    logprobs: np.ndarray  # [T]
    entropy: np.ndarray | None  # [T] when the request asked for entropy
    finish_reason: str | None  # None: running or queued


@dataclass(frozen=True, slots=True)
class InFlightView:
    """Every row of one generate call, every ``controller.every`` decode steps."""

    decoded: int  # decode steps so far in this call
    rows: tuple[LiveRow, ...]
    group_sizes: dict[str, int] = field(default_factory=dict)  # group key -> rows of it in this call
    request_groups: dict[str, str] = field(default_factory=dict)  # request_id -> group key, where they differ
    # request_id -> the context its rows continue (prompt and any prefix: ``GenerationRequest.context``),
    # for a controller that runs the policy on a partial (``control.early_exit``)
    contexts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    params: dict[str, SamplingParams] = field(default_factory=dict)  # request_id -> its sampling params
    # request_id -> the new tokens each of its rows may have (``max_new_tokens`` less the prefix)
    budgets: dict[str, int] = field(default_factory=dict)

    def group_of(self, request_id: str) -> str:
        return self.request_groups.get(request_id, request_id)

    def complete_groups(self) -> list[str]:
        """The groups (``GenerationRequest.group_key``: the request id unless a group spans several
        requests) whose rows in this call all ended on their own (stop or length), in request order."""
        ended: dict[str, int] = {}
        for row in self.rows:
            if row.finish_reason in ENDED_WELL:
                key = self.group_of(row.request_id)
                ended[key] = ended.get(key, 0) + 1
        return [key for key, n in self.group_sizes.items() if n > 0 and ended.get(key, 0) == n]


@dataclass(frozen=True, slots=True)
class Exit:
    """End a row now as ``exited``: keep its first ``cut`` new tokens, then append ``token_ids``
    (not sampled: chosen by the controller) with their log-probs (and entropies, when the row
    records them) under the row's sampling distribution (``control.truncate_steps``: a step
    boundary, then an answer)."""

    cut: int
    token_ids: tuple[int, ...]
    logprobs: np.ndarray  # [len(token_ids)]
    entropy: np.ndarray | None = None  # [len(token_ids)]

    def __post_init__(self) -> None:
        if self.cut < 0 or len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"an Exit keeps {self.cut} tokens and appends {len(self.token_ids)} with "
                             f"{len(self.logprobs)} log-probs: cut must be >= 0, one log-prob per token")


@dataclass(frozen=True, slots=True)
class Steer:
    """A controller's answer. Rows are ``(request_id, sample_index)``."""

    abort: tuple[tuple[str, int], ...] = ()  # end now as ``aborted`` (kept, resumable)
    prune: tuple[tuple[str, int], ...] = ()  # end now as ``pruned`` (kept, for good)
    stop: bool = False  # end every unfinished (and queued) row as ``aborted``
    why: dict[tuple[str, int], str] = field(default_factory=dict)  # per ended row, for its lineage
    exit: dict[tuple[str, int], Exit] = field(default_factory=dict)  # end now as ``exited``, tokens appended


class InFlightController(Protocol):
    """A Control-family stage attached to a Generate stage; the engine calls ``steer``
    every ``every`` decode steps."""

    every: int

    def steer(self, view: InFlightView) -> Steer: ...


class Engine(Protocol):
    """Samples from the current policy."""

    @property
    def policy_version(self) -> int: ...

    def generate(self, requests: Sequence[GenerationRequest], controller: InFlightController | None = None,
                 max_in_flight: int | None = None) -> list[list[Completion]]:
        """One list of ``request.n`` completions per request, in request order. An engine that can
        hand groups over (the decode loop's: transformers, fake) also takes ``ready``, a function
        called with a request's index and its completions as soon as all its rows have ended, while
        the others decode on (``lifecycle: {stream_groups: true}``): the decode loop's engines
        and vLLM; the Ray executor's engine group does not."""
        ...

    def score(self, requests: Sequence[ScoreRequest]) -> list[Scored]:
        """Per-token log-probs and entropies of each response, in request order."""
        ...

    def sync_weights(self, policy_version: int) -> int:
        """Make the engine sample from the policy at ``policy_version``; returns the bytes of
        weights it copied (0: a no-op, when it shares the trained model object)."""
        ...
