"""control.beta_thompson: choose the prompts whose Thompson draw from a Beta posterior over
their success rate lies closest to a target rate (0.5: the most informative for GRPO).

MoPPS, Model Predictive Prompt Selection (Qu, Wang, Mao, Hu, Ommer, Ji, 2025, "Can Prompt
Difficulty be Online Predicted for Accelerating RL Finetuning of Reasoning Models?",
arXiv 2507.04632; code ``thu-rllab/MoPPS``: the fit loop of ``recipe/ours/our_ray_trainer.py``
and ``PosteriorSampler`` in ``recipe/ours/mopps.py``).

Fidelity: checked against thu-rllab/MoPPS@a883f51: 13/14 cases, 1 documented deviation
(``tests/fidelity/mopps.json``).

Each prompt ``i`` has a posterior ``Beta(alpha_i, beta_i)`` over its success rate, starting
at the prior ``(alpha0, beta0)``. A call:

1. takes the next ``m = candidate_ratio * batch_size`` prompts of a seeded per-epoch
   permutation of the pool (the reference's oversized data-loader batch; ``control.uniform``'s
   epochs and ``drop_last`` rule);
2. draws ``p~_i ~ Beta(alpha_i, beta_i)`` for every candidate, seeded by
   ``(seed, epoch, step, crc32(prompt_id))``, so a resumed run redraws it exactly;
3. keeps the ``batch_size`` candidates with the smallest ``(p~_i - target)^2`` (the
   reference's ``topk`` strategy), each with ``n_rollouts`` (default 1; put
   ``control.fixed_n`` downstream for the group size). The other candidates stay in the
   Allocation with ``n_rollouts = 0``; every reason gives the draw and the posterior. For the
   control lineage each entry's ``ControlReason`` is ``closest_to_target`` (picked, with its
   ``rank``) or ``farther_from_target`` (skipped), the ``draw`` as the decisive number, and its
   ``distance`` ``|draw - target|`` against ``cutoff_distance`` (the farthest chosen draw's),
   ``posterior_mean``, ``alpha`` and ``beta``.

After the step, ``observe`` updates each rolled-out prompt from its group's ``s`` correct out
of ``n`` judged rollouts, forgetting toward the prior with ``lambda = decay``:

    alpha_i <- lambda * alpha_i + (1 - lambda) * alpha0 + s
    beta_i  <- lambda * beta_i  + (1 - lambda) * beta0  + (n - s)

(the reference writes ``s * n`` and ``(1 - s) * n`` with ``s`` the success rate, the same
counts). Per-step metrics go to ``controller_state`` (``control`` in ``metrics.jsonl``):
``epoch``, ``candidates``, ``chosen``, the mean / min / max draw of the chosen prompts (the
reference's ``tasksample/sampled_acquisition_score``) and their mean posterior success
``posterior_mean``.

Deviations:
- The reference's update line is ``alpha = ... + s * n if n > 1 else 8``: the conditional
  binds the whole expression, so with one rollout per prompt it sets ``alpha = beta = 8``.
  Here the intended update applies for every ``n``.
- ``s`` and ``n`` count the rollouts a verifier judged (``rollout.correct``), not the
  configured group size times the mean of ``acc >= 1``; they agree when every rollout is
  judged. A group with none judged updates nothing. Each group rolled out in the step is one
  update (a prompt sampled in two loop rounds is updated twice, as the reference updates a
  repeated index twice); groups from earlier steps (replayed) are ignored.
- Draws are seeded per prompt and visit (the reference calls the unseeded
  ``np.random.beta``). Ties in distance keep candidate order (a stable sort; the reference's
  ``np.argsort`` is unstable).
- Only the ``topk`` strategy. The reference's ``threshold`` strategy (keep draws in
  ``[lower, upper]``, shuffled, falling back to the nearest ones) and ``uniform`` are other
  rules, so other stages; the uniform one is ``control.uniform``.
- No warm start from an offline score file (the reference's ``bandit_init``, which sets
  ``alpha = 3 * successes + alpha0``): every prompt starts at the prior.
- Ambiguities resolved: the reference's default for the candidate ratio (``ts_ratio``) could
  not be read (launch scripts of a related DeepScaleR recipe use 16); ``candidate_ratio``
  defaults to 4, our choice. ``decay`` defaults to 1.0, the reference config's default as
  reported by our research notes (not read here; its scripts use 0.5); the prior is
  ``Beta(1, 1)`` (the sampler's ``prior_alpha = prior_beta = 1.0``) and the target 0.5
  (``bandit_target_mean``, as reported). Prompts not chosen are not decayed (the
  reference decays only the prompts it updates). The candidates not chosen are consumed for
  the epoch, as the reference's data loader consumes its whole oversized batch.

Example:

>>> from gfcr.records import Prompt, PromptPool, StepContext, StepReport
>>> from gfcr.stages.testing import scored_group
>>> pool = PromptPool([Prompt(f"p:{i}", text=str(i)) for i in range(8)])
>>> stage = BetaThompson(BetaThompson.Config(batch_size=2, candidate_ratio=2, seed=0))
>>> stage.before_step(StepContext("run", step=0, seed=0, policy_version=0))
>>> first = stage.run(pool)
>>> [e.n_rollouts for e in first]
[1, 1, 0, 0]
>>> chosen = first.active()
>>> stage.observe(StepReport("run", 0, 1, (scored_group(chosen[0].prompt_id, [1, 1, 0]),), None, {}, {}))
>>> stats = stage.stats[chosen[0].prompt_id]
>>> (stats.beta_alpha, stats.beta_beta)  # Beta(1, 1) + 2 successes, 1 failure
(3.0, 2.0)

YAML:

.. code-block:: yaml

    stages:
      pick:   {use: control.beta_thompson, with: {batch_size: 16, candidate_ratio: 4, decay: 0.5}}
      budget: {use: control.fixed_n, from: pick, with: {n: 8}}
"""

