"""Rollouts: the token-level record of one sampled response.

A rollout's response is split into ``segments``; each segment was produced by one policy
version and carries that policy's per-token behaviour log-probabilities. Invariant: the
segments tile ``response_token_ids`` exactly (contiguous, in order, no gaps), so every
token has exactly one policy version and one behaviour log-probability, and a token's
staleness is ``current_version - segment.policy_version``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from gfcr.records.ids import check_id
from gfcr.records.trajectory import Turn, TurnRole


class RolloutStatus(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED_PARTIAL = "aborted_partial"  # stopped in flight, may be resumed (APRIL, CoPRIS)
    PRUNED = "pruned"  # stopped in flight for good (ARRoL)
    FAILED = "failed"


class Origin(StrEnum):
    """Why a rollout exists; group baselines may need to tell these apart."""

    FRESH = "fresh"
    PILOT = "pilot"
    COMMIT = "commit"
    RESUMED = "resumed"
    DRAFT_ACCEPTED = "draft_accepted"
    REPLAYED = "replayed"
    CACHED_CORRECT = "cached_correct"


REUSED_ORIGINS = frozenset({Origin.REPLAYED, Origin.CACHED_CORRECT})
"""Origins of rollouts generated at an earlier step (or outside the run: a replay pool seeded from
a file) and reused in this one: they count in their group and the update, not as generated
(``StepReport.rollouts_generated``, ``tokens_generated``, ``tokens_with_signal``) nor in the
step's ``reward_mean`` / ``correct_fraction``, but as replayed (``rollouts_replayed``)."""


class SegmentOrigin(StrEnum):
    SAMPLED = "sampled"
    DRAFT_ACCEPTED = "draft_accepted"
    REPLAYED_TEXT = "replayed_text"
    SEEDED_CONTEXT = "seeded_context"
    FORCED = "forced"  # appended by an in-flight controller, not sampled (``control.truncate_steps``)
    # an environment's turn (observation, tool result) tokenised into a trajectory's context
    # (``generate.multi_turn``): no policy wrote it, its log-probs are zeros, it is never trained on
    ENVIRONMENT = "environment"


