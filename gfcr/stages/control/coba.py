"""control.coba: CoBA-RL's allocator: each selected prompt's training value ``V(p)`` is a
Beta-density curve over its pass rate ``p`` whose peak follows the model's global failure
rate, and the step's budget goes out one rollout at a time to the largest marginal gain
(a max-heap).

CoBA-RL, Capability-Oriented Budget Allocation (Yao et al., 2026, arXiv 2602.03048; code
announced at ``Within-yao/CoBA-RL``, which held only a README). **The rules here come from the
abstract and summaries of it only**: a "Capability-Oriented Value function" maps a task to its
training gain, shaped like a Beta curve whose shape shifts with the model's capability (its
global failure rate): early, when the model fails often, it favours easier tasks (exploit),
later harder ones (explore); a heap-based greedy strategy hands out the budget. Every formula
below is our choice within those words.

**Value curve.** With ``F`` the global failure rate and concentration ``kappa > 2``,

    ``V(p) = BetaPDF(p; a, b)``,  ``a = 1 + (kappa - 2) F``,  ``b = 1 + (kappa - 2) (1 - F)``,

a Beta density whose mode ``(a - 1) / (a + b - 2)`` is ``F``: a model failing 80% of its
rollouts values prompts it passes 80% of the time (its easy ones) most; once it fails 20%,
prompts at ``p = 0.2`` (its hard ones).

**Marginal gain.** A prompt given ``n`` rollouts is worth ``U(n) = V(p) (1 - p^n - (1 - p)^n)``,
its value times the chance its group is not all-equal (zero advantage), the informative-group
probability of Knapsack-RL, CoBA's baseline. One more rollout gains
``U(n + 1) - U(n) = V(p) p (1 - p) (p^(n-1) + (1 - p)^(n-1))``, which falls with ``n``: the
greedy allocation (every prompt starts at ``n_min``; a max-heap hands the rest out, one
rollout at a time, to the largest gain, at most ``n_max`` a prompt) maximises ``sum_q U_q``.
It spends exactly ``mean_rollouts * |batch|`` (``n_min <= mean_rollouts <= n_max``).

**Estimates.** ``p`` is the mean of a per-prompt Beta posterior (``prompt_stats.beta_update``,
prior ``Beta(1, 1)``, ``decay`` 0: the last observed group with one pseudo-success and one
pseudo-failure, ``(s + 1) / (n + 2)``); a prompt never seen has ``p = 0.5``. ``F`` is an
exponential average over steps of the failure rate of this stage's scored rollouts
(``F <- m F + (1 - m) f``, ``m = failure_momentum``), its first observation taken as is;
``F = 0.5`` before any. Both learn in ``observe`` and are saved with each checkpoint.

Per-step metrics (``step_metrics``): ``prompts``, ``budget``, ``spent`` (equal to it),
``failure_rate`` (``F`` used), ``mode`` (the curve's peak, ``F``), ``min_n``, ``max_n`` and
``mean_p`` (mean ``p`` of the batch). Each entry's ``why``: ``capability_value`` with
``value`` (``V(p)``) and ``p``, ``failure_rate``, ``n`` and ``last_gain`` (the gain of its last
rollout; 0 when it kept ``n_min``).

Defaults (ours; the abstract gives none): ``kappa = 6``, ``n_min = 2``, ``mean_rollouts = 8``,
``n_max = 16``, ``failure_momentum = 0.9``, ``decay = 0``.

Deviations: all of the above is a reconstruction from the abstract; the paper's ``V(p)``
parameterisation, marginal-gain definition, pass-rate estimator and capability signal could
not be read. Heap ties go to the prompt earlier in the allocation.

Fidelity: public code at Within-yao/CoBA-RL@aa6b834; reference cases pending
(``recipe/coba_rl/budget_allocators.py`` ``BetaAllocator``, issue 29); this stage predates it.

Example (``F = 0.5``, ``kappa = 6``: ``V(p) = 30 p^2 (1 - p)^2``):

>>> round(value_curve(0.5, 0.5, 6.0), 4), round(value_curve(0.25, 0.5, 6.0), 4)
(1.875, 1.0547)
>>> round(marginal_gain(0.5, 2, 1.875), 4)   # 1.875 * 0.25 * (0.5 + 0.5)
0.4688
>>> greedy_allocation([0.5, 0.25], failure_rate=0.5, budget=6, n_min=2, n_max=16, kappa=6.0)
[4, 2]

YAML:

.. code-block:: yaml

    stages:
      pick:    {use: control.uniform, with: {batch_size: 16}}
      budget:  {use: control.coba, from: pick, with: {mean_rollouts: 8, n_min: 2, n_max: 16}}
      rollout: {use: generate.sample, from: budget}
"""

