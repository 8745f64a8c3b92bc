"""control.depo: before rollout, predict which prompts would give a zero-variance group (all
correct or all wrong) and skip them, filling the batch from an oversized candidate batch.

Which DEPO: this stage implements DEPO, Difficulty-Estimated Policy Optimization (arXiv
2602.06375, Alibaba), which predicts zero-variance groups *before* rollout and skips those
prompts. It is not arXiv 2605.05802, a different method that predicts zero-variance groups
*during* rollout (from the partial responses), and not "Data-Efficient Policy Optimization"
(arXiv 2509.01321). Pruning during rollout is an in-flight controller in gfcr
(``control.early_exit``, ARRoL-style); nothing here follows 2605.05802.

DEPO (arXiv 2602.06375). **Abstract-only** (and a third-party summary): an
online difficulty estimator (a BERT-style encoder with two heads, trained against the actor's
outcomes with advantage-estimation, distillation and ranking losses) predicts which prompts
would yield no learning signal and drops them *before* rollout; the abstract claims up to 2x
lower rollout cost than DAPO. Thresholds, update cadence and loss weights are not disclosed:
**the estimator and every threshold below are our choices**, listed under Deviations.

The estimator (``success_predictor``, shared with ``control.gps``): a predicted success rate
``p_hat_i = (kappa p_model(i) + S_i) / (kappa + N_i)`` from a logistic model on the policy's
mean-pooled prompt embedding (one forward pass per prompt, once, charged to ``tokens_scored``),
fitted online after every step on the observed groups, anchored on the prompt's own decayed
evidence ``S_i`` of ``N_i``. With ``G = group_size`` independent rollouts the predicted chance
that the group is zero-variance is

    z_i = p_hat_i ** G + (1 - p_hat_i) ** G

A call at step ``t``:

1. takes the next ``candidate_ratio * batch_size`` prompts of a seeded per-epoch permutation
   (``control.uniform``'s epochs);
2. walks them in that order: once ``batch_size`` are kept the rest are ``batch_full``
   (not rolled out); a candidate with ``z_i >= threshold`` is predicted zero-variance and
   skipped (``predicted_all_correct`` when ``p_hat_i >= 0.5``, else ``predicted_all_wrong``)
   unless its visit draw ``u ~ U[0, 1)`` (seeded by ``(seed, epoch, t, crc32(prompt_id))``)
   is below ``explore``: then it is kept (``explore``), so that a wrong prediction can be
   corrected by a new group; any other candidate is kept (``predicted_informative``);
3. each kept prompt gets ``n_rollouts`` (default 1; put ``control.fixed_n`` with ``n = G``
   downstream; ``gfcr validate`` checks that every ``control.fixed_n`` uses ``G``).

When fewer than ``batch_size`` candidates survive, the step trains on fewer prompts (the
rollouts saved are the point); raise ``candidate_ratio`` to fill it more often.

Every candidate is listed; its ``ControlReason`` has the code above, ``zero_variance_probability``
(``z_i``) as the decisive number, and ``predicted_success``, ``model_prediction``,
``evidence_trials``, ``threshold`` and (for a prediction of zero variance) the ``draw``.

``step_metrics`` (``stages.<id>``): ``candidates``, ``kept``, ``skipped_easy``, ``skipped_hard``,
``explored``, ``batch_full``, ``short`` (``batch_size`` minus kept, when positive), the kept
prompts' mean ``predicted_success`` and ``predicted_zero_variance``, the candidates' mean
``candidate_zero_variance``, ``embedded_prompts`` / ``embedding_tokens``, ``train_pairs``,
``train_loss``, and, for the previous step's groups (how right the estimator was):
``informative_zero_variance`` (the fraction of groups predicted informative that came out
zero-variance) and ``explored_zero_variance`` (the same among the explored ones, whose
prediction was zero variance).

Deviations:
- Abstract only; every rule is our reading. **Estimator**: the paper's BERT-style encoder with
  two heads and three losses is replaced by the logistic model on frozen policy embeddings
  plus per-prompt evidence of ``control.gps`` (one head: the success rate; the zero-variance
  probability follows from it under independent rollouts). Its defaults (``kappa = 4``,
  ``lambda = 0.5``, window 512, 50 gradient steps of 0.5 after every step) are guesses.
- **Skip, not down-weight**: the abstract drops predicted zero-variance prompts before
  rollout, which is where the rollout cost is saved; down-weighting would still pay for them.
- **Threshold** ``0.5``: skip when a zero-variance group is predicted more likely than not
  (with ``G = 8``: ``p_hat >= 0.917`` or ``<= 0.083``). A guess; a prompt with no history
  and the untrained model (``p_hat = 0.5``) is never skipped.
- **Exploration** ``explore = 0.1``: not in the abstract; without it a prompt predicted
  zero-variance is never rolled out again and its prediction never corrected (GRESO keeps a
  1% floor for the same reason).
- Oversized candidate batch (``candidate_ratio = 2``) to make up for skips, as MoPPS and GRESO
  do; the unexamined remainder of a full batch is consumed with the epoch.
- Only judged rollouts count; groups of earlier steps (replayed) are ignored.

Fidelity: from the abstract: no public code (arXiv 2602.06375: code "upon acceptance"); the
rules above are this stage's reading. (arXiv 2605.05802, the during-rollout method, is not
implemented.)

Example (embeddings given by hand; a run computes them):

>>> import numpy as np
>>> from gfcr.records import Prompt, PromptPool, StepContext
>>> pool = PromptPool([Prompt(f"p:{i}", text=str(i)) for i in range(4)])
>>> stage = Depo(Depo.Config(batch_size=2, candidate_ratio=2, seed=0, explore=0.0))
>>> stage.use_embeddings([p.prompt_id for p in pool], np.eye(4))
>>> stage.estimator.set_evidence("p:0", successes=40.0, trials=40.0)  # p_hat = (4 * 0.5 + 40) / 44
>>> stage.before_step(StepContext("run", step=0, seed=0, policy_version=0))
>>> alloc = stage.run(pool)  # the epoch's order: p:2, p:0, p:1, p:3; z(p:0) = 0.689
>>> [e.prompt_id for e in alloc], [e.n_rollouts for e in alloc]
(['p:2', 'p:0', 'p:1', 'p:3'], [1, 0, 1, 0])
>>> [e.why.code for e in alloc]
['predicted_informative', 'predicted_all_correct', 'predicted_informative', 'batch_full']

YAML:

.. code-block:: yaml

    stages:
      pick:   {use: control.depo, with: {batch_size: 16, candidate_ratio: 2, group_size: 8, threshold: 0.5}}
      budget: {use: control.fixed_n, from: pick, with: {n: 8}}
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Sequence

import numpy as np
from pydantic import Field

from gfcr.records import Allocation, AllocationEntry, ControlReason, Prompt, PromptPool, StepContext, StepReport
from gfcr.registry import FixesGroupSize, PipelineProblem, Seed
from gfcr.stages.common.epochs import epoch_order, start_batch
from gfcr.stages.common.prompt_stats import visit_draw
from gfcr.stages.common.run_context import RunContext
from gfcr.stages.control.success_predictor import PredictorConfig, SuccessEstimator, zero_variance_probability
from gfcr.stages.resources import Lent

ALIAS = "control.depo"
KEPT = ("predicted_informative", "explore")


def decide(p_hat: float, z: float, draw: float, kept: int, batch_size: int, threshold: float,
           explore: float) -> str:
    """The code of one candidate's decision (see the module docstring, step 2)."""
    if kept >= batch_size:
        return "batch_full"
    if z < threshold:
        return "predicted_informative"
    if draw < explore:
        return "explore"
    return "predicted_all_correct" if p_hat >= 0.5 else "predicted_all_wrong"