@dataclass(slots=True)
class Segment:
    """A maximal span ``[start, end)`` of response tokens produced by one policy version."""

    start: int
    end: int
    policy_version: int
    behavior_logprobs: np.ndarray  # [end - start] float32, log mu(y_t) at generation time
    origin: SegmentOrigin = SegmentOrigin.SAMPLED

    def __post_init__(self) -> None:
        self.behavior_logprobs = np.asarray(self.behavior_logprobs, dtype=np.float32)
        if not 0 <= self.start <= self.end:
            raise ValueError(f"segment [{self.start}, {self.end}) is not a valid span")
        if self.behavior_logprobs.shape != (self.end - self.start,):
            raise ValueError(
                f"segment [{self.start}, {self.end}) has {self.behavior_logprobs.shape} logprobs; "
                f"it needs one per token, shape ({self.end - self.start},)"
            )

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class Rollout:
    """One response to one prompt, with everything the later stages write onto it."""

    rollout_id: str
    group_id: str
    prompt_id: str
    response_token_ids: list[int]
    segments: list[Segment]
    status: RolloutStatus = RolloutStatus.COMPLETED
    origin: Origin = Origin.FRESH
    finish_reason: str = ""
    stop_reason: str = ""  # why an in-flight controller ended it (aborted, pruned or exited), in its own words
    created_step: int = 0  # the step that generated it (a reused rollout keeps its original's)
    text: str | None = None  # decoded response, for verifiers and reading; never re-tokenized
    context_token_ids: list[int] | None = None  # set only when the context differs from the prompt's
    replica: str | None = None  # which engine replica produced it
    ray_node: str | None = None  # the Ray node id that replica ran on (None for an in-process engine)
    replayed_from: str | None = None  # the rollout id a reused rollout copies (``reused``), for lineage
    # a reused rollout's original's oldest policy version: its own segments say the same unless the
    # replay rescored them at the current version (``replay.rlep``, ``correction: none``)
    replayed_policy_version: int | None = None
    # topology, for tree rollouts
    tree_id: str | None = None
    node_id: str | None = None
    parent_node_id: str | None = None
    branch_token_idx: int | None = None  # a branch's fork point: tokens [0, idx) were copied from another leaf
    # continuation across steps (``generate.partial``): the rollout id at the step it was carried from,
    # and how many of its tokens were sampled there (the rest, this step)
    resumed_from: str | None = None
    resumed_tokens: int = 0
    # a previous rollout's prefix accepted as a draft (``generate.speculative``, SPEC-RL): the draft's
    # rollout id and how many of its tokens were accepted (sampled, and counted, when it was made)
    draft_from: str | None = None
    draft_tokens: int = 0
    # a trajectory's turns (``generate.multi_turn``; ``gfcr.records.trajectory``): spans of the response
    # that tile it, model turns over sampled segments, environment turns over ``environment`` ones
    turns: list[Turn] | None = None
    # outcome, written by verifiers
    reward: float | None = None
    reward_components: dict[str, float] = field(default_factory=dict)
    correct: bool | None = None
    reward_reason: str = ""
    token_entropy: np.ndarray | None = None  # [T] float32
    # update-time fields, written only by Filter and Update stages
    loss_mask: np.ndarray | None = None  # [T] bool
    sample_weight: float = 1.0
    advantage: float | np.ndarray | None = None  # scalar, or [T] for per-token estimators
    old_logprobs: np.ndarray | None = None  # [T] float32, pi_old at update start

    def __post_init__(self) -> None:
        check_id(self.rollout_id, "Rollout.rollout_id")
        check_id(self.group_id, "Rollout.group_id")
        check_id(self.prompt_id, "Rollout.prompt_id")
        self.check_segments()
        if self.turns is not None:
            self.check_turns()

    def check_segments(self) -> None:
        """Raise ValueError unless the segments tile the response tokens exactly."""
        position = 0
        for seg in self.segments:
            if seg.start != position:
                raise ValueError(
                    f"rollout {self.rollout_id}: segment starts at {seg.start}, expected {position} "
                    "(segments must be contiguous and in order)"
                )
            position = seg.end
        if position != len(self.response_token_ids):
            raise ValueError(
                f"rollout {self.rollout_id}: segments cover {position} tokens, "
                f"the response has {len(self.response_token_ids)}"
            )

    def check_turns(self) -> None:
        """Raise ValueError unless the turns tile the response and each holds segments of its own
        kind only (environment turns: ``environment`` segments; model turns: any other)."""
        position = 0
        for turn in self.turns or ():
            if turn.start != position:
                raise ValueError(f"rollout {self.rollout_id}: turn starts at {turn.start}, expected {position} "
                                 "(turns must be contiguous and in order)")
            position = turn.end
            for seg in self.segments:
                if seg.start < turn.end and turn.start < seg.end and (
                        (seg.origin == SegmentOrigin.ENVIRONMENT) != (turn.role == TurnRole.ENVIRONMENT)):
                    raise ValueError(f"rollout {self.rollout_id}: {turn.role} turn [{turn.start}, {turn.end}) "
                                     f"overlaps a segment of origin {seg.origin} [{seg.start}, {seg.end})")
        if position != len(self.response_token_ids):
            raise ValueError(f"rollout {self.rollout_id}: turns cover {position} tokens, "
                             f"the response has {len(self.response_token_ids)}")

    def __len__(self) -> int:
        return len(self.response_token_ids)

    @property
    def environment_tokens(self) -> int:
        """Response tokens an environment wrote (``environment`` segments): 0 for a single turn."""
        return sum(len(s) for s in self.segments if s.origin == SegmentOrigin.ENVIRONMENT)

    def trained_mask(self) -> np.ndarray | None:
        """``[T]`` bool: False on the tokens no policy wrote (an environment's turns), which the
        update never trains on whatever a filter's ``loss_mask`` says; None when every token is
        the policy's (every single-turn rollout), so the update's default path is unchanged."""
        if not self.environment_tokens:
            return None
        mask = np.ones(len(self), dtype=bool)
        for s in self.segments:
            if s.origin == SegmentOrigin.ENVIRONMENT:
                mask[s.start:s.end] = False
        return mask

    @property
    def generated_length(self) -> int:
        """The response tokens this rollout sampled itself at this step: all of them, except for a
        tree branch (``generate.tree``), whose first ``branch_token_idx`` tokens were copied from the
        leaf it branched from and were counted there, a rollout carried over from an earlier
        step (``generate.partial``), whose first ``resumed_tokens`` were sampled, and counted, there,
        and one that starts with an accepted draft (``generate.speculative``), whose first
        ``draft_tokens`` were sampled when the draft was. An environment's turns in a trajectory
        (``generate.multi_turn``) were not sampled and do not count."""
        copied = min(max(self.branch_token_idx or 0, self.resumed_tokens, self.draft_tokens), len(self))
        environment = sum(max(0, s.end - max(s.start, copied)) for s in self.segments
                          if s.origin == SegmentOrigin.ENVIRONMENT)  # those past the copied prefix
        return len(self) - copied - environment

    @property
    def forced_tokens(self) -> int:
        """The response tokens an in-flight controller appended instead of sampling them (segment
        origin ``forced``: ``control.truncate_steps``'s answer after a step boundary)."""
        return sum(len(s) for s in self.segments if s.origin == SegmentOrigin.FORCED)

    @property
    def unfinished(self) -> bool:
        """Stopped in flight before its end, to be resumed (status ``aborted_partial``): its reward,
        if a verifier gave it one, is that of half a response."""
        return self.status == RolloutStatus.ABORTED_PARTIAL

    @property
    def sampled_nothing(self) -> bool:
        """Made only of tokens sampled at earlier steps (carried whole by ``generate.partial``, or a
        fully accepted draft of ``generate.speculative``): not counted as generated this step."""
        return (self.resumed_from is not None or self.draft_from is not None) and self.generated_length == 0

    @property
    def carried(self) -> bool:
        """Carried whole into this step by ``generate.partial`` (finished at an earlier step in a
        group that was not; it sampled nothing now, and was counted where it was sampled)."""
        return self.resumed_from is not None and self.generated_length == 0

    @property
    def reused(self) -> bool:
        """Generated at an earlier step and reused now (origin ``replayed`` or ``cached_correct``;
        ``replayed_from`` names the original, ``created_step`` its step and
        ``replayed_policy_version`` its oldest policy version)."""
        return self.origin in REUSED_ORIGINS

    @property
    def behavior_logprobs(self) -> np.ndarray:  # [T] float32
        if not self.segments:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate([s.behavior_logprobs for s in self.segments])

    def policy_versions(self) -> np.ndarray:  # [T] int64
        return np.concatenate(
            [np.full(len(s), s.policy_version, dtype=np.int64) for s in self.segments]
            or [np.zeros(0, dtype=np.int64)]
        )

    def staleness(self, current_version: int) -> np.ndarray:  # [T] int64
        return current_version - self.policy_versions()

    def append(self, token_ids: list[int], logprobs: np.ndarray, policy_version: int,
               origin: SegmentOrigin = SegmentOrigin.SAMPLED) -> None:
        """Extend the response (resume, continuation), merging into the last segment when the
        policy version and origin are unchanged."""
        logprobs = np.asarray(logprobs, dtype=np.float32)
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} logprobs")
        start = len(self.response_token_ids)
        last = self.segments[-1] if self.segments else None
        if last is not None and last.policy_version == policy_version and last.origin == origin:
            self.segments[-1] = Segment(last.start, start + len(token_ids), policy_version,
                                        np.concatenate([last.behavior_logprobs, logprobs]), origin)
        else:
            self.segments.append(Segment(start, start + len(token_ids), policy_version, logprobs, origin))
        self.response_token_ids.extend(token_ids)
