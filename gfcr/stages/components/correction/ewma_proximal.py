"""correction ``ewma_proximal``: PPO-EWMA's proximal policy (Hilton, Cobbe and Schulman, 2021, "Batch
size-invariance for policy optimization", arXiv 2110.00641), as the authors' code computes it
(openai/ppo-ewma, ``compute_losses`` and ``EwmaModel``): every token's ratio is clipped against
an exponentially weighted moving average of the policy's weights, and the importance weight is
taken against the behaviour policy.

The old policy of PPO plays two parts: the behaviour policy ``mu`` that sampled the tokens (for
the importance weight) and the proximal policy the update must not move too far from (for the
clip). PPO-EWMA decouples them and makes the proximal policy ``pi_ewma``, a network whose
weights are the moving average of the trained ones. For every token (stale or fresh):

    ratio_t = pi_theta(y_t) / pi_ewma(y_t)                      (the loss clips it, ``ppo_clip``)
    w_t     = pi_ewma(y_t) / max(mu(y_t), pi_old(y_t) / M)        (detached; M = ``imp_samp_max``)

so that with ``ppo_clip`` the token's loss is the reference's
``max(-A pi_theta / mu', -A clip(ratio_t) pi_ewma / mu')`` with ``mu' = max(mu, pi_theta / M)``
(the behaviour log-prob floored so that no weight exceeds ``M``; ``pi_old``, the policy at update
start, is the detached ``pi_theta`` of the gradient pass). After every optimizer step the
average moves, with ``T`` the weight it has so far (1 at the start, when ``pi_ewma`` is a copy
of the policy):

    T'      = decay T + 1
    theta_e = theta_e * decay T / T' + theta / T'

The moving average is the correction's state: it is checkpointed with the update
(``state_dict``) and a resumed run goes on from it. The metrics report ``is_weight_mean`` and
``is_weight_max`` of ``pi_ewma / mu`` and ``is_clipped_fraction``, the tokens whose weight the
floor bounded (the reference's ``imp_samp_clipfrac``: ``log pi_old - log mu > log M``).

Defaults: ``imp_samp_max: 100.0`` (the reference's ``imp_samp_max``); ``decay`` has none: the
reference's is ``kl_ewma_decay=None`` (no EWMA: plain PPO), and the paper sets it per batch
size, so it is required here. The clip is the loss's (``ppo_clip``; the reference's
``clip_param`` is 0.2, symmetric).

Which PPO-EWMA: the original. The revised PPO-EWMA that "Missing Old Logits in Asynchronous
Agentic RL" (arXiv 2605.12070) proposes for asynchronous agentic RL has no public code: the
repository its paper links (millioniron/ROLL, read at 243a961) holds only a training-inference
correction module and no EWMA. This is the original rule, not that revision.

Fidelity: checked against openai/ppo-ewma@625dac7: 10/10 cases (``tests/fidelity/ewma_proximal.json``;
``compute_losses`` with a stand-in model whose log-probs are the case's: the loss and its
gradient w.r.t. the current log-probs, ``clipfrac`` and ``imp_samp_clipfrac``; proximal near and
far from the behaviour policy, the floor ``M`` binding (2.0), no floor, no clip, clip 0.4, one-sign
advantages), and ``EwmaModel.update``: 4 sequences of steps, decays 8/9, 0.5, 0 and 0.99.

Deviations:
- one EWMA step per optimizer step of the update, which takes one step per batch: the
  reference steps once per mini-batch of its PPO epochs, so the same ``decay`` averages over
  fewer, larger steps here;
- the reference resets the average at each PPG phase (``model_ewma.reset()``), which PPO has
  not; it is never reset here;
- the reference's ``clip_param: 0`` turns the clip off; here the clip is ``ppo_clip``'s (a wide
  ``clip`` does the same);
- the reference averages the tokens of its batch (mean); the aggregation is the update's
  (``token_mean``, the default, is the reference's mean).

Example (a token whose proximal probability is 0.5, sampled at 0.25 and now at 0.6: the
ratio is taken against 0.5 and weighted by 0.5 / 0.25 = 2):

>>> import math, torch
>>> ewma = EWMAProximal(EWMAProximal.Config(decay=0.9))
>>> logp, mu, prox = (torch.tensor([[math.log(p)]]) for p in (0.6, 0.25, 0.5))
>>> c = ewma.correct_with(logp, mu, torch.tensor([[True]]), prox)
>>> round(float(torch.exp(logp - c.proximal)), 4), round(float(c.weight), 4)
(1.2, 2.0)

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {loss: {use: ppo_clip, with: {clip: [0.2, 0.2]}}, correction: {use: ewma_proximal, with: {decay: 0.9, imp_samp_max: 100.0}}}}
"""