class Depo:
    """DEPO: skip prompts an online estimator predicts to give zero-variance groups."""

    class Config(PredictorConfig):
        batch_size: Annotated[int, Field(ge=1, description="prompts kept per call (at most)")]
        candidate_ratio: Annotated[int, Field(ge=1, description=(
            "candidates per call as a multiple of batch_size, from a seeded per-epoch permutation"))] = 2
        group_size: Annotated[int, Field(ge=1, description=(
            "G: rollouts per prompt downstream (control.fixed_n's n), in z = p^G + (1 - p)^G"))] = 8
        threshold: Annotated[float, Field(gt=0.0, le=1.0, description=(
            "skip a candidate whose predicted zero-variance probability z is at least this"))] = 0.5
        explore: Annotated[float, Field(ge=0.0, le=1.0, description=(
            "chance that a candidate predicted zero-variance is kept anyway (its prediction gets checked)"))] = 0.1
        n_rollouts: Annotated[int, Field(ge=1, description="rollouts marked per kept prompt")] = 1
        seed: Seed | None = Field(None, description="permutation and exploration seed; default: the run's seed")

    @staticmethod
    def check_pipeline(config: "Depo.Config", view: Any) -> list[PipelineProblem]:
        """Every stage of the pipeline that fixes the group size must give groups of ``group_size``."""
        out = []
        for sid, other in view.having(FixesGroupSize):
            if other.rollouts_per_prompt != config.group_size:
                n = other.rollouts_per_prompt
                out.append(PipelineProblem(("group_size",), (
                    f"control.depo predicts zero-variance groups of group_size {config.group_size}, and `{sid}` "
                    f"({view.aliases[sid]}) rolls out {n} per prompt"),
                    f"set the same size on both (`--set stages.<this stage>.with.group_size={n}`)"))
        return out

    def __init__(self, config: Config):
        self.config = config
        self.estimator = SuccessEstimator(ALIAS, config)
        self.epoch, self.cursor = 0, 0
        self.kept_codes: dict[str, str] = {}  # this step's kept prompts and why, for the check after rollout
        self.checked: dict[str, float] = {}  # the previous step's check (informative / explored zero-variance)
        self.run_ctx = RunContext(config.seed)
        self._metrics: dict[str, float] = {}
        self._kept_numbers: list[tuple[float, float]] = []
        self._candidate_z: list[float] = []

    def setup(self, lent: Lent) -> None:
        self.run_ctx.setup(lent, ALIAS, policy=True)

    def before_step(self, ctx: StepContext) -> None:
        self.run_ctx.before_step(ctx)
        self.kept_codes = {}
        self._metrics = dict.fromkeys(("candidates", "kept", "skipped_easy", "skipped_hard", "explored", "batch_full",
                                       "embedded_prompts", "embedding_tokens"), 0)
        self._kept_numbers, self._candidate_z = [], []

    def use_embeddings(self, prompt_ids: Sequence[str], vectors: np.ndarray) -> None:
        """Give embeddings by hand (a run computes them with the policy)."""
        self.estimator.embeddings.add(prompt_ids, vectors)
        self.estimator.ensure([], None, None)

    def run(self, pool: PromptPool) -> Allocation:
        cfg, est = self.config, self.estimator
        embedded, tokens = est.ensure(list(pool), self.run_ctx.policy, self.run_ctx.lent)
        self._metrics["embedded_prompts"] += embedded
        self._metrics["embedding_tokens"] += tokens
        m = cfg.candidate_ratio * cfg.batch_size
        self.epoch, self.cursor = start_batch(self.epoch, self.cursor, m, len(pool))
        order = epoch_order(self.run_ctx.seed, self.epoch, len(pool))[self.cursor : self.cursor + m]
        self.cursor += m
        candidates = [pool[int(i)] for i in order]
        p_hat, p_model, trials = est.predict([p.prompt_id for p in candidates])
        z = zero_variance_probability(p_hat, cfg.group_size)
        entries, kept = [], 0
        for i, prompt in enumerate(candidates):
            entry = self._entry(prompt, float(p_hat[i]), float(p_model[i]), float(trials[i]), float(z[i]), kept)
            kept += entry.n_rollouts > 0
            entries.append(entry)
        self._metrics["candidates"] += len(candidates)
        self._candidate_z.extend(float(v) for v in z)
        return Allocation(step=self.run_ctx.step, entries=tuple(entries))

    def _entry(self, prompt: Prompt, p_hat: float, p_model: float, trials: float, z: float,
               kept: int) -> AllocationEntry:
        cfg = self.config
        draw = visit_draw(self.run_ctx.seed, self.epoch, self.run_ctx.step, prompt.prompt_id)
        code = decide(p_hat, z, draw, kept, cfg.batch_size, cfg.threshold, cfg.explore)
        numbers = {"predicted_success": p_hat, "model_prediction": p_model, "evidence_trials": trials,
                   "threshold": cfg.threshold}
        if z >= cfg.threshold and code != "batch_full":
            numbers["draw"] = draw
        why = ControlReason(code, "zero_variance_probability", z, numbers)
        detail = f"predicted success {p_hat:.4f}, zero-variance probability {z:.4f}"
        counter = {"predicted_all_correct": "skipped_easy", "predicted_all_wrong": "skipped_hard",
                   "explore": "explored", "batch_full": "batch_full"}.get(code)
        if counter:
            self._metrics[counter] += 1
        if code not in KEPT:
            return AllocationEntry(prompt, 0, reason=f"depo: {code.replace('_', ' ')} ({detail})", why=why)
        self._metrics["kept"] += 1
        self.kept_codes[prompt.prompt_id] = code
        self._kept_numbers.append((p_hat, z))
        return AllocationEntry(prompt, cfg.n_rollouts, reason=f"depo: {code.replace('_', ' ')} ({detail})", why=why)

    def step_metrics(self) -> dict[str, float]:
        est, out = self.estimator, dict(self._metrics)
        out["epoch"] = self.epoch
        out["short"] = max(self.config.batch_size - out["kept"], 0)
        if self._kept_numbers:
            out["predicted_success"] = float(np.mean([p for p, _ in self._kept_numbers]))
            out["predicted_zero_variance"] = float(np.mean([z for _, z in self._kept_numbers]))
        if self._candidate_z:
            out["candidate_zero_variance"] = float(np.mean(self._candidate_z))
        out["train_pairs"] = len(est.window)
        if not np.isnan(est.last_loss):
            out["train_loss"] = est.last_loss
        out.update(self.checked)
        return out

    def observe(self, report: StepReport) -> None:
        seen = self.estimator.observe(report.groups, report.step, self.run_ctx.policy_version)
        self.checked = {}
        for code, key in (("predicted_informative", "informative_zero_variance"),
                          ("explore", "explored_zero_variance")):
            flags = [s in (0, n) for pid, s, n in seen if self.kept_codes.get(pid) == code]
            if flags:
                self.checked[key] = float(np.mean(flags))

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable data: the position in the epoch, the estimator (weights,
        window, per-prompt evidence, ids of the cached embeddings) and the latest check."""
        return {"epoch": self.epoch, "cursor": self.cursor, "estimator": self.estimator.state_dict(),
                "checked": dict(self.checked)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.estimator.load_state_dict(state["estimator"])
        self.checked = {k: float(v) for k, v in state["checked"].items()}

    def save_files(self, directory: Path) -> None:
        self.estimator.save_files(directory)

    def load_files(self, directory: Path) -> None:
        self.estimator.load_files(directory)
