"""control.xrpo: XRPO's hierarchical rollout allocator: a base group per prompt, then the rest
of the step's budget in phases, one rollout at a time, to the prompts whose Student-t
confidence interval on the mean reward would shrink most, plus an exploration bonus.

XRPO, eXplore-eXploit GRPO (Bamba, Fang, Yu, Zheng and Lai, 2025, arXiv 2510.06672; code
``UIUC-MLSys/XRPO``, not indexed here, not read). The rules below are those of the paper's
abstract and of summaries of its allocator (our research notes, section 2.11); the paper's
method section could not be read in full.

For a prompt ``q`` with ``n_q`` scored rollouts of sample mean ``r_q`` and sample standard
deviation ``s_q`` (``ddof = 1``), the uncertainty of its mean reward is the half-width of the
Student-t interval

    ``h_q(n) = t_{1 - alpha/2, n - 1} * s_q / sqrt(n)``         (``scipy.stats.t``)

and one more rollout is expected to reduce it by ``D_q = h_q(n_q) - h_q(n_q + 1)`` (``s_q``
held at its measured value). The priority of the next rollout is

    ``P_q = D_q + lambda * sqrt(log(1 + T) / n_q)``

with ``T`` the rollouts allocated so far this step over the whole batch (UCB1's round count).
In gfcr this is a loop block (``pipelines/xrpo_arith.yaml``), like ``control.dars``: round 0
gives every selected prompt ``n_base`` rollouts (``stage_index`` 0); each of the ``phases``
later rounds reads the merged groups (``filter.merge_rounds``, the loop's feedback edge),
measures ``s_q`` and ``n_q`` on them, and hands out its share of the remaining budget one
rollout at a time to the largest ``P_q`` (``n_q`` and ``T`` advance with each rollout handed
out, ``s_q`` stays as measured), no prompt above ``n_max``. The step's budget is
``mean_rollouts * |batch|``; phases ``1..j`` of ``P`` may spend ``ceil(R j / P)`` together of
the remainder ``R = budget - n_base |batch|``, so what a capped phase could not place carries
into the next, and a phase gets nothing only once ``R`` is used up (``filter.merge_rounds``
ends the loop after a round that generated nothing).

Budget (``step_metrics``, under ``stages.<id>`` in ``metrics.jsonl``): ``prompts``,
``budget``, ``base_rollouts``, ``phase_rollouts``, ``spent`` (their sum: the step's
``rollouts_generated`` with ``generate.sample``), ``unspent`` (``budget - spent``: nonzero only
when every prompt reached ``n_max`` or a group came back missing), ``max_n`` and ``min_n``
(largest and smallest per-prompt totals). ``spent == budget`` exactly whenever
``n_max * |batch| >= budget`` and every prompt's base group comes back; ``spent <= budget``
always. No state crosses steps: everything is rebuilt each step, so a resumed run needs
nothing saved.

Each entry's ``why`` (``ControlReason``): round 0 ``base`` (``n_base``); a phase round
``largest_priority`` with ``priority`` (``P_q`` before the phase's first rollout) and
``s_q``, ``n_q``, ``half_width``, ``reduction``, ``bonus``, ``given``, or ``lower_priority``
when it got none, ``at_cap`` when it had ``n_max`` already, ``no_group`` without a group.

Reference defaults: ``alpha = 0.05`` (a 95% interval). ``n_base = 4``, ``mean_rollouts = 8``
(GRPO's group of 8 at equal cost), ``n_max = 16``, ``phases = 2`` and ``bonus = 0.1`` are our
choices (see Deviations).

Deviations:
- Where ``s_q`` comes from: a first phase of rollouts in the same step (the paper's
  hierarchical planning samples every prompt a little, then allocates the rest in phases),
  not history from earlier steps: the interval is about the current policy's mean reward.
- The bonus form is not in the sources read: two third-party summaries disagree
  (``lambda sqrt(log(1 + T) / n_q)`` and ``lambda log(1 + T) / n_q``). We take the UCB1 form,
  ``sqrt``, with ``T`` the rollouts allocated so far this step (including the ones handed out
  earlier in the same phase); ``lambda = 0.1`` keeps the bonus (0.07 for ``n_q = 4``,
  ``T = 8``) below the reduction of a balanced prompt (0.20 for ``s_q = 0.58``), so
  zero-variance prompts get rollouts only once the others' reductions have shrunk.
- The number of phases, ``n_base``, ``n_max`` and the per-phase split (even, cumulative
  ceilings, carrying what a phase could not place) are our choices; the paper's values were
  not readable. ``n_base >= 2`` so that ``s_q`` and ``t_{., n - 1}`` exist.
- Rollouts are handed out greedily within a phase (``s_q`` frozen), which is the
  sequential argmax of ``P_q``; a tie goes to the prompt earlier in the allocation.
- XRPO's in-context seeding of all-zero prompts is not part of this stage (its context
  differs from the training prompt); its novelty sharpening is the estimator ``xrpo``.

Fidelity: from the abstract: no public code (the paper names UIUC-MLSys/XRPO, not reachable
here); the rules above are this stage's reading.

Example (two prompts after a base of 4: ``[1, 0, 0, 0]`` has ``s = 0.5``, ``[1, 1, 1, 1]`` has
``s = 0``):

>>> round(half_width(0.5, 4), 4), round(half_width(0.5, 5), 4)   # 3.1824 * 0.5 / 2, 2.7764 * 0.5 / sqrt 5
(0.7956, 0.6208)
>>> round(reduction(0.5, 4), 4), reduction(0.0, 4)
(0.1748, 0.0)
>>> greedy_phase([0.5, 0.0], [4, 4], units=2, total=8, bonus=0.1, n_max=16)   # the spread prompt takes both
[2, 0]
>>> greedy_phase([0.5, 0.0], [4, 4], units=2, total=8, bonus=2.0, n_max=16)   # a large bonus spreads them
[1, 1]

YAML (the loop block; ``pipelines/xrpo_arith.yaml`` is a whole pipeline):

.. code-block:: yaml

    stages:
      pick:    {use: control.uniform, with: {batch_size: 16}}
      plan:    {use: control.xrpo, from: {allocation: pick, groups: merged}, with: {mean_rollouts: 8, n_base: 4}}
      rollout: {use: generate.sample, from: plan, with: {temperature: 1.0, max_new_tokens: 8}}
      reward:  {use: filter.verify, from: rollout}
      merged:  {use: filter.merge_rounds, from: reward}
      keep:    {use: filter.nonzero_variance, from: xrpo}
    loops:
      xrpo: {stages: [plan, rollout, reward, merged], until: merged, max_rounds: 3}
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import Field, model_validator
from scipy import stats

from gfcr.records import Allocation, AllocationEntry, ControlReason, RolloutGroup, RolloutGroups, StepContext
from gfcr.registry import PipelineProblem, StageConfig

ALIAS = "control.xrpo"


def half_width(s: float, n: int, alpha: float = 0.05) -> float:
    """``t_{1 - alpha/2, n - 1} * s / sqrt(n)``: the Student-t interval's half-width (n >= 2)."""
    if n < 2:
        raise ValueError(f"the t interval needs at least 2 rollouts, got n = {n}")
    return float(stats.t.ppf(1.0 - alpha / 2.0, n - 1)) * s / math.sqrt(n)


