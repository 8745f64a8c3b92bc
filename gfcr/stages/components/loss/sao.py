"""loss ``sao``: SAO, Single-rollout Asynchronous Optimization (Hou, Li, Tang, Dong, "SAO",
arXiv 2607.07508), as the third-party reproduction Human-Agent-Society/reef computes it
(``recipes/sao``, ``compute_sao_loss``; no official code was found).

One rollout per prompt, trained asynchronously on whatever policy sampled it: the ratio is
taken against the rollout's own log-probs ``mu`` and used as a detached importance weight, and
a token whose ratio left the trust region contributes nothing (a hard mask, where PPO would
clip):

    r_t = exp(log pi_theta(y_t) - log mu(y_t))
    f_t = r_t if 1 - eps_low < r_t < 1 + eps_high else 0          (strict on both sides)
    l_t = -sg(f_t) A_t log pi_theta(y_t)

so the gradient is ``-f_t A_t grad log pi_theta(y_t)``, with no PPO min. The loss's value is the
reference's (``log pi_theta``, not the log-ratio, multiplies: ``needs_logprobs``).

Defaults: ``clip: [0.3, 5.0]``, the paper's reasoning setting as the recipe quotes it (its
coding setting is ``[0.8, 3.0]``); the paper trains on one rollout per prompt, 128 per step.

Fidelity: checked against Human-Agent-Society/reef@026007c: 24/24 cases
(``tests/fidelity/sao.json``; ``compute_sao_loss``: the per-token losses, the masked-token
indicator and the gradient w.r.t. the current log-probs, the reasoning, coding and a PPO-like
clip, fresh, stale and far-off ratios, ratios just inside and outside both bounds, zero
advantages).

Deviations:
- SAO's advantage is token-level GAE from a value model (``--use-critic``; skip-observation
  GAE over action tokens, the reward on the last one, an optional length-adaptive lambda
  ``1 - 1/(1.5 L)``, critic targets at lambda 1). gfcr has no value model: the shipped SAO
  pipeline (``pipelines/examples/sao_single_arith.yaml``) uses ``reinforce_pp_plain`` with
  ``std_norm: false``, ``A_i = r_i - sum_j n_j r_j / N``, which is that GAE's limit with
  lambda = gamma = 1 under a value model that sees nothing (a constant fitted to the batch's
  tokens by the critic's own Monte-Carlo regression). The per-prompt, per-position values a
  critic learns are not there;
- the ratio is against ``mu`` (the correction ``none``, ``staleness`` or ``freshness``,
  which SAO pairs with); ``tis``, ``decoupled_clip`` and ``recompute_old`` would weight the ratio twice and are
  refused by ``gfcr validate``;
- ``clipped`` (``clip_fraction``) is the reference's ``clipfrac``, the masked tokens; the
  reference's step schedule of critic and actor, its policy-lag and queue-age metrics, and
  its ``torch.compile`` are not here (the reference cases ran it eagerly).

Example (three tokens of a stale rollout: the first within the trust region keeps its weight
``r = 1.5``, the second (``r = 0.5``, under ``1 - 0.3``) and the third (``r = 7``, over
``1 + 5``) are masked):

>>> import math, torch
>>> loss = SAO(SAO.Config())
>>> logp = torch.log(torch.tensor([[0.3, 0.1, 0.7]]))
>>> log_ratio = torch.log(torch.tensor([[1.5, 0.5, 7.0]]))
>>> t = loss.terms(log_ratio, torch.ones(1, 3), torch.ones(1, 3), logprobs=logp)
>>> [round(float(v), 4) for v in t.per_token[0]], t.clipped.tolist()
([1.806, 0.0, 0.0], [[False, True, True]])

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: reward, with: {loss: {use: sao, with: {clip: [0.3, 5.0]}}, advantage: {use: reinforce_pp_plain, with: {std_norm: false}}, correction: {use: staleness, with: {max_staleness: 4}}}}
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from gfcr.stages.components.base import Requirement
from gfcr.stages.components.loss.base import LossConfig, LossTerms


class SAO:
    """Detached, hard-masked importance weight times the advantage's policy gradient."""

    requires = (Requirement("correction", ("none", "staleness", "freshness"),
                            "SAO's ratio is its own importance weight against the behaviour policy"),)
    needs_logprobs = True

    class Config(LossConfig):
        clip: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0)]] = Field(
            (0.3, 5.0), description="(eps_low, eps_high): tokens with a ratio outside (1 - eps_low, 1 + eps_high) "
                                    "are masked (the paper's 0.3, 5.0 for reasoning; 0.8, 3.0 for coding)")

    def __init__(self, config: Config):
        self.config = config

    def terms(self, log_ratio: Any, advantages: Any, weight: Any, *, logprobs: Any = None) -> LossTerms:
        import torch

        if logprobs is None:
            raise ValueError("loss `sao` multiplies the current log-probs: call terms(..., logprobs=[B, R] detached "
                             "log-probs); update.grpo passes them because the class sets `needs_logprobs`")
        eps_low, eps_high = self.config.clip
        ratio = torch.exp(log_ratio.detach())
        keep = (ratio > 1.0 - eps_low) & (ratio < 1.0 + eps_high)
        calibration = torch.where(keep, ratio, torch.zeros_like(ratio))
        log_pi = log_ratio + (logprobs.detach() - log_ratio.detach())  # log pi_theta's value, the log-ratio's gradient
        return LossTerms(-calibration * advantages * log_pi, ratio, ~keep)
