"""Scoring a response text against a ``VerifierSpec``: the reward, and the verifier's verdict.

``score_texts`` scores many ``(text, spec)`` pairs at once on this process's pool of killable
worker processes (``gfcr.stages.verifiers.pool``), ``score_text`` one, and ``score_rollout``
writes the verdict onto a rollout. The reward mixes correctness and format,
``(1 - format_weight) * correct + format_weight * formatted``, in [0, 1]. A verifier that
raises, runs past ``timeout_s`` or kills its worker scores 0 with the reason recorded; an
unknown verifier name is a ``RegistryError`` (a configuration mistake, not a bad response).
``timeout_s=None`` calls the verifier in this thread, unguarded (no worker, no limits).

The ``filter.verify`` stage scores a step's rollouts with these; so do the stages that roll out
on their own (``control.dots``'s reference rollouts, ``control.sgpo``'s profile) and the
runtime's evaluation on a held-out set, which have no stage in front of them.

Example:

>>> from gfcr.records import VerifierSpec
>>> score_text("Answer: 59", VerifierSpec("arithmetic", "59"), timeout_s=None)
(1.0, Score(correct=True, formatted=True, answer='59', reason='answer 59 == 59'))
"""

from __future__ import annotations

import functools
from typing import Sequence

from gfcr.records import Rollout, VerifierSpec
from gfcr.registry import Registry
from gfcr.stages.verifiers import VERIFIERS, Score, Verifier
from gfcr.stages.verifiers.pool import Call, prepare_once, Overran, WorkerDied, default_workers, describe, shared_pool

DEFAULT_MEMORY_MB = 2048  # sympy on a hard expression stays well under this


@functools.cache
def _prepare(verifier: Verifier) -> None:
    """Run the verifier's optional ``prepare()`` once in this process (the unguarded path)."""
    prepare_once(verifier)


def _reward(score: Score, format_weight: float) -> float:
    return (1.0 - format_weight) * float(score.correct) + format_weight * float(score.formatted)


def _verdict(outcome: Score | BaseException, format_weight: float) -> tuple[float, Score]:
    """(reward, score) of a pool call's outcome: an overrun, a dead worker or a verifier error scores 0."""
    if isinstance(outcome, Score):
        return _reward(outcome, format_weight), outcome
    if isinstance(outcome, (Overran, WorkerDied)):
        return 0.0, Score(False, False, None, str(outcome))
    return 0.0, Score(False, False, None, f"verifier error: {describe(outcome)}")


def score_texts(items: Sequence[tuple[str, VerifierSpec]], *, format_weight: float = 0.0, timeout_s: float = 5.0,
                memory_mb: int | None = DEFAULT_MEMORY_MB, workers: int | None = None,
                verifiers: Registry[Verifier] = VERIFIERS) -> list[tuple[float, Score]]:
    """``score_text`` of many ``(text, spec)`` pairs, in parallel on this process's worker pool."""
    calls = [Call(verifiers.get(spec.name), text, spec.ground_truth, dict(spec.options)) for text, spec in items]
    if not calls:
        return []
    pool = shared_pool(workers or default_workers(), memory_mb)
    return [_verdict(outcome, format_weight) for outcome in pool.map(calls, timeout_s)]


def score_text(text: str, spec: VerifierSpec, *, format_weight: float = 0.0, timeout_s: float | None = 5.0,
               memory_mb: int | None = DEFAULT_MEMORY_MB, workers: int | None = None,
               verifiers: Registry[Verifier] = VERIFIERS) -> tuple[float, Score]:
    """(reward, score) of ``text`` against ``spec``. A verifier error, timeout or dead worker
    scores 0 with the reason recorded; an unknown verifier name is a RegistryError (a
    configuration mistake, not a bad response). ``timeout_s=None`` calls the verifier in this
    thread, unguarded (no worker process, no limits)."""
    if timeout_s is not None:
        (scored,) = score_texts([(text, spec)], format_weight=format_weight, timeout_s=timeout_s,
                                memory_mb=memory_mb, workers=workers, verifiers=verifiers)
        return scored
    verifier = verifiers.get(spec.name)
    _prepare(verifier)
    try:
        score = verifier(text, spec.ground_truth, dict(spec.options))
    except Exception as exc:
        return 0.0, Score(False, False, None, f"verifier error: {type(exc).__name__}: {exc}")
    return _reward(score, format_weight), score


def score_item(item: tuple[str, VerifierSpec], *, format_weight: float = 0.0, timeout_s: float | None = 5.0,
               memory_mb: int | None = DEFAULT_MEMORY_MB, workers: int | None = None,
               verifiers: Registry[Verifier] = VERIFIERS) -> tuple[float, Score]:
    """``score_text`` of one ``(text, spec)`` pair: the pure function ``Lent.map`` runs."""
    text, spec = item
    return score_text(text, spec, format_weight=format_weight, timeout_s=timeout_s, memory_mb=memory_mb,
                      workers=workers, verifiers=verifiers)


def score_rollout(rollout: Rollout, spec: VerifierSpec, *, format_weight: float = 0.0,
                  timeout_s: float | None = 5.0, verifiers: Registry[Verifier] = VERIFIERS) -> None:
    """Score ``rollout.text`` against ``spec`` and write reward, correct, components and reason."""
    reward, score = score_text(response_text(rollout), spec, format_weight=format_weight, timeout_s=timeout_s,
                               verifiers=verifiers)
    write_score(rollout, reward, score)


def response_text(rollout: Rollout) -> str:
    if rollout.text is None:
        raise ValueError(f"rollout {rollout.rollout_id} has no text to verify; "
                         "the generate stage must decode responses into `Rollout.text`")
    return rollout.text


def write_score(rollout: Rollout, reward: float, score: Score) -> None:
    """Write a verifier's verdict onto ``rollout``: reward, correct, components and reason."""
    rollout.reward, rollout.correct = reward, score.correct
    rollout.reward_components = {"correct": float(score.correct), "format": float(score.formatted)}
    rollout.reward_reason = score.reason