from __future__ import annotations

import zlib
from typing import Annotated, Any

import numpy as np
from pydantic import Field

from gfcr.records import (Allocation, AllocationEntry, ControlReason, PromptPool, PromptStats, StepContext,
                          StepReport)
from gfcr.registry import Seed, StageConfig
from gfcr.stages.common.epochs import epoch_order, start_batch
from gfcr.stages.common.prompt_stats import (beta_update, observe_group, stats_from_state, stats_to_state,
                                              stats_with_prior)
from gfcr.stages.common.run_context import RunContext

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
PriorCount = Annotated[float, Field(gt=0.0)]


def thompson_draw(seed: int, epoch: int, step: int, prompt_id: str, alpha: float, beta: float) -> float:
    """One draw from ``Beta(alpha, beta)`` for one visit of a prompt, a pure function of where
    it happens and of the posterior."""
    rng = np.random.default_rng([seed, epoch, step, zlib.crc32(prompt_id.encode())])
    return float(rng.beta(alpha, beta))


def closest_to_target(draws: np.ndarray, target: float, k: int) -> np.ndarray:
    """Indices of the ``k`` draws with the smallest ``(draw - target)^2``, closest first; ties
    keep their order."""
    return np.argsort((np.asarray(draws, dtype=float) - target) ** 2, kind="stable")[:k]


