"""update.grpo: the GRPO-family policy update, assembled from five registered components.

For every included group, an advantage estimator (``advantage: {use: ..., with: {...}}``;
``gfcr.stages.components.advantage``) gives one advantage per rollout, a scalar or a ``[T]``
array, and optionally a ``[T]`` loss mask; the advantage is scaled by the group's and the
rollout's sample weight. A loss (``loss: {use: ..., with: {...}}``;
``gfcr.stages.components.loss``) turns each token's log-ratio against the behaviour policy
``mu`` (the log-probs the engine recorded) and its advantage into a per-token loss; the
default, ``ppo_clip``, is the clipped surrogate

    ratio_t = exp(log pi_theta(y_t) - log mu(y_t))
    l_t     = -min(ratio_t * A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)

and an optional KL to a frozen copy of the initial policy (the k3 estimator, as GRPO) is
added, ``+ kl_coef * KL_t``. Every token has a weight ``w_t``: the product of the rollout's
``loss_mask`` (a Filter stage's), the estimator's loss mask, the correction's staleness limit
and, in a tree group, the shared-prefix weight (``1/k`` on a position that ``k`` leaves share:
``gfcr.stages.update.tree_weights``). An aggregation (``aggregation: {use: ...}``;
``gfcr.stages.components.aggregation``) makes one scalar of the weighted per-token losses:
``token_mean`` by default (DAPO: every token of the batch weighs the same, a shared prefix
counts once), ``seq_mean_token_mean`` (GRPO as written) or ``seq_mean_token_sum`` (Dr.GRPO).
One AdamW step per call, with gradient-norm clipping, over micro-batches whose gradients
accumulate; AdamW holds the parameters that require a gradient: every weight, or with
``policy.lora`` the adapter's alone (docs/lora.md). ``gfcr validate`` checks the components against each other and the pipeline
(for example, Dr.GRPO's estimator needs its aggregation).

An off-policy correction (``correction: {use: ...}``; ``gfcr.stages.components.correction``),
``none`` by default, says how stale tokens (replayed, cached or resumed rollouts) are taken:
``tis`` (truncated importance sampling, ``with: {cap: 2.0}``), ``decoupled_clip`` (AReaL's
decoupled PPO for stale tokens, which is also DOTS' clip centred on the stale ratio
``pi_old/mu``), ``recompute_old`` (every ratio against ``pi_old``, no weight: the recomputed
``old_log_probs`` of APRIL's and SPEC-RL's code), ``staleness`` (mask tokens more than
``max_staleness`` versions old; the others take a ``max_staleness`` too), ``freshness``
(weigh each rollout by its age, f-OPD's freshness score) or ``ewma_proximal`` (PPO-EWMA: the
ratio against a moving average of the policy's weights that the correction keeps, checkpointed
with the update, and moves after every step). An upstream stage
that replays old rollouts declares the correction it needs (``update_needs``:
``replay.rollout_replay`` needs ``decoupled_clip``), and ``gfcr validate`` checks it. With any
correction but ``none``, the metrics add ``off_policy_token_fraction`` (tokens with staleness >
0, before the staleness limit), ``is_weight_mean``, ``is_weight_max`` and ``is_clipped_fraction``.

A learning-rate rule (``lr_rule: {use: ...}``; ``gfcr.stages.components.lr_rule``), ``constant``
by default, scales the step's learning rate from the batch and restores it after the step:
``vcpo_ess`` (VCPO) by the effective sample size of the trajectories' sequence importance
weights, summed over every trainer rank. An estimator that weighs by gradients (``opob``,
VCPO's baseline) gets each trajectory's squared gradient norm from one extra forward and
backward pass per trajectory before the backward pass (``train_shard``), under trainer ranks
each rank for its shard, the table then summed over the ranks.

Logits are computed only at response positions (``logits_to_keep``), and rollouts whose
advantage is zero on every counted token (with no KL term) never enter the forward or
backward pass: their loss and gradient are zero, and they still count in the aggregation's
denominator, so the gradient is unchanged (a test checks this). An empty batch, or one whose
advantages are all zero, skips the update; a NaN or infinite loss or gradient norm skips it
too (the reason is reported) and the run goes on.

Who moves what: the stage computes the batch (``prepare``), each shard's gradients and its optimizer
step (``train_shard``) and the report (``finish``): the ``Trains`` role. The runtime's trainer
(``gfcr.runtime.training``) calls them, bumps the policy version and hands it to a weight mover
(``gfcr.runtime.weights``), which brings the engine up to date.

Trainer ranks: with ``resources: {replicas: N}`` on the update and ``executor: {kind: ray}``,
the step runs in N Ray actors over ``torch.distributed`` (``gfcr.runtime.training.ranks``), each
with its own copy of the policy and of this stage. The driver's stage builds the batch and the
plan as above (it holds no optimizer), the trainer splits the forward rollouts into N contiguous
shards balanced by response tokens, and each rank calls ``train_shard``: the same micro-batched
backward against the whole batch's plan, then the gradients summed over the ranks (the batch term
on rank 0 only), then the same clip and AdamW step. The sum of the shards' gradients is the
single-process gradient, to float rounding; the trainer then loads rank 0's weights into the
driver's policy. With ``sharding: fsdp2`` in those resources each rank holds a shard of the policy
and of AdamW (FSDP2): the backward passes sum the policy's gradients themselves, the stage sums the
rest, and the ranks agree on the number of micro-batches, the less busy taking empty passes
(``Ranks.sharded``); an estimator that weighs by gradients and a correction that keeps a moving
average of the weights are refused there (``sharding_problems``).

Saving the batches: with ``save_batches: <folder>`` each step writes ``batch-<version>.json``
there: every rollout of the batch (group, reward, length, advantage, token weights), and per
micro-batch the tensors its loss was built from (current, old, behaviour and reference
log-probs, advantages, weights) with the micro-batch's loss (``gfcr.stages.update.batch_trace``
has the format). It records nothing when unset and changes no number of the step; it is how
``tests/fidelity/test_verl_steps.py`` runs verl's own formulas on gfcr's batches.

Deviations:
- one optimizer step per batch (no PPO epochs or mini-batches yet), so on fresh rollouts
  the ratio is 1 up to numerics; under the correction ``none`` the ratio is taken against
  the engine's behaviour log-probabilities, not against recomputed ``pi_old``. verl recomputes
  ``old_log_prob`` with the actor (with one mini-batch and one epoch it takes
  ``log_prob.detach()``, a ratio of exactly 1): ``correction: {use: recompute_old}`` gives verl's;
  ``none`` is verl's ``use_rollout_log_probs``;
- a micro-batch holds only rollouts with a signal (a zero-advantage rollout without a KL term
  is left out of the forward pass), so the micro-batches are not verl's (every response in
  batch order) and neither is each one's loss; the step's loss and gradient are the same (the
  aggregation divides by the whole batch's totals, as verl's engine workers'
  ``global_batch_info`` does; ``tests/fidelity/steps`` checks both splits);
- the k3 KL (``kl_coef``, verl's ``use_kl_loss`` with ``kl_loss_type: low_var_kl``) is not
  clamped by default; verl clamps ``log(pi_ref / pi)`` to [-20, 20] and the estimate to
  [-10, 10] (no gradient past it), so the two differ on a token whose estimate passes 10: the
  reference gives it more than about 13.6 times the policy's probability, or less than ``e^-11``
  of it (``tests/fidelity/kl_low_var.json``): ``kl_clamp: 10.0`` gives verl's;
- the sample weights of Prompt-GDRO-style stages multiply the advantage;
- position ids follow the attention mask (left-padded prompts), as generation does; TRL
  and the peer hand loop do not pass them;
- under ``seq_mean`` a tree's shared tokens are weighted ``1/k`` in each leaf's sum but each
  leaf is still divided by its own length, so "counts once" is exact only under
  ``token_mean`` (the default).

Fidelity: checked against volcengine/verl@b178a3c: 20/20 cases (``tests/fidelity/steps``: whole
steps with verl's settings, against verl's own ``core_algos`` on the batches this stage saved: 4
seeded runs of 5 steps, GRPO with and without its KL loss, REINFORCE++ with baseline one version
stale, plain REINFORCE++; a case is one step, its advantages and every micro-batch's loss within
float32 rounding; the settings are in ``docs/update-catalog.md``, "Getting verl's numbers");
checked against volcengine/verl@b178a3c: 5/10 cases, 5 documented deviations
(``tests/fidelity/kl_low_var.json``: the KL term against ``kl_penalty`` with ``low_var_kl``, the
estimate and its gradient; with ``kl_clamp: 10.0`` all 10 agree). Beyond these runs the assembly of five registered components is gfcr's own; the components'
reference cases are listed per component in ``docs/fidelity.md``.

Example (one update of the ``tiny-arith`` policy on a hand-scored group):

>>> from gfcr.engines import TransformersEngine, load_policy
>>> from gfcr.records import Allocation, AllocationEntry, Prompt, PromptPool, RolloutGroups
>>> from gfcr.spec import PolicySpec
>>> from gfcr.stages.generate.sample import Sample
>>> from gfcr.runtime import LocalTrainer
>>> from gfcr.stages.resources import Lent
>>> policy = load_policy(PolicySpec(model="tiny-arith"))
>>> lent = Lent(policy, TransformersEngine(policy))
>>> prompt = Prompt("a:0", text="What is 12 + 30? Answer:")
>>> sample, update = Sample(Sample.Config(max_new_tokens=8)), GRPOUpdate(GRPOUpdate.Config(lr=1e-3))
>>> sample.setup(lent); update.setup(lent)
>>> groups = sample.run(Allocation(0, (AllocationEntry(prompt, 4),)))
>>> for i, r in enumerate(groups.rollouts()):
...     r.reward = float(i % 2)
>>> report = LocalTrainer(policy).update(update, groups, PromptPool([prompt]))
>>> report.policy_version, report.rollouts_in_update, report.skipped
(1, 4, False)

YAML:

.. code-block:: yaml

    update:
      use: update.grpo
      from: keep
      with: {lr: 1.0e-4, advantage: {use: mean_std}, loss: {use: ppo_clip, with: {clip: [0.2, 0.28]}}}

Another estimator, with truncated importance sampling and a staleness limit for replayed or
resumed rollouts:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {advantage: {use: gapo, with: {fraction: 0.5}}, correction: {use: tis, with: {cap: 2.0, max_staleness: 4}}}}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import Field, field_validator

from gfcr.records import PromptPool, Rollout, RolloutGroup, RolloutGroups, UpdateReport
from gfcr.registry import BuildsTrees, FixesGroupSize, PipelineProblem, StageConfig, Stateful
from gfcr.registry.components import (AddsBatchTerm, CorrectsSequences, CorrectsTokens, KeepsProximalPolicy,
                                      LearnsParameters,
                                      LimitsStaleness, ReportsStepMetrics, WeighsByGradients, declared, provides)
from gfcr.spec.problems import fixable
from gfcr.stages.resources import Lent, Policy, prompt_tokens
from gfcr.stages.components.advantage import AdvantageSpec, estimate_all
from gfcr.stages.components.aggregation import AggregationSpec, Row
from gfcr.stages.components.base import PairingContext
from gfcr.stages.components.correction import CorrectionSpec
from gfcr.stages.components.loss import LossSpec
from gfcr.stages.components.lr_rule import LrRuleSpec, sequence_log_weights
from gfcr.stages.update.logprobs import k3_kl, padded, response_logprobs
from gfcr.stages.training import Ranks, TrainBatch, step_here
from gfcr.stages.update.batch_trace import micro_batch_record, save_step, saved_rollout
from gfcr.stages.update.by_gradients import number_groups, refine_shard, trajectory_gradient, write_back_advantages
from gfcr.stages.update.ranks import ShardOutcome, ShardSums
from gfcr.stages.update.tree_weights import shared_prefix_weights


@dataclass
class _Item:
    """One rollout of the batch, ready for the forward pass."""

    prompt_ids: list[int]
    rollout: Rollout
    advantage: float | np.ndarray  # scalar, or [T]
    weights: np.ndarray | None = None  # [T] float64 token weights; None: every token weighs 1
    group: RolloutGroup | None = None
    scale: float = 1.0  # the group's and the rollout's sample weight, which multiply the advantage
    index: int = -1  # its place among the forward items (for an estimator that weighs by gradients)
    slots: tuple[int, ...] = ()  # the places of its group's forward items, itself included
    forward_count: int = 0  # how many forward items the batch has

    def row(self) -> Row:
        n = len(self.rollout)
        weight = float(n) if self.weights is None else float(self.weights.sum())
        counted = n if self.weights is None else int((self.weights > 0).sum())
        g = self.group
        return Row(g.group_id if g else "", len(g.rollouts) if g else 1,
                   g.rewards if g else np.zeros(1), n, weight, counted)

    def counts(self) -> bool:
        """Some token of the rollout counts in the loss (an empty rollout counts, as before)."""
        return self.weights is None or bool(self.weights.any())

    def token_count(self) -> float | int:
        return len(self.rollout) if self.weights is None else float(self.weights.sum())

    def has_signal(self) -> bool:
        if isinstance(self.advantage, np.ndarray):
            live = self.advantage if self.weights is None else self.advantage * (self.weights > 0)
            return bool(np.any(live != 0.0))
        return self.advantage != 0.0 and self.counts()

    def advantage_abs(self) -> float:
        return float(np.mean(np.abs(self.advantage))) if isinstance(self.advantage, np.ndarray) else abs(self.advantage)


class GRPOUpdate:
    """Clipped-surrogate policy update from a registered estimator, loss, aggregation and correction."""

    class Config(StageConfig):
        reads_rewards: ClassVar[bool] = True  # a capability (gfcr.registry.ReadsRewards): its advantages read them
        # keys of earlier versions, and where they went (``gfcr validate`` says so; no before-validator,
        # which would turn off JSON-mode parsing of tuples)
        moved_keys: ClassVar[dict[str, str]] = {
            "clip": "the ratio clip belongs to the loss now: write `loss: {use: ppo_clip, with: {clip: [0.2, 0.28]}}` "
                    "(--set update.with.loss.with.clip=[0.2,0.28])",
            "loss_agg": "the aggregation is a component now: write `aggregation: {use: token_mean}` (`seq_mean` is "
                        "now `seq_mean_token_mean`; --set update.with.aggregation.use=seq_mean_token_mean)",
            "tis_cap": "the off-policy correction is a component now: write `correction: {use: tis, with: {cap: 2.0}}` "
                       "(--set update.with.correction.use=tis --set update.with.correction.with.cap=2.0)",
            "decoupled_clip": "the off-policy correction is a component now: write `correction: {use: decoupled_clip}` "
                              "(--set update.with.correction.use=decoupled_clip)",
            "recompute_old": "the off-policy correction is a component now: write `correction: {use: recompute_old}` "
                             "(--set update.with.correction.use=recompute_old)",
            "max_staleness": "the staleness limit belongs to the correction now: write `correction: {use: staleness, "
                             "with: {max_staleness: 4}}` (--set update.with.correction.use=staleness --set "
                             "update.with.correction.with.max_staleness=4), or give `tis`, `decoupled_clip` or "
                             "`recompute_old` a `max_staleness`",
        }

        lr: Annotated[float, Field(gt=0.0, description="AdamW learning rate (constant)")] = 1e-6
        advantage: AdvantageSpec = Field(AdvantageSpec(), description="advantage estimator: {use: <alias>, with: {...}}")
        loss: LossSpec = Field(LossSpec(), description="per-token policy loss: {use: <alias>, with: {...}}")
        aggregation: AggregationSpec = Field(AggregationSpec(), description="how token losses become one "
                                                                           "scalar: {use: <alias>, with: {...}}")
        correction: CorrectionSpec = Field(CorrectionSpec(), description="off-policy correction of stale tokens: "
                                                                        "{use: <alias>, with: {...}}")
        lr_rule: LrRuleSpec = Field(LrRuleSpec(), description="how each step's learning rate is scaled from its "
                                                              "batch: {use: <alias>, with: {...}}")
        kl_coef: Annotated[float, Field(ge=0.0, description="weight of the k3 KL to the initial policy")] = 0.0
        kl_clamp: Annotated[float, Field(gt=0.0)] | None = Field(
            None, description="clamp each token's KL estimate to [-c, c] (and its log-ratio to [-20, 20]): "
                              "10.0 is verl's low_var_kl; null: unclamped")
        max_grad_norm: Annotated[float, Field(gt=0.0)] | None = 1.0
        weight_decay: Annotated[float, Field(ge=0.0)] = 0.0
        betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's (beta1, beta2), each in [0, 1)")
        adam_eps: Annotated[float, Field(gt=0.0)] = 1e-8
        micro_batch_size: Annotated[int, Field(ge=1, description="rollouts per forward/backward pass")] = 16
        temperature: Annotated[float, Field(gt=0.0, description="the sampling temperature (log-probs are tempered)")] = 1.0
        save_batches: str | None = Field(None, description="a folder: each step's batch, the tensors its loss saw "
                                                           "and its losses, saved as JSON there "
                                                           "(gfcr.stages.update.batch_trace); null: nothing saved")

        @field_validator("betas")
        @classmethod
        def _betas_in_unit_interval(cls, betas: tuple[float, float]) -> tuple[float, float]:
            if not all(0.0 <= b < 1.0 for b in betas):  # torch's AdamW refuses them only when the run starts
                raise fixable(f"Adam's betas must each be in [0, 1), got {list(betas)}",
                              "write e.g. `betas: [0.9, 0.999]`; beta 1 or more never forgets, a negative one "
                              "flips the moment estimates")
            return betas

        def declared_correction(self) -> str | None:
            """The correction the author wrote (``correction: {use: ...}``), None when left to the default
            (``gfcr.registry.DeclaresCorrection``: a stale lifecycle needs one declared)."""
            return self.correction.use if "correction" in self.model_fields_set else None

    @staticmethod
    def check_pipeline(config: "GRPOUpdate.Config", view: Any) -> list[PipelineProblem]:
        """The components' pairings with each other and with the pipeline, and what the upstream
        stages need of the update (``view.update_needs``), for ``gfcr validate``."""
        fixing = view.configs.get(view.rollouts_from) if view.rollouts_from else None
        ctx = PairingContext(config.advantage.use, config.loss.use, config.aggregation.use,
                             view.rollouts_per_prompt, view.rollouts_from, view.upstream, config.correction.use,
                             declared(config.loss.component_class(), "token_corrections"),
                             fixing.group_size_setting if isinstance(fixing, FixesGroupSize) else None,
                             bool(view.having(BuildsTrees, upstream=True)), config.lr_rule.use)
        specs = (config.advantage, config.loss, config.aggregation, config.correction, config.lr_rule)
        return [p for spec in specs for p in spec.pairing_problems(ctx)] + unmet_needs(ctx, view)

    @staticmethod
    def sharding_problems(config: "GRPOUpdate.Config") -> list[PipelineProblem]:
        """What this Config asks for that trainer ranks with the policy sharded (``sharding: fsdp2``)
        cannot do (``gfcr.registry.TrainsSharded``): a per-trajectory gradient (one backward pass per
        trajectory, a different number on each rank) and a moving average of the policy's weights (a
        copy of the sharded model)."""
        problems = []
        if provides(config.advantage.build(), WeighsByGradients):
            problems.append(PipelineProblem(
                ("advantage", "use"), f"the estimator `{config.advantage.use}` weighs each trajectory by its own "
                                      "gradient, one backward pass per trajectory, and with `sharding: fsdp2` every "
                                      "backward pass is a collective of all the ranks",
                "remove `sharding` from the update's resources (replicated ranks), or choose another estimator"))
        if provides(config.correction.build(), KeepsProximalPolicy):
            problems.append(PipelineProblem(
                ("correction", "use"), f"the correction `{config.correction.use}` keeps a moving average of the "
                                       "policy's weights, a copy of the whole model, which sharded ranks do not hold",
                "remove `sharding` from the update's resources (replicated ranks), or choose another correction"))
        return problems

    def __init__(self, config: Config):
        self.config = config
        self.estimator = config.advantage.build()
        self.loss = config.loss.build()
        self.aggregation = config.aggregation.build()
        self.correction = config.correction.build()
        self.lr_rule = config.lr_rule.build()
        self.keeps_proximal = provides(self.correction, KeepsProximalPolicy)  # PPO-EWMA: a proximal policy of its own
        # else the ratio is against mu, as on-policy
        self.per_sequence = provides(self.correction, CorrectsSequences)  # verl's sequence-level IS
        self.off_policy = provides(self.correction, CorrectsTokens) or self.keeps_proximal or self.per_sequence
        self.by_gradients = provides(self.estimator, WeighsByGradients)  # VCPO's OPOB: advantages need ||g_i||
        self.policy: Policy | None = None
        self.optimizer: Any = None
        self.reference: Any = None

    def setup(self, lent: Lent) -> None:
        import torch

        cfg = self.config
        self.policy = lent.require_policy("update.grpo")
        if not lent.steps_optimizer:  # the runtime's trainer ranks each build this stage and step there
            return
        # the weights that train: all of them, or a LoRA adapter's alone (its base is frozen: docs/lora.md)
        groups = [{"params": [p for p in self.policy.model.parameters() if p.requires_grad]}]
        if provides(self.aggregation, LearnsParameters):  # param groups: [{"params": [...], "lr": ...}]
            groups += self.aggregation.parameters(next(self.policy.model.parameters()).device)
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps,
                                           weight_decay=cfg.weight_decay)
        if self.keeps_proximal:
            self.correction.attach(self.policy.model)
        if cfg.kl_coef > 0:
            self.reference = self.policy.reference()

    # --- the step (the Trains role: the runtime's trainer calls prepare, train_shard, finish) ----

    def run(self, groups: RolloutGroups, pool: PromptPool) -> UpdateReport:
        """One step in this process without the runtime (``gfcr.stages.training.step_here``): the
        policy's version and the engine's weights stay where they are. The runner never calls it:
        its trainer (``gfcr.runtime.training``) calls the three methods below and moves both."""
        return step_here(self, self._policy().version, groups, pool)

    def prepare(self, groups: RolloutGroups, pool: PromptPool) -> TrainBatch:
        """The batch: every rollout of the included groups with its advantage written onto it, the
        ones that enter the forward pass (``items``), the aggregation's plan over all of them, and
        the batch's metrics; skipped when nothing would move the weights."""
        policy = self._policy()
        items, batch_groups, zero_var = self._batch(groups, pool)
        n_rollouts, n_tokens = batch_denominators(items)
        metrics: dict[str, float] = {"batch_groups": batch_groups, "batch_rollouts": n_rollouts,
                                     "batch_tokens": n_tokens, "batch_zero_variance_groups": zero_var}
        plan = self.aggregation.plan([i.row() for i in items])
        if self.off_policy:
            metrics["off_policy_token_fraction"] = off_policy_fraction(items, policy.version)
        forward = [i for i in items if len(i.rollout) and (self._signal(i) or (self.config.kl_coef > 0 and i.counts()))]
        if self.by_gradients:
            number_groups(forward)
        skip = None if forward else "empty batch" if not items else "every advantage is zero"
        saved = self._saved_batch(items, forward) if self.config.save_batches else None
        return TrainBatch(forward, [len(i.rollout) for i in forward], plan, metrics, skip, policy.version, saved)

    def _saved_batch(self, items: list[_Item], forward: list[_Item]) -> dict[str, Any]:
        """What ``save_batches`` keeps of the batch before training (``gfcr.stages.update.batch_trace``)."""
        cfg, entered = self.config, {id(i) for i in forward}
        built = {"advantage": self.estimator, "loss": self.loss, "aggregation": self.aggregation,
                 "correction": self.correction, "lr_rule": self.lr_rule}
        components = {k: {"use": getattr(cfg, k).use, "with": c.config.model_dump(mode="json")}
                      for k, c in built.items()}  # every component's resolved Config, defaults included
        update = {**components, "micro_batch_size": cfg.micro_batch_size, "temperature": cfg.temperature,
                  "kl_coef": cfg.kl_coef}
        return {"update": update, "rollouts": [saved_rollout(i, id(i) in entered) for i in items]}

    def finish(self, batch: TrainBatch, shards: list[ShardOutcome]) -> UpdateReport:
        """The step's report from the shards' answers (in rank order; none when the batch was
        skipped). Its ``policy_version`` is the batch's; the trainer writes the version after."""
        metrics, forward = batch.metrics, batch.items
        if self.config.save_batches:
            save_step(self.config.save_batches, batch, shards)
        if batch.skip_reason is not None:
            return UpdateReport(batch.version, skipped=True, skip_reason=batch.skip_reason, metrics=metrics)
        outcome, loss = shards[0], shards[0].loss
        if self.by_gradients:  # the advantages the ranks weighed by gradients, onto the driver's rollouts
            write_back_advantages(forward, [s.advantages for s in shards])
        metrics.update(self._stats(ShardSums.merged([s.sums for s in shards]), forward, outcome.extra))
        if self.off_policy:  # pi_old as each rank computed it, onto the driver's rollouts
            _write_back_old_logprobs(forward, [s.old_logprobs for s in shards])
        if outcome.grad_norm is not None:
            metrics["grad_norm"] = outcome.grad_norm
        if outcome.skip_reason is not None:
            return UpdateReport(batch.version, skipped=True, skip_reason=outcome.skip_reason, loss=loss,
                                metrics=metrics)
        return UpdateReport(batch.version, len(forward), sum(len(i.rollout) for i in forward), loss=loss,
                            metrics=metrics)

    def train_shard(self, shard: list[_Item], plan: Any, version: int, ranks: Ranks) -> ShardOutcome:
        """This rank's part of one step: backward its ``shard`` against the whole batch's
        ``plan`` (rank 0 adds the aggregation's batch term), sum the gradients over the ranks,
        then clip and step, which every rank does alike, at the learning rate the ``lr_rule`` gives
        for this batch (restored after the step); then a correction with a proximal policy of its
        own follows the new weights. In one process ``shard`` is the batch."""
        advantages = self._weigh_by_gradients(shard, ranks) if self.by_gradients else None
        trace = [] if self.config.save_batches else None
        sums, loss, lr_totals = self.shard_gradients(shard, plan, version, ranks, trace)
        extra = self.aggregation.metrics() if provides(self.aggregation, ReportsStepMetrics) else {}
        factor, lr_metrics = self.lr_rule.factor(lr_totals)
        extra = {**extra, **lr_metrics}
        old = [i.rollout.old_logprobs for i in shard] if self.off_policy else None
        if not math.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            return ShardOutcome(sums, loss, None, f"non-finite loss ({loss})", old, extra, advantages, trace)
        grad_norm = self._clip_gradients()
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return ShardOutcome(sums, loss, grad_norm, f"non-finite gradient norm ({grad_norm})", old, extra,
                                advantages, trace)
        self._step_scaled(factor)
        self.optimizer.zero_grad(set_to_none=True)
        if self.keeps_proximal:
            self.correction.follow(self._policy().model)
        return ShardOutcome(sums, loss, grad_norm, None, old, extra, advantages, trace)

    def _step_scaled(self, factor: float) -> None:
        """One optimizer step with every param group's learning rate multiplied by ``factor``, then
        put back (VCPO's ``_optimizer_step_with_buffer``)."""
        if factor == 1.0:
            self.optimizer.step()
            return
        base = [g["lr"] for g in self.optimizer.param_groups]
        for g, lr in zip(self.optimizer.param_groups, base):
            g["lr"] = lr * factor
        try:
            self.optimizer.step()
        finally:
            for g, lr in zip(self.optimizer.param_groups, base):
                g["lr"] = lr

    def shard_gradients(self, shard: list[_Item], plan: Any, version: int, ranks: Ranks,
                        trace: list[dict[str, Any]] | None = None) -> tuple[ShardSums, float, list[float]]:
        """The first half of ``train_shard``: the gradients of the whole batch's loss, in every
        rank's ``.grad``, the loss (the batch term added on rank 0 only) and the learning-rate
        rule's sums over the whole batch (each micro-batch's record appended to ``trace``)."""
        passes = -(-len(shard) // self.config.micro_batch_size)
        idle = ranks.most(passes) - passes if ranks.sharded else 0  # agreed before any pass's collectives
        sums = self.backward(shard, plan, batch_term=ranks.rank == 0, trace=trace)
        for _ in range(idle):  # each pass is a collective of all the ranks: the less busy take empty ones
            self._idle_pass()
        loss, lr_totals = self._sum_over_ranks(sums.loss, ranks, sums.lr_sums)
        return sums, loss, lr_totals

    def _idle_pass(self) -> None:
        """A forward and backward pass that adds nothing to any gradient (a one-token row times 0),
        so that a rank with fewer micro-batches than another takes part in each pass's collectives."""
        import torch

        model = self._policy().model
        ids = torch.zeros((1, 1), dtype=torch.long, device=self._device())
        (model(input_ids=ids).logits.sum() * 0.0).backward()

    def _device(self) -> Any:
        return next(self._policy().model.parameters()).device

    def _sum_over_ranks(self, loss: float, ranks: Ranks, lr_sums: list[float]) -> tuple[float, list[float]]:
        """Sum every optimizer parameter's gradient, the loss and the learning-rate rule's sums over
        the ranks (SUM, not mean: each shard's loss is already divided by the whole batch's totals).
        A parameter no rank gave a gradient keeps none, so AdamW skips it as in one process."""
        import torch

        if ranks.world_size == 1:
            return loss, list(lr_sums)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if ranks.sharded:  # the policy's gradients were summed in the backward passes (FSDP2's reduce-scatter)
            policy = {id(p) for p in self._policy().model.parameters()}
            params = [p for p in params if id(p) not in policy]
        k = len(lr_sums)
        # [1 + k + P]: the loss, the lr rule's sums, then which parameters got a gradient
        scalars = torch.tensor([loss, *lr_sums] + [float(p.grad is not None) for p in params], dtype=torch.float64,
                               device=self._device())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        ranks.all_reduce_sum([p.grad for p in params] + [scalars])
        for p, got in zip(params, scalars[1 + k:].tolist()):
            if not got:
                p.grad = None
        return float(scalars[0]), scalars[1:1 + k].tolist()

    def _signal(self, item: _Item) -> bool:
        """Whether the item moves the weights: a non-zero advantage on a counted token; under an
        estimator that weighs by gradients, any counted rollout of a group whose rewards differ."""
        if not self.by_gradients:
            return item.has_signal()
        return item.counts() and item.group is not None and bool(np.ptp(item.group.rewards) > 0)

    def _weigh_by_gradients(self, shard: list[_Item], ranks: Ranks) -> list[float]:
        """Each shard item's advantage from its group's per-trajectory gradients (VCPO's OPOB;
        ``gfcr.stages.update.by_gradients``), written onto the items."""
        model, cfg = self._policy().model, self.config
        needs = bool(declared(self.loss, "needs_logprobs"))

        def measure(item: _Item) -> tuple[float, float, float, float]:
            return trajectory_gradient(model, item, self._ratio, self.loss, cfg.temperature, needs)

        return refine_shard(shard, measure, self.estimator, ranks, next(model.parameters()).device)

    def _policy(self) -> Policy:
        if self.policy is None:
            raise RuntimeError("update.grpo was not set up with a policy")
        return self.policy

    def _batch(self, groups: RolloutGroups, pool: PromptPool) -> tuple[list[_Item], int, int]:
        """Every rollout of the included groups, with its advantage written onto it."""
        policy, items = self._policy(), []
        included = [g for g in groups if g.verdict.included and g.rollouts]
        zero_var = 0
        estimates = estimate_all(self.estimator, included, pool)  # raises on unscored rollouts, naming the group
        for g, estimate in zip(included, estimates):
            zero_var += int(len(g.rollouts) > 1 and np.ptp(g.rewards) == 0)
            prompt_ids = prompt_tokens(policy, pool.get(g.prompt_id))
            tree = shared_prefix_weights(g)
            for index, (r, a) in enumerate(zip(g.rollouts, estimate.values)):
                r.advantage = _scaled(a, g.sample_weight * r.sample_weight)
                weights = self._token_weights(r, estimate.mask(index), tree.get(r.rollout_id), policy.version)
                items.append(_Item(r.context_token_ids or prompt_ids, r, r.advantage, weights, g,
                                   g.sample_weight * r.sample_weight))
        return items, len(included), zero_var

    def _token_weights(self, r: Rollout, estimator_mask: np.ndarray | None, tree: np.ndarray | None,
                       version: int) -> np.ndarray | None:
        """``[T]`` weights, or None when every token weighs 1 (the default path stays exact)."""
        # a trajectory's environment turns are never trained on (``Rollout.trained_mask``; None for one turn)
        factors = [m for m in (r.loss_mask, estimator_mask, r.trained_mask()) if m is not None]
        if tree is not None:
            factors.append(tree)
        kept = self.correction.keeps(r, version) if provides(self.correction, LimitsStaleness) else None
        if kept is not None:
            factors.append(kept)
        if not factors:
            return None
        weights = np.ones(len(r), dtype=np.float64)
        for f in factors:
            weights = weights * np.asarray(f, dtype=np.float64)
        return weights

    def backward(self, items: list[_Item], plan: Any, batch_term: bool,
                 trace: list[dict[str, Any]] | None = None) -> ShardSums:
        """Backward the loss of ``items`` in micro-batches (and, with ``batch_term``, the
        aggregation's once-a-step term); the aggregation divides by the whole batch's totals
        (``plan``), so leaving out zero-advantage rollouts changes nothing. Returns the sums the
        step's diagnostics are made of; with ``trace``, appends each micro-batch's tensors and loss
        to it (``save_batches``)."""
        import torch

        cfg = self.config
        sums = ShardSums()
        for start in range(0, len(items), cfg.micro_batch_size):
            chunk = items[start:start + cfg.micro_batch_size]
            logp, mask = response_logprobs(self._policy().model, chunk, cfg.temperature)  # [B, R]
            width, device = mask.shape[1], logp.device
            behaviour = padded([i.rollout.behavior_logprobs for i in chunk], width, device)  # [B, R]
            adv = _advantages(chunk, width, logp)  # [B, 1] or [B, R]
            weight = mask if all(i.weights is None for i in chunk) else mask * padded(
                [_ones_if_none(i) for i in chunk], width, device)  # [B, R]
            log_ratio, correction = self._ratio(chunk, logp, behaviour, weight)
            if correction is not None:
                sums.correction.add(correction, weight)
                _write_old_logprobs(chunk, logp)
            sums.lr_sums = _added(sums.lr_sums, self.lr_rule.sums(sequence_log_weights(logp, behaviour, weight)))
            extra = {"logprobs": logp.detach()} if declared(self.loss, "needs_logprobs") else {}
            terms = self.loss.terms(log_ratio, adv.expand_as(logp), weight, **extra)
            per_token = terms.per_token if not self.off_policy else terms.per_token * correction.weight
            if self.reference is not None:
                with torch.no_grad():
                    ref, _ = response_logprobs(self.reference, chunk, cfg.temperature)
                kl = k3_kl(ref, logp, cfg.kl_clamp)
                per_token = per_token + cfg.kl_coef * kl
                sums.kl += float((kl.detach() * weight).sum())
            loss = self.aggregation.reduce(per_token, weight, [i.row() for i in chunk], plan)
            loss.backward()
            sums.loss += float(loss.detach())
            if trace is not None:
                tensors = {"log_prob": logp, "old_log_prob": behaviour if correction is None else correction.proximal,
                           "behaviour_log_prob": behaviour, "advantage": adv.expand_as(logp), "weight": weight}
                if self.reference is not None:
                    tensors["ref_log_prob"] = ref
                trace.append(micro_batch_record([i.rollout.rollout_id for i in chunk], [len(i.rollout) for i in chunk],
                                                tensors, float(loss.detach())))
            with torch.no_grad():
                counted_mask = mask if weight is mask else (weight > 0).to(mask.dtype)
                sums.clipped += float((terms.clipped.to(mask.dtype) * counted_mask).sum())
                sums.ratio += float((terms.ratio * counted_mask).sum())
                sums.counted += int(counted_mask.sum())
        term = self.aggregation.batch_term(plan) if batch_term and provides(self.aggregation, AddsBatchTerm) else None
        if term is not None:
            term.backward()
            sums.loss += float(term.detach())
        return sums

    def _ratio(self, chunk: list[_Item], logp: Any, behaviour: Any, weight: Any) -> tuple[Any, Any]:
        """``(log_ratio, correction)`` of a micro-batch: against ``mu`` (no correction), or against
        the correction's proximal log-probs (its own proximal policy's, scored here, for PPO-EWMA;
        from the counted tokens ``weight``, for a sequence-level correction)."""
        import torch

        if not self.off_policy:
            return logp - behaviour, None
        width, device = logp.shape[1], logp.device
        stale = padded([i.rollout.staleness(self._policy().version) > 0 for i in chunk], width, device) > 0
        if self.keeps_proximal:
            with torch.no_grad():
                proximal, _ = response_logprobs(self.correction.proximal_model(), chunk, self.config.temperature)
            correction = self.correction.correct_with(logp, behaviour, stale, proximal)
        elif self.per_sequence:
            correction = self.correction.correct_sequences(logp, behaviour, stale, weight)
        else:
            correction = self.correction.correct(logp, behaviour, stale)
        return logp - correction.proximal, correction

    def _stats(self, sums: ShardSums, items: list[_Item], extra: dict[str, float]) -> dict[str, float]:
        """The step's diagnostics from the (merged) sums: the loss, and means over counted tokens."""
        counted = max(sums.counted, 1)
        stats = {"loss": sums.loss, "clip_fraction": sums.clipped / counted, "ratio_mean": sums.ratio / counted,
                 "advantage_abs_mean": float(np.mean([i.advantage_abs() for i in items]))}
        if self.config.kl_coef > 0:
            stats["kl"] = sums.kl / counted
        if self.off_policy:
            stats.update(sums.correction.metrics())
        stats.update(extra)
        return stats

    def _clip_gradients(self) -> float:
        import torch

        params = [p for p in self._policy().model.parameters() if p.grad is not None]
        if self.config.max_grad_norm is None:
            if params and _is_sharded(params[0].grad):  # the norm of the whole, over every rank's shard
                return _whole(torch.nn.utils.get_total_norm([p.grad for p in params]))
            norms = [p.grad.detach().norm() for p in params]
            return float(torch.stack(norms).norm()) if norms else 0.0
        return _whole(torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm))

    # --- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = {"optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}
        if isinstance(self.aggregation, Stateful):
            state["aggregation"] = self.aggregation.state_dict()
        if isinstance(self.correction, Stateful):  # PPO-EWMA's moving average
            state["correction"] = self.correction.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("aggregation") is not None and isinstance(self.aggregation, Stateful):
            self.aggregation.load_state_dict(state["aggregation"])
        if state.get("correction") is not None and isinstance(self.correction, Stateful):
            self.correction.load_state_dict(state["correction"])
        if state.get("optimizer") is not None and self.optimizer is not None:  # None where trainer ranks step
            self.optimizer.load_state_dict(state["optimizer"])


