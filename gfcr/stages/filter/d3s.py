"""filter.d3s: D^3S dynamic dual-level down-sampling: keep the rollouts whose advantages vary
most, mask all but the tokens with the largest ``|A| * H``, and relax both over training.

D^3S (Wang, Yang, Tian, Shi, Ma, Liu, Yao, Ding, 2025, "Learning More with Less: A Dynamic
Dual-Level Down-Sampling Framework for Efficient Policy Optimization", arXiv 2509.22115; ICLR
2026). The update batch is thinned on two levels before the update:

1. **Sample level.** Each included group's advantages ``A_i`` come from ``advantage`` (an
   estimator of the update's registry; default ``mean_std``, GRPO's ``(r - mean) / (std +
   eps)`` over the whole group). The stage keeps the subset ``S`` that maximises the
   population variance ``Var_{i in S}(A_i)`` (the paper shows ``Var(A)`` is tied to an upper
   bound of the policy-gradient norm), of size

       intra_group:  m_g = max(2, ceil(rho_s * G_g))   per group of G_g rollouts
       cross_group:  m   = max(2, ceil(rho_s * N))     over the N rollouts of all included groups

   The best subset is the ``k`` largest and ``m - k`` smallest advantages for some ``k``
   (PODS's max-variance down-sampling, arXiv 2504.13818, ``O(n log n)``; ``down_sampling``).
   The others leave their group (``RolloutGroup.remove``, reason ``not in the max-Var(A)
   subset ...``): out of the baseline and the update, kept in lineage and in the step's
   generated counts. In ``cross_group`` a group left with fewer than 2 rollouts is dropped.

2. **Token level.** The advantages are recomputed, with the same estimator, on the kept
   subsets: they are what the update will compute (``update.grpo`` re-estimates every group
   from its rewards, so the kept rollouts' advantages are those of the subset, not of the full
   group). Each counted token (``loss_mask`` True or absent) of a kept rollout gets the score
   ``|A_{i,t}| * H_{i,t}`` (``A_{i,t} = A_i`` for a scalar advantage); the ``ceil(rho_t * T)``
   highest scores among the batch's ``T`` counted tokens stay counted and every other token's
   ``loss_mask`` becomes False: out of the loss and of the aggregation's denominator (the
   update multiplies each token's weight by ``loss_mask``).

3. **Schedule.** ``rho(step) = start + (end - start) * min(1, step / ramp_steps)`` for both
   ratios: aggressive down-sampling first, relaxed to ``end`` by ``ramp_steps``. The step is
   the run's (``StepContext.step``), so the stage keeps no state and a resumed run continues
   the schedule where it stopped.

Under the default ``token_mean`` aggregation the loss is then the mean over the kept tokens;
rollouts left with no counted token skip the forward and backward pass.

Entropy ``H_{i,t}`` (``entropy``): ``recorded`` (default) reads ``Rollout.token_entropy``, which
``generate.sample`` writes with ``entropy: true``: the entropy of the tempered, untruncated
sampling distribution of the policy that sampled the rollout (the current policy, for fresh
rollouts), at no extra cost; ``gfcr validate`` refuses a token level after a ``generate.sample``
that does not record it. A rollout without recorded entropy on a counted token (a replayed
rollout, a resumed prefix) is scored through the engine instead. ``scored`` scores every
rollout through the engine (``Engine.score`` under the current policy at ``temperature``; for
engines that record no entropy while sampling, such as the vLLM engine). Scoring costs one
forward pass over each scored rollout's prompt and response, without gradient; its response
tokens are added to the step's ``tokens_scored`` (so ``gfcr compare`` charges them) and to
the ``entropy_tokens_scored`` metric. With ``token_keep_start = token_keep_end = 1`` the token
level is off and needs no entropy.

Defaults (ours; see Deviations): ``scope: intra_group``, ``rho_s`` 0.5 to 1.0 and ``rho_t`` 0.2
to 1.0 over ``ramp_steps: 100``. ``step_metrics`` reports the two ratios, rollouts and tokens in
and kept, groups dropped, ``Var(A)`` before and after the sample level (the mean of the groups'
for ``intra_group``, the pooled one for ``cross_group``), and the tokens whose entropy was scored.

Deviations: the paper's body (its exact keep ratios, schedule shape and selection details) was
not available to us; the rules above are from its abstract, a third-party summary (intra- and
cross-group variants, D3S-I the more stable) and PODS, whose max-variance rule the sample level
matches. Our choices, each an ambiguity resolved:
- the ratios' values and the linear schedule are ours: ``rho_t`` starts at 0.2 after the
  "80/20" high-entropy-token result (arXiv 2506.01939), ``rho_s`` at 0.5, and both end at 1.0
  (no down-sampling once relaxed); set ``*_end`` below 1 to keep down-sampling late;
- the advantages of the selection are those of the full group (``advantage``, checked equal to
  the update's estimator); after the selection the update re-estimates them on the kept subset
  (the abstract does not say which the paper's update uses; we did not verify PODS's choice);
- a group is never cut below 2 rollouts (a lone rollout has no group baseline); in
  ``cross_group`` a group with fewer than 2 rollouts selected is dropped whole;
- ties: between subsets of equal variance, more of the largest advantages; equal values and
  equal token scores in rollout and position order;
- the token level ranks tokens across the whole batch (with per-rollout ranking ``|A_i|`` would
  be a constant factor and the product would reduce to ``H``); a per-token estimator's
  ``[T]`` advantages are used as they are, and its mean over the response is the rollout's
  value at the sample level;
- tokens an earlier filter masked stay masked and do not count in ``T``;
- zero-variance groups are not dropped (their tokens score ``|A| = 0`` and are masked first
  at the token level); put ``filter.nonzero_variance`` before the stage to leave them out.

Fidelity: from the abstract: no public code (its code is in the supplementary material only);
the rules above are this stage's reading.

Example (a hand group, ``rho_s = 0.5``: the two correct and the first two wrong rollouts have
the largest reward variance; then the ``ceil(0.5 * 4)`` tokens with the largest ``|A| * H``):

>>> import numpy as np
>>> from gfcr.records import Prompt, PromptPool, RolloutGroups, StepContext
>>> from gfcr.stages.testing import scored_group
>>> group = scored_group("p:0", [0.0, 1.0, 0.0, 0.0, 0.5, 1.0, 0.0, 0.0])
>>> for i, r in enumerate(group.rollouts):
...     r.token_entropy = np.array([0.1 * (i + 1)], dtype=np.float32)
>>> stage = D3S(D3S.Config(sample_keep_start=0.5, token_keep_start=0.5))
>>> out = stage.run(RolloutGroups([group]), PromptPool([Prompt("p:0", text="x")]), StepContext("r", 0, 0, 0))
>>> [r.rollout_id for r in group.rollouts], [m.rollout.rollout_id for m in group.removed]
(['p:0@s0/0', 'p:0@s0/1', 'p:0@s0/2', 'p:0@s0/5'], ['p:0@s0/3', 'p:0@s0/4', 'p:0@s0/6', 'p:0@s0/7'])
>>> [bool(r.loss_mask[0]) for r in group.rollouts]  # |A| = 0.866 each; H = 0.1, 0.2, 0.3, 0.6
[False, False, True, True]

YAML:

.. code-block:: yaml

    rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 8, entropy: true}}
    reward:  {use: filter.verify, from: rollout}
    d3s:     {use: filter.d3s, from: reward, with: {scope: intra_group, sample_keep_start: 0.5, token_keep_start: 0.2, ramp_steps: 100}}
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from gfcr.records import PromptPool, Rollout, RolloutGroup, RolloutGroups, StepContext
from gfcr.registry import EstimatesAdvantages, PipelineProblem, RecordsEntropy, StageConfig
from gfcr.spec.problems import fixable
from gfcr.stages.filter.down_sampling import kept_count, linear_ratio, max_variance_subset, top_fraction
from gfcr.stages.resources import Engine, Policy, Lent, ScoreRequest, prompt_tokens
from gfcr.stages.components.advantage import AdvantageSpec, estimate_all

Ratio = Annotated[float, Field(gt=0.0, le=1.0)]
MIN_GROUP = 2  # a group keeps at least this many rollouts: a lone rollout has no baseline


class D3S:
    """D^3S: keep each group's max-Var(A) subset and the tokens with the largest |A|·H, on a relaxing schedule."""

    class Config(StageConfig):
        reads_rewards: ClassVar[bool] = True  # a capability (gfcr.registry.ReadsRewards): a verifier must be upstream
        scope: Literal["intra_group", "cross_group"] = Field(
            "intra_group", description="where Var(A) is maximised: within each group (D3S-I) or over the "
                                       "pooled rollouts of all included groups (D3S-C)")
        sample_keep_start: Annotated[Ratio, Field(description="rho_s at step 0: the fraction of rollouts kept")] = 0.5
        sample_keep_end: Annotated[Ratio, Field(description="rho_s from ramp_steps on (1.0: no sample-level "
                                                            "down-sampling once relaxed)")] = 1.0
        token_keep_start: Annotated[Ratio, Field(description="rho_t at step 0: the fraction of the batch's counted "
                                                             "tokens kept in the loss")] = 0.2
        token_keep_end: Annotated[Ratio, Field(description="rho_t from ramp_steps on (1.0: no token-level "
                                                           "masking once relaxed)")] = 1.0
        ramp_steps: Annotated[int, Field(ge=1, description="steps over which both ratios move linearly from "
                                                           "start to end")] = 100
        advantage: AdvantageSpec = Field(AdvantageSpec(), description="the advantage estimator of Var(A) and |A|; "
                                         "must equal the update's `advantage`")
        entropy: Literal["recorded", "scored"] = Field(
            "recorded", description="where H comes from: recorded at sampling (generate.sample `entropy: true`; "
                                    "rollouts without it are scored), or scored through the engine for every rollout")
        temperature: Annotated[float, Field(gt=0.0, description="the temperature of entropies scored through the "
                                            "engine: the sampling one")] = 1.0

        @model_validator(mode="after")
        def _schedule_relaxes(self) -> "D3S.Config":
            for level in ("sample", "token"):
                start, end = getattr(self, f"{level}_keep_start"), getattr(self, f"{level}_keep_end")
                if start > end:
                    raise fixable(f"`{level}_keep_start` ({start}) is above `{level}_keep_end` ({end}): D^3S starts "
                                  "aggressive and relaxes, so the kept fraction may only grow",
                                  f"swap them, or set both equal for a constant ratio (--set stages.<id>.with."
                                  f"{level}_keep_end={start})")
            return self

        @property
        def token_level(self) -> bool:
            """Whether any step masks tokens (and so needs entropies)."""
            return self.token_keep_start < 1.0

    @staticmethod
    def check_pipeline(config: "D3S.Config", view: Any) -> list[PipelineProblem]:
        """The selection's estimator is the update's; the generators upstream record entropy."""
        found = []
        update = view.configs.get("update")
        theirs = update.advantage if isinstance(update, EstimatesAdvantages) else None
        if isinstance(theirs, AdvantageSpec) and not _same_estimator(config.advantage, theirs):
            found.append(PipelineProblem(
                ("advantage",), f"the selection's advantage estimator (`{config.advantage.use}` "
                f"{config.advantage.with_}) is not the update's (`{theirs.use}` {theirs.with_}): "
                "Var(A) and |A| would be measured on other advantages than the update uses",
                f"set this stage's `advantage` to the update's (`advantage: {{use: {theirs.use}}}` "
                "with the same `with`)"))
        if config.token_level and config.entropy == "recorded":
            for sid, generator in view.having(RecordsEntropy, upstream=True):
                if not generator.records_entropy:
                    found.append(PipelineProblem(
                        ("token_keep_start",), f"the token level ranks tokens by |A|·H and "
                        f"`{sid}` ({view.aliases[sid]}) does not record entropy: every rollout would "
                        "be scored again through the engine, one forward pass each",
                        f"set `entropy: true` on `{sid}` (--set stages.{sid}.with.entropy=true); "
                        "or `entropy: scored` here to pay that pass (an engine that records no "
                        "entropy, vLLM); or turn the token level off (`token_keep_start: 1.0`)"))
        return found

    def __init__(self, config: Config):
        self.config = config
        self.estimator = config.advantage.build()
        self._policy: Policy | None = None
        self._engine: Engine | None = None
        self._metrics: dict[str, float] = {}

    def setup(self, lent: Lent) -> None:
        """The engine that scores entropies: required with ``entropy: scored``, borrowed when the
        pipeline has one otherwise (for rollouts that carry no recorded entropy)."""
        cfg = self.config
        needed = cfg.token_level and cfg.entropy == "scored"
        if cfg.token_level and (needed or (lent.engine is not None and lent.policy is not None)):
            self._policy = lent.require_policy("filter.d3s")
            self._engine = lent.require_engine("filter.d3s")  # metered: scored tokens are charged

    def ratios(self, step: int) -> tuple[float, float]:
        """``(rho_s, rho_t)`` at ``step``."""
        c = self.config
        return (linear_ratio(c.sample_keep_start, c.sample_keep_end, c.ramp_steps, step),
                linear_ratio(c.token_keep_start, c.token_keep_end, c.ramp_steps, step))

    def run(self, groups: RolloutGroups, pool: PromptPool, ctx: StepContext) -> RolloutGroups:
        rho_s, rho_t = self.ratios(ctx.step)
        included = [g for g in groups if g.verdict.included and g.rollouts]
        before = sum(len(g.rollouts) for g in included)
        values = [_per_rollout(a.values) for a in estimate_all(self.estimator, included, pool)]
        keep = self._select(values, rho_s)
        pooled = self.config.scope == "cross_group"
        var_before, var_after = _variance(values, None, pooled), _variance(values, keep, pooled)
        dropped = self._apply(included, keep, rho_s)
        survivors = [g for g in included if g.verdict.included]
        tokens_in, tokens_kept, scored = self._mask_tokens(survivors, pool, rho_t) if rho_t < 1.0 else (0, 0, 0)
        self._metrics = {"sample_keep_ratio": rho_s, "token_keep_ratio": rho_t, "rollouts_in": before,
                         "rollouts_kept": sum(len(g.rollouts) for g in survivors), "groups_dropped": dropped,
                         "adv_var_before": var_before, "adv_var_after": var_after, "tokens_in": tokens_in,
                         "tokens_kept": tokens_kept, "entropy_tokens_scored": scored}
        return groups.included()

    def step_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    # --- sample level ------------------------------------------------------------------------

    def _select(self, values: list[np.ndarray], rho: float) -> list[np.ndarray]:
        """Per group, the indices of its rollouts in the max-Var(A) subset."""
        if self.config.scope == "intra_group":
            return [max_variance_subset(v, kept_count(rho, len(v), MIN_GROUP)) if len(v) >= MIN_GROUP
                    else np.arange(len(v)) for v in values]
        pooled = np.concatenate(values) if values else np.zeros(0)
        if len(pooled) < MIN_GROUP:
            return [np.arange(len(v)) for v in values]
        chosen = max_variance_subset(pooled, kept_count(rho, len(pooled), MIN_GROUP))
        offsets = np.cumsum([0] + [len(v) for v in values])
        return [chosen[(chosen >= lo) & (chosen < hi)] - lo for lo, hi in zip(offsets[:-1], offsets[1:])]

    def _apply(self, groups: list[RolloutGroup], keep: list[np.ndarray], rho: float) -> int:
        """Remove the rollouts outside each group's subset; drop a group left below 2 (cross-group)."""
        dropped = 0
        for g, kept in zip(groups, keep):
            n = len(g.rollouts)
            if len(kept) == n:
                continue
            if len(kept) < MIN_GROUP:
                g.drop(f"D3S cross-group selection kept {len(kept)} of its {n} rollouts (fewer than {MIN_GROUP}: "
                       f"no group baseline; keep ratio {rho:.3g})")
                dropped += 1
                continue
            reason = f"not in the max-Var(A) subset ({len(kept)} of {n} kept, keep ratio {rho:.3g})"
            chosen = set(kept.tolist())
            for rid in [r.rollout_id for i, r in enumerate(g.rollouts) if i not in chosen]:
                g.remove(rid, reason)
        return dropped

    # --- token level -------------------------------------------------------------------------

    def _mask_tokens(self, groups: list[RolloutGroup], pool: PromptPool, rho: float) -> tuple[int, int, int]:
        """Keep the batch's ``ceil(rho * T)`` counted tokens with the largest ``|A| * H`` in the
        loss. Returns (counted tokens, kept tokens, tokens whose entropy was scored)."""
        rollouts, abs_adv = [], []
        for g, advantages in zip(groups, estimate_all(self.estimator, groups, pool)):
            for r, a in zip(g.rollouts, advantages.values):
                rollouts.append(r)
                abs_adv.append(np.abs(np.broadcast_to(np.asarray(a, dtype=np.float64), (len(r),))))
        entropies, scored = self._entropies(rollouts, pool)
        counted = [_counted(r) for r in rollouts]
        scores = np.concatenate([(a * h)[c] for a, h, c in zip(abs_adv, entropies, counted)] or [np.zeros(0)])
        kept = top_fraction(scores, rho)
        start = 0
        for r, c in zip(rollouts, counted):
            mask = np.zeros(len(r), dtype=bool)  # [T]
            n = int(c.sum())
            mask[np.flatnonzero(c)] = kept[start:start + n]
            r.loss_mask, start = mask, start + n
        return len(scores), int(kept.sum()), scored

    def _entropies(self, rollouts: list[Rollout], pool: PromptPool) -> tuple[list[np.ndarray], int]:
        """``[T]`` entropies per rollout: recorded ones, else scored through the engine."""
        score_all = self.config.entropy == "scored"
        missing = [r for r in rollouts if score_all or not _has_entropy(r)]
        scored = dict(zip((r.rollout_id for r in missing), self._score(missing, pool))) if missing else {}
        out = [np.asarray(scored.get(r.rollout_id, r.token_entropy), dtype=np.float64) for r in rollouts]
        return out, sum(len(r) for r in missing)

    def _score(self, rollouts: list[Rollout], pool: PromptPool) -> list[np.ndarray]:
        if self._engine is None or self._policy is None:
            raise ValueError(f"filter.d3s: rollout {rollouts[0].rollout_id} needs its token entropy scored and the "
                             "stage has no engine to score it; set `entropy: true` on the generate.sample stage "
                             "(with this stage's `entropy: recorded`), or run it in a pipeline with a policy and "
                             "engine")
        requests = [ScoreRequest(tuple(r.context_token_ids or prompt_tokens(self._policy, pool.get(r.prompt_id))),
                                 tuple(r.response_token_ids), self.config.temperature) for r in rollouts]
        return [s.entropy for s in self._engine.score(requests)]


