"""advantage ``tic_grpo``: TIC-GRPO's length-corrected group advantage (arXiv 2508.02833: Pang, Luo
and Jin, "TIC-GRPO: Provable and Efficient Optimization for Reinforcement Learning from Human
Feedback").

Each reward is divided by its response's length before GRPO's group normalisation. With
``r_i`` the rewards and ``|y_i|`` the response lengths in tokens of a group of ``G``:

    u_i = r_i / |y_i|
    A_i = (u_i - mean(u)) / (std(u) + eps)

so that, paired with the trajectory-ratio loss (``loss: {use: tic_grpo}``), whose gradient sums
the score over a response's tokens, a long response's gradient is not larger for its length:
the paper's convergence bound then has no term in the variance of sequence lengths.

Where the rule comes from: the paper's body could not be read from gfcr's build machine; the
formula is the one public transcription found (grpo-composer,
``grpo_composer/core/advantages/length_corrected.py``, unreproduced by its authors), and it is
what the gfcr issue that asked for this estimator names ("TIC-GRPO (length-corrected)").

Deviations:
- the transcription's own choices are kept where gfcr has a convention: the sample std
  (``std_ddof: 1``, as the transcription's ``torch.std``) and ``eps`` added to it, here
  ``mean_std``'s 1e-6 (the transcription adds 1e-8 to the std and to the length);
- a group whose length-corrected rewards are all equal, or a group of one rollout, gets exactly
  0.0, as ``mean_std`` does (a group of equal rewards but different lengths is *not* equal
  after the correction, and keeps a signal: correct short answers gain);
- ``|y_i|`` is the response's token count, EOS included when the engine returned one; a
  response of 0 tokens is refused (its reward per token is undefined);
- unscored rollouts (NaN rewards) raise ValueError naming the group.

Fidelity: from the abstract: no public code; the rules above are this component's reading.

Example (rewards 1, 1, 0 with lengths 2, 4, 4: ``u = 0.5, 0.25, 0``, mean 0.25, sample std 0.25):

>>> import numpy as np
>>> from gfcr.records import Rollout, RolloutGroup, Segment
>>> rollouts = [Rollout(f"g#{i}", "g", "p", [5] * n, [Segment(0, n, 0, np.zeros(n))], reward=r)
...             for i, (r, n) in enumerate([(1.0, 2), (1.0, 4), (0.0, 4)])]
>>> [round(a, 4) for a in TICLengthCorrected(TICLengthCorrected.Config()).estimate(
...     RolloutGroup("g", "p", 0, 3, rollouts)).values]
[1.0, 0.0, -1.0]

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

from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from gfcr.records import RolloutGroup
from gfcr.stages.components.advantage.base import Advantages, EstimatorConfig, checked_rewards, has_no_baseline


class TICLengthCorrected:
    """GRPO's group normalisation of rewards divided by response length."""

    class Config(EstimatorConfig):
        eps: Annotated[float, Field(ge=0.0, description="added to the std of the length-corrected rewards")] = 1e-6
        std_ddof: Literal[0, 1] = Field(1, description="1: sample std (the transcription's torch.std); 0: population")

    def __init__(self, config: Config):
        self.config = config

    def estimate(self, group: RolloutGroup) -> Advantages:
        r = checked_rewards(group)  # [G]
        lengths = np.array([len(rollout) for rollout in group.rollouts], dtype=np.float64)  # [G]
        if (lengths == 0).any():
            empty = [rollout.rollout_id for rollout, n in zip(group.rollouts, lengths) if n == 0]
            raise ValueError(f"group {group.group_id}: `tic_grpo` divides rewards by response length, and "
                             f"{', '.join(empty)} has no tokens; drop empty responses upstream "
                             f"(filter.finish_reason) or use `mean_std`")
        u = r / lengths
        if has_no_baseline(u):
            return Advantages.scalars(u * 0.0)
        return Advantages.scalars((u - u.mean()) / (u.std(ddof=self.config.std_ddof) + self.config.eps))
