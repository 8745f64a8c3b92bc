"""correction ``none``: every token's ratio against the behaviour log-probs its segment
recorded, as PPO (Schulman et al., 2017, arXiv 1707.06347) and GRPO (arXiv 2402.03300) take it.

    ratio_t = exp(log pi_theta(y_t) - log mu(y_t))

On fresh rollouts ``mu`` is the policy being trained (up to the engine's numerics), so this is
on-policy GRPO. The default: the update adds no IS diagnostics and writes no
``old_logprobs``.

Deviations: none; stale tokens (replayed or resumed rollouts) are taken as they are, against
the policy that sampled them (choose ``tis``, ``decoupled_clip``, ``recompute_old`` or
``staleness`` for them).

Example:

>>> NoCorrection(NoCorrection.Config()).config
Config()

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {correction: {use: none}}}
"""

from __future__ import annotations

from gfcr.stages.components.correction.base import CorrectionConfig


class NoCorrection:
    """The ratio against the behaviour policy; nothing to correct."""

    class Config(CorrectionConfig):
        pass

    def __init__(self, config: Config):
        self.config = config