def _same_estimator(a: AdvantageSpec, b: AdvantageSpec) -> bool:
    return a.use == b.use and a.build().config == b.build().config


def _per_rollout(values: tuple[float | np.ndarray, ...]) -> np.ndarray:
    """``[G]``: a scalar advantage, or a per-token estimator's mean over the response."""
    return np.array([(float(np.mean(v)) if v.size else 0.0) if isinstance(v, np.ndarray) else float(v)
                     for v in values], dtype=np.float64)


def _variance(values: list[np.ndarray], keep: list[np.ndarray] | None, pooled: bool) -> float:
    """The population Var(A) the scope maximises, of all (``keep`` None) or the kept rollouts: the
    mean over groups of each group's (intra-group), or that of the pooled rollouts (cross-group)."""
    parts = [v if keep is None else v[k] for v, k in zip(values, keep or [None] * len(values))]
    parts = [p for p in parts if len(p)]
    if not parts:
        return 0.0
    return float(np.var(np.concatenate(parts))) if pooled else float(np.mean([np.var(p) for p in parts]))


def _counted(r: Rollout) -> np.ndarray:  # [T] bool
    return np.ones(len(r), dtype=bool) if r.loss_mask is None else np.asarray(r.loss_mask, dtype=bool)


def _has_entropy(r: Rollout) -> bool:
    if r.token_entropy is None or len(r.token_entropy) != len(r):
        return False
    return bool(np.isfinite(np.asarray(r.token_entropy)[_counted(r)]).all())
