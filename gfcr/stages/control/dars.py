"""control.dars: after N rollouts per prompt, give each hard prompt ΔN more (DARS's second-stage top-up).

DARS, Difficulty Adaptive Rollout Sampling (Yang et al., 2025, "Depth-Breadth Synergy in
RLVR", arXiv 2508.13755; reference code ``yangzhch6/DARS``,
``verl/verl/trainer/ppo/ray_dars_trainer.py``, ``schedule_ET`` / ``schedule_HW`` in ``fit``). A
step samples ``N`` rollouts per prompt, measures each prompt's accuracy ``acc`` on them, then
samples ``ΔN`` more for the hard ones and trains on the merged groups.

The schedule, for a group of ``N`` first-stage rollouts with accuracy ``acc``:

- ``acc >= 0.5``: ``ΔN = 0``; ``acc = 0`` is replaced by ``acc := 0.5 / N``;
- the absolute advantage mass of one sample, ``S(acc) = 2 acc (1 - acc)`` (``std: false``) or
  ``2 sqrt(acc (1 - acc))`` (``std: true``, the advantage divided by the group's std), and the
  target ``A_peak = 0.5 N`` (``std: false``) or ``N`` (``std: true``);
- ``et`` (equal treatment):  ``ΔN = ceil((A_peak - N S) / S)``;
- ``hw`` (hardness-weighted): ``ΔN = ceil((2 (1 - acc) A_peak - N S) / S)``;
- ``ΔN`` is clipped to ``[0, N_max - N]``, so no prompt gets more than ``N_max`` rollouts a step.

In gfcr this is a loop block of two rounds (``pipelines/dars_arith.yaml``): the stage reads
the selected prompts (``allocation``) and the loop's merged groups (``groups``, the feedback
edge from the loop's until stage, ``filter.merge_rounds``). Round 0 (no groups yet) gives each
selected prompt ``n`` rollouts (``stage_index`` 0); round 1 reads each prompt's accuracy from
its group (``Rollout.correct``: verl's ``acc``) and asks for ``ΔN`` more (``stage_index`` 1, the
reason names the accuracy and ``ΔN``); later rounds ask for nothing. The generate stage
samples the top-up in its own loop round, so with a seed derived from ``(seed, step, round)``
and new request ids: the top-up rollouts are fresh samples, never copies of the first ones;
``filter.merge_rounds`` appends them to the prompt's first group. Keep ``0 < acc < 1`` after
the loop with ``filter.nonzero_variance`` (DARS's filter with ``upper_threshold = 1``).

Budget accounting (``step_metrics``, under ``stages.<id>`` in ``metrics.jsonl`` and MLflow):
``prompts``, ``first_rollouts`` (``sum N``), ``topup_rollouts`` (``sum ΔN``), ``total_rollouts``
(their sum: with ``generate.sample`` and no in-flight control, the step's
``rollouts_generated``), ``max_rollouts`` (``N_max`` per prompt: the bound ``total_rollouts``
never exceeds), ``topup_prompts``, ``at_cap_prompts`` (``ΔN = N_max - N``, the cap reached),
``zero_acc_prompts``, ``easy_prompts`` (``acc >= 0.5``) and ``first_acc_mean``.

Reference defaults: ``n = 8``, ``n_max = 64``, ``std = false`` (the reference scripts'
``rollout.n``, ``algorithm.n_max`` and ``grpo_use_std``); ``schedule = hw``, the schedule the
reference's ``N_max = 64`` script runs (its ET script uses ``N_max = 32``). ``std`` must match
the update's advantage: ``std: false`` with ``advantage: {use: mean}`` (the reference's GRPO
without std), ``std: true`` with ``mean_std``; ``gfcr validate`` refuses a mismatch. No cross-step state:
everything is rebuilt each step, so a resumed run needs nothing saved.

Deviations:
- The reference's second generation call sets ``do_sample=False`` (and ``validate=True``) in
  its ``meta_info``; whether its engine then still samples is unclear (the research notes flag
  it). Here the top-up is always sampled stochastically, with the rollout stage's own
  temperature and a seed of its own loop round, as DARS intends: greedy top-ups would be
  copies of one response.
- ``arithmetic: exact`` computes ``ΔN`` in exact fractions; it differs from the reference's
  float32 ceiling (the default) in 5 of the 900 reference cases, where the exact value is an
  integer (for example ``N = 6``, ``acc = 0``, hw: 30 exactly, 31 in the reference) or float32
  rounding lands just above one.
- ``acc`` is the fraction of correct rollouts (verl's ``acc``); the reference averages the
  score, which is the same for a 0/1 reward. ``N`` in the formulas is the configured ``n``
  and ``acc`` is measured on the rollouts the group holds when the round starts.
- A prompt whose first group was dropped in round 0, or has none, gets no top-up.
- The reference trains on a 3072-prompt batch with full-batch updates ("Breadth"); the batch
  size is the selector's (``control.uniform``'s ``batch_size``).

Fidelity: checked against yangzhch6/DARS@9b21b71: 900/900 cases (``tests/fidelity/dars.json``).

Example:

>>> [topup_size(k, 8, 64, "et", std=False) for k in (0, 1, 2, 3, 4, 8)]   # acc = k/8
[27, 11, 3, 1, 0, 0]
>>> [topup_size(k, 8, 64, "hw", std=False) for k in (0, 1, 2, 3)]
[56, 24, 8, 3]
>>> topup_size(0, 8, 16, "hw", std=False)   # capped at N_max - N
8
>>> from gfcr.records import Allocation, AllocationEntry, Prompt, RolloutGroups, StepContext
>>> from gfcr.stages.testing import scored_group
>>> stage = Dars(Dars.Config(n=4, n_max=16, schedule="et"))
>>> stage.before_step(StepContext("run", step=0, seed=0, policy_version=0))
>>> def round_(r): return StepContext("run", step=0, seed=0, policy_version=0, round=r)
>>> picked = Allocation(0, (AllocationEntry(Prompt("p:0", text="0"), 1), AllocationEntry(Prompt("p:1", text="1"), 1)))
>>> [e.n_rollouts for e in stage.run(picked, RolloutGroups(), round_(0))]
[4, 4]
>>> first = RolloutGroups([scored_group("p:0", [1, 0, 0, 0]), scored_group("p:1", [1, 1, 0, 1])])
>>> [(e.n_rollouts, e.reason) for e in stage.run(picked, first, round_(1))]
[(2, 'dars et: acc 1/4, ΔN 2'), (0, 'dars et: acc 3/4 >= 0.5, no top-up')]
>>> {k: stage.step_metrics()[k] for k in ("first_rollouts", "topup_rollouts", "total_rollouts", "max_rollouts")}
{'first_rollouts': 8, 'topup_rollouts': 2, 'total_rollouts': 10, 'max_rollouts': 32}

YAML (the loop block; ``pipelines/dars_arith.yaml`` is a whole pipeline):

.. code-block:: yaml

    stages:
      pick:    {use: control.uniform, with: {batch_size: 16}}
      topup:   {use: control.dars, from: {allocation: pick, groups: merged}, with: {n: 8, n_max: 64, schedule: hw}}
      rollout: {use: generate.sample, from: topup, with: {temperature: 1.0, max_new_tokens: 8}}
      reward:  {use: filter.verify, from: rollout}
      merged:  {use: filter.merge_rounds, from: reward}
      keep:    {use: filter.nonzero_variance, from: dars}
    loops:
      dars: {stages: [topup, rollout, reward, merged], until: merged, max_rounds: 2}
"""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from gfcr.records import Allocation, AllocationEntry, RolloutGroup, RolloutGroups, StepContext
from gfcr.registry import EstimatesAdvantages, PipelineProblem, StageConfig