from __future__ import annotations

import heapq
from dataclasses import replace
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import Field, model_validator
from scipy import stats as scipy_stats

from gfcr.records import Allocation, AllocationEntry, ControlReason, PromptStats, StepContext, StepReport
from gfcr.registry import StageConfig
from gfcr.stages.common.prompt_stats import (beta_mean, beta_update, observe_group, stats_from_state,
                                              stats_to_state, stats_with_prior)

ALIAS = "control.coba"


def value_curve(p: float, failure_rate: float, kappa: float) -> float:
    """``V(p)``: the Beta density with mode ``failure_rate`` and concentration ``kappa``."""
    a = 1.0 + (kappa - 2.0) * failure_rate
    b = 1.0 + (kappa - 2.0) * (1.0 - failure_rate)
    return float(scipy_stats.beta.pdf(p, a, b))


def marginal_gain(p: float, n: int, value: float) -> float:
    """``U(n + 1) - U(n)`` for ``U(n) = value (1 - p^n - (1 - p)^n)``."""
    return value * p * (1.0 - p) * (p ** (n - 1) + (1.0 - p) ** (n - 1))


def greedy_allocation(pass_rates: list[float], failure_rate: float, budget: int, n_min: int, n_max: int,
                      kappa: float) -> list[int]:
    """Every prompt ``n_min``, then ``budget - n_min * k`` rollouts one at a time to the largest
    marginal gain (a max-heap: a prompt's gain depends only on its own ``n``), none above ``n_max``."""
    counts = [n_min] * len(pass_rates)
    values = [value_curve(p, failure_rate, kappa) for p in pass_rates]
    heap = [(-marginal_gain(p, n_min, v), i) for i, (p, v) in enumerate(zip(pass_rates, values))]
    heapq.heapify(heap)
    for _ in range(budget - n_min * len(pass_rates)):
        if not heap:
            break
        _, i = heapq.heappop(heap)
        counts[i] += 1
        if counts[i] < n_max:
            heapq.heappush(heap, (-marginal_gain(pass_rates[i], counts[i], values[i]), i))
    return counts


