"""control.coba: CoBA-RL's allocator, as ``BetaAllocator`` of the authors' code computes it:
each selected prompt's training value ``V(N, p)`` is a saturating gain in its group size ``N``
times a Beta density over its pass rate ``p`` whose peak follows the model's failure rate, and
a max-heap hands the step's budget out by marginal gain.

CoBA-RL, Capability-Oriented Budget Allocation (Yao et al., 2026, arXiv 2602.03048), code
``Within-yao/CoBA-RL`` @ aa6b834, ``recipe/coba_rl/budget_allocators.py`` (``BetaAllocator``),
driven by ``recipe/coba_rl/coba_rl_ray_trainer.py`` once a step.

**Pass rates.** A prompt's ``p`` is its success count over its rollouts in the last ``window``
steps in which it was rolled out (a success is a rollout the verifier judged correct: the
reference counts reward 1.0). A prompt never seen counts as ``p = 0.5``; when no prompt of the
batch has been seen (the first step), the budget is split evenly, the remainder to the first.

**Value curve.** With ``s = beta_sum`` and ``F`` the mean, over the last ``window`` steps, of each
step's mean per-prompt failure rate (``1 - successes / rollouts``, prompts weighted alike),
late training (``F <= 0.5``) sharpens it to ``F' = sigmoid(10 (F - 0.5))`` (else ``F' = F``), and

    ``a = clip(1 + (s - 2) F', 1, s - 1)``,  ``b = s - a``,

a Beta density with mode ``F'``: a model failing often values the prompts it passes (exploit),
one that passes often the prompts it fails (explore). Before any observation ``a = s - 2``,
``b = 2``. With ``tau = tau_min + (tau_max - tau_min) clip(var(p) / var_max, 0, 1)`` (``var``: the
population variance of the explored prompts' ``p``, each clipped to ``[smoothing, 1 - smoothing]``
as everywhere below),

    ``V(N, p) = (1 - exp(-N / tau p (1 - p))) BetaPDF(p; a, b)``.

**Allocation.** Every prompt gets ``n_min``; of the ``R`` rollouts left, prompts with
``p < 0.05`` (very hard) and ``p > 0.99`` (very easy) sit out the heap, and the others ("explored",
``E`` of the ``M``) share ``int(R r)`` of them, ``r = exploration_budget_ratio`` when ``E > M / 2``,
else ``0.6 + (r - 0.6) 2 E / M`` (``0.6`` when ``E = 0``): a max-heap of ``V(N + 1, p) - V(N, p)``
hands them out one at a time, none above ``n_max``, ties to the earlier prompt. What is left goes
to the very hard prompts, then the explored, then the very easy (``leftover``): ``weighted``
gives prompt after prompt ``int(left (1 - p)^weight_alpha / total weight)`` of what is *still*
left (so earlier prompts get more), then one even pass of the rest; ``uniform`` one even pass.
A prompt at ``n_max`` takes nothing, so the spend can fall short of the budget (``spent``).

The budget is ``mean_rollouts * |batch|`` (the reference's ``train_batch_size * rollout.n``).

Per-step metrics (``step_metrics``): ``prompts``, ``budget``, ``spent``, ``explored`` (``E``),
``very_hard``, ``very_easy``, ``failure_rate`` (``F``, the window's, once observed), ``alpha`` and ``beta`` (the curve's), ``mode`` (its peak ``F'``), ``min_n``,
``max_n``, ``mean_p``, and ``tau`` on steps the heap ran. Each entry's ``why``: ``capability_value``
(``value`` ``V(N, p)``) for an explored prompt, ``very_hard`` / ``very_easy`` / ``first_step``
otherwise, with ``p``, ``n`` and ``alpha``, ``beta``.

Defaults: the authors' launch script ``examples/coba_rl/run_qwen2.5_7b_coba_rl.sh`` (the one the
README runs, on the model of its results table, Qwen2.5-7B-Instruct): ``n_min = 2``, ``n_max =
128``, ``window = 1``, ``beta_sum = 11``, ``mean_rollouts = 16`` (its ``rollout.n``); the rest
are ``BetaAllocator``'s own (the script leaves them): ``tau_min = 3``, ``tau_max = 12``, ``var_max
= 0.1667``, ``smoothing = 0.01``, ``exploration_budget_ratio = 0.8``, ``leftover = weighted``,
``weight_alpha = 1``. The class's own defaults differ in ``n_max = 32``, ``window = 3``, ``beta_sum
= 7``; half the reference cases run with those.

Deviations: none in what is computed. gfcr requires ``n_min <= mean_rollouts <= n_max`` (the
reference splits a smaller budget evenly below ``n_min``); a success is the verifier's
``correct`` where the reference tests ``reward == 1.0`` (the same for gfcr's binary verifiers).

Fidelity: checked against Within-yao/CoBA-RL@aa6b834: 72/72 cases

Example (before any observation: ``a = 9``, ``b = 2``; ``tau = 3``):

>>> round(value(0.5, 4, tau=3.0, alpha=9.0, beta=2.0), 4)  # (1 - exp(-1/3)) * 90 / 2^9
0.0498
>>> allocate([None, None, None], budget=8, n_min=2, n_max=128, shape=(9.0, 2.0)).counts  # first step
[3, 3, 2]
>>> plan = allocate([0.5, 0.0, 1.0], budget=12, n_min=2, n_max=128, shape=(9.0, 2.0))
>>> plan.kinds, plan.counts  # 6 above n_min: int(6 * 0.733) = 4 to the heap, 2 to the very hard
(['explored', 'very_hard', 'very_easy'], [6, 4, 2])

YAML:

.. code-block:: yaml

    stages:
      pick:    {use: control.uniform, with: {batch_size: 16}}
      budget:  {use: control.coba, from: pick, with: {mean_rollouts: 8, n_min: 2, n_max: 16}}
      rollout: {use: generate.sample, from: budget}
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator
from scipy.special import betaln

from gfcr.records import Allocation, AllocationEntry, ControlReason, StepContext, StepReport
from gfcr.registry import StageConfig
from gfcr.stages.common.prompt_stats import observe_group

ALIAS = "control.coba"

VERY_HARD, VERY_EASY = 0.05, 0.99  # p below / above: outside the heap (hard-coded in the reference)
MIN_EXPLORATION_RATIO = 0.6  # the explored prompts' share of R when few of them (hard-coded there)
SHARPNESS = 10.0  # of the sigmoid that sharpens a failure rate <= 0.5


def beta_shape(failure_rate: float, beta_sum: float) -> tuple[float, float]:
    """The value curve's ``(a, b)`` for a window failure rate ``F``: mode ``F`` (sharpened below 0.5)."""
    f = failure_rate if failure_rate > 0.5 else 1.0 / (1.0 + math.exp(-SHARPNESS * (failure_rate - 0.5)))
    a = min(max(1.0 + (beta_sum - 2.0) * f, 1.0), beta_sum - 1.0)
    return a, beta_sum - a