ALIAS = "control.dars"
# the update's advantage estimators whose normalisation DARS's two variants assume
STD_OF_ADVANTAGE = {"mean": False, "mean_std": True}
Arithmetic = Literal["float32", "exact"]


def topup_size(correct: int, n: int, n_max: int, schedule: Literal["et", "hw"], std: bool,
               measured: int | None = None, arithmetic: Arithmetic = "float32") -> int:
    """DARS's ``ΔN`` for a prompt with ``correct`` of its ``measured`` (default ``n``) first-stage
    rollouts right, ``N = n``: in the reference's float32 arithmetic, or in exact fractions."""
    measured = n if measured is None else measured
    if not 0 <= correct <= measured or measured < 1 or n < 1:
        raise ValueError(f"{correct} correct out of {measured} rollouts")
    if arithmetic == "float32":
        return min(max(_float32_topup(correct, measured, n, schedule, std), 0), n_max - n)
    acc = Fraction(correct, measured)
    if acc >= Fraction(1, 2):
        return 0
    if acc == 0:
        acc = Fraction(1, 2 * n)  # acc := 0.5 / N
    target = Fraction(1, 2) * n if not std else Fraction(n)  # A_peak
    if schedule == "hw":
        target *= 2 * (1 - acc)
    if std:
        s = 2 * math.sqrt(acc * (1 - acc))
        raw = math.ceil((float(target) - n * s) / s - 1e-9)
    else:
        s = 2 * acc * (1 - acc)
        raw = math.ceil((target - n * s) / s)
    return min(max(raw, 0), n_max - n)