class Coba:
    """CoBA-RL (abstract only): a capability-shifted Beta value curve, heap-greedy marginal allocation."""

    class Config(StageConfig):
        sizes_each_group: ClassVar[bool] = True  # a capability: it sizes each prompt's group itself
        mean_rollouts: Annotated[int, Field(ge=1, description=(
            "rollouts per selected prompt on average: the step spends exactly mean_rollouts * |batch|"))] = 8
        n_min: Annotated[int, Field(ge=1, description="rollouts every selected prompt gets at least")] = 2
        n_max: Annotated[int, Field(ge=1, description="most rollouts one prompt gets in a step")] = 16
        kappa: Annotated[float, Field(gt=2.0, description=(
            "concentration a + b of the Beta value curve (larger: a narrower peak at the failure rate)"))] = 6.0
        failure_momentum: Annotated[float, Field(ge=0.0, lt=1.0, description=(
            "m in F <- m F + (1 - m) f: how slowly the global failure rate follows each step's"))] = 0.9
        decay: Annotated[float, Field(ge=0.0, le=1.0, description=(
            "per-prompt Beta posterior decay (prompt_stats.beta_update): 0 keeps only the last group, 1 all"))] = 0.0
        prior_alpha: Annotated[float, Field(gt=0.0, description="Beta prior pseudo-successes of a prompt's pass rate")] = 1.0
        prior_beta: Annotated[float, Field(gt=0.0, description="Beta prior pseudo-failures of a prompt's pass rate")] = 1.0

        @model_validator(mode="after")
        def _budget_fits(self) -> "Coba.Config":
            if not self.n_min <= self.mean_rollouts <= self.n_max:
                raise ValueError(
                    f"need n_min <= mean_rollouts <= n_max, got {self.n_min}, {self.mean_rollouts}, {self.n_max}: "
                    "otherwise no allocation spends the budget exactly (e.g. 2, 8, 16)")
            return self

    def __init__(self, config: Config):
        self.config = config
        self.stats: dict[str, PromptStats] = {}
        self.failure_rate: float | None = None  # F; None before the first observation
        self._policy_version = 0
        self._assigned: set[str] = set()  # prompts this stage sized this step
        self._metrics: dict[str, float] = {}

    def before_step(self, ctx: StepContext) -> None:
        self._policy_version = ctx.policy_version
        self._assigned, self._metrics = set(), {}

    def pass_rate(self, prompt_id: str) -> float:
        """The posterior mean of the prompt's pass rate; the prior's mean for a prompt never seen."""
        if prompt_id in self.stats:
            return beta_mean(self.stats[prompt_id])
        return self.config.prior_alpha / (self.config.prior_alpha + self.config.prior_beta)

    @property
    def capability(self) -> float:
        """``F`` as the allocation uses it: 0.5 before any observation."""
        return 0.5 if self.failure_rate is None else self.failure_rate

    def run(self, allocation: Allocation) -> Allocation:
        cfg, f = self.config, self.capability
        active = allocation.active()
        rates = [self.pass_rate(e.prompt_id) for e in active]
        budget = cfg.mean_rollouts * len(active)
        counts = dict(zip((e.prompt_id for e in active),
                          zip(greedy_allocation(rates, f, budget, cfg.n_min, cfg.n_max, cfg.kappa), rates)))
        self._assigned.update(counts)
        entries = [self._entry(e, *counts[e.prompt_id], f) if e.n_rollouts > 0 else e for e in allocation]
        sizes = [n for n, _ in counts.values()]
        self._metrics = {"prompts": len(active), "budget": budget, "spent": sum(sizes), "failure_rate": f,
                         "mode": f, "min_n": min(sizes, default=0), "max_n": max(sizes, default=0),
                         "mean_p": float(np.mean(rates)) if rates else 0.0}
        return allocation.with_entries(entries)

    def _entry(self, entry: AllocationEntry, n: int, p: float, f: float) -> AllocationEntry:
        cfg = self.config
        v = value_curve(p, f, cfg.kappa)
        last = marginal_gain(p, n - 1, v) if n > cfg.n_min else 0.0
        why = ControlReason("capability_value", "value", v, {"p": p, "failure_rate": f, "n": n, "last_gain": last})
        mine = f"coba: p {p:.3g}, F {f:.3g}, V {v:.3g}, n {n}"
        return replace(entry, n_rollouts=n, why=why, reason=f"{entry.reason}; {mine}" if entry.reason else mine)

    def step_metrics(self) -> dict[str, float]:
        """This step's budget and spend, the failure rate the curve used, and the spread of group sizes."""
        return dict(self._metrics)

    def observe(self, report: StepReport) -> None:
        cfg, failed, judged = self.config, 0, 0
        for group in report.groups:
            if group.step != report.step or group.prompt_id not in self._assigned:
                continue
            obs = observe_group(group, self._policy_version)
            if obs is None:
                continue
            stats = stats_with_prior(self.stats, group.prompt_id, 1, cfg.prior_alpha, cfg.prior_beta)
            stats.record(obs)
            beta_update(stats, obs.n_correct, obs.n, cfg.decay, cfg.prior_alpha, cfg.prior_beta)
            failed, judged = failed + obs.n - obs.n_correct, judged + obs.n
        if judged:
            step_rate = failed / judged
            self.failure_rate = step_rate if self.failure_rate is None else (
                cfg.failure_momentum * self.failure_rate + (1.0 - cfg.failure_momentum) * step_rate)

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON data: the failure rate and every observed prompt's stats."""
        return {"failure_rate": self.failure_rate,
                "prompts": {pid: stats_to_state(s) for pid, s in self.stats.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.failure_rate = None if state["failure_rate"] is None else float(state["failure_rate"])
        self.stats = {pid: stats_from_state(s) for pid, s in state["prompts"].items()}
