"""control.mc_grpo: MC-GRPO's allocation, G + 1 rollouts per prompt (G to train on and one
median pivot), paired with the ``mc_grpo`` advantage estimator.

MC-GRPO, median-centred GRPO (arXiv 2601.22582; reference code ``lotusroot-kim/MC-GRPO``,
``grpo_trainer_gsm.py`` with ``mc=True``, ``scripts/MCGRPO_gsm.sh``): the trainer generates
``G + 1`` completions per prompt; the estimator (``update.grpo`` with ``advantage: {use:
mc_grpo}``) takes the lower median of the ``G + 1`` rewards as the baseline and leaves the
median's own rollout (the pivot) out of the loss, so ``G`` rollouts carry gradient. This stage
is the Control half of the pair: every selected prompt (``n_rollouts > 0``) gets ``g + 1``
rollouts; prompts an upstream control skipped stay skipped.

Its Config exposes ``rollouts_per_prompt = g + 1``, so ``gfcr validate`` pairs it with the
estimator like ``control.fixed_n``: the estimator's ``g`` (when set) must equal this stage's
``g``, and a mismatch is an error naming both keys. This stage refuses an update whose
advantage is not ``mc_grpo``: any other estimator would train on the extra rollout as an
ordinary one, and ``control.fixed_n`` says that plainly (``n: 9``). ``control.fixed_n`` with
``n: G + 1`` still pairs with the estimator as before.

Budget (``step_metrics``, under ``stages.<id>`` in ``metrics.jsonl``): ``prompts``,
``budget`` (``(g + 1) * prompts``), ``spent`` (equal to it: the step's ``rollouts_generated``
with ``generate.sample``), ``pivot_rollouts`` (``prompts``: the rollouts spent on pivots, left
out of the loss) and ``trained_rollouts`` (``g * prompts``). Each entry's ``why`` is
``ControlReason("g_plus_pivot", "g", g, {"pivot": 1})``. No state.

Reference defaults: ``g = 8``, as the reference's main script (``scripts/MCGRPO_gsm.sh``,
``--num_generations=8``, which overrides its recipes' 16).

Deviations: none in the allocation (``G + 1`` per prompt, as the reference's ``num_generations
+ 1`` with ``--mc``); which rollout is the pivot is decided after scoring, by the estimator.

Fidelity: checked against lotusroot-kim/MC-GRPO@da07745: 10/10 cases
(``tests/fidelity/mc_grpo_allocation.json``: the trainer's ``use_extra_rollout`` block on
``RepeatSampler``'s prompts, G from 1 to 16, with and without ``--allocation``). The ``mc_grpo``
advantage estimator it pairs with is checked in ``tests/fidelity/mc_grpo.json``.

Example:

>>> from gfcr.records import Allocation, AllocationEntry, Prompt
>>> stage = McGrpo(McGrpo.Config(g=4))
>>> alloc = Allocation(0, (AllocationEntry(Prompt("p:0", text="0"), 1),
...                        AllocationEntry(Prompt("p:1", text="1"), 0, reason="skip")))
>>> [(e.n_rollouts, e.reason) for e in stage.run(alloc)]
[(5, 'mc_grpo: G 4 + 1 pivot'), (0, 'skip')]
>>> stage.step_metrics()
{'prompts': 1, 'budget': 5, 'spent': 5, 'pivot_rollouts': 1, 'trained_rollouts': 4}

YAML (``pipelines/mc_grpo_arith.yaml`` is a whole pipeline):

.. code-block:: yaml

    stages:
      pick:    {use: control.uniform, with: {batch_size: 16}}
      budget:  {use: control.mc_grpo, from: pick, with: {g: 8}}
      rollout: {use: generate.sample, from: budget, with: {temperature: 1.0, max_new_tokens: 8}}
      reward:  {use: filter.verify, from: rollout}
    update: {use: update.grpo, from: reward, with: {advantage: {use: mc_grpo, with: {g: 8}}}}
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, ClassVar

from pydantic import Field

from gfcr.records import Allocation, ControlReason
from gfcr.registry import EstimatesAdvantages, PipelineProblem, StageConfig

ALIAS = "control.mc_grpo"


class McGrpo:
    """G + 1 rollouts per selected prompt, for MC-GRPO's median pivot."""

    class Config(StageConfig):
        sizes_each_group: ClassVar[bool] = True  # a capability: it sizes each prompt's group itself
        g: Annotated[int, Field(ge=1, description=(
            "G: rollouts per prompt that carry gradient; the stage allocates G + 1 (one is the median pivot)"))] = 8

        @property
        def rollouts_per_prompt(self) -> int:
            """The group size this stage fixes, G + 1 (read by ``gfcr validate``'s pairing checks)."""
            return self.g + 1

        def group_size_setting(self, n: int) -> str:
            return f"g={n - 1}"

    @staticmethod
    def check_pipeline(config: "McGrpo.Config", view: Any) -> list[PipelineProblem]:
        """The update's advantage must be ``mc_grpo``: any other trains on the pivot as an ordinary rollout."""
        update = view.configs.get("update")
        advantage = update.advantage.use if isinstance(update, EstimatesAdvantages) else None
        if advantage is None or advantage == "mc_grpo":  # an update without an estimator registry (a test's)
            return []
        return [PipelineProblem(
            ("g",), f"{ALIAS} allocates G + 1 = {config.g + 1} rollouts for MC-GRPO's median pivot, "
                    f"but the update's advantage is `{advantage}`: the extra rollout would be trained "
                    "on as an ordinary one",
            f"set the update's `advantage: {{use: mc_grpo, with: {{g: {config.g}}}}}`, or use "
            f"`control.fixed_n` with `n: {config.g + 1}` for a plain group of {config.g + 1}")]

    def __init__(self, config: Config):
        self.config = config
        self._prompts = self._spent = 0

    def run(self, allocation: Allocation) -> Allocation:
        g = self.config.g
        why = ControlReason("g_plus_pivot", "g", g, {"pivot": 1})
        entries = [replace(e, n_rollouts=g + 1, reason=f"mc_grpo: G {g} + 1 pivot", why=why) if e.n_rollouts > 0
                   else e for e in allocation]
        self._prompts = sum(e.n_rollouts > 0 for e in entries)
        self._spent = sum(e.n_rollouts for e in entries)
        return allocation.with_entries(entries)

    def step_metrics(self) -> dict[str, float]:
        """The step's budget (G + 1 per prompt) and its split into pivots and trained rollouts."""
        g, p = self.config.g, self._prompts
        return {"prompts": p, "budget": (g + 1) * p, "spent": self._spent, "pivot_rollouts": p,
                "trained_rollouts": g * p}
