"""advantage ``mc_grpo``: MC-GRPO as its reference code computes it (arXiv 2601.22582;
``lotusroot-kim/MC-GRPO``, ``grpo_trainer_gsm.py`` with ``mc=True``).

The group holds ``G + 1`` rollouts (ask the Control stage for one more: ``control.mc_grpo``
with ``g: 8``, the paired allocator, or ``control.fixed_n`` with ``n: 9`` for ``G = 8``).
``gfcr validate`` checks the pairing: some stage upstream of the update must fix the group
size (``control.mc_grpo`` or ``control.fixed_n``), and with ``g: G`` set it must allocate
``G + 1``. With ``r`` their rewards:

1. ``m`` = the lower median of ``r`` (``torch.median``); the pivot is the rollout whose reward
   is ``m``;
2. ``A = (r - m) / (median(|r - m|) + mad_eps)`` (``mad_scale: true``, the reference), or
   ``A = r - m``;
3. every non-zero advantage (``|A| > 1e-6``, the reference's ``isclose`` tolerance) is
   multiplied by ``(G + 1) / #non-zero`` (``rescale_nonzero: true``);
4. the pivot is left out of the loss: its loss mask is all ``False``, so its tokens count
   neither in the loss nor in its denominator, as the reference removes it from the batch.

Fidelity: checked against lotusroot-kim/MC-GRPO@da07745: 15/15 cases (``tests/fidelity/mc_grpo.json``;
the pivot's index among tied rollouts is not compared: it differs in 8 of them).

Deviations:
- when several rollouts share the median reward, the pivot is the first of them in rollout
  order (``torch.median`` leaves the index among ties unspecified);
- with binary rewards the MAD is usually 0, so ``A = +-1000`` before the rescale, exactly as
  in the reference (the research note's ambiguity 2); ``mad_scale: false`` turns it off;
- a group whose rewards are all equal gets exactly 0.0 (its pivot is still masked); unscored
  rollouts (NaN rewards) raise ValueError naming the group.

Example (``G + 1 = 5``: the median is 1, the pivot is the first rollout, and the two non-zero
advantages are rescaled by 5/2):

>>> from gfcr.stages.testing import scored_group
>>> out = MCGRPO(MCGRPO.Config(mad_scale=False)).estimate(scored_group("p:0", [1.0, 0.0, 0.0, 1.0, 1.0]))
>>> out.values
(0.0, -2.5, -2.5, 0.0, 0.0)
>>> [bool(m.all()) for m in out.loss_masks]
[False, True, True, True, True]

YAML:

.. code-block:: yaml

    budget: {use: control.fixed_n, from: pick, with: {n: 9}}
    # ...
    update: {use: update.grpo, from: keep, with: {advantage: {use: mc_grpo, with: {g: 8, mad_scale: true}}}}
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
from pydantic import Field

from gfcr.records import RolloutGroup
from gfcr.registry import PipelineProblem
from gfcr.stages.components.advantage.base import (Advantages, EstimatorConfig, checked_rewards, has_no_baseline,
                                               lower_median)
from gfcr.stages.components.advantage.median import median_centred
from gfcr.stages.components.base import PairingContext

NONZERO_ATOL = 1e-6  # the reference's torch.isclose(..., atol=1e-6)


def _allocate(ctx: PairingContext, n: int) -> str:
    """How to make the stage that fixes the group size allocate ``n`` rollouts per prompt."""
    sid = ctx.rollouts_from
    if ctx.rollouts_setting is None:
        return f"make `{sid}` allocate {n} rollouts per prompt"
    key, _, value = ctx.rollouts_setting(n).partition("=")
    return f"set `{key}: {value}` on `{sid}` (--set stages.{sid}.with.{key}={value})"


class MCGRPO:
    """Median baseline over G+1 rollouts; the pivot is masked out, the rest rescaled."""

    class Config(EstimatorConfig):
        mad_scale: bool = Field(True, description="divide by the median absolute deviation + mad_eps (reference)")
        mad_eps: Annotated[float, Field(gt=0.0, description="floor of the MAD (the reference's 1e-3)")] = 1e-3
        rescale_nonzero: bool = Field(True, description="multiply non-zero advantages by (G+1) / #non-zero")
        g: Annotated[int, Field(ge=1)] | None = Field(
            None, description="the training group size G: `gfcr validate` checks that the Control stage allocates "
                              "G + 1 rollouts per prompt (null: G + 1 is whatever it allocates)")

    def __init__(self, config: Config):
        self.config = config

    def estimate(self, group: RolloutGroup) -> Advantages:
        r = checked_rewards(group)  # [G+1]
        pivot = int(np.flatnonzero(r == lower_median(r))[0]) if len(r) else -1
        masks = tuple(np.full(len(ro), i != pivot, dtype=bool) for i, ro in enumerate(group.rollouts))
        if has_no_baseline(r):
            return Advantages(tuple(0.0 for _ in r), masks)
        a = median_centred(r, self.config.mad_scale, self.config.mad_eps)
        nonzero = np.abs(a) > NONZERO_ATOL
        if self.config.rescale_nonzero and nonzero.any():
            a = np.where(nonzero, a * (len(r) / int(nonzero.sum())), a)
        return Advantages(tuple(float(v) for v in a), masks)

    @staticmethod
    def pairing_problems(config: "MCGRPO.Config", ctx: PairingContext) -> list[PipelineProblem]:
        """G + 1 rollouts per prompt, fixed by a Control stage upstream of the update."""
        n = ctx.rollouts_per_prompt
        if n is None:
            g = config.g or 8
            return [PipelineProblem(
                ("advantage", "use"),
                "MC-GRPO needs G + 1 rollouts per prompt from a fixed allocation (the extra one is the "
                "median pivot, left out of the loss), and no stage upstream of the update fixes the "
                "group size",
                f"add `control.mc_grpo` with `g: {g}` (or `control.fixed_n` with `n: {g + 1}`) "
                "upstream of the update")]
        if config.g is not None and n != config.g + 1:
            return [PipelineProblem(
                ("advantage", "with", "g"),
                f"MC-GRPO with `g: {config.g}` needs G + 1 = {config.g + 1} rollouts per prompt, but "
                f"stage `{ctx.rollouts_from}` allocates {n}",
                _allocate(ctx, config.g + 1) + (f", or set `g: {n - 1}`" if n >= 2 else ""))]
        if n < 2:
            return [PipelineProblem(
                ("advantage", "use"),
                f"MC-GRPO needs G + 1 >= 2 rollouts per prompt, but stage `{ctx.rollouts_from}` "
                f"allocates {n}: its only rollout is the pivot, left out of the loss",
                f"{_allocate(ctx, 9)} (G = 8)")]
        return []