def value(p: float, n: int, tau: float, alpha: float, beta: float, smoothing: float = 0.01) -> float:
    """``V(N, p) = (1 - exp(-N / tau p (1 - p))) BetaPDF(p; alpha, beta)``, ``p`` clipped to ``[s, 1 - s]``."""
    p = min(max(p, smoothing), 1.0 - smoothing)
    density = math.exp((alpha - 1.0) * math.log(p) + (beta - 1.0) * math.log(1.0 - p) - betaln(alpha, beta))
    return (1.0 - math.exp(-n / tau * p * (1.0 - p))) * density


def temperature(rates: list[float], tau_min: float, tau_max: float, var_max: float, smoothing: float) -> float:
    """``tau``: from ``tau_min`` to ``tau_max`` as the explored pass rates' variance grows to ``var_max``."""
    spread = float(np.var(np.clip(rates, smoothing, 1.0 - smoothing))) / var_max
    return tau_min + (tau_max - tau_min) * min(max(spread, 0.0), 1.0)


@dataclass(frozen=True)
class Plan:
    """One step's allocation: group sizes in batch order, the heap's ``tau`` (None when it did
    not run) and each prompt's category (``explored``, ``very_hard``, ``very_easy``, ``first_step``)."""

    counts: list[int]
    tau: float | None
    kinds: list[str]


