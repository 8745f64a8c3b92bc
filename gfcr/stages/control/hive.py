"""control.hive: choose prompts in two stages, a cheap prior from each prompt's history (its
success rate and response entropy at the "learning edge"), then a check under the current
policy (the prompt's entropy, one forward pass over its tokens) that prunes prompts whose
historical utility has gone stale.

HIVE, History-Informed and online-VErified prompt selection (Wu, Lu, Liu, Wang, Yang, Lin,
Zhang, Li, Tang, 2026, arXiv 2603.25184; v2 "Train at the Moving Edge: Efficient RL for
Large Reasoning Models via Rollout Selection"). **Only the abstract and introduction could
be read** (the stored copies of the paper stop before its method section; no code was found):
"HIVE first uses historical reward statistics and response entropy as a cheap prior to
filter candidate prompts, and then employs prompt entropy as a real-time proxy to prune
instances with stale utility"; the learning edge is "the intersection of intermediate
difficulty and high response entropy". **Every threshold, keep ratio and the two scores
below are our reading of those sentences, not the paper's formulas.**

A call takes the next ``m = candidate_ratio * batch_size`` prompts of a seeded per-epoch
permutation of the pool (``control.uniform``'s epochs and ``drop_last`` rule, as
``control.beta_thompson``) and:

1. **History (coarse).** Over a prompt's last ``history_size`` observations (one per group
   rolled out), ``p = sum(correct) / sum(judged)`` and ``H = mean`` of the groups' mean
   response-token entropy. A prompt never observed passes (no evidence against it). A seen
   prompt with ``p <= min_success`` or ``p >= max_success`` is off the edge and dropped
   (defaults 0 and 1: every judged rollout in the window failed, or every one succeeded).
   Each prompt off the edge is re-admitted with probability ``explore`` (one draw per visit,
   seeded by ``(seed, epoch, step, crc32(prompt_id))``, so a resumed run redraws it). The
   rest are ranked by the edge score ``u = p (1 - p) * H`` (reward variance, i.e.
   intermediate difficulty, times uncertainty), unseen and re-admitted prompts first; the
   first ``ceil(coarse_ratio * m)`` pass.
2. **Online verification (fine).** Each prompt passing stage 1, with tokens
   ``x_1 .. x_L``, gets its prompt entropy under the current policy
   ``PE(x) = (1 / L) * sum_{t=1..L} H(pi(. | x_1 .. x_t))``, the mean entropy of the
   next-token distribution after each prefix of the prompt (the last one is where the
   response starts), at ``temperature``. One ``score`` call, batched over the prompts, is
   that forward pass; its ``L`` tokens per prompt are counted in the step's
   ``tokens_scored``. The ``batch_size`` prompts of highest ``PE`` are kept (ties in stage-1
   order), each with ``n_rollouts`` (default 1; put ``control.fixed_n`` downstream for the
   group size).

Every candidate is in the Allocation: the kept ones first, the others with ``n_rollouts = 0``
and a reason (off the edge, cut at stage 1, pruned at stage 2). ``observe`` records one
observation per group rolled out in the step (``prompt_stats.observe_group``: judged
rollouts only; the response entropy needs ``generate.sample`` with ``entropy: true``, which
``gfcr validate`` requires). ``step_metrics`` (``stages.<id>`` in ``metrics.jsonl``, and
MLflow) reports, summed over the step's calls (a loop block calls it each round):
``candidates``, ``off_edge`` (dropped by the band), ``readmitted`` (off the edge, let through
by ``explore``), ``kept_stage1``, ``kept_stage2``, ``unseen`` (kept prompts never observed),
``tokens_scored`` (the prompt tokens this stage scored) and, when a prompt was scored,
``prompt_entropy_mean`` (over the stage-1 survivors) and ``prompt_entropy_kept`` (over the
kept ones).

With the defaults, 64 candidates for a batch of 16 become at most 32 after stage 1 and 16
after stage 2.

Deviations and ambiguities resolved (abstract only, see above):
- The edge score ``p (1 - p) * H`` and the band ``(min_success, max_success)``: the paper's
  "intermediate difficulty and high response entropy", combined as a product; ``p (1 - p)``
  is the variance of a 0/1 reward, whose collapse to 0 makes a GRPO group useless.
- Stage 2 keeps the highest prompt entropies: we read "prompt entropy as a real-time proxy"
  of the policy's current uncertainty, low entropy meaning the policy has moved past the
  prompt since its history was written. The paper's exact definition of prompt entropy was
  not readable; ours is the mean next-token entropy over the prompt's positions (the
  distribution before ``x_1`` is left out: there is no context for it). ``score`` is given
  ``x_1`` as the prompt and ``x_2 .. x_L`` plus one placeholder token (``x_1`` again) as the
  response: the entropies do not depend on the tokens scored, and the placeholder's
  position is the distribution after the whole prompt.
- Keep ratios: ``candidate_ratio`` 4 and ``coarse_ratio`` 0.5 are our choice; the final
  batch is ``batch_size`` whenever stage 1 leaves that many. When fewer prompts are on the
  edge, the batch shrinks (as GRESO's does); compose with ``filter.dynamic_sampling`` in a
  loop block to top it up.
- The history window is the last ``history_size`` (default 4) groups, unweighted; a group's
  entropy averages its judged rollouts' tokens that have one (a continued prefix's tokens
  have none). A seen prompt whose window has no entropy ranks after those that have one, by
  ``p (1 - p)`` alone.
- Unseen prompts rank first (GRESO never skips a prompt without history): while a candidate
  batch holds more unseen prompts than stage 1 keeps (the first epoch, or a pool much larger
  than what has been rolled out), stage 1 passes only unseen ones and stage 2 alone chooses
  among them; the history steers once the candidates are mostly seen.
- Re-admission (``explore``, default 0.1, our choice; GRESO's exploration of skipped
  prompts): without it a prompt off the edge would stay off for good, since its window only
  changes when it is rolled out, and a prompt all wrong early in training would never be
  tried again once the policy could solve it. Re-admitted prompts rank with the unseen:
  their history is what is in doubt. ``explore: 0`` gives the pure rule.
- Groups from earlier steps (replayed) are not observations of this step and are ignored;
  a prompt rolled out twice in one step (two loop rounds) is observed twice.

Fidelity: from the abstract: no public code; the rules above are this stage's reading.

Example (prompt entropies from the test engine ``gfcr.engines.fake``):

>>> from gfcr.engines.fake import FakeEngine
>>> from gfcr.records import Prompt, PromptPool, StepContext, StepReport
>>> from gfcr.stages.resources import Lent
>>> from gfcr.stages.testing import scored_group
>>> engine = FakeEngine()
>>> pool = PromptPool([Prompt(f"p:{i}", text=str(i), prompt_token_ids=engine.encode(f"{i}+{i}=")) for i in range(8)])
>>> stage = Hive(Hive.Config(batch_size=2, candidate_ratio=2, seed=0))
>>> stage.setup(Lent(engine=engine))
>>> stage.before_step(StepContext("run", step=0, seed=0, policy_version=0))
>>> [e.n_rollouts for e in stage.run(pool)]  # 4 candidates, 2 pass stage 1, 2 kept
[1, 1, 0, 0]
>>> {k: stage.step_metrics()[k] for k in ("candidates", "kept_stage1", "kept_stage2", "tokens_scored")}
{'candidates': 4, 'kept_stage1': 2, 'kept_stage2': 2, 'tokens_scored': 8}
>>> stage.observe(StepReport("run", 0, 1, (scored_group("p:3", [1, 1, 1]),), None, {}, {}))
>>> edge_score(stage.stats["p:3"], 4)  # 3 of 3 correct: p = 1, off the edge
(1.0, nan)

YAML:

.. code-block:: yaml

    stages:
      pick:    {use: control.hive, with: {batch_size: 16, candidate_ratio: 4, coarse_ratio: 0.5}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 8}}
      rollout: {use: generate.sample, from: budget, with: {entropy: true}}
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Collection, Sequence

import numpy as np
from pydantic import Field, model_validator

from gfcr.records import (Allocation, AllocationEntry, ControlReason, Prompt, PromptPool, PromptStats, StepContext,
                          StepReport)
from gfcr.registry import PipelineProblem, RecordsEntropy, StageConfig
from gfcr.spec.problems import fixable
from gfcr.stages.common.epochs import epoch_order, start_batch
from gfcr.stages.common.prompt_stats import observe_group, stats_from_state, stats_to_state, visit_draw
from gfcr.stages.common.run_context import RunContext
from gfcr.stages.resources import Lent, ScoreRequest, prompt_tokens

ALIAS = "control.hive"
Probability = Annotated[float, Field(ge=0.0, le=1.0)]


def edge_score(stats: PromptStats | None, window: int) -> tuple[float, float]:
    """``(p, H)`` over the last ``window`` observations: success rate of the judged rollouts
    and mean of the groups' response entropies (NaN when none has one); ``(nan, nan)`` for a
    prompt never observed."""
    history = list(stats.history)[-window:] if stats is not None else []
    n = sum(o.n for o in history)
    if n == 0:
        return math.nan, math.nan
    entropies = [o.mean_entropy for o in history if math.isfinite(o.mean_entropy)]
    return sum(o.n_correct for o in history) / n, float(np.mean(entropies)) if entropies else math.nan


def off_edge(scores: Sequence[tuple[float, float]], band: tuple[float, float]) -> set[int]:
    """Indices of the seen candidates whose success rate ``p`` lies outside the open band."""
    low, high = band
    return {i for i, (p, _) in enumerate(scores) if not math.isnan(p) and not low < p < high}


def stage_one(scores: Sequence[tuple[float, float]], band: tuple[float, float], keep: int,
              readmit: Collection[int] = ()) -> tuple[list[int], set[int]]:
    """Stage 1 over candidates' ``(p, H)``: the indices passing, best first (unseen and
    re-admitted, then by ``p (1 - p) H``, then those without entropy by ``p (1 - p)``; ties in
    candidate order), at most ``keep``; and the indices off the edge (``p`` outside the open
    band) that ``readmit`` does not name."""
    off = off_edge(scores, band) - set(readmit)

    def key(i: int) -> tuple[int, float]:
        p, h = scores[i]
        if math.isnan(p) or i in readmit:
            return 0, 0.0
        return (1, -p * (1 - p) * h) if math.isfinite(h) else (2, -p * (1 - p))

    ranked = sorted((i for i in range(len(scores)) if i not in off), key=key)
    return ranked[:keep], off


def coarse_keep(coarse_ratio: float, candidates: int) -> int:
    """``ceil(coarse_ratio * candidates)``, without float noise (0.07 * 100 is 7, not 8)."""
    return math.ceil(round(coarse_ratio * candidates, 9))


def stage_two(entropies: Sequence[float], keep: int) -> list[int]:
    """Stage 2: the positions of the ``keep`` highest prompt entropies, highest first; ties keep
    their order."""
    return [int(i) for i in np.argsort(-np.asarray(entropies, dtype=float), kind="stable")[:keep]]


def prompt_entropy_request(token_ids: Sequence[int], temperature: float) -> ScoreRequest:
    """The score request whose entropies are the next-token entropies after each prefix
    ``x_1 .. x_t`` (t = 1..L) of the prompt: prompt ``x_1``, response ``x_2 .. x_L`` plus a
    placeholder (``x_1``) for the position after the whole prompt."""
    ids = tuple(int(t) for t in token_ids)
    if not ids:
        raise ValueError("a prompt with no tokens has no prompt entropy")
    return ScoreRequest(ids[:1], ids[1:] + ids[:1], temperature)


class Hive:
    """HIVE: history-informed coarse selection, then prompt-entropy pruning under the current policy."""

    class Config(StageConfig):
        batch_size: Annotated[int, Field(ge=1, description="prompts kept per call (after stage 2)")]
        candidate_ratio: Annotated[int, Field(ge=1, description=(
            "candidates drawn per call, as a multiple of batch_size"))] = 4
        coarse_ratio: Annotated[float, Field(gt=0.0, le=1.0, description=(
            "stage 1 keeps at most ceil(coarse_ratio * candidates), ranked by p (1 - p) H"))] = 0.5
        min_success: Probability = Field(0.0, description=(
            "a seen prompt with historical success rate <= this is off the edge (too hard)"))
        max_success: Probability = Field(1.0, description=(
            "a seen prompt with historical success rate >= this is off the edge (too easy)"))
        history_size: Annotated[int, Field(ge=1, description=(
            "last observations (groups) per prompt the historical statistics average; checkpointed"))] = 4
        temperature: Annotated[float, Field(gt=0.0, description=(
            "temperature of the distribution whose entropy is the prompt entropy"))] = 1.0
        explore: Probability = Field(0.1, description=(
            "probability that a prompt off the edge is re-admitted to stage 1 at a visit, ranked with the unseen"))
        n_rollouts: Annotated[int, Field(ge=1, description="rollouts marked per kept prompt")] = 1
        seed: int | None = Field(None, description="permutation and re-admission seed; default: the run's seed")

        @model_validator(mode="after")
        def _band_is_open(self) -> "Hive.Config":
            if self.min_success >= self.max_success:
                raise fixable(f"min_success ({self.min_success:g}) must be below max_success ({self.max_success:g}): "
                              "no success rate would be on the edge",
                              "lower `min_success` or raise `max_success`; the defaults are 0 and 1")
            cap = coarse_keep(self.coarse_ratio, self.candidate_ratio * self.batch_size)
            if cap < self.batch_size:
                raise fixable(f"stage 1 keeps at most ceil(coarse_ratio * candidate_ratio * batch_size) = {cap} "
                              f"prompts, fewer than batch_size ({self.batch_size})",
                              f"raise `coarse_ratio` to at least {1 / self.candidate_ratio:g}, or `candidate_ratio`")
            return self

    @staticmethod
    def check_pipeline(config: "Hive.Config", view: Any) -> list[PipelineProblem]:
        """Stage 1 ranks by response entropy: some generate stage must record it."""
        generators = view.having(RecordsEntropy)
        if any(generator.records_entropy for _, generator in generators):
            return []
        fix = (f"set `entropy: true` on `{generators[0][0]}` (`--set stages.{generators[0][0]}.with.entropy=true`)"
               if generators else "generate with `generate.sample` and `entropy: true`")
        return [PipelineProblem(
            (), "control.hive ranks prompts by their historical response entropy, and no generate stage "
                "records per-token entropy", fix)]

    def __init__(self, config: Config):
        self.config = config
        self.epoch, self.cursor = 0, 0
        self.stats: dict[str, PromptStats] = {}
        self.run_ctx = RunContext(config.seed)
        self._metrics: dict[str, float] = {}
        self._entropy_sums: list[float] = []  # sum and count over survivors, then over kept
        self._reset_metrics()

    def setup(self, lent: Lent) -> None:
        self.run_ctx.setup(lent, ALIAS, engine=True)

    def before_step(self, ctx: StepContext) -> None:
        self.run_ctx.before_step(ctx)
        self._reset_metrics()

    def _reset_metrics(self) -> None:
        self._metrics = dict.fromkeys(("candidates", "off_edge", "readmitted", "unseen", "kept_stage1",
                                       "kept_stage2", "tokens_scored"), 0)
        self._entropy_sums = [0.0, 0, 0.0, 0]

    # --- selection ---------------------------------------------------------------------------

    def run(self, pool: PromptPool) -> Allocation:
        cfg, at = self.config, self.run_ctx
        m = cfg.candidate_ratio * cfg.batch_size
        self.epoch, self.cursor = start_batch(self.epoch, self.cursor, m, len(pool))
        order = epoch_order(at.seed, self.epoch, len(pool))[self.cursor : self.cursor + m]
        candidates = [pool[int(i)] for i in order]
        self.cursor += m
        scores = [edge_score(self.stats.get(p.prompt_id), cfg.history_size) for p in candidates]
        band = (cfg.min_success, cfg.max_success)
        readmit = {i for i in off_edge(scores, band)
                   if visit_draw(at.seed, self.epoch, at.step, candidates[i].prompt_id) < cfg.explore}
        survivors, off = stage_one(scores, band, coarse_keep(cfg.coarse_ratio, m), readmit)
        entropies = self.prompt_entropies([candidates[i] for i in survivors])
        kept = [survivors[j] for j in stage_two(entropies, cfg.batch_size)]
        pe = dict(zip(survivors, entropies))
        self._count(len(candidates), off, readmit, survivors, kept, scores, pe)
        reasons = self._reasons(len(candidates), scores, off, readmit, survivors, kept, pe)
        order = kept + [i for i in range(len(candidates)) if i not in set(kept)]
        entries = tuple(AllocationEntry(candidates[i], cfg.n_rollouts if i in set(kept) else 0,
                                        reason=reasons[i][0], why=reasons[i][1]) for i in order)
        return Allocation(step=at.step, entries=entries)

    def prompt_entropies(self, prompts: Sequence[Prompt]) -> list[float]:
        """``PE(x)`` of each prompt under the current policy: one batched ``score`` call."""
        if not prompts:
            return []
        if self.run_ctx.engine is None:
            raise RuntimeError(f"`{ALIAS}` was not set up with an engine (the runtime calls setup before run)")
        requests = [prompt_entropy_request(self._tokens(p), self.config.temperature) for p in prompts]
        self._metrics["tokens_scored"] += sum(len(r.response_token_ids) for r in requests)
        return [float(np.mean(s.entropy)) for s in self.run_ctx.engine.score(requests)]

    def _tokens(self, prompt: Prompt) -> list[int]:
        if prompt.prompt_token_ids is None and self.run_ctx.lent is not None:
            return prompt_tokens(self.run_ctx.lent.require_policy(ALIAS), prompt)
        return prompt.prompt_token_ids or []

    def _count(self, candidates: int, off: set[int], readmit: set[int], survivors: list[int], kept: list[int],
               scores: list[tuple[float, float]], pe: dict[int, float]) -> None:
        m = self._metrics
        m["candidates"] += candidates
        m["off_edge"] += len(off)
        m["readmitted"] += len(readmit)
        m["unseen"] += sum(math.isnan(scores[i][0]) for i in kept)
        m["kept_stage1"] += len(survivors)
        m["kept_stage2"] += len(kept)
        sums = self._entropy_sums
        sums[0] += sum(pe.values())
        sums[1] += len(pe)
        sums[2] += sum(pe[i] for i in kept)
        sums[3] += len(kept)

    def _reasons(self, n: int, scores: list[tuple[float, float]], off: set[int], readmit: set[int],
                 survivors: list[int], kept: list[int], pe: dict[int, float]) -> list[tuple[str, ControlReason]]:
        """Each candidate's reason, as text and as a ``ControlReason``: ``off_edge`` (decided by its
        success rate), ``cut_stage1`` (by its stage-1 rank), ``pruned_stage2`` or ``kept`` (by its
        prompt entropy under the current policy)."""
        cfg = self.config
        rank1 = {i: r + 1 for r, i in enumerate(survivors)}
        rank2 = {i: r + 1 for r, i in enumerate(sorted(survivors, key=lambda i: (-pe[i], rank1[i])))}
        out = []
        for i in range(n):
            p, h = scores[i]
            history = "unseen" if math.isnan(p) else f"success {p:.3f}, response entropy {h:.4f}"
            history += ", re-admitted off the edge" if i in readmit else ""
            seen = {} if math.isnan(p) else {"success": p, **({} if math.isnan(h) else {"response_entropy": h})}
            seen |= {"readmitted": 1.0} if i in readmit else {}
            if i in off:
                text = f"hive: off the edge ({history}; band ({cfg.min_success:g}, {cfg.max_success:g}))"
                why = ControlReason("off_edge", "success", p, {"min_success": cfg.min_success,
                                                                "max_success": cfg.max_success})
            elif i not in rank1:
                text = f"hive: cut at stage 1 ({history})"
                why = ControlReason("cut_stage1", None, None, seen)
            else:
                what = "kept" if i in set(kept) else "pruned at stage 2"
                text = (f"hive: {what} (stage-1 rank {rank1[i]}, {history}; prompt entropy {pe[i]:.4f}, "
                        f"rank {rank2[i]})")
                why = ControlReason("kept" if i in set(kept) else "pruned_stage2", "prompt_entropy", pe[i],
                                    seen | {"stage1_rank": rank1[i], "stage2_rank": rank2[i]})
            out.append((text, why))
        return out

    def step_metrics(self) -> dict[str, float]:
        out = dict(self._metrics)
        total, count, kept_total, kept_count = self._entropy_sums
        if count:
            out["prompt_entropy_mean"] = total / count
        if kept_count:
            out["prompt_entropy_kept"] = kept_total / kept_count
        return out

    # --- learning ----------------------------------------------------------------------------

    def observe(self, report: StepReport) -> None:
        for group in report.groups:
            obs = observe_group(group, self.run_ctx.policy_version) if group.step == report.step else None
            if obs is None:
                continue
            if group.prompt_id not in self.stats:
                self.stats[group.prompt_id] = PromptStats(group.prompt_id, history_size=self.config.history_size)
            self.stats[group.prompt_id].record(obs)

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable data: position in the epoch and every observed prompt's history."""
        return {"epoch": self.epoch, "cursor": self.cursor,
                "prompts": {pid: stats_to_state(s) for pid, s in self.stats.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.stats = {pid: stats_from_state(s) for pid, s in state["prompts"].items()}
