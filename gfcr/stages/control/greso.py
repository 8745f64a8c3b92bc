"""control.greso: skip prompts before rollout when their recent groups were all correct or
all wrong, with a skip probability that tunes itself toward a target zero-variance rate.

GRESO, GRPO with Efficient Selective Rollout (Zheng et al., 2025, arXiv 2506.02177; code
``Infini-AI-Lab/GRESO``, ``DataProfiler`` and the fit loop of ``ray_trainer.py``).

Selection walks the pool in a seeded per-epoch permutation, as ``control.uniform`` does,
and tests each candidate prompt:

- ``z`` = its easy streak (consecutive most recent observations that were all correct);
  if that is 0, its hard streak (all wrong). Easy is tested first.
- ``P_skip = 1 - max(p ** z, min_keep_probability)`` with ``p = p_easy`` or ``p_hard``; a
  prompt with no streak (or no history) is never skipped.
- One Bernoulli draw per prompt per visit decides. The draw is seeded by
  ``(seed, epoch, step, crc32(prompt_id))``, so a resumed run redraws it exactly without
  stored RNG state.

Candidates are drawn until ``batch_size`` prompts are kept (each gets ``n_rollouts``,
default 1; put ``control.fixed_n`` downstream to set the group size). Skipped candidates
stay in the Allocation with ``n_rollouts=0`` and a reason such as
``greso: skip (easy streak 3, p_easy 0.45, P_skip 0.909)``. Every entry also carries its
``ControlReason`` for the control lineage: code ``no_streak`` (picked, ``p_skip = 0``), or
``easy_streak`` / ``hard_streak`` with ``p_skip`` as the decisive number and the ``streak``,
``p_easy`` / ``p_hard`` and the visit's ``draw`` (skipped when ``draw < p_skip``). The step's
``controller_state`` (``control.<id>`` in ``metrics.jsonl`` and MLflow) reports ``p_easy``,
``p_hard``, ``candidates``, ``kept``, ``skipped_easy``, ``skipped_hard`` and ``stopped``.

After each step, ``observe`` records one observation per group rolled out in the step
(kept or dropped, each loop round its own sampling event) and, once past the first epoch,
tunes the exploration probabilities: with ``alpha = target_zero_variance``,
``p_easy`` moves down by ``step_size`` when the step's all-correct ratio is at least
``alpha / 3`` and up otherwise; ``p_hard`` likewise against ``2 * alpha / 3``; both are
clipped to ``[min_p, max_p]``.

Fidelity: checked against Infini-AI-Lab/GRESO@b277843: 34/36 cases, 2 documented deviations
(``tests/fidelity/greso.json``).

Deviations:
- "Easy" and "hard" are "all judged rollouts correct" and "none correct" (``rollout.correct``),
  not the reference's reward thresholds ``mean >= 0.98`` and ``mean <= 0.11``, which fit
  only its 1 / 0.1 / 0 reward scheme (as the research note recommends). Rollouts that no
  verifier judged (``correct is None``) are left out; a group with none judged is not
  observed.
- No adaptive sampling batch. The reference accumulates filtered prompts until
  ``adaptive_bs`` are ready and sizes that from the zero-variance ratio just observed
  (``max(64, min(384, 1.25 * remaining / (1 - zv) / n))``). Here a call keeps
  ``batch_size`` prompts, examining at most ``max_candidates_factor * batch_size``
  candidates; the accumulate-until-enough half is a loop block with
  ``filter.dynamic_sampling``. Sizing the batch from the observed ratio would need the
  filter's in-step counts fed back into this stage, which the graph does not provide.
- A batch never spans two epochs: a call starts a new epoch when fewer than ``batch_size``
  candidates are left (``control.uniform``'s ``drop_last`` rule), and when the epoch runs
  out mid-batch the call returns the prompts kept so far. ``controller_state["stopped"]``
  says why a call stopped (``filled``, ``max_candidates`` or ``epoch_end``). The reference
  carries its accumulated batch across the epoch boundary.
- The ratios that tune ``p_easy`` and ``p_hard`` count groups (sampling events), not
  responses; the reference counts responses, which is the same when every group has ``n``
  rollouts. A step with no observed group leaves the probabilities unchanged. Groups from
  earlier steps (replayed) are not observations of this step and are ignored.
- ``p_easy`` and ``p_hard`` are rounded to 10 decimals after each update, so repeated
  +/- 0.01 steps do not drift.

Example:

>>> from gfcr.records import Prompt, PromptPool, StepContext, StepReport
>>> from gfcr.stages.testing import scored_group
>>> pool = PromptPool([Prompt(f"p:{i}", text=str(i)) for i in range(4)])
>>> stage = Greso(Greso.Config(batch_size=2, seed=0))
>>> stage.before_step(StepContext("run", step=0, seed=0, policy_version=0))
>>> first = stage.run(pool)
>>> [e.n_rollouts for e in first]
[1, 1]
>>> groups = tuple(scored_group(e.prompt_id, [1, 1, 1]) for e in first)
>>> stage.observe(StepReport("run", 0, 1, groups, None, {}, {}))
>>> [stage.stats[e.prompt_id].easy_streak for e in first]
[1, 1]
>>> skip_probability(stage.stats[first.entries[0].prompt_id], p_easy=0.5, p_hard=0.5)
(0.5, 'easy')

YAML:

.. code-block:: yaml

    stages:
      pick:   {use: control.greso, with: {batch_size: 16, target_zero_variance: 0.25}}
      budget: {use: control.fixed_n, from: pick, with: {n: 8}}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, model_validator

from gfcr.records import (Allocation, AllocationEntry, ControlReason, Prompt, PromptPool, PromptStats, StepContext,
                          StepReport)
from gfcr.registry import Seed, StageConfig
from gfcr.stages.common.epochs import epoch_order, start_batch
from gfcr.stages.common.prompt_stats import observe_group, stats_from_state, stats_to_state, visit_draw
from gfcr.stages.common.run_context import RunContext

Probability = Annotated[float, Field(ge=0.0, le=1.0)]


def skip_probability(stats: PromptStats | None, p_easy: float, p_hard: float,
                     min_keep_probability: float = 0.01) -> tuple[float, str | None]:
    """GRESO's ``P_skip`` of a prompt and the streak that drives it (``"easy"``, ``"hard"``,
    or None when the prompt has no zero-variance streak and is never skipped)."""
    if stats is None:
        return 0.0, None
    for kind, streak, p in (("easy", stats.easy_streak, p_easy), ("hard", stats.hard_streak, p_hard)):
        if streak > 0:
            return 1.0 - max(p**streak, min_keep_probability), kind
    return 0.0, None


@dataclass(frozen=True, slots=True)
class _Decision:
    entry: AllocationEntry
    skipped: str | None  # "easy" / "hard" when skipped


class Greso:
    """GRESO pre-rollout selective rollout: probabilistically skip recently zero-variance prompts."""

    class Config(StageConfig):
        batch_size: Annotated[int, Field(ge=1, description="prompts kept per call")]
        n_rollouts: Annotated[int, Field(ge=1, description="rollouts marked per kept prompt")] = 1
        seed: Seed | None = Field(None, description="permutation and draw seed; default: the run's seed")
        initial_p_easy: Probability = Field(0.5, description="starting keep base for easy streaks")
        initial_p_hard: Probability = Field(0.5, description="starting keep base for hard streaks")
        target_zero_variance: Annotated[float, Field(gt=0.0, lt=1.0, description=(
            "alpha: target share of zero-variance groups; easy gets alpha/3, hard 2*alpha/3"))] = 0.25
        step_size: Annotated[float, Field(ge=0.0, le=1.0, description="p_easy/p_hard change per step")] = 0.01
        min_p: Probability = 0.05
        max_p: Probability = 0.95
        min_keep_probability: Probability = Field(0.01, description="floor of p**z (the code's 1% keep floor)")
        max_candidates_factor: Annotated[int, Field(ge=1, description=(
            "examine at most this many times batch_size candidates per call"))] = 8
        history_size: Annotated[int, Field(ge=0, description=(
            "observations kept per prompt (streaks stay exact); they are checkpointed"))] = 4

        @model_validator(mode="after")
        def _bounds_ordered(self) -> "Greso.Config":
            if self.min_p > self.max_p:
                raise ValueError(f"min_p ({self.min_p}) must not exceed max_p ({self.max_p})")
            return self

    def __init__(self, config: Config):
        self.config = config
        self.p_easy, self.p_hard = config.initial_p_easy, config.initial_p_hard
        self.epoch, self.cursor = 0, 0
        self.stats: dict[str, PromptStats] = {}
        self.run_ctx = RunContext(config.seed)

    def before_step(self, ctx: StepContext) -> None:
        self.run_ctx.before_step(ctx)

    def run(self, pool: PromptPool) -> Allocation:
        size = self.config.batch_size
        self.epoch, self.cursor = start_batch(self.epoch, self.cursor, size, len(pool))
        order = epoch_order(self.run_ctx.seed, self.epoch, len(pool))
        limit = self.config.max_candidates_factor * size
        decisions: list[_Decision] = []
        kept = 0
        while kept < size and len(decisions) < limit and self.cursor < len(pool):
            decision = self._decide(pool[int(order[self.cursor])])
            self.cursor += 1
            decisions.append(decision)
            kept += int(decision.skipped is None)
        stopped = "filled" if kept == size else ("max_candidates" if len(decisions) >= limit else "epoch_end")
        state = {
            "p_easy": self.p_easy, "p_hard": self.p_hard, "epoch": self.epoch, "candidates": len(decisions),
            "kept": kept, "skipped_easy": sum(d.skipped == "easy" for d in decisions),
            "skipped_hard": sum(d.skipped == "hard" for d in decisions), "stopped": stopped,
        }
        return Allocation(step=self.run_ctx.step, entries=tuple(d.entry for d in decisions), controller_state=state)

    def _decide(self, prompt: Prompt) -> _Decision:
        stats = self.stats.get(prompt.prompt_id)
        p_skip, kind = skip_probability(stats, self.p_easy, self.p_hard, self.config.min_keep_probability)
        if kind is None:
            return _Decision(AllocationEntry(prompt, self.config.n_rollouts, reason="greso: keep (no streak)",
                                             why=ControlReason("no_streak", "p_skip", 0.0)), None)
        streak = stats.easy_streak if kind == "easy" else stats.hard_streak
        p = self.p_easy if kind == "easy" else self.p_hard
        detail = f"{kind} streak {streak}, p_{kind} {p:.2f}, P_skip {p_skip:.3f}"
        draw = visit_draw(self.run_ctx.seed, self.epoch, self.run_ctx.step, prompt.prompt_id)
        why = ControlReason(f"{kind}_streak", "p_skip", p_skip, {"streak": streak, f"p_{kind}": p, "draw": draw})
        if draw < p_skip:
            return _Decision(AllocationEntry(prompt, 0, reason=f"greso: skip ({detail})", why=why), kind)
        kept = AllocationEntry(prompt, self.config.n_rollouts, reason=f"greso: keep ({detail})", why=why)
        return _Decision(kept, None)

    def observe(self, report: StepReport) -> None:
        observations = []
        for group in report.groups:
            obs = observe_group(group, self.run_ctx.policy_version) if group.step == report.step else None
            if obs is not None:
                self._stats(group.prompt_id).record(obs)
                observations.append(obs)
        if self.epoch == 0 or not observations:
            return  # the reference tunes only after the first epoch
        alpha = self.config.target_zero_variance
        easy_ratio = sum(o.all_correct for o in observations) / len(observations)
        hard_ratio = sum(o.all_wrong for o in observations) / len(observations)
        self.p_easy = self._tuned(self.p_easy, too_many=easy_ratio >= alpha / 3)
        self.p_hard = self._tuned(self.p_hard, too_many=hard_ratio >= 2 * alpha / 3)

    def _tuned(self, p: float, too_many: bool) -> float:
        # too many zero-variance groups got through: lower p, so more of them are skipped
        moved = p - self.config.step_size if too_many else p + self.config.step_size
        return round(min(max(moved, self.config.min_p), self.config.max_p), 10)

    def _stats(self, prompt_id: str) -> PromptStats:
        if prompt_id not in self.stats:
            self.stats[prompt_id] = PromptStats(prompt_id, history_size=self.config.history_size)
        return self.stats[prompt_id]

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable data: probabilities, position, and every prompt's stats."""
        return {
            "p_easy": self.p_easy, "p_hard": self.p_hard, "epoch": self.epoch, "cursor": self.cursor,
            "prompts": {pid: stats_to_state(s) for pid, s in self.stats.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.p_easy, self.p_hard = float(state["p_easy"]), float(state["p_hard"])
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.stats = {pid: stats_from_state(s) for pid, s in state["prompts"].items()}