from __future__ import annotations

import copy
import math
from typing import Annotated, Any

import numpy as np
from pydantic import Field

from gfcr.records import Rollout
from gfcr.registry import PipelineProblem
from gfcr.stages.components.base import PairingContext
from gfcr.stages.components.correction.base import (CorrectionConfig, MaxStaleness, TokenCorrection, kept_tokens,
                                                    per_token_ratio_problems)


class EWMAProximal:
    """Every token's ratio against an EWMA of the policy's weights, weighted by pi_ewma / mu."""

    class Config(CorrectionConfig):
        decay: Annotated[float, Field(ge=0.0, lt=1.0, description=(
            "the EWMA's decay per optimizer step (required: the reference's default is no EWMA; the paper "
            "sets it per batch size)"))]
        imp_samp_max: Annotated[float, Field(gt=1.0)] | None = Field(
            100.0, description="M: mu floored at pi_old / M, so that no ratio pi / mu exceeds M at the step's "
                               "start (the reference's imp_samp_max, 100.0); null: no floor")
        max_staleness: MaxStaleness = None

    @staticmethod
    def pairing_problems(config: Config, ctx: PairingContext) -> list[PipelineProblem]:
        return per_token_ratio_problems("ewma_proximal", ctx)

    def __init__(self, config: Config):
        self.config = config
        self.model: Any = None  # the moving average: a copy of the policy's network, no gradient
        self.total_weight = 1.0
        self._pending: dict[str, Any] | None = None  # state loaded before the policy was lent

    def attach(self, model: Any) -> None:
        """Start the average at a copy of the policy (or at the checkpoint's, if one was loaded)."""
        self.model = copy.deepcopy(model)
        for p in self.model.parameters():
            p.requires_grad_(False)
        if self._pending is not None:
            self.load_state_dict(self._pending)

    def proximal_model(self) -> Any:
        if self.model is None:
            raise RuntimeError("correction ewma_proximal was not attached to the policy (update.grpo's setup does)")
        return self.model

    def follow(self, model: Any) -> None:
        """One EWMA step towards ``model``'s weights (the reference's ``EwmaModel.update``)."""
        import torch

        decay = self.config.decay
        total = decay * self.total_weight + 1
        keep = decay * self.total_weight / total
        with torch.no_grad():
            for p, avg in zip(model.parameters(), self.proximal_model().parameters(), strict=True):
                avg.mul_(keep).add_(p.detach() / total)
        self.total_weight = total

    def correct_with(self, logp: Any, behaviour: Any, stale: Any, proximal: Any) -> TokenCorrection:
        import torch

        old = logp.detach()
        floor = self.config.imp_samp_max
        adjusted = behaviour if floor is None else torch.max(behaviour, old - math.log(floor))
        weight = torch.exp(proximal - adjusted)
        capped = (old - behaviour > math.log(floor)) if floor is not None else torch.zeros_like(stale)
        return TokenCorrection(proximal, weight, torch.exp(proximal - behaviour), torch.ones_like(stale), capped)

    def keeps(self, rollout: Rollout, version: int) -> np.ndarray | None:
        return kept_tokens(self.config.max_staleness, rollout, version)

    def state_dict(self) -> dict[str, Any]:
        if self.model is None:
            return dict(self._pending) if self._pending is not None else {}
        return {"weights": [p.detach().clone() for p in self.model.parameters()], "total_weight": self.total_weight}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch

        if not state:
            return
        if self.model is None:
            self._pending = state
            return
        with torch.no_grad():
            for avg, saved in zip(self.model.parameters(), state["weights"], strict=True):
                avg.copy_(saved)
        self.total_weight = float(state["total_weight"])
        self._pending = None