def allocate(pass_rates: list[float | None], budget: int, n_min: int, n_max: int, shape: tuple[float, float],
             tau_range: tuple[float, float] = (3.0, 12.0), var_max: float = 0.1667, smoothing: float = 0.01,
             exploration_budget_ratio: float = 0.8, leftover: str = "weighted", weight_alpha: float = 1.0) -> Plan:
    """BetaAllocator.allocate: ``pass_rates`` in batch order (None: never seen), ``budget >= n_min * len``."""
    m = len(pass_rates)
    if all(p is None for p in pass_rates):
        return Plan(even_split(budget, m), None, ["first_step"] * m)
    rates = [0.5 if p is None else p for p in pass_rates]
    kinds = ["very_hard" if p < VERY_HARD else "very_easy" if p > VERY_EASY else "explored" for p in rates]
    counts, left = [n_min] * m, budget - n_min * m
    explored = [i for i, k in enumerate(kinds) if k == "explored"]
    tau = None
    share = int(left * exploration_share(len(explored), m, exploration_budget_ratio))
    if left > 0 and explored and share > 0:
        tau = temperature([rates[i] for i in explored], *tau_range, var_max, smoothing)
        for i, n in zip(explored, heap_greedy([rates[i] for i in explored], share, n_min, n_max, tau, shape,
                                              smoothing)):
            left -= n - n_min
            counts[i] = n
    for kind in ("very_hard", "explored", "very_easy"):
        members = [i for i, k in enumerate(kinds) if k == kind]
        if left > 0 and members:
            spread = spread_weighted if leftover == "weighted" else spread_evenly
            left = spread(left, members, counts, n_max, rates, weight_alpha)
    return Plan(counts, tau, kinds)


