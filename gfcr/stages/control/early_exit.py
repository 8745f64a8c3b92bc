"""control.early_exit: ARRoL-style online rollout pruning (an in-flight controller).

ARRoL (arXiv 2603.24840, ACL 2026; the repository is README-only, so every rule below that the
abstract leaves open is a choice made here, listed under Deviations): rollouts are checked at a
checkpoint length; a lightweight quality head, trained on the fly from the final rewards of
finished rollouts, predicts each partial's success; partials are pruned so that the survivors'
positive ratio moves toward a target (about 0.5), with oversampling so the groups keep their size.

The rule, per group (the rows of one request; the allocation gives each prompt ``n`` rows, more
than ``keep``: ``control.fixed_n`` with ``n: 16`` and ``keep: 8`` is 2x oversampling):

1. **checkpoint**: once every row of the group has ``at_tokens`` new tokens or has ended, each
   running row is a candidate. Its feature is the policy's last-layer hidden state, mean-pooled
   over the partial response (``fingerprints`` with layer -1: one forward pass over prompt and
   partial, no gradients, charged to the step's ``tokens_scored``), standardised over the head's
   training examples;
2. **predict**: ``p = sigmoid(w . x + b)`` (``LogisticSuccess``, the predictor ``control.gps``
   uses), or no pruning at all while the head has fewer than ``min_examples`` labelled examples;
3. **prune**: the group keeps ``slots = max(0, keep - ended)`` of its candidates (rows that ended
   before the checkpoint are kept: pruning them saves nothing): the ``round(target_ratio * slots)``
   with the highest ``p`` and the ``slots - round(target_ratio * slots)`` with the lowest ``p``,
   so the survivors' predicted positive ratio is pulled toward ``target_ratio`` from both ends;
   the rest are pruned (finish ``pruned``, kept on the record);
4. **learn**: after the step (``observe``), each candidate that survived and was scored gives an
   example ``(x, correct)``; the head is refitted on the latest ``train_window`` examples
   (``fit_steps`` gradient steps, warm start). The head, its examples and its calibration
   counts are checkpointed.

Pair it with ``filter.finish_reason`` (``reasons: [pruned], action: drop``) after the generate
stage, so pruned partials leave their groups before the verifier and the update (they would
otherwise score as wrong answers): ``pipelines/early_exit_arith.yaml``. It supports hosts whose
rollout ids are ``<request id>/<row>`` (``generate.sample``).

Metrics per step: ``checked`` (candidates), ``pruned``, ``head_examples`` and ``head_ready`` (1
once it prunes), and, over the labelled survivors of the steps before (the step's own labels
arrive after its metrics), ``predicted_mean``, ``realised_mean`` and ``brier``. The calibration
(10 bins of ``p``: count, sums of predicted and of realised) is in the checkpointed state,
``calibration``.

Deviations (choices the abstract leaves open, seed_methods 2.16):

- when to prune: at a fixed new-token count ``at_tokens`` (required, no default: the paper's is not
  public), once per group, when all its rows reach it;
- the head's input: the last decoder layer's hidden state mean-pooled over the partial; its model:
  logistic regression (the abstract says "lightweight"); its loss: the log-loss on ``correct``;
- how the survivors are chosen: the highest- and lowest-``p`` candidates in the target proportion
  (the abstract says only "steer survivors toward a target positive ratio");
- the group size: ``keep`` survivors per group, with the oversampling set by the allocation;
- the head's test-time voting use is not implemented.

Fidelity: from the abstract: no public code (Hsu1023/ARRoL holds a README only); the rules above
are this stage's reading.

Example (a head with enough examples, a group of 4 rows at the checkpoint, keep 2, target 0.5:
the most and the least promising survive):

>>> import numpy as np
>>> from gfcr.stages.engine import InFlightView, LiveRow
>>> stage = EarlyExit(EarlyExit.Config(at_tokens=2, keep=2, min_examples=0))
>>> stage._features = lambda rows, view: np.array([[2.0], [0.5], [-1.0], [-3.0]])[:len(rows)]
>>> stage.head.weights, stage.head.bias = np.array([1.0]), 0.0
>>> stage.center, stage.scale = np.zeros(1), np.ones(1)
>>> rows = tuple(LiveRow("g", i, (1, 2), np.zeros(2), None, None) for i in range(4))
>>> steer = stage.steer(InFlightView(2, rows, {"g": 4}))
>>> sorted(k[1] for k in steer.prune)
[1, 2]

YAML:

.. code-block:: yaml

    prune:   {use: control.early_exit, with: {at_tokens: 4, keep: 8}}
    rollout: {use: generate.sample, from: budget, in_flight: [prune], with: {max_new_tokens: 8}}
    gone:    {use: filter.finish_reason, from: rollout, with: {reasons: [pruned], action: drop}}
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Sequence

import numpy as np
from pydantic import Field

from gfcr.records import StepReport
from gfcr.registry import DropsFinishes, FixesGroupSize, PipelineProblem, StageConfig
from gfcr.stages.common.fingerprints import FORWARDS_POLICY, fingerprints
from gfcr.stages.control.success_predictor import LogisticSuccess
from gfcr.stages.engine import InFlightView, LiveRow, Steer
from gfcr.stages.resources import Policy, Lent

BINS = 10


class EarlyExit:
    """Prune partial rollouts at a checkpoint length by a learned success head (ARRoL)."""

    every: int = 1  # decode steps between steer calls (the in-flight controller role)

    class Config(StageConfig):
        sync_only: ClassVar[str] = FORWARDS_POLICY  # the partials' features (gfcr.registry.NeedsSyncLifecycle)
        at_tokens: Annotated[int, Field(ge=1, description="the checkpoint: new tokens a row has when it is checked")]
        keep: Annotated[int, Field(ge=1, description="rows kept per group (the allocation oversamples above it)")]
        target_ratio: Annotated[float, Field(ge=0.0, le=1.0, description=(
            "the survivors' positive ratio to steer toward (ARRoL: about 0.5)"))] = 0.5
        min_examples: Annotated[int, Field(ge=0, description="labelled examples the head needs before it prunes")] = 64
        train_window: Annotated[int, Field(ge=1, description="latest examples the head is fitted on")] = 2048
        fit_steps: Annotated[int, Field(ge=0, description="gradient steps of the head after every step")] = 100
        learning_rate: Annotated[float, Field(gt=0.0, description="gradient step size of the head")] = 0.5
        l2: Annotated[float, Field(ge=0.0, description="L2 penalty on the head's weights")] = 1e-3

    @staticmethod
    def check_pipeline(config: "EarlyExit.Config", view: Any) -> list[PipelineProblem]:
        """Pruned rows must leave their groups (a ``filter.finish_reason`` dropping ``pruned``), and
        a fixed group size (``control.fixed_n``) must give more rows than ``keep``, or nothing is pruned."""
        found = []
        drops = [sid for sid, other in view.having(DropsFinishes) if "pruned" in other.dropped_finishes]
        if not drops:
            found.append(PipelineProblem(
                ("keep",), "the rows this controller prunes stay in their groups: no "
                "`filter.finish_reason` drops `pruned` rollouts, so the verifier would score the "
                "pruned partials as wrong answers and the update would train on them",
                "add `gone: {use: filter.finish_reason, from: rollout, with: {reasons: [pruned], "
                "action: drop}}` after the generate stage and read from it"))
        for sid, other in view.having(FixesGroupSize):
            if other.rollouts_per_prompt > config.keep:
                continue
            key, _, above = other.group_size_setting(config.keep).partition("=")
            found.append(PipelineProblem(("keep",), f"`keep: {config.keep}` leaves nothing to prune: `{sid}` "
                                         f"({view.aliases[sid]}) allocates {other.rollouts_per_prompt} rows a prompt",
                                         f"oversample: set `{sid}`'s `{key}` above {above} (ARRoL's 2x: "
                                         f"{other.group_size_setting(2 * config.keep).partition('=')[2]}), "
                                         "or lower `keep`"))
        return found

    def __init__(self, config: Config):
        self.config = config
        self.policy: Policy | None = None
        self.lent: Lent | None = None
        self.head = LogisticSuccess(0)
        self.examples: list[tuple[np.ndarray, float]] = []  # (feature, correct), oldest first
        self.center = self.scale = np.zeros(0)
        self.calibration = np.zeros((BINS, 3))  # per bin of p: count, sum of p, sum of correct
        self.squared_error = 0.0  # sum of (p - correct)^2 over the calibration's examples
        self._decided: set[str] = set()
        self._pending: dict[str, tuple[np.ndarray, float]] = {}  # rollout id -> (feature, p), this step
        self._step = {"checked": 0, "pruned": 0}

    def setup(self, lent: Lent) -> None:
        self.lent = lent
        self.policy = lent.require_policy("control.early_exit")

    @property
    def ready(self) -> bool:
        return len(self.examples) >= self.config.min_examples and len(self.head.weights) > 0

    def steer(self, view: InFlightView) -> Steer:
        by_group: dict[str, list[LiveRow]] = {}
        for row in view.rows:
            by_group.setdefault(view.group_of(row.request_id), []).append(row)
        due = [(g, rows) for g, rows in by_group.items() if g not in self._decided and all(
            r.finish_reason is not None or len(r.token_ids) >= self.config.at_tokens for r in rows)]
        if not due:
            return Steer()
        candidates = [r for _, rows in due for r in rows if r.finish_reason is None]
        x = self._features(candidates, view) if candidates else np.zeros((0, 0))
        p = self._predict(x)
        by_key = {(r.request_id, r.sample_index): (xi, pi) for r, xi, pi in zip(candidates, x, p)}
        prune = []
        for g, rows in due:
            self._decided.add(g)
            live = [r for r in rows if r.finish_reason is None]
            for r in live:
                self._pending[f"{r.request_id}/{r.sample_index}"] = by_key[(r.request_id, r.sample_index)]
            if self.ready:
                prune += self._choose(live, [by_key[(r.request_id, r.sample_index)][1] for r in live],
                                      slots=max(0, self.config.keep - (len(rows) - len(live))))
        why = {key: f"control.early_exit: predicted success {by_key[key][1]:.3f} at token {self.config.at_tokens}, "
                    f"outside the kept highest and lowest predictions of its group" for key in prune}
        self._step["checked"] += len(candidates)
        self._step["pruned"] += len(prune)
        for key in prune:
            self._pending.pop(f"{key[0]}/{key[1]}", None)
        return Steer(prune=tuple(prune), why=why)

    def _choose(self, live: list[LiveRow], p: list[float], slots: int) -> list[tuple[str, int]]:
        """The keys to prune: all but the ``k_pos`` highest-p and ``slots - k_pos`` lowest-p rows."""
        if len(live) <= slots:
            return []
        order = sorted(range(len(live)), key=lambda i: (-p[i], i))  # ties: the earlier row first
        k_pos = int(round(self.config.target_ratio * slots))
        kept = set(order[:k_pos]) | set(order[len(order) - (slots - k_pos):] if slots - k_pos else ())
        return [(live[i].request_id, live[i].sample_index) for i in range(len(live)) if i not in kept]

    def _features(self, rows: Sequence[LiveRow], view: InFlightView) -> np.ndarray:
        if not view.contexts:
            raise RuntimeError("control.early_exit needs the engine's view of each row's context "
                               "(InFlightView.contexts); its host engine does not give it")
        pairs = [(view.contexts[r.request_id], r.token_ids) for r in rows]
        policy = self.policy
        if self.lent is not None:
            self.lent.charge_scoring(sum(len(c) + len(t) for c, t in pairs))
        tok = policy.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return fingerprints(policy.model, pairs, pad, [-1]).astype(np.float64)

    def _predict(self, x: np.ndarray) -> np.ndarray:
        if not self.ready or not len(x):
            return np.full(len(x), np.nan)
        return self.head.predict(self._standardise(x))

    def _standardise(self, x: np.ndarray) -> np.ndarray:
        return (x - self.center) / self.scale / np.sqrt(x.shape[1])

    def before_step(self, ctx: Any) -> None:
        self._decided.clear()
        self._pending.clear()
        self._step = {"checked": 0, "pruned": 0}

    def observe(self, report: StepReport) -> None:
        labelled = []
        for group in report.groups:
            for r in group.generated:
                seen = self._pending.get(r.rollout_id)
                if seen is not None and r.reward is not None and r.status.value in ("completed", "truncated"):
                    labelled.append((seen[0], seen[1], float(bool(r.correct))))
        for _, p, y in labelled:
            if not np.isnan(p):
                self.calibration[min(int(p * BINS), BINS - 1)] += (1.0, p, y)
                self.squared_error += (p - y) ** 2
        self.examples = (self.examples + [(x, y) for x, _, y in labelled])[-self.config.train_window:]
        self._fit()

    def _fit(self) -> None:
        if not self.examples:
            return
        x = np.stack([e[0] for e in self.examples])
        y = np.array([e[1] for e in self.examples])
        self.center, self.scale = x.mean(0), np.where(x.std(0) > 0, x.std(0), 1.0)
        if len(self.head.weights) != x.shape[1]:
            self.head = LogisticSuccess(x.shape[1])
        self.head.fit(self._standardise(x), y, np.ones(len(y)), self.config.fit_steps, self.config.learning_rate,
                      self.config.l2)

    def step_metrics(self) -> dict[str, float]:
        """This step's checks and prunes; the head's state and calibration as of the step's start
        (the step's own labels arrive after the metrics are read, in ``observe``)."""
        count, p_sum, y_sum = self.calibration.sum(0)
        out = {**self._step, "head_ready": float(self.ready), "head_examples": float(len(self.examples))}
        if count:
            out.update(predicted_mean=float(p_sum / count), realised_mean=float(y_sum / count),
                       brier=float(self.squared_error / count))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"head": self.head.state_dict(), "features": np.stack([e[0] for e in self.examples])
                if self.examples else np.zeros((0, 0)), "labels": np.array([e[1] for e in self.examples]),
                "center": self.center, "scale": self.scale, "calibration": self.calibration,
                "squared_error": self.squared_error}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.head = LogisticSuccess(0)
        self.head.load_state_dict(state["head"])
        feats, labels = np.asarray(state["features"], np.float64), np.asarray(state["labels"], np.float64)
        self.examples = [(feats[i], float(labels[i])) for i in range(len(labels))]
        self.center, self.scale = np.asarray(state["center"]), np.asarray(state["scale"])
        self.calibration = np.asarray(state["calibration"], np.float64)
        self.squared_error = float(state["squared_error"])