def reduction(s: float, n: int, alpha: float = 0.05) -> float:
    """``h(n) - h(n + 1)`` at a fixed sample std ``s``: what one more rollout shrinks the interval by."""
    return half_width(s, n, alpha) - half_width(s, n + 1, alpha)


def priority(s: float, n: int, total: int, bonus: float, alpha: float = 0.05) -> float:
    """``reduction + bonus * sqrt(log(1 + total) / n)``."""
    return reduction(s, n, alpha) + bonus * math.sqrt(math.log1p(total) / n)


def greedy_phase(stds: list[float], counts: list[int], units: int, total: int, bonus: float, n_max: int,
                 alpha: float = 0.05) -> list[int]:
    """Hand out ``units`` rollouts one at a time to the largest priority; each one advances its
    prompt's ``n`` and the batch's ``total`` (which moves every prompt's bonus, so the argmax is
    recomputed each time rather than kept in a heap). Prompts at ``n_max`` take none; fewer than
    ``units`` go out when every prompt is capped. Ties go to the lower index."""
    given = [0] * len(stds)
    for _ in range(units):
        open_ = [(-priority(s, n + g, total, bonus, alpha), i)
                 for i, (s, n, g) in enumerate(zip(stds, counts, given)) if n + g < n_max]
        if not open_:
            break
        _, i = min(open_)
        given[i] += 1
        total += 1
    return given


