"""How a model-based scorer (``filter.judge``, ``filter.reward_model``, a criterion of ``filter.rubric``)
turns what it read into a score, with its declared fallback: one rule for all of them.

A scorer reads a ``Judged`` for each rollout: a value, or None with the reason no value could be
read (an empty or unparseable answer, a score out of range, a timeout, a non-finite logit, an
oversized input). ``settle`` gives the score (the value, or the scorer's declared ``fallback``),
whether it fell back, and the reason the lineage records (``<what> fallback 0: <reason>`` for a
fallback). ``write_model_score`` writes it the way ``filter.verify`` writes a verdict: ``reward``,
``correct = reward >= pass_at`` (never for a fallback), ``reward_components = {<name>: reward,
<name>_fallback: 0 | 1}`` and ``reward_reason``.

Example:

>>> settle(Judged(None, "judge gave an empty answer"), 0.0, "judge")
(0.0, True, 'judge fallback 0: judge gave an empty answer')
>>> settle(Judged(0.7, "judge score 7 in [0, 10]"), 0.0, "judge")
(0.7, False, 'judge score 7 in [0, 10]')
"""

from __future__ import annotations

from gfcr.records import Rollout
from gfcr.stages.filter.judge_prompts import Judged


def settle(judged: Judged, fallback: float, what: str) -> tuple[float, bool, str]:
    """``(score, fell_back, reason)``: the value read, or ``fallback`` with the reason no value was read."""
    if judged.value is not None:
        return judged.value, False, judged.reason
    return fallback, True, f"{what} fallback {fallback:g}: {judged.reason}"


def write_model_score(rollout: Rollout, judged: Judged, *, name: str, fallback: float, pass_at: float,
                      note: str = "") -> None:
    """Write a model's score (or its fallback) onto ``rollout``; ``note`` is appended to the reason."""
    reward, fell_back, reason = settle(judged, fallback, name.replace("_", " "))
    rollout.reward, rollout.correct = reward, not fell_back and reward >= pass_at
    rollout.reward_components = {name: reward, f"{name}_fallback": float(fell_back)}
    rollout.reward_reason = reason + note