def even_split(budget: int, m: int) -> list[int]:
    """``budget // m`` each, one more to each of the first ``budget % m``."""
    return [budget // m + (1 if i < budget % m else 0) for i in range(m)]


def exploration_share(explored: int, m: int, ratio: float) -> float:
    """The explored prompts' share of the rollouts above ``n_min``."""
    if explored == 0:
        return MIN_EXPLORATION_RATIO
    if explored > m / 2:
        return ratio
    return MIN_EXPLORATION_RATIO + (ratio - MIN_EXPLORATION_RATIO) * (explored / m * 2)


def heap_greedy(rates: list[float], extra: int, n_min: int, n_max: int, tau: float, shape: tuple[float, float],
                smoothing: float) -> list[int]:
    """``n_min`` each, then ``extra`` rollouts one at a time to the largest ``V(N + 1) - V(N)``
    (ties to the earlier prompt), none above ``n_max``."""
    counts = [n_min] * len(rates)

    def gain(i: int) -> float:
        n, p = counts[i], rates[i]
        return value(p, n + 1, tau, *shape, smoothing) - value(p, n, tau, *shape, smoothing)

    heap = [(-gain(i), i) for i in range(len(rates)) if counts[i] < n_max]
    heapq.heapify(heap)
    while extra > 0 and heap:
        _, i = heapq.heappop(heap)
        counts[i] += 1
        extra -= 1
        if counts[i] < n_max:
            heapq.heappush(heap, (-gain(i), i))
    return counts


def spread_evenly(left: int, members: list[int], counts: list[int], n_max: int, *_: Any) -> int:
    """One even pass of ``left`` over the members below ``n_max`` (the first get the remainder),
    each capped at ``n_max``; returns what is still left."""
    open_ = [i for i in members if counts[i] < n_max]
    if not open_:
        return left
    for i, share in zip(open_, even_split(left, len(open_))):
        given = min(share, n_max - counts[i])
        counts[i] += given
        left -= given
    return left


def spread_weighted(left: int, members: list[int], counts: list[int], n_max: int, rates: list[float],
                    weight_alpha: float) -> int:
    """Member after member ``int(left w / W)`` of what is still left, ``w = (1 - p)^weight_alpha``
    over the members below ``n_max``, then one even pass of the rest."""
    weights = [(i, (1.0 - min(max(rates[i], 1e-6), 1.0 - 1e-6)) ** weight_alpha)
               for i in members if counts[i] < n_max]
    if not weights:
        return left
    total = sum(w for _, w in weights)
    if total == 0:
        return spread_evenly(left, members, counts, n_max)
    for i, w in weights:
        given = min(int(left * w / total), n_max - counts[i])
        counts[i] += given
        left -= given
    return spread_evenly(left, [i for i, _ in weights], counts, n_max) if left > 0 else left


class Coba:
    """CoBA-RL (BetaAllocator): a capability-shifted Beta value curve, heap-greedy marginal allocation."""

    class Config(StageConfig):
        sizes_each_group: ClassVar[bool] = True  # a capability: it sizes each prompt's group itself
        mean_rollouts: Annotated[int, Field(ge=1, description=(
            "rollouts per selected prompt on average: the step's budget is mean_rollouts * |batch|"))] = 16
        n_min: Annotated[int, Field(ge=1, description="rollouts every selected prompt gets at least (n_low)")] = 2
        n_max: Annotated[int, Field(ge=1, description="most rollouts one prompt gets in a step (n_up)")] = 128
        window: Annotated[int, Field(ge=1, description=(
            "steps the pass rates and the failure rate average over (sliding_window_size)"))] = 1
        beta_sum: Annotated[float, Field(gt=2.0, description=(
            "a + b of the Beta value curve (beta_params_sum; larger: a narrower peak)"))] = 11.0
        tau_min: Annotated[float, Field(gt=0.0, description="tau when the explored pass rates agree")] = 3.0
        tau_max: Annotated[float, Field(gt=0.0, description="tau when their variance reaches var_max")] = 12.0
        var_max: Annotated[float, Field(gt=0.0, description="the pass-rate variance that gives tau_max")] = 0.1667
        smoothing: Annotated[float, Field(ge=0.0, lt=0.5, description=(
            "pass rates are clipped to [smoothing, 1 - smoothing] in the value and tau"))] = 0.01
        exploration_budget_ratio: Annotated[float, Field(ge=0.0, le=1.0, description=(
            "share of the rollouts above n_min the heap hands out when most prompts are explored"))] = 0.8
        leftover: Annotated[Literal["weighted", "uniform"], Field(description=(
            "how the rest is spread (remaining_budget_method): by (1 - p)^weight_alpha, or evenly"))] = "weighted"
        weight_alpha: Annotated[float, Field(ge=0.0, description="exponent of (1 - p) in the weighted spread")] = 1.0

        @model_validator(mode="after")
        def _budget_fits(self) -> "Coba.Config":
            if not self.n_min <= self.mean_rollouts <= self.n_max:
                raise ValueError(
                    f"need n_min <= mean_rollouts <= n_max, got {self.n_min}, {self.mean_rollouts}, {self.n_max}: "
                    "otherwise the budget cannot give every prompt n_min within the cap (e.g. 2, 16, 128)")
            return self

    def __init__(self, config: Config):
        self.config = config
        self.windows: dict[str, deque[tuple[int, int]]] = {}  # prompt -> (successes, rollouts) per step seen
        self.failure_rates: deque[float] = deque(maxlen=config.window)  # per step: mean per-prompt failure
        self.shape = (config.beta_sum - 2.0, 2.0)  # (a, b) of the value curve, updated in observe
        self._assigned: set[str] = set()  # prompts this stage sized this step
        self._metrics: dict[str, float] = {}

    def before_step(self, ctx: StepContext) -> None:
        self._assigned, self._metrics = set(), {}

    def pass_rate(self, prompt_id: str) -> float | None:
        """Successes over rollouts in the prompt's last ``window`` observed steps; None if never seen."""
        seen = self.windows.get(prompt_id)
        if not seen:
            return None
        return sum(s for s, _ in seen) / sum(n for _, n in seen)

    def run(self, allocation: Allocation) -> Allocation:
        cfg = self.config
        active = allocation.active()
        rates = [self.pass_rate(e.prompt_id) for e in active]
        budget = cfg.mean_rollouts * len(active)
        plan = allocate(rates, budget, cfg.n_min, cfg.n_max, self.shape, (cfg.tau_min, cfg.tau_max), cfg.var_max,
                        cfg.smoothing, cfg.exploration_budget_ratio, cfg.leftover, cfg.weight_alpha)
        decided = {e.prompt_id: (n, p, kind) for e, n, p, kind in zip(active, plan.counts, rates, plan.kinds)}
        self._assigned.update(decided)
        entries = [self._entry(e, *decided[e.prompt_id], plan.tau) if e.n_rollouts > 0 else e for e in allocation]
        self._metrics = self._step_metrics(plan, rates, budget)
        return allocation.with_entries(entries)

    def _step_metrics(self, plan: Plan, rates: list[float | None], budget: int) -> dict[str, float]:
        a, b = self.shape
        seen = [0.5 if p is None else p for p in rates]
        metrics = {"prompts": len(plan.counts), "budget": budget, "spent": sum(plan.counts),
                   "explored": plan.kinds.count("explored"), "very_hard": plan.kinds.count("very_hard"),
                   "very_easy": plan.kinds.count("very_easy"), "alpha": a, "beta": b, "mode": (a - 1.0) / (a + b - 2.0), "min_n": min(plan.counts, default=0),
                   "max_n": max(plan.counts, default=0), "mean_p": float(np.mean(seen)) if seen else 0.0}
        if self.failure_rate is not None:
            metrics["failure_rate"] = self.failure_rate
        return metrics | ({"tau": plan.tau} if plan.tau is not None else {})

    @property
    def failure_rate(self) -> float | None:
        """``F``: the window's mean failure rate; None before any observation."""
        return float(np.mean(self.failure_rates)) if self.failure_rates else None

    def _entry(self, entry: AllocationEntry, n: int, p: float | None, kind: str, tau: float | None) -> AllocationEntry:
        a, b = self.shape
        shown = 0.5 if p is None else p
        quantities = {"p": shown, "n": n, "alpha": a, "beta": b}
        if kind == "explored" and tau is not None:
            why = ControlReason("capability_value", "value", value(shown, n, tau, a, b, self.config.smoothing),
                                quantities | {"tau": tau})
        else:
            why = ControlReason("first_step" if kind == "explored" else kind, None, None, quantities)
        mine = f"coba: p {shown:.3g}, {kind}, n {n}"
        return replace(entry, n_rollouts=n, why=why, reason=f"{entry.reason}; {mine}" if entry.reason else mine)

    def step_metrics(self) -> dict[str, float]:
        """This step's budget and spend, the value curve's shape and the spread of group sizes."""
        return dict(self._metrics)

    def observe(self, report: StepReport) -> None:
        counts: dict[str, tuple[int, int]] = {}
        for group in report.groups:
            if group.step != report.step or group.prompt_id not in self._assigned:
                continue
            obs = observe_group(group, 0)
            if obs is None:
                continue
            s, n = counts.get(group.prompt_id, (0, 0))
            counts[group.prompt_id] = (s + obs.n_correct, n + obs.n)
        for pid, seen in counts.items():
            self.windows.setdefault(pid, deque(maxlen=self.config.window)).append(seen)
        if counts:
            self.failure_rates.append(1.0 - float(np.mean([s / n for s, n in counts.values()])))
            self.shape = beta_shape(self.failure_rate, self.config.beta_sum)

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON data: each prompt's window, the failure-rate window and the curve's shape."""
        return {"prompts": {pid: [list(x) for x in w] for pid, w in self.windows.items()},
                "failure_rates": list(self.failure_rates), "shape": list(self.shape)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        window = self.config.window
        self.windows = {pid: deque((tuple(x) for x in w), maxlen=window) for pid, w in state["prompts"].items()}
        self.failure_rates = deque(state["failure_rates"], maxlen=window)
        self.shape = tuple(state["shape"])
