"""advantage ``opob``: VCPO's optimal off-policy baseline (Variance-Controlled Policy Optimization,
"Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs", arXiv 2602.17616): the closed-form
baseline that minimises the variance of the importance-weighted policy gradient, as the authors'
code computes it (mit-han-lab/vcpo, ``compute_opob_baseline`` and ``_update_grad_buffers``).

Each trajectory's gradient weighs in the baseline by its squared norm and its squared importance
weight. Per group of ``G`` rollouts with rewards ``R_i``:

    W_i = ||g_i||^2 * w_i^2                     (/ L_i^2 with ``normalize_by_length``)
    b   = sum_i W_i R_i / (sum_i W_i + eps)     (``agg: mean``; weighted median or winsorized mean)
    A_i = (R_i - b) / std(R)                    (``norm_by_std``, where std > 1e-8; else R_i - b)

``g_i`` is the gradient of trajectory ``i``'s own loss at advantage 1, summed over its counted
tokens (the reference's ``grad_norm_unscaled``: the per-trajectory gradient with the loss, its
ratio and the off-policy correction's weights as the update takes them), ``w_i = exp(sum_t log
pi_old(y_t) - log mu(y_t))`` its sequence importance weight (``min(w_i, C)`` with
``use_clipped_is_ratios``), ``L_i`` its counted tokens and ``std`` the group's population std.
``update.grpo`` takes one extra forward and backward pass per trajectory for ``||g_i||^2``
before its backward pass (the reference's ``update_policy_per_traj``: one backward per
trajectory), under trainer ranks each rank for its own trajectories, the norms then summed over
the ranks so that every rank has its groups whole. ``estimate`` (what the batch is planned with,
and the advantage where no gradient is taken) is the same rule with every ``W_i = 1``.

Defaults from the authors' script (``recipe/fully_async_policy/shell/vcpo/math/vcpo_k=10.sh``):
scope group, ``agg: mean``, ``use_is_weights: true``, ``norm_by_std: true``,
``use_clipped_is_ratios: false``, ``normalize_by_length: false``, ``rollout_is_threshold: 8.0``.
The authors require a sequence-mean aggregation with it (``seq-mean-token-mean`` in the
script), and so does this estimator.

Fidelity: checked against mit-han-lab/vcpo@c7f030f: 12/12 cases (``tests/fidelity/opob.json``;
``compute_grad_info``, ``compute_opob_baseline`` and ``_update_grad_buffers`` with stand-in
gradient buffers that record each trajectory's coefficient, i.e. its effective advantage: the
baselines and advantages from given gradient norms, sequence weights, lengths and rewards;
equal weights, two groups, groups of 2 and 8, with and without IS weights, clipped weights,
length normalisation, without std normalisation, median, winsorized mean, continuous and equal
rewards).

Deviations:
- scope ``group`` only: the reference's ``minibatch`` scope (one baseline over the mini-batch's
  advantages) is not offered;
- ``g_i`` leaves out the KL term to the reference policy (the reference's per-trajectory loss
  includes its KL loss when one is configured; the authors' script has none);
- a group whose rewards are all equal, or of one rollout, gets exactly 0 and takes no backward
  pass (``update.grpo`` skips rollouts without signal); the reference gives them
  ``R eps / (sum W + eps)``, below 1e-8 of their reward (1 reference case checks the function's
  value, which ``refine_group`` returns);
- the gradient is then the update's ordinary backward pass with these advantages (one more
  pass); the reference builds it from the per-trajectory gradients it kept
  (``R_i g_i`` and ``g_i`` buffers), which is the same gradient when the loss is linear in the
  advantage, as it is with the authors' clip range (``clip_ratio_low 1.0``, ``high 1e9``): with a
  ratio clip that binds, the reference clips every trajectory as if its advantage were positive.

Example (two correct and two wrong responses; the first correct one's gradient is three times
longer, so the baseline moves towards 1):

>>> import numpy as np
>>> opob = OPOB(OPOB.Config())
>>> a = opob.refine_group(np.array([1.0, 1.0, 0.0, 0.0]), np.array([9.0, 1.0, 1.0, 1.0]), np.zeros(4), np.full(4, 3.0))
>>> [round(float(x), 4) for x in a]
[0.3333, 0.3333, -1.6667, -1.6667]

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {advantage: {use: opob, with: {agg: mean, norm_by_std: true}}, aggregation: {use: seq_mean_token_mean}}}
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import numpy as np
from pydantic import Field

from gfcr.records import RolloutGroup
from gfcr.stages.components.advantage.base import Advantages, EstimatorConfig, checked_rewards, has_no_baseline
from gfcr.stages.components.base import Requirement

STD_FLOOR = 1e-8  # the reference normalises by the std only above it
WINSOR = (0.05, 0.95)  # the reference's weighted quantiles of the winsorized mean


class OPOB:
    """Rewards centred on the gradient-norm- and IS-weighted group mean, divided by the group std."""

    requires: ClassVar[tuple[Requirement, ...]] = (Requirement(
        "aggregation", ("seq_mean_token_mean", "seq_mean_token_sum"),
        "VCPO's OPOB baseline is defined per trajectory (the authors assert a seq-mean aggregation)"),)

    class Config(EstimatorConfig):
        agg: Literal["mean", "median", "winsorized_mean"] = Field(
            "mean", description="the weighted mean (the authors' script), median or 5-95% winsorized mean")
        use_is_weights: bool = Field(True, description="W_i includes the squared sequence IS weight w_i^2")
        use_clipped_is_ratios: bool = Field(False, description="w_i clipped at rollout_is_threshold in W_i")
        rollout_is_threshold: Annotated[float, Field(gt=0.0)] | None = Field(
            8.0, description="C of min(w_i, C) (the authors' rollout_is_threshold); null: none")
        normalize_by_length: bool = Field(False, description="W_i divided by the squared response length")
        norm_by_std: bool = Field(True, description="divide R_i - b by the group's population std (where > 1e-8)")
        eps: Annotated[float, Field(ge=0.0)] = Field(1e-8, description="added to the sum of weights (the reference's)")

    def __init__(self, config: Config):
        self.config = config

    def estimate(self, group: RolloutGroup) -> Advantages:
        """The stand-in with every ``W_i = 1`` (the update replaces it by ``refine_group``'s); exactly 0
        for a lone rollout or equal rewards, which take no backward pass."""
        r = checked_rewards(group)
        if has_no_baseline(r):
            return Advantages.scalars(r * 0.0)
        return Advantages.scalars(self._advantages(r, np.ones(len(r))))

    def refine_group(self, rewards: np.ndarray, sq_grad_norms: np.ndarray, log_seq_weights: np.ndarray,
                     lengths: np.ndarray) -> np.ndarray:
        """``[G]`` advantages of one group from its trajectories' squared gradient norms, log
        sequence IS weights and lengths."""
        weights = self.trajectory_weights(sq_grad_norms, log_seq_weights, lengths)
        return self._advantages(np.asarray(rewards, dtype=np.float64), weights)

    def trajectory_weights(self, sq_grad_norms: np.ndarray, log_seq_weights: np.ndarray,
                           lengths: np.ndarray) -> np.ndarray:
        """``[G]``: ``W_i = ||g_i||^2 w_i^2`` (``/ L_i^2``), as the Config says."""
        cfg = self.config
        w = np.exp(np.asarray(log_seq_weights, dtype=np.float64))
        if cfg.use_clipped_is_ratios and cfg.rollout_is_threshold is not None:
            w = np.minimum(w, cfg.rollout_is_threshold)
        weights = np.asarray(sq_grad_norms, dtype=np.float64) * (w ** 2 if cfg.use_is_weights else 1.0)
        return weights / np.asarray(lengths, dtype=np.float64) ** 2 if cfg.normalize_by_length else weights

    def baseline(self, values: np.ndarray, weights: np.ndarray) -> float:
        """The weighted mean, median or winsorized mean of ``values`` (the reference's, on lists)."""
        if len(values) == 0:
            return 0.0
        if self.config.agg == "mean":
            return float((values * weights).sum() / (weights.sum() + self.config.eps))
        if weights.sum() == 0.0:
            return 0.0
        if self.config.agg == "median":
            return _weighted_quantile(values, weights, 0.5)
        low, high = (_weighted_quantile(values, weights, q) for q in WINSOR)
        return float((np.clip(values, low, high) * weights).sum() / (weights.sum() + self.config.eps))

    def _advantages(self, rewards: np.ndarray, weights: np.ndarray) -> np.ndarray:
        b = self.baseline(rewards, weights)
        std = float(rewards.std()) if len(rewards) else 0.0  # population std, as the reference's
        scale = 1.0 / std if self.config.norm_by_std and std > STD_FLOOR else 1.0
        return (rewards - b) * scale


def _weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The first value (ascending) whose cumulative weight reaches ``q`` of the total."""
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    at = int(np.searchsorted(cum, q * cum[-1], side="left"))
    return float(values[order][min(at, len(values) - 1)])
