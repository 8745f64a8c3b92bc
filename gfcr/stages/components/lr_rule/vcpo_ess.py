"""lr_rule ``vcpo_ess``: VCPO's learning-rate rule (Variance-Controlled Policy Optimization, "Stable
Asynchrony: Variance-Controlled Off-Policy RL for LLMs", arXiv 2602.17616): the step size shrinks
with the batch's effective sample size, as the authors' code computes it
(mit-han-lab/vcpo, ``compute_ess_info`` and ``_optimizer_step_with_buffer``).

Stale rollouts make a few trajectories' importance weights dominate the gradient; VCPO measures
that with the effective sample size of the batch's sequence weights and takes a smaller step:

    w_i   = exp(sum_t log pi_old(y_t) - log mu(y_t))       (trajectory i; optionally min(w_i, C))
    ESS   = (sum_i w_i)^2 / (sum_i w_i^2 + 1e-8),   rho = ESS / B
    scale = min(1, rho / base_ess_ratio)
    lr    = base_lr * sqrt(scale)   (``scaling_rule: sqrt``)   or   base_lr * scale   (``linear``)

for that one optimizer step, every param group alike; the learning rates are restored after it.
``pi_old`` is the policy at update start (the detached log-probs of the gradient pass: the
authors' ``skip_recompute_old_log_prob`` setting, which their script uses), ``mu`` the
behaviour log-probs the engine recorded; ``B`` counts the batch's trajectories over every
trainer rank (the sums are added across ranks, as the reference all-reduces them). On fresh
rollouts every ``w_i`` is 1, so ``rho = 1`` and the learning rate is unchanged.

Defaults from the authors' script (``recipe/fully_async_policy/shell/vcpo/math/vcpo_k=10.sh``):
``scaling_rule: sqrt``, ``base_ess_ratio: 1.0``, ``use_clipped: false`` (``rho`` from the
unclipped weights), ``rollout_is_threshold: 8.0`` (the clip of the clipped weights, their
``rollout_is_threshold``). The script also trains with lr 1e-6 constant, weight decay 0.1,
gradient clip 1.0, 16 rollouts per prompt, staleness up to 10.

The metrics add ``ess``, ``ess_ratio``, ``ess_clipped``, ``ess_ratio_clipped`` and
``lr_factor`` (the factor the learning rate was multiplied by).

Fidelity: checked against mit-han-lab/vcpo@c7f030f: 10/10 cases (``tests/fidelity/vcpo_ess.json``;
``compute_is_info``, ``compute_ess_info`` and ``_optimizer_step_with_buffer``'s learning-rate
rule, its optimizer a stand-in that records the rates at the step and after: on-policy,
mild and strong staleness, sqrt and linear, clipped weights, no threshold, base ratio 0.5, one
trajectory, one dominant trajectory, padding).

Deviations:
- the weights are summed over the tokens that count in the loss (a Filter's loss mask, the
  staleness limit, a trajectory's environment turns are left out); the reference sums over the
  whole response mask;
- ``B`` and the sums cover the trajectories that enter the backward pass: a rollout whose
  advantage is zero on every token never does (``update.grpo``), where the reference counts
  every trajectory of the mini-batch (with ``filter.nonzero_variance`` upstream, as the shipped
  pipeline has, the two agree);
- one optimizer step per batch (the reference steps once per mini-batch of its batch).

Example (four trajectories, one of which the current policy now finds e^2 times likelier than
the behaviour policy did: ``rho = 0.47``, so the learning rate is scaled by ``sqrt(0.47)``):

>>> import torch
>>> rule = VCPOESS(VCPOESS.Config())
>>> totals = rule.sums(torch.tensor([2.0, 0.0, 0.0, 0.0])).tolist()
>>> factor, metrics = rule.factor(totals)
>>> round(metrics["ess_ratio"], 4), round(factor, 4)
(0.4685, 0.6845)

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {lr_rule: {use: vcpo_ess, with: {scaling_rule: sqrt, base_ess_ratio: 1.0}}}}
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from gfcr.stages.components.lr_rule.base import LrRuleConfig

EPS = 1e-8  # the reference's, in the ESS's denominator


class VCPOESS:
    """The learning rate scaled by the batch's effective-sample-size ratio (sqrt or linear)."""

    class Config(LrRuleConfig):
        scaling_rule: Literal["sqrt", "linear"] = Field(
            "sqrt", description="lr = base_lr * sqrt(scale) (the authors' script) or base_lr * scale")
        base_ess_ratio: Annotated[float, Field(gt=0.0)] = Field(
            1.0, description="the ESS ratio at and above which the learning rate is not scaled (the authors' 1.0)")
        use_clipped: bool = Field(False, description="take rho from the weights clipped at rollout_is_threshold "
                                                     "(the authors' script: false)")
        rollout_is_threshold: Annotated[float, Field(gt=0.0)] | None = Field(
            8.0, description="C of the clipped weights min(w_i, C) (the authors' rollout_is_threshold); null: none")

    def __init__(self, config: Config):
        self.config = config

    def sums(self, log_seq_weights: Any) -> Any:
        """``[5]``: the count, sum and sum of squares of the weights, then of the clipped ones."""
        import torch

        w = torch.exp(log_seq_weights.detach()).to(torch.float64)  # exp in the log-probs' dtype, as the reference
        c = self.config.rollout_is_threshold
        clipped = w if c is None else w.clamp(max=c)
        return torch.stack([torch.tensor(float(w.numel()), dtype=torch.float64), w.sum(), (w * w).sum(),
                            clipped.sum(), (clipped * clipped).sum()])

    def factor(self, totals: list[float]) -> tuple[float, dict[str, float]]:
        n, s, ss, sc, ssc = totals
        ess, ess_clipped = (s * s / (ss + EPS), sc * sc / (ssc + EPS)) if n > 0 else (0.0, 0.0)
        ratio, ratio_clipped = (ess / n, ess_clipped / n) if n > 0 else (0.0, 0.0)
        scale = min(1.0, (ratio_clipped if self.config.use_clipped else ratio) / max(self.config.base_ess_ratio, EPS))
        factor = scale ** 0.5 if self.config.scaling_rule == "sqrt" else scale
        return factor, {"ess": ess, "ess_ratio": ratio, "ess_clipped": ess_clipped,
                        "ess_ratio_clipped": ratio_clipped, "lr_factor": factor}
