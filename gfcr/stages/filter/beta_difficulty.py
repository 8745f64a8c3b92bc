"""filter.beta_difficulty: after rollout, update each prompt's Beta posterior over its success
rate with its group's successes, and keep only the groups whose posterior mean lies in a band.

The Filter side of the per-prompt Beta posterior of MoPPS (Qu, Wang, Mao, Hu, Ommer, Ji, 2025,
arXiv 2507.04632; code ``thu-rllab/MoPPS``, ``PosteriorSampler``) and VADE (arXiv 2511.18902,
read from its abstract only). Each prompt ``i`` has ``Beta(alpha_i, beta_i)``, starting at the
prior ``(alpha0, beta0)``. For each group the stage is given, in order:

1. update (the shared ``beta_update``, MoPPS's decayed update with ``lambda = decay``) from the
   group's ``s`` correct out of ``n`` judged rollouts (``rollout.correct`` not None):

       alpha_i <- lambda * alpha_i + (1 - lambda) * alpha0 + s
       beta_i  <- lambda * beta_i  + (1 - lambda) * beta0  + (n - s)

2. if the group is included, keep it iff its posterior mean after the update lies in the band:

       low <= alpha_i / (alpha_i + beta_i) <= high

   else drop it with the reason ``posterior mean 0.833 outside [0.3, 0.7] (Beta(5, 1))``.

Defaults: the band ``[0.3, 0.7]`` is MoPPS's ``threshold`` strategy as its launch scripts set
it (``bandit_lower_bound=0.3``, ``bandit_upper_bound=0.7``; bounds inclusive, as its
``>=`` / ``<=``); VADE's band or gain function is not disclosed in its abstract. ``decay = 1``
(no forgetting, the MoPPS config default as our research notes report it; its scripts use
0.5), prior ``Beta(1, 1)`` (the sampler's ``prior_alpha = prior_beta = 1.0``).

Stateful: ``state_dict`` holds every observed prompt's ``PromptStats`` as plain JSON data; the
stage draws nothing at random, so it needs no seed. This posterior is the stage's own: a
``control.beta_thompson`` in the same pipeline keeps a separate one (both updated by the same
rule).

Deviations:
- Not a published Filter. MoPPS applies its band to a Thompson draw from the posterior,
  *before* rollout, to choose prompts (``control.beta_thompson``'s side); this applies it to the
  posterior *mean*, *after* rollout, to drop groups: the draw would make the verdict random,
  and after rollout the group's own successes are already in the mean.
- Only ``drop``: no ``reweight`` action. None of the sources (MoPPS, VADE's abstract, the
  research notes) defines a sample weight as a function of the Beta posterior, so none is
  offered.
- ``s`` and ``n`` count the judged rollouts (MoPPS writes ``s * n`` with ``s`` the success
  rate and ``n`` the configured group size; they agree when every rollout is judged; a group
  with none judged updates nothing). The reference's ``n = 1`` slip (``alpha = beta = 8``, see
  ``control.beta_thompson``) is not reproduced.
- Groups already dropped by an earlier filter still update the posterior (their rollouts are
  evidence about the prompt) but keep their first verdict. Groups from an earlier step
  (replayed) are judged but do not update the posterior again. A rollout with no reward is an
  error: put ``filter.verify`` first.

Fidelity: checked against thu-rllab/MoPPS@a883f51: 15/15 cases (``tests/fidelity/beta_difficulty.json``:
``PosteriorSampler.train``'s decayed update and ``sample_batch``'s threshold band test,
``in_range_mask``, run on the posterior mean after each step's update: ties at the bounds,
all-correct, all-wrong, first steps, decays 0 to 1, other priors). Applying the band to the mean
after rollout rather than to a Thompson draw before it is gfcr's own (Deviations); no case
compares that choice.

Example:

>>> from gfcr.records import RolloutGroups, StepContext
>>> from gfcr.stages.testing import scored_group
>>> stage = BetaDifficulty(BetaDifficulty.Config())
>>> stage.before_step(StepContext("run", step=0, seed=0, policy_version=0))
>>> groups = RolloutGroups([scored_group("p:0", [1, 1, 1, 1]), scored_group("p:1", [1, 0])])
>>> [g.prompt_id for g in stage.run(groups)]  # Beta(1+4, 1+0): mean 5/6; Beta(1+1, 1+1): mean 1/2
['p:1']
>>> groups.groups[0].verdict.reason
'posterior mean 0.833 outside [0.3, 0.7] (Beta(5, 1))'

YAML (after the verifier, so the groups carry their successes):

.. code-block:: yaml

    reward: {use: filter.verify, from: rollout}
    band:   {use: filter.beta_difficulty, from: reward, with: {low: 0.3, high: 0.7, decay: 0.5}}
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import Field, model_validator

from gfcr.records import PromptStats, RolloutGroup, RolloutGroups, StepContext
from gfcr.registry import StageConfig
from gfcr.stages.common.prompt_stats import (
    beta_mean, beta_update, observe_group, stats_from_state, stats_to_state, stats_with_prior,
)

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
PriorCount = Annotated[float, Field(gt=0.0)]


class BetaDifficulty:
    """Update each prompt's Beta posterior from its group, keep groups whose posterior mean is in [low, high]."""

    class Config(StageConfig):
        reads_rewards: ClassVar[bool] = True  # a capability (gfcr.registry.ReadsRewards): a verifier must be upstream
        low: Probability = Field(0.3, description="lowest posterior mean success rate kept (MoPPS bandit_lower_bound)")
        high: Probability = Field(0.7, description="highest posterior mean success rate kept (MoPPS bandit_upper_bound)")
        decay: Probability = Field(1.0, description=(
            "lambda: weight kept by the old posterior at each update; 1 - lambda moves it toward the prior"))
        prior_alpha: PriorCount = Field(1.0, description="alpha0: prior pseudo-successes")
        prior_beta: PriorCount = Field(1.0, description="beta0: prior pseudo-failures")
        history_size: Annotated[int, Field(ge=0, description=(
            "observations kept per prompt for inspection; they are checkpointed"))] = 4

        @model_validator(mode="after")
        def _band(self):
            if self.low > self.high:
                raise ValueError(f"low ({self.low}) must be at most high ({self.high})")
            return self

    def __init__(self, config: Config):
        self.config = config
        self.stats: dict[str, PromptStats] = {}
        self._step, self._policy_version = 0, 0

    def before_step(self, ctx: StepContext) -> None:
        self._step, self._policy_version = ctx.step, ctx.policy_version

    def run(self, groups: RolloutGroups) -> RolloutGroups:
        kept = []
        for group in groups:
            self._update(group)
            if not group.verdict.included:
                continue
            reason = self._outside_band(group.prompt_id)
            if reason is None:
                kept.append(group)
            else:
                group.drop(reason)
        return RolloutGroups(kept)

    def _update(self, group: RolloutGroup) -> None:
        unscored = [r.rollout_id for r in group.rollouts if r.reward is None]
        if unscored and group.verdict.included:
            raise ValueError(f"group {group.group_id} has unscored rollouts {unscored}; "
                             "put a verifier stage (filter.verify) before this filter")
        obs = observe_group(group, self._policy_version) if group.step == self._step else None
        if obs is None:
            return
        stats = self._stats(group.prompt_id)
        stats.record(obs)
        beta_update(stats, obs.n_correct, obs.n, self.config.decay, self.config.prior_alpha, self.config.prior_beta)

    def _outside_band(self, prompt_id: str) -> str | None:
        """Why the prompt's posterior mean is outside ``[low, high]``, or None if inside."""
        stats = self.stats.get(prompt_id) or PromptStats(prompt_id, beta_alpha=self.config.prior_alpha,
                                                         beta_beta=self.config.prior_beta)
        mean, low, high = beta_mean(stats), self.config.low, self.config.high
        if low <= mean <= high:
            return None
        return (f"posterior mean {mean:.3f} outside [{low:g}, {high:g}] "
                f"(Beta({stats.beta_alpha:g}, {stats.beta_beta:g}))")

    def _stats(self, prompt_id: str) -> PromptStats:
        cfg = self.config
        return stats_with_prior(self.stats, prompt_id, cfg.history_size, cfg.prior_alpha, cfg.prior_beta)

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable data: every observed prompt's stats."""
        return {"prompts": {pid: stats_to_state(s) for pid, s in self.stats.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats = {pid: stats_from_state(s) for pid, s in state["prompts"].items()}
