"""control.vade: a non-stationary bandit over prompts: Thompson-sample each prompt's Beta
posterior, decayed on two time scales, and choose the draws with the largest information
gain ``p~ (1 - p~)``.

VADE, Variance-Aware Dynamic sampling via online sample-level Difficulty Estimation (Hu, Qiu,
Bai, Yang, Yuan, Jing, He, Zhang, 2025, arXiv 2511.18902). Only the abstract could be read
(no code: VADE-RL.github.io was announced, not reachable here): "online sample-level
difficulty estimation using Beta distributions, a Thompson sampler that maximizes information
gain through the estimated correctness probability, and a two-scale prior decay mechanism",
the selection "modeled as a non-stationary multi-armed bandit". **The gain function, the two
decay constants and how the two scales combine are our reading of that sentence, not the
paper's.** The posterior, its update and the seeded draw are the ones of MoPPS
(``control.beta_thompson``; shared through ``prompt_stats`` and ``thompson_draw``).

Each prompt ``i`` has ``Beta(alpha_i, beta_i)`` (prior ``(alpha0, beta0)``), the step ``t_i``
of its last update and its count of updates. A call at step ``t``:

1. takes the candidates: every prompt of the pool (``candidate_ratio: null``, the default:
   each prompt is an arm of the bandit; in a loop block, less those chosen by the step's
   earlier rounds, whose draws would be the same), or the next ``candidate_ratio * batch_size`` prompts
   of a seeded per-epoch permutation (MoPPS's oversized batch, ``control.uniform``'s epochs);
2. decays each seen candidate's posterior toward the prior for the steps it sat idle, the
   **slow scale** ``lambda_s = slow_decay`` per step:
   ``alpha' = alpha0 + (alpha_i - alpha0) * lambda_s ** (t - t_i)`` (``beta'`` alike);
3. draws ``p~_i ~ Beta(alpha', beta')``, seeded by ``(seed, epoch, t, crc32(prompt_id))``;
4. keeps the ``batch_size`` candidates with the largest gain ``g_i = p~_i (1 - p~_i)`` (ties
   in candidate order), each with ``n_rollouts`` (default 1; put ``control.fixed_n``
   downstream for the group size).

After the step, ``observe`` updates every prompt rolled out in it from its group's ``s``
correct out of ``n`` judged rollouts: first the idle decay of step 2 (made permanent), then
the **fast scale** ``lambda_f = fast_decay`` per update, MoPPS's decayed update:

    alpha_i <- lambda_f * alpha' + (1 - lambda_f) * alpha0 + s
    beta_i  <- lambda_f * beta'  + (1 - lambda_f) * beta0  + (n - s)

Why this gain: ``p (1 - p)`` is the variance of a prompt's 0/1 reward, the quantity whose
collapse to 0 makes a group's advantages vanish (the paper's "gradient vanishing"), and the
abstract says the gain is maximised "through the estimated correctness probability", a
function of the draw. A group of ``G`` is informative with probability
``1 - p^G - (1 - p)^G``, which orders draws the same way. We did not use the expected
reduction of the posterior's entropy: for a Beta posterior it is largest for draws near 0 or
1 (an all-equal group makes the posterior most concentrated), the opposite of what the
abstract says the sampler prefers. Consequence: among the same candidates with the same draws,
the chosen prompts are those MoPPS's ``topk`` picks with target 0.5 (``p (1 - p)`` falls with
``|p - 0.5|``); VADE differs from ``control.beta_thompson`` in its candidates (the whole pool
by default, so a prompt may be chosen again at the next step; nothing is consumed) and in the
slow, idle-time decay, which lets a prompt's old evidence fade while it is not chosen.

For the control lineage each entry's ``ControlReason`` is ``largest_gain`` (picked, with its
``rank``) or ``smaller_gain`` (skipped), the ``gain`` as the decisive number, ``cutoff_gain``
(the smallest chosen gain), the ``draw``, the decayed ``posterior_mean``, ``alpha`` and ``beta``.
With every prompt a candidate only the chosen ones are listed (below), so the lineage holds
no row for the others; the step's ``gain_min`` bounds their gains (none is larger).

Per-step metrics go to ``controller_state`` (``control.<id>`` in ``metrics.jsonl`` and
MLflow): ``candidates``, ``chosen``, the chosen prompts' mean / min ``gain``, mean ``draw``,
mean decayed ``posterior_mean`` (their predicted success), ``unseen`` (chosen prompts never
observed), ``idle_steps`` (mean steps since the last update of the chosen seen ones) and
``tracked`` (prompts with a posterior).

Deviations:
- Abstract only: the gain ``p~ (1 - p~)``, the slow decay per idle step (default 0.99) and
  the fast decay per update (default 0.5, the value of MoPPS's launch scripts) are guesses.
  The prior is ``Beta(1, 1)``.
- ``s`` and ``n`` count the rollouts a verifier judged (``rollout.correct``); a group with
  none judged updates nothing; groups from earlier steps (replayed) are ignored; a prompt
  rolled out twice in one step (two loop rounds) is updated twice.
- Draws are seeded per prompt and step, so a resumed run redraws them exactly.
- With every prompt a candidate, only the chosen prompts are listed in the Allocation (not
  the whole pool with ``n_rollouts = 0``); with ``candidate_ratio`` set, every candidate is
  listed, as ``control.beta_thompson`` lists them.

Fidelity: from the abstract: no public code (a project page only; thu-rllab/MoPPS is the nearest
code); the rules above are this stage's reading.

Example:

>>> from gfcr.records import Prompt, PromptPool, StepContext, StepReport
>>> from gfcr.stages.testing import scored_group
>>> pool = PromptPool([Prompt(f"p:{i}", text=str(i)) for i in range(8)])
>>> stage = Vade(Vade.Config(batch_size=2, seed=0, fast_decay=0.5, slow_decay=0.5))
>>> stage.before_step(StepContext("run", step=0, seed=0, policy_version=0))
>>> [e.n_rollouts for e in stage.run(pool)]
[1, 1]
>>> stage.observe(StepReport("run", 0, 1, (scored_group("p:3", [1, 1, 0]),), None, {}, {}))
>>> stats = stage.stats["p:3"]
>>> (stats.beta_alpha, stats.beta_beta)  # 0.5 * 1 + 0.5 * 1 + 2, 0.5 * 1 + 0.5 * 1 + 1
(3.0, 2.0)
>>> stage.posterior("p:3", step=2)  # two idle steps: 1 + (3 - 1) * 0.25, 1 + (2 - 1) * 0.25
(1.5, 1.25)

YAML:

.. code-block:: yaml

    stages:
      pick:   {use: control.vade, with: {batch_size: 16, slow_decay: 0.99, fast_decay: 0.5}}
      budget: {use: control.fixed_n, from: pick, with: {n: 8}}
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import Field

from gfcr.records import (Allocation, AllocationEntry, ControlReason, Prompt, PromptPool, PromptStats, StepContext,
                          StepReport)
from gfcr.registry import Seed, StageConfig
from gfcr.stages.common.epochs import epoch_order, start_batch
from gfcr.stages.common.prompt_stats import (beta_update, observe_group, stats_from_state, stats_to_state,
                                              stats_with_prior)
from gfcr.stages.common.run_context import RunContext
from gfcr.stages.control.beta_thompson import thompson_draw

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
PriorCount = Annotated[float, Field(gt=0.0)]


def information_gain(draws: np.ndarray) -> np.ndarray:
    """Our reading of VADE's gain: ``p~ (1 - p~)``, the variance of a 0/1 reward at the draw."""
    p = np.asarray(draws, dtype=float)
    return p * (1.0 - p)