class BetaThompson:
    """MoPPS: Thompson-sample each candidate's Beta posterior, keep those nearest the target."""

    class Config(StageConfig):
        batch_size: Annotated[int, Field(ge=1, description="prompts chosen per call (the reference's B)")]
        candidate_ratio: Annotated[int, Field(ge=1, description=(
            "candidates drawn per call, as a multiple of batch_size (the reference's ts_ratio)"))] = 4
        n_rollouts: Annotated[int, Field(ge=1, description="rollouts marked per chosen prompt")] = 1
        target: Probability = Field(0.5, description="success rate the chosen draws should be closest to")
        decay: Probability = Field(1.0, description=(
            "lambda: weight kept by the old posterior at each update; 1 - lambda moves it toward the prior"))
        prior_alpha: PriorCount = Field(1.0, description="alpha0: prior pseudo-successes")
        prior_beta: PriorCount = Field(1.0, description="beta0: prior pseudo-failures")
        seed: Seed | None = Field(None, description="permutation and draw seed; default: the run's seed")
        history_size: Annotated[int, Field(ge=0, description=(
            "observations kept per prompt for inspection; they are checkpointed"))] = 4

    def __init__(self, config: Config):
        self.config = config
        self.epoch, self.cursor = 0, 0
        self.stats: dict[str, PromptStats] = {}
        self.run_ctx = RunContext(config.seed)

    def before_step(self, ctx: StepContext) -> None:
        self.run_ctx.before_step(ctx)

    def posterior(self, prompt_id: str) -> tuple[float, float]:
        """``(alpha, beta)`` of a prompt; the prior when it was never observed."""
        stats = self.stats.get(prompt_id)
        if stats is None:
            return self.config.prior_alpha, self.config.prior_beta
        return stats.beta_alpha, stats.beta_beta

    def run(self, pool: PromptPool) -> Allocation:
        m = self.config.candidate_ratio * self.config.batch_size
        self.epoch, self.cursor = start_batch(self.epoch, self.cursor, m, len(pool))
        order = epoch_order(self.run_ctx.seed, self.epoch, len(pool))[self.cursor : self.cursor + m]
        self.cursor += m
        candidates = [pool[int(i)] for i in order]
        posteriors = [self.posterior(p.prompt_id) for p in candidates]
        draws = np.array([thompson_draw(self.run_ctx.seed, self.epoch, self.run_ctx.step, p.prompt_id, a, b)
                          for p, (a, b) in zip(candidates, posteriors)])
        chosen = [int(i) for i in closest_to_target(draws, self.config.target, self.config.batch_size)]
        rank = {i: r for r, i in enumerate(chosen)}
        order_out = chosen + [i for i in range(len(candidates)) if i not in rank]
        cutoff = float(abs(draws[chosen[-1]] - self.config.target))  # the farthest chosen draw's distance
        entries = tuple(self._entry(candidates[i], draws[i], posteriors[i], rank.get(i), cutoff) for i in order_out)
        return Allocation(step=self.run_ctx.step, entries=entries, controller_state=self._metrics(draws[chosen], [
            posteriors[i] for i in chosen], len(candidates)))

    def _entry(self, prompt, draw: float, posterior: tuple[float, float], rank: int | None,
               cutoff: float) -> AllocationEntry:
        a, b = posterior
        detail = f"draw {draw:.4f}, Beta({a:g}, {b:g})"
        numbers = {"distance": abs(draw - self.config.target), "cutoff_distance": cutoff,
                   "target": self.config.target, "posterior_mean": a / (a + b), "alpha": a, "beta": b}
        if rank is None:
            why = ControlReason("farther_from_target", "draw", draw, numbers)
            return AllocationEntry(prompt, 0, reason=f"beta_thompson: not chosen ({detail})", why=why)
        why = ControlReason("closest_to_target", "draw", draw, {"rank": rank + 1, **numbers})
        return AllocationEntry(prompt, self.config.n_rollouts, reason=f"beta_thompson: rank {rank + 1} ({detail})",
                               why=why)

    def _metrics(self, draws: np.ndarray, posteriors: list[tuple[float, float]], candidates: int) -> dict[str, Any]:
        means = [a / (a + b) for a, b in posteriors]
        return {
            "epoch": self.epoch, "candidates": candidates, "chosen": len(draws),
            "draw_mean": float(np.mean(draws)), "draw_min": float(np.min(draws)), "draw_max": float(np.max(draws)),
            "posterior_mean": float(np.mean(means)),
        }

    def observe(self, report: StepReport) -> None:
        for group in report.groups:
            obs = observe_group(group, self.run_ctx.policy_version) if group.step == report.step else None
            if obs is None:
                continue
            stats = self._stats(group.prompt_id)
            stats.record(obs)
            beta_update(stats, obs.n_correct, obs.n, self.config.decay, self.config.prior_alpha,
                        self.config.prior_beta)

    def _stats(self, prompt_id: str) -> PromptStats:
        cfg = self.config
        return stats_with_prior(self.stats, prompt_id, cfg.history_size, cfg.prior_alpha, cfg.prior_beta)

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable data: position in the epoch and every observed prompt's stats."""
        return {"epoch": self.epoch, "cursor": self.cursor,
                "prompts": {pid: stats_to_state(s) for pid, s in self.stats.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.stats = {pid: stats_from_state(s) for pid, s in state["prompts"].items()}
