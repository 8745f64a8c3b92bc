"""control.ar3po: AR3PO's adaptive rollout: staged rollouts, a prompt stops once it has a
correct response, and the rest get more in the next stage, up to ``k * stages``.

AR3PO, Adaptive Rollout and Response Reuse Policy Optimization (Zhang et al., 2025,
"Improving Sampling Efficiency in RLVR through Adaptive Rollout and Response Reuse", arXiv
2509.25808; an ICLR 2026 submission, withdrawn; no code found). Only the abstract, third-party
summaries and the reviews were readable, so every number below is this stage's choice (see
Deviations). The rule (research notes, section 2.10):

- a step's prompts are rolled out in ``stages`` stages; in each stage every *active* prompt
  gets ``k`` more rollouts;
- a prompt becomes inactive once one of its rollouts is correct (``Rollout.correct``), so an
  easy prompt costs ``k`` rollouts and a hard one up to ``k * stages``;
- after the last stage, a prompt with no correct response takes a correct response generated
  for it at an earlier step, when one is cached: that is AR3PO's response reuse, the Replay
  stage ``replay.correct_cache`` placed after the loop block (it joins exactly the groups with
  no correct response), so this stage does not keep a cache of its own.

In gfcr this is a loop block (``pipelines/ar3po_arith.yaml``), like ``control.dars``: the
stage reads the selected prompts (``allocation``) and the loop's merged groups (``groups``, the
feedback edge from ``filter.merge_rounds``). Round ``s < stages`` gives ``k`` rollouts to each
prompt whose merged group holds no correct rollout yet (every selected prompt in round 0;
``stage_index`` ``s``); round ``stages`` reads the last stage's groups and asks for nothing, so
the step's metrics know which prompts stayed unsolved (the loop's ``max_rounds`` is
``stages + 1``; ``filter.merge_rounds`` ends the loop early, after the first round that asks
for nothing, so a batch solved in round 0 costs one extra pass of the stage and no rollouts).

Budget accounting (``step_metrics``, under ``stages.<id>`` in ``metrics.jsonl`` and MLflow):
``prompts``; ``budget`` (``k * stages * |batch|``, the cap: no step spends more); ``spent``
(the rollouts allocated, all stages: with ``generate.sample``, the step's
``rollouts_generated``); ``unspent`` (``budget - spent``, what the early stops saved);
``stage<s>_rollouts`` and ``stage<s>_prompts`` for each stage ``s``; ``solved_prompts`` (a
correct rollout when last looked at), ``unsolved_prompts`` (none after the last stage the
stage saw: the groups a response cache can complete), and ``mean_rollouts`` (``spent /
prompts``). ``k * |batch| <= spent <= budget`` on every step, each allocated rollout counted
once. No state crosses steps: everything is rebuilt each step, so a resumed run needs nothing
saved (the cache's state is ``replay.correct_cache``'s, saved with its checkpoint).

Each entry's ``why`` (``ControlReason``): ``first_stage`` (``k``), ``no_correct_yet``
(``correct`` 0, ``rollouts`` so far) when it gets ``k`` more, ``has_correct`` (``correct`` and
``rollouts``) once inactive, ``stages_done`` in the round after the last stage, ``no_group``
when its group came back missing or dropped.

Reference defaults: none are published. ``k = 4`` and ``stages = 2`` are our choice: a prompt
gets at most 8 rollouts, GRPO's group of 8, so a step never spends more than GRPO on the same
batch, and an easy prompt spends half of it.

Deviations (abstract-only, every rule a choice):
- the stage sizes (``k`` every stage, ``stages``) are not in the sources read; a stage gives
  every active prompt the same ``k``;
- a prompt whose first stage is all correct stops too (the notes' open question whether
  all-correct prompts get fewer responses): its group of ``k`` carries no gradient, and a
  zero-variance filter after the loop (``filter.nonzero_variance``) drops it;
- "correct" is the verifier's ``Rollout.correct``; a group dropped by a filter inside the loop
  gets no more rollouts;
- response reuse is ``replay.correct_cache``'s (appended, not swapped for a wrong response;
  stale tokens under ``update.grpo``'s correction ``decoupled_clip``; see that stage's deviations);
- the rollouts of all stages form one group per prompt (``filter.merge_rounds``), so the
  update's group baseline is taken over all of a prompt's rollouts, whatever their stage.

Fidelity: from the abstract: no public code; the rules above are this stage's reading.

Example (``k = 2``, two stages: ``p:0`` is solved in stage 0, ``p:1`` is not and gets 2 more):

>>> from gfcr.records import Allocation, AllocationEntry, Prompt, RolloutGroups, StepContext
>>> from gfcr.stages.testing import scored_group
>>> stage = Ar3po(Ar3po.Config(k=2, stages=2))
>>> stage.before_step(StepContext("run", step=0, seed=0, policy_version=0))
>>> def round_(r): return StepContext("run", step=0, seed=0, policy_version=0, round=r)
>>> picked = Allocation(0, (AllocationEntry(Prompt("p:0", text="0"), 1), AllocationEntry(Prompt("p:1", text="1"), 1)))
>>> [e.n_rollouts for e in stage.run(picked, RolloutGroups(), round_(0))]
[2, 2]
>>> first = RolloutGroups([scored_group("p:0", [0, 1]), scored_group("p:1", [0, 0])])
>>> [(e.n_rollouts, e.why.code) for e in stage.run(picked, first, round_(1))]
[(0, 'has_correct'), (2, 'no_correct_yet')]
>>> {k: stage.step_metrics()[k] for k in ("budget", "spent", "unspent", "solved_prompts")}
{'budget': 8, 'spent': 6, 'unspent': 2, 'solved_prompts': 1}

YAML (the loop block, then the response cache; ``pipelines/ar3po_arith.yaml`` is a whole pipeline):

.. code-block:: yaml

    stages:
      pick:    {use: control.uniform, with: {batch_size: 16}}
      adapt:   {use: control.ar3po, from: {allocation: pick, groups: merged}, with: {k: 4, stages: 2}}
      rollout: {use: generate.sample, from: adapt, with: {temperature: 1.0, max_new_tokens: 8}}
      reward:  {use: filter.verify, from: rollout}
      merged:  {use: filter.merge_rounds, from: reward}
      reuse:   {use: replay.correct_cache, from: ar3po, with: {join: 1, per_prompt: 1, max_staleness: 16}}
      keep:    {use: filter.nonzero_variance, from: reuse}
    loops:
      ar3po: {stages: [adapt, rollout, reward, merged], until: merged, max_rounds: 3}
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, ClassVar

from pydantic import Field

from gfcr.records import Allocation, AllocationEntry, ControlReason, RolloutGroup, RolloutGroups, StepContext
from gfcr.registry import PipelineProblem, StageConfig

ALIAS = "control.ar3po"


class Ar3po:
    """AR3PO adaptive rollout: k rollouts a stage to each prompt without a correct response, for a few stages."""

    class Config(StageConfig):
        sizes_each_group: ClassVar[bool] = True  # a capability: it sizes each prompt's group itself
        k: Annotated[int, Field(ge=1, description="rollouts each still-active prompt gets in one stage")] = 4
        stages: Annotated[int, Field(ge=1, description=(
            "rollout stages per step (the loop's max_rounds is stages + 1); a prompt gets at most k * stages"))] = 2

    @staticmethod
    def check_pipeline(config: "Ar3po.Config", view: Any) -> list[PipelineProblem]:
        """The groups come back through a loop's feedback edge, not from a generate stage upstream."""
        generators = view.in_family("generate", upstream=True)
        return [PipelineProblem(
            (), f"`{sid}` ({view.aliases[sid]}) is upstream of {ALIAS}: its later stages would be generated by no "
                "stage",
            "put the stage in a loop block with the rollout, verify and merge stages and read `groups` from the "
            "loop's until stage: `from: {allocation: pick, groups: merged}`, `loops: {ar3po: {stages: [adapt, "
            f"rollout, reward, merged], until: merged, max_rounds: {config.stages + 1}}}}}` "
            "(pipelines/ar3po_arith.yaml)")
            for sid in generators[:1]]

    def __init__(self, config: Config):
        self.config = config
        self._given: dict[str, int] = {}  # prompt id -> rollouts allocated this step, all stages
        self._solved: set[str] = set()  # prompts seen with a correct rollout this step
        self._per_stage: dict[int, tuple[int, int]] = {}  # stage -> (prompts, rollouts)

    def before_step(self, ctx: StepContext) -> None:
        self._given, self._solved, self._per_stage = {}, set(), {}

    def run(self, allocation: Allocation, groups: RolloutGroups, ctx: StepContext) -> Allocation:
        if ctx.round is None:
            raise ValueError(f"{ALIAS} runs outside a loop block: it never gets to its later stages; put it in one "
                             "(pipelines/ar3po_arith.yaml)")
        if ctx.round == 0:
            entries = [self._first(e) if e.n_rollouts > 0 else e for e in allocation]
        else:
            by_prompt = {g.prompt_id: g for g in groups}
            entries = [self._later(e, by_prompt.get(e.prompt_id), ctx.round) for e in allocation]
        if ctx.round < self.config.stages:
            given = [e for e in entries if e.prompt_id in self._given and e.n_rollouts > 0]
            self._per_stage[ctx.round] = (len(given), sum(e.n_rollouts for e in given))
        return allocation.with_entries(entries)

    def _first(self, entry: AllocationEntry) -> AllocationEntry:
        k = self.config.k
        self._given[entry.prompt_id] = k
        return replace(entry, n_rollouts=k, stage_index=0, reason=f"ar3po stage 0: {k}",
                       why=ControlReason("first_stage", "k", k))

    def _later(self, entry: AllocationEntry, group: RolloutGroup | None, stage: int) -> AllocationEntry:
        cfg = self.config
        if entry.prompt_id not in self._given:
            return replace(entry, n_rollouts=0, stage_index=stage)
        if group is None or not group.verdict.included or not group.rollouts:
            return replace(entry, n_rollouts=0, stage_index=stage, reason=f"ar3po stage {stage}: no group",
                           why=ControlReason("no_group"))
        correct, size = _correct(group), len(group.rollouts)
        seen = {"correct": correct, "rollouts": size}
        if correct > 0:
            self._solved.add(entry.prompt_id)
            return replace(entry, n_rollouts=0, stage_index=stage, why=ControlReason("has_correct", quantities=seen),
                           reason=f"ar3po stage {stage}: {correct}/{size} correct, inactive")
        if stage >= cfg.stages:
            return replace(entry, n_rollouts=0, stage_index=stage, why=ControlReason("stages_done", quantities=seen),
                           reason=f"ar3po: {cfg.stages} stages done, 0/{size} correct")
        self._given[entry.prompt_id] += cfg.k
        return replace(entry, n_rollouts=cfg.k, stage_index=stage,
                       why=ControlReason("no_correct_yet", "k", cfg.k, seen),
                       reason=f"ar3po stage {stage}: 0/{size} correct, {cfg.k} more")

    def step_metrics(self) -> dict[str, float]:
        """The step's cap, spend, and prompts and rollouts per stage."""
        cfg, prompts = self.config, len(self._given)
        spent = sum(self._given.values())
        budget = cfg.k * cfg.stages * prompts
        out: dict[str, float] = {"prompts": prompts, "budget": budget, "spent": spent, "unspent": budget - spent}
        for s in range(cfg.stages):
            out[f"stage{s}_prompts"], out[f"stage{s}_rollouts"] = self._per_stage.get(s, (0, 0))
        out["solved_prompts"] = len(self._solved)
        out["unsolved_prompts"] = prompts - len(self._solved)
        out["mean_rollouts"] = spent / prompts if prompts else 0.0
        return out


def _correct(group: RolloutGroup) -> int:
    missing = [r.rollout_id for r in group.rollouts if r.correct is None]
    if missing:
        raise ValueError(f"group {group.group_id}: rollouts {missing[:3]} have no `correct`; {ALIAS} stops a prompt "
                         "at its first correct rollout: put filter.verify in the loop block before its until stage")
    return sum(bool(r.correct) for r in group.rollouts)
