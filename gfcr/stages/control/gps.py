"""control.gps: score every prompt of the pool, including prompts never rolled out, with a small
predictor of success shared across prompts (embedding plus the prompt's own history), and
pick a batch of intermediate predicted difficulty that stays away from what was recently picked.

GPS, Generalizable Predictive Prompt Selection (arXiv 2602.01970; the group of MoPPS and
TRACE). **Abstract-only**: the abstract describes "a lightweight generative model trained on
the shared optimization history" whose "history-conditioned prior" lets it predict the
difficulty of prompts never rolled out, and a batch acquisition combining "intermediate-
difficulty prioritization" with "history-anchored diversity". The model, the acquisition
formula and the diversity kernel below are **our choices**, each listed under Deviations.

The predictor (``success_predictor``, shared with ``control.depo``):

- every pool prompt is embedded once (the first call that sees it) by the policy: the mean
  over its prompt tokens of the last hidden state, one forward pass, charged to the step's
  ``tokens_scored`` (the embedding ``control.dots`` uses; saved with each checkpoint);
- ``p_model(i) = sigmoid(w . x_i + b)`` on the standardised embedding ``x_i``, one model for
  all prompts, fitted online after every step by ``fit_steps`` gradient steps on the binomial
  log-loss of the last ``train_window`` observed ``(prompt, s correct of n)`` groups;
- the prompt's own history anchors it: ``p_hat_i = (kappa p_model(i) + S_i) / (kappa + N_i)``
  with ``S_i`` / ``N_i`` its successes / trials decayed by ``lambda`` at each new group
  (``p_hat = p_model`` for a prompt never rolled out).

A call at step ``t`` (candidates: every pool prompt, less those chosen by earlier loop rounds
of the step), in a seeded order (a permutation by ``(seed, t)``: it breaks ties, and at the
first step, when every prediction is 0.5, it is the whole choice):

1. utility ``u_i = 4 p_hat_i (1 - p_hat_i)`` (1 at 0.5, 0 at 0 or 1: the variance of the 0/1
   reward, scaled to [0, 1]);
2. anchors: the prompts chosen in the last ``anchor_steps`` steps (the history) and those
   already chosen in this call; ``sim_i = max(0, max over anchors a of cos(x_i, x_a))``;
3. greedily, ``batch_size`` times: choose the candidate with the largest
   ``score_i = u_i - diversity * sim_i`` (first in the seeded order on ties), add it to the
   anchors, update the ``sim`` of the rest.

A prompt chosen at the previous step has ``sim = 1`` (the cosine with itself), so it needs a
utility ``diversity`` larger than a fresh prompt's to be chosen again: recent choices and their
near-duplicates are discounted, and the discount lapses after ``anchor_steps`` steps.

Each chosen entry's ``ControlReason`` is ``diverse_intermediate`` with ``score`` as the
decisive number and ``rank``, ``predicted_success`` (``p_hat``), ``model_prediction``
(``p_model``), ``evidence_trials`` (``N``), ``utility``, ``similarity`` and ``cutoff_score``
(the smallest chosen score). Only the chosen are listed (every prompt is a candidate).

``step_metrics`` (``stages.<id>`` in ``metrics.jsonl`` and MLflow): ``candidates``, ``chosen``,
``anchors`` (history anchors at the call), the chosen prompts' mean ``predicted_success``,
``model_prediction``, ``utility``, ``similarity`` and ``score``, ``unseen`` (chosen prompts never
rolled out), ``pool_predicted_mean`` and ``pool_intermediate`` (pool prompts with
``0.2 <= p_hat <= 0.8``), ``embedded_prompts`` / ``embedding_tokens`` (this step's forward pass),
``train_pairs`` (the window) and ``train_loss`` (its loss before the latest fit), and
``prediction_error``: the mean ``|p_hat - s/n|`` over the groups of the previous step, each
against the ``p_hat`` it was chosen with (how well the predictor anticipated them).

Deviations:
- Abstract only; every rule is our reading. **Predictor**: the paper's latent-variable
  generative model (ELBO-trained, Monte-Carlo prediction) is replaced by a logistic regression
  on frozen policy embeddings, a point estimate without a latent variable; its "history-
  conditioned prior" is read as the two uses of history above (the shared model is fitted on
  the optimisation history, and a prompt's own decayed evidence updates the model's prediction
  taken as a Beta-like prior of ``kappa`` pseudo-trials). Defaults (``kappa = 4``,
  ``lambda = 0.5`` as MoPPS's scripts, window 512, 50 steps of 0.5, L2 1e-3) are guesses.
- **Embeddings**: the policy's mean-pooled last hidden state (as ``control.dots``), not the
  offline MiniLM of ``replay``'s embedder: it needs no second model, and on tiny-arith a
  sentence embedder trained on natural language is blind to what makes ``37+48`` harder than
  ``10+20`` for this policy. Each prompt is embedded once, by the policy of the call that first
  sees it (the initial policy for a fixed pool); the cache is never refreshed.
  Features are standardised over the cached embeddings (they move if the pool grows).
- **Acquisition**: ``u = 4 p (1 - p)`` for "intermediate difficulty", a max-cosine penalty
  against recent and in-batch choices for "history-anchored diversity", combined linearly with
  weight ``diversity = 0.5`` over ``anchor_steps = 2`` steps (guesses), greedy (a submodular-
  style batch choice; no Thompson draw: the predictor's point estimate is used).
- The same predictor's test-time use (compute allocation) is not implemented.
- Only judged rollouts count; groups of earlier steps (replayed) are ignored.

Fidelity: from the abstract: no public code (Batorskq/GPS is an unrelated paper of the same
name); the rules above are this stage's reading.

Example (embeddings given by hand; a run computes them):

>>> import numpy as np
>>> from gfcr.records import Prompt, PromptPool, StepContext
>>> pool = PromptPool([Prompt(f"p:{i}", text=str(i)) for i in range(4)])
>>> stage = Gps(Gps.Config(batch_size=2, seed=0, diversity=0.5))
>>> stage.use_embeddings([p.prompt_id for p in pool], np.array([[1, 0], [1, 0.1], [0, 1], [-1, 0]]))
>>> stage.before_step(StepContext("run", step=0, seed=0, policy_version=0))
>>> alloc = stage.run(pool)  # every prediction 0.5: the seeded order decides the first, diversity the second
>>> [e.n_rollouts for e in alloc], len({e.prompt_id for e in alloc})
([1, 1], 2)

YAML:

.. code-block:: yaml

    stages:
      pick:   {use: control.gps, with: {batch_size: 16, diversity: 0.5, anchor_steps: 2}}
      budget: {use: control.fixed_n, from: pick, with: {n: 8}}
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Annotated, Any, Sequence

import numpy as np
from pydantic import Field

from gfcr.records import Allocation, AllocationEntry, ControlReason, PromptPool, StepContext, StepReport
from gfcr.registry import Seed
from gfcr.stages.common.run_context import RunContext
from gfcr.stages.control.success_predictor import PredictorConfig, SuccessEstimator
from gfcr.stages.resources import Lent

ALIAS = "control.gps"
_ORDER = 0x47505331  # salt of the tie-breaking permutation


def utility(p_hat: np.ndarray) -> np.ndarray:
    """``4 p (1 - p)``: intermediate difficulty, 1 at 0.5 and 0 at 0 or 1."""
    p = np.asarray(p_hat, dtype=np.float64)
    return 4.0 * p * (1.0 - p)


def cosine(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Cosine similarities ``[len(x), len(y)]`` (0 against a zero vector)."""
    def unit(a: np.ndarray) -> np.ndarray:
        norm = np.linalg.norm(a, axis=1, keepdims=True)
        return np.where(norm > 0, a / np.where(norm > 0, norm, 1.0), 0.0)
    return unit(np.asarray(x, dtype=np.float64)) @ unit(np.asarray(y, dtype=np.float64)).T


