"""filter.entropy: a rollout-level gate on the mean token entropy of each response.

Each rollout's mean token entropy ``h_r = mean_t H_{r,t}`` is read from
``Rollout.token_entropy``, the entropy of the tempered, untruncated sampling distribution at
each token that the engine records while sampling (``generate.sample`` with ``entropy: true``;
``generate.tree`` with ``entropy: true`` or ``uncertainty: entropy``). Positions without a
recorded entropy (NaN: a resumed prefix) are left out of the mean. The band is a pair of
quantiles ``[q_lo, q_hi]`` of the ``h_r`` of the rollouts in scope, ``scope: batch`` (every
rollout of the included groups of this call) or ``scope: group`` (each group alone):

    lo = quantile(h, q_lo),  hi = quantile(h, q_hi)     (numpy's linear interpolation)
    in band  <=>  lo <= h_r <= hi

and each rollout gets the ``action``:

- ``keep`` (default): rollouts outside the band are removed from their group
  (``RolloutGroup.remove``, with their entropy and the band as the reason, kept for lineage);
- ``drop``: rollouts inside the band are removed;
- ``reweight``: rollouts inside the band have ``sample_weight`` multiplied by ``weight`` (the
  update scales their advantage by it); the others are unchanged.

A group left with no rollout is dropped. The output holds the included groups. Per step it
reports ``rollouts_seen``, ``rollouts_removed``, ``rollouts_reweighted``, ``entropy_mean`` and
the batch thresholds ``entropy_lo`` / ``entropy_hi`` (``scope: batch``).

Deviations: no single paper defines this gate (issue 11 asks for it as a generic Filter piece;
seed_methods 4.5 lists the Filter pieces defined elsewhere, and the entropy-based selections it
cites — D^3S' token level, arXiv 2509.22115, the "80/20" high-entropy tokens, arXiv 2506.01939 —
work on tokens, not whole rollouts). The defaults are this stage's choice: keep the band
``[0.2, 1.0]`` of the batch, i.e. remove the fifth of the rollouts the policy was most certain
about. A rollout with no recorded entropy at all raises ValueError naming it (and ``gfcr
validate`` refuses an upstream ``generate.sample`` that records none), rather than passing
silently.

Fidelity: gfcr's own: no paper defines this rollout-level gate; the band and defaults are this
stage's choice.

Example (four one-token rollouts of entropies 0.1 .. 0.4; keep the band [0.5, 1.0]):

>>> import numpy as np
>>> from gfcr.stages.testing import scored_group
>>> from gfcr.records import RolloutGroups
>>> group = scored_group("p:0", [1, 0, 1, 0])
>>> for i, r in enumerate(group.rollouts):
...     r.token_entropy = np.array([0.1 * (i + 1)], dtype=np.float32)
>>> out = EntropyGate(EntropyGate.Config(band=(0.5, 1.0))).run(RolloutGroups([group]))
>>> [r.rollout_id for r in group.rollouts], len(group.removed)
(['p:0@s0/2', 'p:0@s0/3'], 2)

YAML:

.. code-block:: yaml

    rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 8, entropy: true}}
    reward:  {use: filter.verify, from: rollout}
    gate:    {use: filter.entropy, from: reward, with: {action: keep, band: [0.2, 1.0]}}
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field, model_validator

from gfcr.records import Rollout, RolloutGroup, RolloutGroups
from gfcr.registry import PipelineProblem, RecordsEntropy, StageConfig
from gfcr.spec.problems import fixable


def mean_entropy(r: Rollout) -> float:
    """The mean recorded token entropy of a rollout (NaN positions left out); ValueError if none."""
    h = None if r.token_entropy is None else np.asarray(r.token_entropy, dtype=np.float64)
    if h is None or not np.isfinite(h).any():
        raise ValueError(f"rollout {r.rollout_id} has no recorded token entropy, and filter.entropy gates on it; "
                         "sample with `entropy: true` on the generate stage")
    return float(np.nanmean(h))


class EntropyGate:
    """Keep, drop or reweight rollouts by a quantile band of their mean token entropy."""

    class Config(StageConfig):
        action: Literal["keep", "drop", "reweight"] = Field(
            "keep", description="keep: remove rollouts outside the band; drop: remove those inside; reweight: "
                                "multiply the sample weight of those inside by `weight`")
        band: tuple[float, float] = Field((0.2, 1.0), description="[q_lo, q_hi]: quantiles of the rollouts' mean "
                                                                 "token entropies, 0 <= q_lo < q_hi <= 1")
        scope: Literal["batch", "group"] = Field("batch", description="quantiles over the whole call's rollouts "
                                                                      "or within each group")
        weight: Annotated[float, Field(ge=0.0, description="sample-weight factor inside the band "
                                                           "(action: reweight)")] = 0.5

        @model_validator(mode="after")
        def _band_is_ordered(self) -> "EntropyGate.Config":
            lo, hi = self.band
            if not 0.0 <= lo < hi <= 1.0:
                raise fixable(f"`band` must be two quantiles 0 <= q_lo < q_hi <= 1, got {list(self.band)}",
                              "write e.g. `band: [0.2, 1.0]` (the upper 80% of the mean entropies)")
            return self

    @staticmethod
    def check_pipeline(config: "EntropyGate.Config", view: Any) -> list[PipelineProblem]:
        """An upstream generator that records token entropies."""
        found = []
        for sid, generator in view.having(RecordsEntropy, upstream=True):
            if not generator.records_entropy:
                found.append(PipelineProblem(
                    ("action",), f"filter.entropy gates on recorded token entropies, and `{sid}` "
                                 f"({view.aliases[sid]}) does not record them",
                    f"set `entropy: true` on `{sid}` (--set stages.{sid}.with.entropy=true)"))
        return found

    def __init__(self, config: Config):
        self.config = config
        self._metrics: dict[str, float] = {}

    def step_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def run(self, groups: RolloutGroups) -> RolloutGroups:
        cfg = self.config
        included = [g for g in groups.included() if g.rollouts]
        entropies = {r.rollout_id: mean_entropy(r) for g in included for r in g.rollouts}
        metrics = {"rollouts_seen": float(len(entropies)), "rollouts_removed": 0.0, "rollouts_reweighted": 0.0,
                   "entropy_mean": float(np.mean(list(entropies.values()))) if entropies else float("nan")}
        if cfg.scope == "batch" and entropies:
            band = self._band(list(entropies.values()))
            metrics["entropy_lo"], metrics["entropy_hi"] = band
        for g in included:
            if cfg.scope == "group":
                band = self._band([entropies[r.rollout_id] for r in g.rollouts])
            removed, reweighted = self._apply(g, entropies, band)
            metrics["rollouts_removed"] += removed
            metrics["rollouts_reweighted"] += reweighted
        self._metrics = metrics
        return groups.included()

    def _band(self, values: list[float]) -> tuple[float, float]:
        lo, hi = np.quantile(np.asarray(values, dtype=np.float64), self.config.band)
        return float(lo), float(hi)

    def _apply(self, group: RolloutGroup, entropies: dict[str, float], band: tuple[float, float]) -> tuple[int, int]:
        cfg, (lo, hi) = self.config, band
        removed = reweighted = 0
        for r in list(group.rollouts):
            h = entropies[r.rollout_id]
            inside = lo <= h <= hi
            if cfg.action == "reweight":
                if inside:
                    r.sample_weight *= cfg.weight
                    reweighted += 1
            elif inside == (cfg.action == "drop"):
                where = "inside" if inside else "outside"
                group.remove(r.rollout_id, f"mean token entropy {h:.4g} {where} the band [{lo:.4g}, {hi:.4g}]")
                removed += 1
        if not group.rollouts:
            group.drop("every rollout removed by the entropy gate")
        return removed, reweighted