def _float32_topup(correct: int, measured: int, n: int, schedule: str, std: bool) -> int:
    """The uncapped ``ΔN`` as the reference computes it: ``acc`` is verl's float32 mean of the 0/1
    scores (numpy float32 scalars combine with Python floats as torch's 0-d tensors do), and
    the float result is ceiled, so where the exact value is an integer rounding may add one."""
    acc = np.float32(correct) / np.float32(measured)
    if acc >= 0.5:
        return 0
    if acc == 0:
        acc = 0.5 / n  # a Python float from here on, as in the reference
    s = 2 * math.sqrt(acc * (1 - acc)) if std else 2 * acc * (1 - acc)
    peak = n if std else 0.5 * n
    target = 2 * (1 - acc) * peak if schedule == "hw" else peak
    return math.ceil((target - n * s) / s)


class Dars:
    """DARS: N rollouts per prompt, then a difficulty-adaptive top-up of ΔN (ET or HW), capped at N_max."""

    class Config(StageConfig):
        sizes_each_group: ClassVar[bool] = True  # a capability: it sizes each prompt's group itself
        n: Annotated[int, Field(ge=1, description="N: first-stage rollouts per prompt (reference rollout.n)")] = 8
        n_max: Annotated[int, Field(ge=1, description=(
            "N_max: most rollouts a prompt gets in a step, first stage and top-up together "
            "(reference algorithm.n_max)"))] = 64
        schedule: Literal["et", "hw"] = Field("hw", description=(
            "et: equal treatment (every hard prompt topped up to the same advantage mass A_peak); "
            "hw: hardness-weighted (target 2(1 - acc) A_peak)"))
        std: bool = Field(False, description=(
            "the advantage is divided by the group's std (reference grpo_use_std): S = 2 sqrt(acc(1-acc)) "
            "and A_peak = N instead of 2 acc(1-acc) and 0.5 N"))
        arithmetic: Arithmetic = Field("float32", description=(
            "float32: the reference's (verl's float32 accuracy, the float result ceiled: where the exact "
            "ΔN is an integer rounding may add one); exact: exact fractions"))

        @model_validator(mode="after")
        def _cap_covers_first_stage(self) -> "Dars.Config":
            if self.n_max < self.n:
                raise ValueError(f"n_max ({self.n_max}) must be at least n ({self.n}): N_max caps first-stage "
                                 "and top-up rollouts together")
            return self

    @staticmethod
    def check_pipeline(config: "Dars.Config", view: Any) -> list[PipelineProblem]:
        """The groups come back through a loop's feedback edge, not from a generate stage upstream;
        ``std`` matches the update's advantage when that is ``mean`` or ``mean_std``."""
        problems = []
        generators = view.in_family("generate", upstream=True)
        if generators:
            problems.append(PipelineProblem(
                (), f"`{generators[0]}` ({view.aliases[generators[0]]}) is upstream of {ALIAS}: its top-up would be "
                    "generated by no stage, or sampled with the first stage's seed",
                "put the stage in a loop block with the rollout, verify and merge stages and read `groups` from the "
                "loop's until stage: `from: {allocation: pick, groups: merged}`, `loops: {dars: {stages: [topup, "
                "rollout, reward, merged], until: merged, max_rounds: 2}}` (pipelines/dars_arith.yaml)"))
        update = view.configs.get("update")
        advantage = update.advantage.use if isinstance(update, EstimatesAdvantages) else None
        if advantage in STD_OF_ADVANTAGE and STD_OF_ADVANTAGE[advantage] != config.std:
            problems.append(PipelineProblem(
                ("std",), f"std: {str(config.std).lower()} sizes the top-up for an advantage "
                          f"{'divided' if config.std else 'not divided'} by the group's std, but the update's "
                          f"advantage is `{advantage}`",
                f"set `std: {str(not config.std).lower()}` here, or the update's advantage to "
                f"`{'mean_std' if config.std else 'mean'}`"))
        return problems

    def __init__(self, config: Config):
        self.config = config
        self._first: dict[str, int] = {}  # prompt id -> first-stage rollouts allocated this step
        self._topup: dict[str, tuple[int, int, int]] = {}  # prompt id -> (ΔN, correct, rollouts measured)

    def before_step(self, ctx: StepContext) -> None:
        self._first, self._topup = {}, {}

    def run(self, allocation: Allocation, groups: RolloutGroups, ctx: StepContext) -> Allocation:
        round_ = ctx.round
        if round_ is None:
            raise ValueError(f"{ALIAS} runs outside a loop block: it never gets to its top-up round; put it in "
                             "one (pipelines/dars_arith.yaml)")
        if round_ == 0:
            return self._first_stage(allocation)
        if round_ == 1:
            return self._second_stage(allocation, groups)
        return allocation.with_entries([replace(e, n_rollouts=0, reason="dars: one top-up per step") for e in allocation])

    def _first_stage(self, allocation: Allocation) -> Allocation:
        n = self.config.n
        entries = [replace(e, n_rollouts=n, stage_index=0) if e.n_rollouts > 0 else e for e in allocation]
        self._first = {e.prompt_id: n for e in entries if e.n_rollouts > 0}
        return allocation.with_entries(entries)

    def _second_stage(self, allocation: Allocation, groups: RolloutGroups) -> Allocation:
        by_prompt = {g.prompt_id: g for g in groups}
        return allocation.with_entries([self._topup_entry(e, by_prompt.get(e.prompt_id)) for e in allocation])

    def _topup_entry(self, entry: AllocationEntry, group: RolloutGroup | None) -> AllocationEntry:
        cfg, name = self.config, f"dars {self.config.schedule}"
        if entry.prompt_id not in self._first:
            return replace(entry, n_rollouts=0, stage_index=1)
        if group is None or not group.verdict.included or not group.rollouts:
            why = "no first-stage group" if group is None or not group.rollouts else "first-stage group dropped"
            return replace(entry, n_rollouts=0, stage_index=1, reason=f"{name}: {why}, no top-up")
        correct, size = _correct(group), len(group.rollouts)
        dn = topup_size(correct, cfg.n, cfg.n_max, cfg.schedule, cfg.std, measured=size, arithmetic=cfg.arithmetic)
        self._topup[entry.prompt_id] = (dn, correct, size)
        if 2 * correct >= size:
            return replace(entry, n_rollouts=0, stage_index=1,
                           reason=f"{name}: acc {correct}/{size} >= 0.5, no top-up")
        return replace(entry, n_rollouts=dn, stage_index=1, reason=f"{name}: acc {correct}/{size}, ΔN {dn}")

    def step_metrics(self) -> dict[str, float]:
        """Budget accounting of the step: rollouts asked for in each stage and the bound."""
        cfg = self.config
        topups = list(self._topup.values())
        first = sum(self._first.values())
        top = sum(dn for dn, _, _ in topups)
        return {
            "prompts": len(self._first), "first_rollouts": first, "topup_rollouts": top,
            "total_rollouts": first + top, "max_rollouts": cfg.n_max * len(self._first),
            "topup_prompts": sum(dn > 0 for dn, _, _ in topups),
            "at_cap_prompts": sum(dn > 0 and dn == cfg.n_max - cfg.n for dn, _, _ in topups),
            "zero_acc_prompts": sum(c == 0 for _, c, _ in topups),
            "easy_prompts": sum(2 * c >= k for _, c, k in topups),
            "first_acc_mean": sum(c / k for _, c, k in topups) / len(topups) if topups else 0.0,
        }


def _correct(group: RolloutGroup) -> int:
    missing = [r.rollout_id for r in group.rollouts if r.correct is None]
    if missing:
        raise ValueError(f"group {group.group_id}: rollouts {missing[:3]} have no `correct`; {ALIAS} reads each "
                         "prompt's accuracy: put filter.verify in the loop block before its until stage")
    return sum(bool(r.correct) for r in group.rollouts)
