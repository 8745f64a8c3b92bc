"""loss ``ppo_clip``: the clipped surrogate of PPO (Schulman et al., 2017, arXiv 1707.06347) as
GRPO (arXiv 2402.03300) uses it per token, with DAPO's decoupled clip range (arXiv 2503.14476,
"clip-higher") and an optional dual clip (Ye et al., 2020, arXiv 1912.09729; verl's
``clip_ratio_c``).

With ``rho_t = pi_theta(y_t) / pi_prox(y_t)`` and advantage ``A_t``:

    l_t = -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t)

and with ``dual_clip: c`` (``c > 1``), for ``A_t < 0`` the loss is further capped at
``-c A_t``: ``l_t = min(l_t, -c A_t)``, so a token whose ratio has grown far beyond the clip
range cannot pull an unbounded negative advantage (verl: ``clip_ratio_c = 3.0``).

``clipped`` marks the tokens whose ratio lies outside ``[1 - eps_low, 1 + eps_high]`` (the
``clip_fraction`` metric), whatever the advantage's sign.

Fidelity: checked against volcengine/verl@b178a3c: 60/60 cases (``tests/fidelity/ppo_clip.json``;
``compute_policy_loss_vanilla``: the aggregated loss and its gradient, symmetric clip,
DAPO's clip-higher ``[0.2, 0.28]``, dual clip 3.0 and 10.0, positive and negative advantages,
ratios inside and far outside the range, padding and masked tokens, ``token_mean`` and
``seq_mean_token_mean``); checked against volcengine/verl@b178a3c: 8/12 cases, 4 documented
deviations (``tests/fidelity/ppo_clip_edges.json``: ratios exactly on the clip bounds, and
log-ratios past verl's clamp; with ``log_ratio_clamp: 20.0`` all 72 verl cases agree).

Deviations (verl, TRL and the peer hand loop compute the same surrogate):
- verl clamps the log-ratio to [-20, 20] before the exponential (past it the ratio is
  ``e^20`` and carries no gradient); it is not clamped by default here, which matters only
  without a dual clip, for a negative advantage on a token whose ratio is past ``e^20`` (4
  reference cases): ``log_ratio_clamp: 20.0`` gives verl's;
- verl always dual-clips (``clip_ratio_c`` 3.0 by default); here ``dual_clip`` is off unless
  set, as in TRL: ``dual_clip: 3.0`` gives verl's;
- the ``clip_fraction`` metric counts every counted token whose ratio is outside the range;
  verl's ``pg_clipfrac`` counts only those where the clip binds (``pg_losses2 > pg_losses1``:
  above ``1 + eps_high`` with ``A > 0``, below ``1 - eps_low`` with ``A < 0``), per micro-batch.
  On the one-version-stale REINFORCE++ run of ``tests/fidelity/steps`` (the same losses) step 1
  reports 0.049 here and 0.014 in verl (token-weighted over its micro-batches). The loss is
  unaffected; no setting gives verl's metric.

Example (a token whose probability rose 50% with a positive advantage is clipped):

>>> import math, torch
>>> loss = PPOClip(PPOClip.Config(clip=(0.2, 0.28)))
>>> t = loss.terms(torch.tensor([[math.log(1.5)]]), torch.tensor([[2.0]]), torch.ones(1, 1))
>>> round(float(t.per_token), 4), bool(t.clipped)
(-2.56, True)

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {loss: {use: ppo_clip, with: {clip: [0.2, 0.28], dual_clip: 3.0}}}}
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from gfcr.stages.components.loss.base import LossConfig, LossTerms


class PPOClip:
    """Token-level clipped surrogate, optionally dual-clipped."""

    class Config(LossConfig):
        clip: tuple[Annotated[float, Field(ge=0.0)], Annotated[float, Field(ge=0.0)]] = Field(
            (0.2, 0.2), description="(eps_low, eps_high) of the ratio clip; [0.2, 0.28] is DAPO's clip-higher")
        dual_clip: Annotated[float, Field(gt=1.0)] | None = Field(
            None, description="cap the loss of negative advantages at -c A (verl's clip_ratio_c, 3.0); null: off")
        log_ratio_clamp: Annotated[float, Field(gt=0.0)] | None = Field(
            None, description="clamp the log-ratio to [-c, c] before the exponential (no gradient past it); verl's "
                              "is 20.0")

    def __init__(self, config: Config):
        self.config = config

    def terms(self, log_ratio: Any, advantages: Any, weight: Any) -> LossTerms:
        import torch

        eps_low, eps_high = self.config.clip
        clamp = self.config.log_ratio_clamp
        ratio = torch.exp(log_ratio if clamp is None else torch.clamp(log_ratio, -clamp, clamp))
        surrogate = torch.min(ratio * advantages, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages)
        per_token = -surrogate
        if self.config.dual_clip is not None:
            capped = torch.min(per_token, -self.config.dual_clip * advantages)
            per_token = torch.where(advantages < 0, capped, per_token)
        detached = ratio.detach()
        return LossTerms(per_token, detached, (detached < 1 - eps_low) | (detached > 1 + eps_high))
