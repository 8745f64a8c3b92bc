"""loss ``tic_grpo``: TIC-GRPO's trajectory-level importance ratio (Pang, Luo and Jin, arXiv 2508.02833,
"TIC-GRPO: Provable and Efficient Optimization for Reinforcement Learning from Human
Feedback"), clipped from above only.

GRPO multiplies each token's advantage by that token's ratio ``pi_theta(y_t) / pi_old(y_t)``,
which (the paper shows) estimates the policy gradient at ``pi_old`` rather than at
``pi_theta``. TIC-GRPO replaces the token ratios with one ratio per response, the ratio of the
whole trajectory's probabilities:

    rho_i = pi_theta(y_i | x) / pi_prox(y_i | x) = exp( sum_t log_ratio_it )
    l_i   = -min(rho_i A_i, clip(rho_i, 1 - eps_low, 1 + eps_high) A_i)

where the sum runs over the response's counted tokens (``weight > 0``) and ``eps_low = null``
(the default) clips from above only. ``l_i`` is written on every token of the response; with
the ``seq_mean_token_mean`` aggregation (which this loss requires) the update's loss is
``(1/N) sum_i l_i``, a mean over trajectories. Because ``rho_i`` is a product, not GSPO's
geometric mean, the gradient carries the whole sequence's score:

    grad l_i = -rho_i A_i sum_t grad log pi_theta(y_it)   (0 where the clip is active)

TIC-GRPO pairs the ratio with a length-corrected advantage, the estimator ``tic_grpo``
(``gfcr.stages.components.advantage.tic_grpo``), which divides each reward by its response's
length before group normalisation: the two are separate components so either can be ablated.

Where the rules come from: the trajectory ratio is the paper's abstract ("replaces token-level
importance ratios with a single trajectory-level probability ratio"). The paper's body could
not be read from gfcr's build machine (no network beyond package registries); the upper-only
clip is taken from the one public transcription found, grpo-composer
(``grpo_composer/clipping/trajectory_level.py``, marked unreproduced by its own authors). That
transcription's bound ``1 + 0.28`` is DAPO's, not a value from the TIC-GRPO paper, so
``eps_high`` has no default here and must be set.

Deviations:
- the clip rule (upper-only) and the absence of a paper value for ``eps_high`` are as
  described above: to be checked against the paper's section on the algorithm;
- no cap on ``sum_t log_ratio``: with one optimizer step per batch on fresh rollouts the sum
  is 0 up to numerics; on stale rollouts a long response's ratio can overflow, and the update
  then skips the step with the reason (a non-finite loss), as for any loss;
- a per-token advantage ``A_it`` enters each token's term with the sequence ratio (the paper
  defines only trajectory advantages); every built-in estimator except tree ones gives scalars.

TIC-GRPO defines no per-token importance weight, so the update's corrections ``tis``,
``decoupled_clip`` and ``recompute_old`` are refused by ``gfcr validate``
(``token_corrections = False``).

Fidelity: from the abstract: no public code; the rules above are this component's reading.

Example (two tokens with log-ratios 0.1 and 0.2: ``rho = e^0.3 = 1.35``, above ``1 + 0.28``, so
with a positive advantage the loss is the clipped ``-1.28 A``; with a negative advantage no
lower clip applies and the loss is ``-rho A``):

>>> import torch
>>> loss = TICGRPO(TICGRPO.Config(eps_high=0.28))
>>> log_ratio, weight = torch.tensor([[0.1, 0.2], [0.1, 0.2]]), torch.ones(2, 2)
>>> t = loss.terms(log_ratio, torch.tensor([[1.0, 1.0], [-1.0, -1.0]]), weight)
>>> [round(float(v), 4) for v in t.per_token[:, 0]], t.clipped[:, 0].tolist()
([-1.28, 1.3499], [True, True])

YAML:

.. code-block:: yaml

    update:
      use: update.grpo
      from: reward
      with:
        advantage: {use: tic_grpo}
        loss: {use: tic_grpo, with: {eps_high: 0.28}}
        aggregation: {use: seq_mean_token_mean}
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from gfcr.stages.components.base import Requirement
from gfcr.stages.components.loss.base import LossConfig, LossTerms


class TICGRPO:
    """Clipped surrogate on the trajectory probability ratio (a product over tokens)."""

    requires = (Requirement("aggregation", ("seq_mean_token_mean",),
                            "TIC-GRPO's objective is a mean over trajectories of one ratio each"),)
    token_corrections = False

    class Config(LossConfig):
        eps_high: Annotated[float, Field(gt=0.0, description=(
            "upper clip 1 + eps_high of the trajectory ratio (no paper value could be read: required)"))]
        eps_low: Annotated[float, Field(gt=0.0, le=1.0)] | None = Field(
            None, description="lower clip 1 - eps_low; null: clipped from above only (the transcribed rule)")

    def __init__(self, config: Config):
        self.config = config

    def terms(self, log_ratio: Any, advantages: Any, weight: Any) -> LossTerms:
        import torch

        counted = (weight > 0).to(log_ratio.dtype)  # [B, R]: the tokens of y_i
        rho = torch.exp((log_ratio * counted).sum(1, keepdim=True)).expand_as(log_ratio)  # [B, R]
        low = None if self.config.eps_low is None else 1 - self.config.eps_low
        high = 1 + self.config.eps_high
        per_token = -torch.min(rho * advantages, torch.clamp(rho, min=low, max=high) * advantages)
        detached = rho.detach()
        clipped = detached > high if low is None else (detached > high) | (detached < low)
        return LossTerms(per_token, detached, clipped)