def greedy_diverse(util: np.ndarray, x: np.ndarray, anchors: np.ndarray, k: int, diversity: float
                   ) -> tuple[list[int], list[float], list[float]]:
    """Greedy batch: ``k`` times the index of the largest ``u - diversity * sim`` (first on ties),
    ``sim`` the largest positive cosine with the anchors and the indices already chosen.
    Returns the chosen indices in order, their scores and their similarities when chosen."""
    util = np.asarray(util, dtype=np.float64)
    sim = np.zeros(len(util)) if not len(anchors) else np.maximum(cosine(x, anchors).max(axis=1), 0.0)
    free = np.ones(len(util), dtype=bool)
    chosen, scores, sims = [], [], []
    for _ in range(min(k, len(util))):
        score = np.where(free, util - diversity * sim, -np.inf)
        i = int(np.argmax(score))  # the first maximum
        chosen.append(i)
        scores.append(float(score[i]))
        sims.append(float(sim[i]))
        free[i] = False
        sim = np.maximum(sim, cosine(x, x[i : i + 1])[:, 0])
    return chosen, scores, sims


class Gps:
    """GPS: a shared success predictor over embeddings and history; intermediate and diverse picks."""

    class Config(PredictorConfig):
        batch_size: Annotated[int, Field(ge=1, description="prompts chosen per call")]
        n_rollouts: Annotated[int, Field(ge=1, description="rollouts marked per chosen prompt")] = 1
        diversity: Annotated[float, Field(ge=0.0, description=(
            "weight of the similarity penalty against recent and in-batch choices "
            "(0: intermediate difficulty only)"))] = 0.5
        anchor_steps: Annotated[int, Field(ge=0, description=(
            "steps whose chosen prompts anchor the diversity penalty (0: in-batch diversity only)"))] = 2
        seed: Seed | None = Field(None, description="tie-breaking order seed; default: the run's seed")

    def __init__(self, config: Config):
        self.config = config
        self.estimator = SuccessEstimator(ALIAS, config)
        self.recent: deque[tuple[int, list[str]]] = deque()  # (step, chosen prompt ids) of the last anchor_steps
        self.chosen_p: dict[str, float] = {}  # this step's chosen prompts and their p_hat, for prediction_error
        self.prediction_error: float | None = None  # over the previous step's groups
        self.run_ctx = RunContext(config.seed)
        self._taken: set[str] = set()
        self._metrics: dict[str, float] = {}

    def setup(self, lent: Lent) -> None:
        self.run_ctx.setup(lent, ALIAS, policy=True)

    def before_step(self, ctx: StepContext) -> None:
        self.run_ctx.before_step(ctx)
        self._taken = set()
        self.chosen_p = {}
        self._metrics = {"embedded_prompts": 0, "embedding_tokens": 0}

    def use_embeddings(self, prompt_ids: Sequence[str], vectors: np.ndarray) -> None:
        """Give embeddings by hand (a run computes them with the policy)."""
        self.estimator.embeddings.add(prompt_ids, vectors)
        self.estimator.ensure([], None, None)

    def anchor_ids(self) -> list[str]:
        """The prompts chosen in the last ``anchor_steps`` steps before this one."""
        first = self.run_ctx.step - self.config.anchor_steps
        return [pid for step, ids in self.recent if first <= step < self.run_ctx.step for pid in ids]

    def run(self, pool: PromptPool) -> Allocation:
        cfg, est = self.config, self.estimator
        embedded, tokens = est.ensure(list(pool), self.run_ctx.policy, self.run_ctx.lent)
        self._metrics["embedded_prompts"] += embedded
        self._metrics["embedding_tokens"] += tokens
        order = np.random.default_rng([self.run_ctx.seed, self.run_ctx.step, _ORDER]).permutation(len(pool))
        candidates = [pool[int(i)] for i in order if pool[int(i)].prompt_id not in self._taken]
        ids = [p.prompt_id for p in candidates]
        p_hat, p_model, trials = est.predict(ids)
        util = utility(p_hat)
        x = est.embeddings.features(ids)
        history = [a for a in self.anchor_ids() if a in est.embeddings.row]
        anchor_ids = history + sorted(self._taken)
        anchors = est.embeddings.features(anchor_ids) if anchor_ids else np.zeros((0, x.shape[1]))
        chosen, scores, sims = greedy_diverse(util, x, anchors, cfg.batch_size, cfg.diversity)
        cutoff = min(scores) if scores else 0.0
        entries = []
        for rank, (i, score, sim) in enumerate(zip(chosen, scores, sims)):
            why = ControlReason("diverse_intermediate", "score", score, {
                "rank": rank + 1, "predicted_success": float(p_hat[i]), "model_prediction": float(p_model[i]),
                "evidence_trials": float(trials[i]), "utility": float(util[i]), "similarity": sim,
                "cutoff_score": cutoff})
            entries.append(AllocationEntry(candidates[i], cfg.n_rollouts, why=why, reason=(
                f"gps: rank {rank + 1} (predicted success {p_hat[i]:.4f}, utility {util[i]:.4f}, "
                f"similarity {sim:.4f}, score {score:.4f})")))
            self.chosen_p[ids[i]] = float(p_hat[i])
        picked = [ids[i] for i in chosen]
        self._taken.update(picked)
        if self.recent and self.recent[-1][0] == self.run_ctx.step:
            self.recent[-1][1].extend(picked)
        else:
            self.recent.append((self.run_ctx.step, picked))
        while self.recent and self.recent[0][0] < self.run_ctx.step - cfg.anchor_steps:
            self.recent.popleft()
        self._record(len(candidates), len(history), chosen, p_hat, p_model,
                     util, sims, scores, trials)
        return Allocation(step=self.run_ctx.step, entries=tuple(entries))

    def _record(self, n_candidates: int, n_anchors: int, chosen: list[int], p_hat: np.ndarray, p_model: np.ndarray,
                util: np.ndarray, sims: list[float], scores: list[float], trials: np.ndarray) -> None:
        m = self._metrics
        m["candidates"] = m.get("candidates", 0) + n_candidates
        m["chosen"] = m.get("chosen", 0) + len(chosen)
        m["anchors"] = n_anchors
        if chosen:
            m["predicted_success"] = float(np.mean(p_hat[chosen]))
            m["model_prediction"] = float(np.mean(p_model[chosen]))
            m["utility"] = float(np.mean(util[chosen]))
            m["similarity"] = float(np.mean(sims))
            m["score"] = float(np.mean(scores))
            m["unseen"] = m.get("unseen", 0) + int(np.sum(trials[chosen] == 0))
        m["pool_predicted_mean"] = float(np.mean(p_hat)) if len(p_hat) else 0.0
        m["pool_intermediate"] = int(np.sum((p_hat >= 0.2) & (p_hat <= 0.8)))

    def step_metrics(self) -> dict[str, float]:
        est = self.estimator
        out = dict(self._metrics)
        out["train_pairs"] = len(est.window)
        if not np.isnan(est.last_loss):
            out["train_loss"] = est.last_loss
        if self.prediction_error is not None:
            out["prediction_error"] = self.prediction_error
        return out

    def observe(self, report: StepReport) -> None:
        seen = self.estimator.observe(report.groups, report.step, self.run_ctx.policy_version)
        errors = [abs(self.chosen_p[pid] - s / n) for pid, s, n in seen if pid in self.chosen_p]
        self.prediction_error = float(np.mean(errors)) if errors else None

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable data: the predictor (weights, window, per-prompt evidence, the
        ids of the cached embeddings), the recent choices and the latest prediction error."""
        return {"estimator": self.estimator.state_dict(), "recent": [[s, list(ids)] for s, ids in self.recent],
                "prediction_error": self.prediction_error}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.estimator.load_state_dict(state["estimator"])
        self.recent = deque((int(s), [str(p) for p in ids]) for s, ids in state["recent"])
        self.prediction_error = None if state["prediction_error"] is None else float(state["prediction_error"])

    def save_files(self, directory: Path) -> None:
        self.estimator.save_files(directory)

    def load_files(self, directory: Path) -> None:
        self.estimator.load_files(directory)
