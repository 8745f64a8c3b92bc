"""A rollout as a state tree (``gfcr.runtime.store.state_tree``: JSON and arrays, nothing pickled), for
the stages that keep rollouts across steps in their checkpointed state: ``generate.partial``'s
buffer and ``generate.speculative``'s draft store. Generation fields and outcome only; the
update-time fields (advantage, loss mask, old log-probs) belong to the step that computed them."""

from __future__ import annotations

from typing import Any

import numpy as np

from gfcr.records import Origin, Rollout, RolloutStatus, Segment, SegmentOrigin, Turn


def copy_segment(s: Segment) -> Segment:
    return Segment(s.start, s.end, s.policy_version, s.behavior_logprobs.copy(), s.origin)


def snapshot(r: Rollout) -> Rollout:
    """What a buffer keeps of a rollout: its generation fields and reward, copied (later stages
    write on the original). ``rollout_state`` is the same as a state tree, for checkpoints."""
    return rollout_from_state(rollout_state(r))


def rollout_state(r: Rollout) -> dict[str, Any]:
    return {"rollout_id": r.rollout_id, "group_id": r.group_id, "prompt_id": r.prompt_id,
            "tokens": np.asarray(r.response_token_ids, np.int64), "status": str(r.status), "origin": str(r.origin),
            "finish_reason": r.finish_reason, "stop_reason": r.stop_reason, "created_step": r.created_step,
            "text": r.text, "replica": r.replica, "ray_node": r.ray_node,
            "resumed_from": r.resumed_from, "resumed_tokens": r.resumed_tokens, "draft_from": r.draft_from,
            "draft_tokens": r.draft_tokens, "reward": r.reward, "correct": r.correct, "entropy": r.token_entropy,
            "turns": None if r.turns is None else [t.state() for t in r.turns],
            "segments": [[s.start, s.end, s.policy_version, s.behavior_logprobs, str(s.origin)] for s in r.segments]}


def rollout_from_state(d: dict[str, Any]) -> Rollout:
    segments = [Segment(int(a), int(b), int(v), np.asarray(lp, np.float32), SegmentOrigin(o))
                for a, b, v, lp, o in d["segments"]]
    entropy = None if d["entropy"] is None else np.asarray(d["entropy"], np.float32)
    turns = None if d.get("turns") is None else [Turn.from_state(t) for t in d["turns"]]  # absent before trajectories
    return Rollout(d["rollout_id"], d["group_id"], d["prompt_id"], [int(t) for t in d["tokens"]], segments,
                   status=RolloutStatus(d["status"]), origin=Origin(d["origin"]), finish_reason=d["finish_reason"],
                   stop_reason=d.get("stop_reason", ""), created_step=d["created_step"], text=d["text"],
                   replica=d["replica"], ray_node=d.get("ray_node"),  # absent in checkpoints before nodes were recorded
                   resumed_from=d["resumed_from"], resumed_tokens=d["resumed_tokens"], draft_from=d["draft_from"],
                   draft_tokens=d["draft_tokens"], reward=d["reward"], correct=d["correct"], token_entropy=entropy,
                   turns=turns)