def largest_gain(gains: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest gains, largest first; ties keep their order."""
    return np.argsort(-np.asarray(gains, dtype=float), kind="stable")[:k]


def idle_decayed(alpha: float, beta: float, idle_steps: int, slow_decay: float,
                 prior_alpha: float, prior_beta: float) -> tuple[float, float]:
    """A posterior after ``idle_steps`` steps without an update: the slow scale,
    ``prior + (posterior - prior) * slow_decay ** idle_steps``."""
    keep = slow_decay ** max(idle_steps, 0)
    return prior_alpha + (alpha - prior_alpha) * keep, prior_beta + (beta - prior_beta) * keep


class Vade:
    """VADE: Thompson draws from two-scale-decayed Beta posteriors, the largest p(1 - p) chosen."""

    class Config(StageConfig):
        batch_size: Annotated[int, Field(ge=1, description="prompts chosen per call")]
        candidate_ratio: Annotated[int | None, Field(ge=1, description=(
            "candidates per call as a multiple of batch_size, from a seeded per-epoch permutation; "
            "null: every prompt of the pool is a candidate (an arm of the bandit)"))] = None
        n_rollouts: Annotated[int, Field(ge=1, description="rollouts marked per chosen prompt")] = 1
        slow_decay: Probability = Field(0.99, description=(
            "slow scale: weight a posterior keeps per step without an update (a guess; 1 = no idle decay)"))
        fast_decay: Probability = Field(0.5, description=(
            "fast scale: weight the old posterior keeps at each update (a guess; MoPPS's lambda)"))
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
        self._taken: set[str] = set()  # prompts chosen by earlier loop rounds of this step

    def before_step(self, ctx: StepContext) -> None:
        self.run_ctx.before_step(ctx)
        self._taken = set()

    def posterior(self, prompt_id: str, step: int) -> tuple[float, float]:
        """``(alpha, beta)`` of a prompt at ``step``, decayed for its idle steps; the prior when
        it was never observed."""
        cfg, stats = self.config, self.stats.get(prompt_id)
        if stats is None or stats.last_selected_step is None:
            return cfg.prior_alpha, cfg.prior_beta
        return idle_decayed(stats.beta_alpha, stats.beta_beta, step - stats.last_selected_step, cfg.slow_decay,
                            cfg.prior_alpha, cfg.prior_beta)

    def run(self, pool: PromptPool) -> Allocation:
        candidates = self._candidates(pool)
        posteriors = [self.posterior(p.prompt_id, self.run_ctx.step) for p in candidates]
        draws = np.array([thompson_draw(self.run_ctx.seed, self.epoch, self.run_ctx.step, p.prompt_id, a, b)
                          for p, (a, b) in zip(candidates, posteriors)])
        gains = information_gain(draws)
        chosen = [int(i) for i in largest_gain(gains, min(self.config.batch_size, len(candidates)))]
        rank = {i: r for r, i in enumerate(chosen)}
        listed = chosen if self.config.candidate_ratio is None else \
            chosen + [i for i in range(len(candidates)) if i not in rank]
        cutoff = float(gains[chosen[-1]]) if chosen else 0.0  # the smallest chosen gain
        entries = tuple(self._entry(candidates[i], draws[i], gains[i], posteriors[i], rank.get(i), cutoff)
                        for i in listed)
        self._taken.update(candidates[i].prompt_id for i in chosen)
        return Allocation(step=self.run_ctx.step, entries=entries,
                          controller_state=self._metrics(candidates, chosen, draws, gains, posteriors))

    def _candidates(self, pool: PromptPool) -> list[Prompt]:
        if self.config.candidate_ratio is None:
            return [p for p in pool if p.prompt_id not in self._taken]
        m = self.config.candidate_ratio * self.config.batch_size
        self.epoch, self.cursor = start_batch(self.epoch, self.cursor, m, len(pool))
        order = epoch_order(self.run_ctx.seed, self.epoch, len(pool))[self.cursor : self.cursor + m]
        self.cursor += m
        return [pool[int(i)] for i in order]

    def _entry(self, prompt: Prompt, draw: float, gain: float, posterior: tuple[float, float],
               rank: int | None, cutoff: float) -> AllocationEntry:
        a, b = posterior
        detail = f"draw {draw:.4f}, gain {gain:.4f}, Beta({a:.4g}, {b:.4g})"
        numbers = {"draw": draw, "cutoff_gain": cutoff, "posterior_mean": a / (a + b), "alpha": a, "beta": b}
        if rank is None:
            why = ControlReason("smaller_gain", "gain", gain, numbers)
            return AllocationEntry(prompt, 0, reason=f"vade: not chosen ({detail})", why=why)
        why = ControlReason("largest_gain", "gain", gain, {"rank": rank + 1, **numbers})
        return AllocationEntry(prompt, self.config.n_rollouts, reason=f"vade: rank {rank + 1} ({detail})", why=why)

    def _metrics(self, candidates: list[Prompt], chosen: list[int], draws: np.ndarray, gains: np.ndarray,
                 posteriors: list[tuple[float, float]]) -> dict[str, Any]:
        ids = [candidates[i].prompt_id for i in chosen]
        seen = [self.stats[p] for p in ids if p in self.stats and self.stats[p].last_selected_step is not None]
        idle = [self.run_ctx.step - s.last_selected_step for s in seen]
        return {
            "epoch": self.epoch, "candidates": len(candidates), "chosen": len(chosen),
            "gain_mean": float(np.mean(gains[chosen])), "gain_min": float(np.min(gains[chosen])),
            "draw_mean": float(np.mean(draws[chosen])),
            "posterior_mean": float(np.mean([posteriors[i][0] / sum(posteriors[i]) for i in chosen])),
            "unseen": len(ids) - len(seen), "idle_steps": float(np.mean(idle)) if idle else 0.0,
            "tracked": len(self.stats),
        }

    def observe(self, report: StepReport) -> None:
        cfg = self.config
        for group in report.groups:
            obs = observe_group(group, self.run_ctx.policy_version) if group.step == report.step else None
            if obs is None:
                continue
            stats = stats_with_prior(self.stats, group.prompt_id, cfg.history_size, cfg.prior_alpha, cfg.prior_beta)
            stats.beta_alpha, stats.beta_beta = self.posterior(group.prompt_id, report.step)  # the slow scale
            stats.record(obs)
            beta_update(stats, obs.n_correct, obs.n, cfg.fast_decay, cfg.prior_alpha, cfg.prior_beta)  # the fast one
            stats.last_selected_step = report.step
            stats.times_selected += 1

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable data: position in the epoch and every observed prompt's stats
        (posterior, last update step, updates)."""
        return {"epoch": self.epoch, "cursor": self.cursor,
                "prompts": {pid: stats_to_state(s) for pid, s in self.stats.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.stats = {pid: stats_from_state(s) for pid, s in state["prompts"].items()}