def _is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (a sharded parameter's or gradient's, under FSDP2)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _whole(norm: Any) -> float:
    """A gradient norm as a number; over sharded gradients (DTensors) the norm of the whole."""
    return float(norm.full_tensor() if _is_sharded(norm) else norm)


def unmet_needs(ctx: PairingContext, view: Any) -> list[PipelineProblem]:
    """What the upstream stages declared they need of the update (``view.update_needs``: for
    example ``replay.rollout_replay``'s ``decoupled_clip`` correction) and its components do not give."""
    aliases = dict(view.upstream)
    found = []
    for sid, need in view.update_needs:
        if ctx.chosen(need.key) not in need.allowed:
            found.append(PipelineProblem(
                (need.key, "use"), f"stage `{sid}` ({aliases[sid]}) {need.why}, and the update's {need.key} is "
                                   f"`{ctx.chosen(need.key)}`",
                f"set `{need.key}: {{use: {need.allowed[0]}}}` in the update's `with` (--set "
                f"update.with.{need.key}.use={need.allowed[0]})"))
    return found


def batch_denominators(items: list[_Item]) -> tuple[int, float | int]:
    """(responses that count, token weight of the batch): ``seq_mean`` and ``token_mean``
    divide by them."""
    n_rollouts = sum(1 for i in items if i.counts())
    if all(i.weights is None for i in items):
        return n_rollouts, sum(len(i.rollout) for i in items)
    return n_rollouts, float(sum(i.token_count() for i in items))


