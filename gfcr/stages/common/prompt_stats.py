"""Per-prompt statistics shared by the stages that learn from past groups (the Control
selectors, ``filter.beta_difficulty``): what a group tells about its prompt, a Beta posterior
over the prompt's success rate, and ``PromptStats`` as plain checkpointable data.

The record itself is ``gfcr.records.PromptStats`` (history ring buffer, GRESO's easy/hard
streaks, ``beta_alpha`` / ``beta_beta``); this module holds the functions around it:

- ``observe_group``: the ``Observation`` a group makes of its prompt, counting only the
  rollouts a verifier judged (``rollout.correct`` not None); None when none was judged. Its
  ``mean_entropy`` is the mean per-token entropy over those rollouts' response tokens whose
  entropy the generator recorded (``generate.sample`` with ``entropy: true``), NaN when none.
- ``beta_update``: the decayed Beta update of MoPPS (Qu et al., 2025, arXiv 2507.04632),
  ``alpha <- lam * alpha + (1 - lam) * alpha0 + s`` and
  ``beta <- lam * beta + (1 - lam) * beta0 + (n - s)`` for ``s`` successes out of ``n``;
  ``lam = 1`` is the plain conjugate update, ``lam < 1`` forgets toward the prior.
- ``beta_mean``: the posterior mean ``alpha / (alpha + beta)``.
- ``visit_draw``: the seeded uniform draw of one visit of a prompt (GRESO's skip, HIVE's
  re-admission), a pure function of ``(seed, epoch, step, crc32(prompt_id))``, so a resumed
  run redraws it exactly.
- ``stats_to_state`` / ``stats_from_state``: ``PromptStats`` to JSON-safe data and back
  (enums as strings, NaN as None), what a stage's ``state_dict`` stores.

Example:

>>> from gfcr.records import PromptStats
>>> stats = PromptStats("p:0", beta_alpha=3.0, beta_beta=2.0)
>>> beta_update(stats, successes=1, n=1, decay=0.5, prior_alpha=1.0, prior_beta=1.0)
>>> (stats.beta_alpha, stats.beta_beta)  # 0.5*3 + 0.5*1 + 1, 0.5*2 + 0.5*1 + 0
(3.0, 1.5)
>>> beta_mean(stats)
0.6666666666666666
>>> stats_from_state(stats_to_state(stats)) == stats
True
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from dataclasses import fields
from enum import Enum
from typing import Any, Sequence

import numpy as np

from gfcr.records import Lifecycle, Observation, ObservationSource, PromptStats, Rollout, RolloutGroup

NAN_FIELDS = ("mean_reward", "reward_std", "mean_entropy")  # Observation floats stored as None when NaN


def observe_group(group: RolloutGroup, policy_version: int) -> Observation | None:
    """The observation a group makes of its prompt: correct out of the judged rollouts (None
    when no rollout was judged)."""
    judged = [r for r in group.rollouts if r.correct is not None]
    if not judged:
        return None
    stats = group.stats
    return Observation(step=group.step, policy_version=policy_version, n=len(judged),
                       n_correct=sum(bool(r.correct) for r in judged), mean_reward=stats.reward_mean,
                       reward_std=stats.reward_std, mean_length=stats.mean_length,
                       mean_entropy=response_entropy(judged))


def response_entropy(rollouts: Sequence[Rollout]) -> float:
    """Mean token entropy over the rollouts' response tokens with a recorded (finite) entropy,
    every token weighing the same; NaN when no token has one."""
    parts = [r.token_entropy for r in rollouts if r.token_entropy is not None]
    values = np.concatenate(parts) if parts else np.zeros(0)
    values = values[np.isfinite(values)]
    return float(values.mean()) if values.size else math.nan


def stats_with_prior(stats: dict[str, PromptStats], prompt_id: str, history_size: int,
                     prior_alpha: float, prior_beta: float) -> PromptStats:
    """``stats[prompt_id]``, created at the Beta prior on first sight."""
    if prompt_id not in stats:
        stats[prompt_id] = PromptStats(prompt_id, history_size=history_size, beta_alpha=prior_alpha,
                                       beta_beta=prior_beta)
    return stats[prompt_id]


def beta_update(stats: PromptStats, successes: int, n: int, decay: float,
                prior_alpha: float, prior_beta: float) -> None:
    """Decay ``stats``' Beta posterior toward the prior by ``decay`` (MoPPS's lambda), then add
    ``successes`` out of ``n`` Bernoulli trials."""
    if not 0 <= successes <= n:
        raise ValueError(f"prompt {stats.prompt_id}: {successes} successes out of {n} trials")
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must be in [0, 1], got {decay}")
    stats.beta_alpha = decay * stats.beta_alpha + (1.0 - decay) * prior_alpha + successes
    stats.beta_beta = decay * stats.beta_beta + (1.0 - decay) * prior_beta + (n - successes)


def beta_mean(stats: PromptStats) -> float:
    """The posterior mean success rate ``alpha / (alpha + beta)``."""
    return stats.beta_alpha / (stats.beta_alpha + stats.beta_beta)


def visit_draw(seed: int, epoch: int, step: int, prompt_id: str) -> float:
    """The uniform [0, 1) draw of one visit of a prompt, a pure function of where it happens."""
    return float(np.random.default_rng([seed, epoch, step, zlib.crc32(prompt_id.encode())]).random())


def _plain(value: Any) -> Any:
    """A JSON-safe form of a PromptStats or Observation field (enums as strings, NaN as None)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def stats_to_state(stats: PromptStats) -> dict[str, Any]:
    """PromptStats as plain JSON-serializable data."""
    state = {f.name: _plain(getattr(stats, f.name)) for f in fields(PromptStats) if f.name != "history"}
    state["history"] = [{f.name: _plain(getattr(o, f.name)) for f in fields(Observation)} for o in stats.history]
    return state


def stats_from_state(state: dict[str, Any]) -> PromptStats:
    """The inverse of ``stats_to_state``."""
    history = deque(
        Observation(**{**o, "source": ObservationSource(o["source"]),
                       **{k: math.nan for k in NAN_FIELDS if k in o and o[k] is None}})
        for o in state["history"]
    )
    return PromptStats(**{**state, "history": history, "lifecycle": Lifecycle(state["lifecycle"])})
