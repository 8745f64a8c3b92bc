"""A rollout kept for a later step: ``StoredRollout``, what replay and reuse keep of a ``Rollout``.

The replay store (``replay.store``), RLEP's experience pool and the reusing stages
(``replay.rollout_replay``, ``replay.correct_cache``, ``control.pilot_commit``) keep rollouts
as these. A ``StoredRollout`` keeps what replay needs of a ``Rollout`` (token ids, segments
with their policy versions and behaviour log-probs, status, origin, text, reward) and none of
its update-time fields (advantage, loss mask), which belong to the step that computed them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gfcr.records import Origin, Rollout, RolloutStatus, Segment

FIXED_BYTES = 64  # ids, step, reward, flags: the estimate of an entry's fixed fields
SEGMENT_BYTES = 24  # start, end, policy version


@dataclass(frozen=True, slots=True)
class StoredRollout:
    """One rollout in a replay store, under its ``entry_id`` (unique for the store's life)."""

    entry_id: int
    rollout_id: str
    group_id: str
    prompt_id: str
    step: int  # the step that generated it
    added_step: int  # the step it entered the store
    response_token_ids: np.ndarray  # [T] int32
    segments: tuple[Segment, ...]
    status: RolloutStatus
    origin: Origin
    finish_reason: str
    text: str
    reward: float | None
    correct: bool | None
    priority: float
    nbytes: int  # the store's estimate of what the entry holds, its vector included

    @property
    def policy_version(self) -> int:
        """The oldest policy version among its tokens (0 for an empty response)."""
        return min((s.policy_version for s in self.segments), default=0)

    @property
    def policy_version_max(self) -> int:
        return max((s.policy_version for s in self.segments), default=0)

    def staleness(self, current_version: int) -> int:
        """Policy versions between its oldest token and ``current_version``."""
        return current_version - self.policy_version

    def to_rollout(self, rollout_id: str, group_id: str, origin: Origin = Origin.REPLAYED) -> Rollout:
        """A new ``Rollout`` with this one's tokens, segments and outcome, recording where it came from
        (``replayed_from``, ``created_step``, ``replayed_policy_version``); its update-time fields start empty."""
        segments = [Segment(s.start, s.end, s.policy_version, s.behavior_logprobs.copy(), s.origin)
                    for s in self.segments]
        return Rollout(rollout_id, group_id, self.prompt_id, self.response_token_ids.tolist(), segments,
                       status=self.status, origin=origin, finish_reason=self.finish_reason, created_step=self.step,
                       text=self.text, reward=self.reward, correct=self.correct, replayed_from=self.rollout_id,
                       replayed_policy_version=self.policy_version)


def stored_bytes(n_tokens: int, n_segments: int, text: str, dim: int) -> int:
    """Token ids and log-probs (4 B each per token), segments, UTF-8 text, the vector (4 B per dimension)."""
    return FIXED_BYTES + 8 * n_tokens + SEGMENT_BYTES * n_segments + len(text.encode("utf-8")) + 4 * dim


def stored_from(rollout: Rollout, entry_id: int, added_step: int, text: str, priority: float,
                dim: int) -> StoredRollout:
    tokens = np.asarray(rollout.response_token_ids, dtype=np.int32)
    segments = tuple(Segment(s.start, s.end, s.policy_version, s.behavior_logprobs.copy(), s.origin)
                     for s in rollout.segments)
    return StoredRollout(
        entry_id=entry_id, rollout_id=rollout.rollout_id, group_id=rollout.group_id, prompt_id=rollout.prompt_id,
        step=rollout.created_step, added_step=added_step, response_token_ids=tokens, segments=segments,
        status=rollout.status, origin=rollout.origin, finish_reason=rollout.finish_reason, text=text,
        reward=rollout.reward, correct=rollout.correct, priority=float(priority),
        nbytes=stored_bytes(len(tokens), len(segments), text, dim))