def off_policy_fraction(items: list[_Item], version: int) -> float:
    """The share of the batch's response tokens with staleness > 0 (before the staleness limit)."""
    total = sum(len(i.rollout) for i in items)
    stale = sum(int((i.rollout.staleness(version) > 0).sum()) for i in items)
    return stale / total if total else 0.0


def _scaled(advantage: float | np.ndarray, weight: float) -> float | np.ndarray:
    if isinstance(advantage, np.ndarray):
        return np.asarray(advantage, dtype=np.float64) * weight
    return float(advantage) * weight


def _ones_if_none(item: _Item) -> np.ndarray:
    return np.ones(len(item.rollout)) if item.weights is None else item.weights


def _advantages(chunk: list[_Item], width: int, like: Any) -> Any:
    """``[B, 1]`` scalar advantages, or ``[B, R]`` when any rollout has per-token ones."""
    import torch

    if not any(isinstance(i.advantage, np.ndarray) for i in chunk):
        return torch.tensor([i.advantage for i in chunk], dtype=like.dtype, device=like.device)[:, None]
    rows = [i.advantage if isinstance(i.advantage, np.ndarray) else np.full(len(i.rollout), i.advantage)
            for i in chunk]
    return padded(rows, width, like.device).to(like.dtype)


def _write_back_old_logprobs(items: list[_Item], shards: list[list[Any] | None]) -> None:
    """``pi_old`` of each item, in the shards' order (which is the items')."""
    old = [o for shard in shards for o in (shard or [])]
    for item, o in zip(items, old, strict=True):
        item.rollout.old_logprobs = o


def _added(total: list[float], sums: Any) -> list[float]:
    """``total`` plus a rule's ``[k]`` sums of one micro-batch."""
    values = [float(v) for v in sums.tolist()]
    return values if not total else [a + b for a, b in zip(total, values, strict=True)]


def _write_old_logprobs(chunk: list[_Item], logp: Any) -> None:
    old = logp.detach().cpu().numpy()
    for b, item in enumerate(chunk):
        item.rollout.old_logprobs = old[b, :len(item.rollout)].astype(np.float32)