def reward_std(group: RolloutGroup) -> tuple[float, int]:
    """The sample std (``ddof = 1``) of the group's scored rewards, and how many there are."""
    rewards = [r.reward for r in group.rollouts if r.reward is not None]
    if len(rewards) < len(group.rollouts):
        raise ValueError(f"group {group.group_id}: some rollouts have no reward; {ALIAS} measures each prompt's "
                         "reward spread: put filter.verify in the loop block before its until stage")
    return (float(np.std(rewards, ddof=1)) if len(rewards) >= 2 else 0.0), len(rewards)


class Xrpo:
    """XRPO: base rollouts, then phased rollouts to the largest Student-t half-width reduction plus a bonus."""

    class Config(StageConfig):
        sizes_each_group: ClassVar[bool] = True  # a capability: it sizes each prompt's group itself
        mean_rollouts: Annotated[int, Field(ge=2, description=(
            "rollouts per selected prompt on average: the step's budget is mean_rollouts * |batch|"))] = 8
        n_base: Annotated[int, Field(ge=2, description=(
            "rollouts every prompt gets in round 0, on which s_q is measured (at least 2)"))] = 4
        n_max: Annotated[int, Field(ge=2, description="most rollouts one prompt gets in a step, all rounds together")] = 16
        phases: Annotated[int, Field(ge=1, description=(
            "loop rounds after the base that share the rest of the budget (the loop's max_rounds is phases + 1)"))] = 2
        alpha: Annotated[float, Field(gt=0.0, lt=1.0, description=(
            "the interval's level: t_{1 - alpha/2, n - 1} (0.05: a 95% interval)"))] = 0.05
        bonus: Annotated[float, Field(ge=0.0, description=(
            "lambda: weight of the exploration bonus lambda * sqrt(log(1 + T) / n_q)"))] = 0.1

        @model_validator(mode="after")
        def _budget_fits(self) -> "Xrpo.Config":
            if not self.n_base <= self.mean_rollouts <= self.n_max:
                raise ValueError(
                    f"need n_base <= mean_rollouts <= n_max, got {self.n_base}, {self.mean_rollouts}, {self.n_max}: "
                    "the base must fit in the budget and the budget under the cap (e.g. 4, 8, 16)")
            return self

    @staticmethod
    def check_pipeline(config: "Xrpo.Config", view: Any) -> list[PipelineProblem]:
        """The groups come back through a loop's feedback edge, not from a generate stage upstream."""
        generators = view.in_family("generate", upstream=True)
        return [PipelineProblem(
            (), f"`{sid}` ({view.aliases[sid]}) is upstream of {ALIAS}: its phases would be generated by no stage",
            "put the stage in a loop block with the rollout, verify and merge stages and read `groups` from the "
            "loop's until stage: `from: {allocation: pick, groups: merged}`, `loops: {xrpo: {stages: [plan, "
            "rollout, reward, merged], until: merged, max_rounds: 3}}` (pipelines/xrpo_arith.yaml)")
            for sid in generators[:1]]

    def __init__(self, config: Config):
        self.config = config
        self._given: dict[str, int] = {}  # prompt id -> rollouts allocated this step, all rounds
        self._base = self._phase = 0  # rollouts allocated this step in round 0 and in the phases

    def before_step(self, ctx: StepContext) -> None:
        self._given, self._base, self._phase = {}, 0, 0

    @property
    def budget(self) -> int:
        return self.config.mean_rollouts * len(self._given)

    def run(self, allocation: Allocation, groups: RolloutGroups, ctx: StepContext) -> Allocation:
        if ctx.round is None:
            raise ValueError(f"{ALIAS} runs outside a loop block: it never gets to its phases; put it in one "
                             "(pipelines/xrpo_arith.yaml)")
        if ctx.round == 0:
            return self._base_round(allocation)
        if ctx.round > self.config.phases:
            return allocation.with_entries([replace(e, n_rollouts=0, reason="xrpo: phases done") for e in allocation])
        return self._phase_round(allocation, groups, ctx.round)

    def _base_round(self, allocation: Allocation) -> Allocation:
        n = self.config.n_base
        why = ControlReason("base", "n_base", n)
        entries = [replace(e, n_rollouts=n, stage_index=0, reason=f"xrpo: base {n}", why=why)
                   if e.n_rollouts > 0 else e for e in allocation]
        self._given = {e.prompt_id: n for e in entries if e.n_rollouts > 0}
        self._base = n * len(self._given)
        return allocation.with_entries(entries)

    def _phase_round(self, allocation: Allocation, groups: RolloutGroups, phase: int) -> Allocation:
        cfg = self.config
        by_prompt = {g.prompt_id: g for g in groups if g.rollouts}
        ids = [e.prompt_id for e in allocation if e.prompt_id in self._given and e.prompt_id in by_prompt]
        measured = {pid: reward_std(by_prompt[pid]) for pid in ids}
        remainder = self.budget - self._base
        units = -(-remainder * phase // cfg.phases) - self._phase  # ceil(R j / P) minus what earlier phases placed
        stds, counts = [measured[p][0] for p in ids], [measured[p][1] for p in ids]
        total = sum(self._given.values())
        given = dict(zip(ids, greedy_phase(stds, counts, units, total, cfg.bonus, cfg.n_max, cfg.alpha)))
        for pid, g in given.items():
            self._given[pid] += g
        self._phase += sum(given.values())
        return allocation.with_entries([self._phase_entry(e, measured, given, total, phase) for e in allocation])

    def _phase_entry(self, entry: AllocationEntry, measured: dict[str, tuple[float, int]], given: dict[str, int],
                     total: int, phase: int) -> AllocationEntry:
        cfg = self.config
        if entry.prompt_id not in self._given:
            return replace(entry, n_rollouts=0, stage_index=phase)
        if entry.prompt_id not in measured:
            return replace(entry, n_rollouts=0, stage_index=phase, reason=f"xrpo phase {phase}: no group",
                           why=ControlReason("no_group"))
        s, n = measured[entry.prompt_id]
        g = given[entry.prompt_id]
        if n >= cfg.n_max:
            return replace(entry, n_rollouts=0, stage_index=phase, reason=f"xrpo phase {phase}: at n_max {cfg.n_max}",
                           why=ControlReason("at_cap", "n_q", n, {"n_max": cfg.n_max}))
        h, d = half_width(s, n, cfg.alpha), reduction(s, n, cfg.alpha)
        bonus = cfg.bonus * math.sqrt(math.log1p(total) / n)
        code = "largest_priority" if g > 0 else "lower_priority"
        why = ControlReason(code, "priority", d + bonus, {"s_q": s, "n_q": n, "half_width": h, "reduction": d,
                                                          "bonus": bonus, "given": g})
        return replace(entry, n_rollouts=g, stage_index=phase, why=why,
                       reason=f"xrpo phase {phase}: s {s:.3g}, n {n}, reduction {d:.3g} + bonus {bonus:.3g}, +{g}")

    def step_metrics(self) -> dict[str, float]:
        """The step's budget and what each kind of round spent of it."""
        totals = list(self._given.values())
        spent = self._base + self._phase
        return {"prompts": len(totals), "budget": self.budget, "base_rollouts": self._base,
                "phase_rollouts": self._phase, "spent": spent, "unspent": self.budget - spent,
                "max_n": max(totals, default=0), "min_n": min(totals, default=0)}
