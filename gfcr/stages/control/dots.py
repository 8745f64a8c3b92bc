"""control.dots: every ``mu`` steps, roll out a small random reference set under the current
policy, predict every prompt's success rate by attention over that set, and sample the
prompts whose prediction is nearest 0.5 for the next ``mu`` steps.

DOTS, Difficulty-targeted Online daTa Selection (Sun et al., 2025, "Improving Data Efficiency
for LLM Reinforcement Fine-tuning Through Difficulty-targeted Online Data Selection and
Rollout Replay", NeurIPS 2025, arXiv 2506.05316; reference ``ASTRAL-Group/data-efficient-llm-rl``,
``rl_training/verl/verl/trainer/ppo/teacher_utils.py`` read; the trainer
``ray_trainer_teacher_replay.py`` and ``run_bash/final_ds_teacher_replay.sh`` were not
readable, their rules and defaults are those of our research notes, section 2.6). Its Replay
half is ``replay.rollout_replay``.

**A selection round** (the first call, then whenever the round's selection is used up, i.e.
every ``mu`` calls: every ``mu`` steps without a loop block):

1. **Embeddings.** Every pool prompt gets ``e = mean over its prompt tokens of the policy's
   last hidden state`` (one forward pass over the prompt tokens, no gradients), the first time
   a round sees it, and keeps it: the reference embeds the prompts once with a frozen backbone,
   here the backbone is the policy as it is then (the initial policy for the prompts of the
   first round). The tokens forwarded are charged to the step's ``tokens_scored``; the cache
   holds ``N * d`` float32 (tiny-arith, ``d = 128``: 512 bytes a prompt, 2 MB for 4000) and is
   saved with each checkpoint (``files/embeddings.npy``).
2. **Reference set.** ``K`` prompts drawn uniformly without replacement from the pool (seeded
   by ``(seed, round)``), each sampled ``n`` times through the engine under the current policy
   and scored by its verifier: ``acc_k = correct_k / n``. The ``K * n`` samples are not
   trained on; they are charged to the step's ``rollouts_generated`` and ``tokens_generated``
   (``Resources.charge_generation``), as the paper counts them in its compute.
3. **Prediction.** With ``LN`` a parameter-free LayerNorm (zero mean, unit variance over the
   ``d`` coordinates) standing for the projections ``W_q``, ``W_r``:

       s_k = <LN(e_q), LN(e_k)> / sqrt(d)
       p_raw(q) = sum_k softmax(s / tau)_k * acc_k          (tau = attention_temperature, 1.0)

   then (``calibrate: true``, the reference's ``predict``) the least-squares line
   ``acc_k ~ a * p_raw(k) + b`` over the reference prompts (each predicted with the full
   reference set, itself included) is applied to every prompt: ``p_hat = a * p_raw + b``
   (``a = 0``, ``b = mean acc`` when the ``p_raw(k)`` are all equal).
4. **Sampling.** ``m = mu * sigma * B`` prompts (the first round: ``mu * B``) drawn from the
   whole pool without replacement, each draw with probability proportional to
   ``w = exp(-|p_hat - alpha| / tau_s)`` (``alpha = 0.5``, ``tau_s = 1e-3``: close to greedy
   on ``|p_hat - 0.5|``), by Gumbel top-``m`` (the same law as sequential draws), seeded by
   ``(seed, round)``. The selection is dispatched in draw order, ``m / mu`` prompts a call
   (``sigma * B``; ``B`` in the first round), each with ``n_rollouts`` (default 1: put
   ``control.fixed_n`` downstream for the group size).

Every dispatched entry's ``ControlReason`` is ``difficulty_targeted`` with ``p_hat`` as the
decisive number (``predicted_success``) and its ``distance`` ``|p_hat - alpha|``, ``target``,
``raw_prediction``, ``draw_rank`` (its place in the round's draw), ``round`` and the round's
``reference_accuracy_mean``. ``step_metrics`` (``stages.<id>`` in ``metrics.jsonl``, and
MLflow): ``round`` (rounds run so far), ``rounds_run`` (this step), ``reference_rollouts`` /
``reference_tokens`` (what this step's reference rollouts cost; the step's
``rollouts_generated`` / ``tokens_generated`` include them), ``embedded_prompts`` /
``embedding_tokens`` (this step's forward pass), ``dispatched``, ``predicted_mean`` and
``distance_mean`` (over the prompts dispatched this step), ``selection_left``, and the latest
round's ``reference_accuracy_mean``, ``predicted_pool_mean``, ``calibration_slope`` and
``calibration_intercept``.

With ``replay.rollout_replay`` (``fresh_fraction`` sigma, checked equal by ``gfcr validate``)
the update sees ``sigma * B`` fresh groups and ``(1 - sigma) * B`` replayed ones; in the first
round the ``B`` fresh groups a step make the replay stage add ``B (1 - sigma) / sigma`` more
once its buffer holds them (from the second step on).

Fidelity: checked against ASTRAL-Group/data-efficient-llm-rl@59df918: 24/24 cases
(``tests/fidelity/dots.json``: the sampling distribution; the predictor and the draw are not compared).

Deviations:
- **No trained predictor.** The reference trains its query and reference projections (3-layer
  MLPs ending in LayerNorm) and a calibration head offline on another model's rollouts, then
  freezes them; gfcr has none for tiny-arith. Here ``W_q = W_r = LN`` without weights (the
  reference projections' last layer, the linear layers taken as the identity): ``p_raw`` is an
  attention over the correlation of mean-pooled embeddings, scaled by ``sqrt(d)``. This is an
  untrained similarity, not the paper's predictor. Measured once on tiny-arith (initial policy,
  the 400-prompt pool of ``pipelines/dots_arith.yaml``, every prompt's success rate from 8
  samples, K = 64 random references, 5 draws): ``p_raw`` correlates with the held-out prompts'
  success rates (Pearson 0.46, Spearman 0.41) but spans little (std 0.015), so the calibration
  stretches it (slope about 13); the calibrated ``p_hat`` is off by 0.236 on average, against
  0.285 for predicting the reference mean. Mean-pooled embeddings of these prompts share a
  large common part (the template's tokens); subtracting the pool's mean embedding first gave
  Pearson 0.52 and slope 1.2, but is not in the paper and is not done here.
- **Calibration head absent.** The default ``group_logit_temp`` head (an MLP over the mean and
  std of the reference accuracies giving a temperature and a bias in logit space) is trained
  with the projections and cannot be reproduced untrained; it is left out. The reference's
  *online* linear calibration on the reference set (``TeacherModelWorker.predict``) is kept
  (``calibrate``); ``p_hat`` is not clipped to [0, 1] (the reference does not clip either).
- **Embeddings from the policy** (the brief), not from a separate frozen backbone
  (Qwen2.5-Math-1.5B-Instruct in the reference); last hidden layer, mean over the prompt
  tokens (the reference's ``TextEncoder`` pooling for a non-BERT model). A prompt is embedded
  once, by the policy of the round that first sees it; the cache is never refreshed.
- Rounds are counted in calls (a round's selection lasts ``mu`` calls); in a loop block that
  is ``mu`` rounds, not ``mu`` steps. The reference prompts are drawn from the whole pool
  (they may also be selected), and a prompt selected in one round may be selected again in
  the next. A pool smaller than a round's selection (or than ``K``) is an error, not a
  shorter round. The reference samples use this stage's ``temperature`` and
  ``max_new_tokens`` (set them as the rollout stage's) and the engine's per-row seeding.

Example (embeddings and reference accuracies given by hand; a run computes them):

>>> import numpy as np
>>> q, refs = np.array([[1.0, 0.0]]), np.array([[1.0, 0.0], [0.0, 1.0]])
>>> round(float(attention_predict(q, refs, np.array([1.0, 0.0]), 1.0)[0]), 4)  # 1 / (1 + e^(-2 sqrt 2))
0.9442
>>> np.round(sampling_weights(np.array([0.5, 0.6, 0.3]), 0.5, 0.1), 4)  # exp(-[0, 1, 2]) / sum
array([0.6652, 0.2447, 0.09  ])
>>> linear_calibration(np.array([0.2, 0.4]), np.array([0.0, 0.5]))  # acc = 2.5 p_raw - 0.5
(2.5, -0.5)

YAML:

.. code-block:: yaml

    stages:
      pick:    {use: control.dots, with: {batch_size: 16, interval: 2, fresh_fraction: 0.5,
                                          reference_prompts: 32, reference_samples: 4, max_new_tokens: 8}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 8}}
      rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 8}}
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Sequence

import numpy as np
from pydantic import Field, model_validator

from gfcr.records import Allocation, AllocationEntry, ControlReason, Prompt, PromptPool, StepContext
from gfcr.registry import PipelineProblem, ReplaysFresh, StageConfig
from gfcr.spec.problems import fixable
from gfcr.stages.common.fingerprints import fingerprints
from gfcr.stages.common.run_context import RunContext
from gfcr.stages.common.seeds import step_seed
from gfcr.stages.resources import GenerationRequest, Resources, SamplingParams, prompt_tokens
from gfcr.stages.verifiers.scoring import score_text

ALIAS = "control.dots"
EMBEDDINGS = "embeddings.npy"
_REFERENCE, _SAMPLE = 0x52454653, 0x53414D50  # salts: the reference draw and the selection draw differ


# --- the predictor and the sampling law (pure functions) -----------------------------------------

def layer_norm(x: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """Each row standardised over its last axis (LayerNorm without weights)."""
    x = np.asarray(x, dtype=np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(axis=-1, keepdims=True) + eps)


def attention_predict(queries: np.ndarray, refs: np.ndarray, acc: np.ndarray, tau: float) -> np.ndarray:
    """``p_raw = softmax(<LN q, LN r_k> / sqrt(d) / tau) . acc`` for each query row: ``[N]``
    from queries ``[N, d]``, references ``[K, d]`` and their accuracies ``[K]``."""
    q, r = layer_norm(queries), layer_norm(refs)
    scores = q @ r.T / np.sqrt(q.shape[-1]) / tau  # [N, K]
    scores -= scores.max(axis=1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=1, keepdims=True)
    return weights @ np.asarray(acc, dtype=np.float64)


def linear_calibration(predicted: np.ndarray, acc: np.ndarray) -> tuple[float, float]:
    """``(a, b)`` of the least-squares line ``acc ~ a * predicted + b``; ``(0, mean acc)`` when
    the predictions are all equal (no slope to fit)."""
    x, y = np.asarray(predicted, dtype=np.float64), np.asarray(acc, dtype=np.float64)
    spread = float(((x - x.mean()) ** 2).sum())
    if spread <= 1e-18:
        return 0.0, round(float(y.mean()), 12)
    slope = float(((x - x.mean()) * (y - y.mean())).sum()) / spread
    return round(slope, 12), round(float(y.mean() - slope * x.mean()), 12)


def sampling_weights(p_hat: np.ndarray, alpha: float, tau_s: float) -> np.ndarray:
    """The probability of each prompt at a single draw: ``exp(-|p_hat - alpha| / tau_s)``
    normalised (computed as a softmax, so ``tau_s = 1e-3`` does not underflow)."""
    logits = -np.abs(np.asarray(p_hat, dtype=np.float64) - alpha) / tau_s
    w = np.exp(logits - logits.max())
    return w / w.sum()


def sample_without_replacement(p_hat: np.ndarray, alpha: float, tau_s: float, m: int,
                               rng: np.random.Generator) -> list[int]:
    """``m`` indices drawn without replacement with probability proportional to
    ``exp(-|p_hat - alpha| / tau_s)``, in draw order (Gumbel top-``m``)."""
    logits = -np.abs(np.asarray(p_hat, dtype=np.float64) - alpha) / tau_s
    keys = logits + rng.gumbel(size=len(logits))
    return [int(i) for i in np.argsort(-keys, kind="stable")[:m]]


# --- the stage ------------------------------------------------------------------------------------

class Dots:
    """DOTS: a reference set rolled out every mu steps, attention-predicted difficulty, prompts near 0.5."""

    class Config(StageConfig):
        batch_size: Annotated[int, Field(ge=1, description=(
            "B: the update batch of the pipeline; a call dispatches sigma * B prompts (B in the first round)"))]
        interval: Annotated[int, Field(ge=1, description=(
            "mu: calls (steps) between selection rounds; a round selects mu * sigma * B prompts"))] = 2
        fresh_fraction: Annotated[float, Field(gt=0.0, le=1.0, description=(
            "sigma: the fresh share of the update batch (as replay.rollout_replay's fresh_fraction)"))] = 0.5
        reference_prompts: Annotated[int, Field(ge=2, description=(
            "K: reference prompts rolled out each round"))] = 256
        reference_samples: Annotated[int, Field(ge=1, description=(
            "n: samples per reference prompt; acc_k = correct / n"))] = 8
        target: Annotated[float, Field(ge=0.0, le=1.0, description=(
            "alpha: the predicted success rate the sampling favours"))] = 0.5
        selection_temperature: Annotated[float, Field(gt=0.0, description=(
            "tau_s: weights exp(-|p_hat - alpha| / tau_s); small is near greedy"))] = 1e-3
        attention_temperature: Annotated[float, Field(gt=0.0, description=(
            "tau: softmax temperature of the attention over the reference set"))] = 1.0
        calibrate: Annotated[bool, Field(description=(
            "apply the least-squares line of acc on p_raw over the reference set (the reference's calibration)"))] = True
        n_rollouts: Annotated[int, Field(ge=1, description="rollouts marked per dispatched prompt")] = 1
        temperature: Annotated[float, Field(ge=0.0, description="reference sampling temperature")] = 1.0
        max_new_tokens: Annotated[int, Field(ge=1, description=(
            "reference response length cap (set it as the rollout stage's)"))] = 64
        seed: int | None = Field(None, description="reference and selection draw seed; default: the run's")

        @model_validator(mode="after")
        def _fresh_batch_is_whole(self) -> "Dots.Config":
            fresh = Fraction(repr(self.fresh_fraction)) * self.batch_size
            if fresh.denominator != 1:
                raise fixable(f"fresh_fraction * batch_size = {self.fresh_fraction:g} * {self.batch_size} = "
                              f"{float(fresh):g} is not a whole number of prompts per step",
                              "choose batch_size and fresh_fraction so that sigma * B is an integer "
                              "(e.g. batch_size: 16, fresh_fraction: 0.5)")
            return self

        @property
        def fresh_per_call(self) -> int:
            return int(Fraction(repr(self.fresh_fraction)) * self.batch_size)

    @staticmethod
    def check_pipeline(config: "Dots.Config", view: Any) -> list[PipelineProblem]:
        """A rollout replay in the pipeline (``replay.rollout_replay``) must replay at the same sigma."""
        out = []
        for sid, other in view.having(ReplaysFresh):
            if other.replays_fresh_fraction != config.fresh_fraction:
                out.append(PipelineProblem(("fresh_fraction",), (
                    f"control.dots selects sigma * B fresh prompts with fresh_fraction {config.fresh_fraction:g}, "
                    f"and `{sid}` ({view.aliases[sid]}) fills the batch for fresh_fraction "
                    f"{other.replays_fresh_fraction:g}"),
                    f"set the same `fresh_fraction` on both (`--set stages.{sid}.with.fresh_fraction="
                    f"{config.fresh_fraction:g}`)"))
        return out

    def __init__(self, config: Config):
        self.config = config
        self.round = 0  # rounds run so far
        self.selection: list[tuple[str, float, float]] = []  # (prompt id, p_hat, p_raw) in draw order
        self.cursor = 0  # selection entries dispatched
        self.last_round: dict[str, float] = {}  # the latest round's reference and calibration numbers
        self.embedded: list[str] = []  # prompt ids of the cached embeddings, in row order
        self.embeddings = np.zeros((0, 0), dtype=np.float32)  # [len(embedded), d]
        self._row: dict[str, int] = {}
        self.run_ctx = RunContext(config.seed)
        self._metrics: dict[str, float] = {}
        self._picked: list[tuple[float, float]] = []  # (p_hat, distance) of this step's dispatched prompts

    def setup(self, resources: Resources) -> None:
        self.run_ctx.setup(resources, ALIAS, policy=True, engine=True)

    def before_step(self, ctx: StepContext) -> None:
        self.run_ctx.before_step(ctx)
        self._metrics = dict.fromkeys(("rounds_run", "reference_rollouts", "reference_tokens", "embedded_prompts",
                                       "embedding_tokens", "dispatched"), 0)
        self._picked = []

    # --- a call ----------------------------------------------------------------------------------

    def round_size(self, first: bool) -> int:
        """``m``: prompts a round selects (``mu * B`` for the first, ``mu * sigma * B`` after)."""
        cfg = self.config
        return cfg.interval * (cfg.batch_size if first else cfg.fresh_per_call)

    def run(self, pool: PromptPool) -> Allocation:
        if self.cursor >= len(self.selection):
            self.run_round(pool)
        per_call = len(self.selection) // self.config.interval
        chunk = self.selection[self.cursor : self.cursor + per_call]
        entries = tuple(self._entry(pool.get(pid), p_hat, p_raw, self.cursor + i)
                        for i, (pid, p_hat, p_raw) in enumerate(chunk))
        self.cursor += len(chunk)
        self._metrics["dispatched"] += len(entries)
        return Allocation(step=self.run_ctx.step, entries=entries)

    def _entry(self, prompt: Prompt, p_hat: float, p_raw: float, rank: int) -> AllocationEntry:
        distance = abs(p_hat - self.config.target)
        self._picked.append((p_hat, distance))
        why = ControlReason("difficulty_targeted", "predicted_success", p_hat, {
            "distance": distance, "target": self.config.target, "raw_prediction": p_raw, "draw_rank": rank + 1,
            "round": self.round - 1, "reference_accuracy_mean": self.last_round["reference_accuracy_mean"]})
        return AllocationEntry(prompt, self.config.n_rollouts, why=why,
                               reason=f"dots: round {self.round - 1}, draw {rank + 1}, predicted success {p_hat:.4f}")

    # --- a selection round -----------------------------------------------------------------------

    def run_round(self, pool: PromptPool) -> None:
        """Embed what is new, roll out the reference set, predict, sample the next selection."""
        cfg, m = self.config, self.round_size(self.round == 0)
        if len(pool) < max(m, cfg.reference_prompts):
            raise ValueError(
                f"{ALIAS}: the pool holds {len(pool)} prompts; a round needs {m} to select "
                f"(interval * {'batch_size' if self.round == 0 else 'fresh_fraction * batch_size'}) and "
                f"{cfg.reference_prompts} reference prompts; use a larger data source or lower batch_size, "
                "interval or reference_prompts")
        self.embed(pool)
        rng = np.random.default_rng([self.run_ctx.seed, self.round, _REFERENCE])
        ref_rows = [int(i) for i in np.sort(rng.choice(len(pool), size=cfg.reference_prompts, replace=False))]
        acc = self.reference_accuracies([pool[i] for i in ref_rows])
        p_raw, p_hat, (a, b) = self.predict(pool, ref_rows, acc)
        order = sample_without_replacement(p_hat, cfg.target, cfg.selection_temperature, m,
                                           np.random.default_rng([self.run_ctx.seed, self.round, _SAMPLE]))
        self.selection = [(pool[i].prompt_id, float(p_hat[i]), float(p_raw[i])) for i in order]
        self.cursor = 0
        self.last_round = {"reference_accuracy_mean": float(np.mean(acc)), "predicted_pool_mean": float(np.mean(p_hat)),
                           "calibration_slope": a, "calibration_intercept": b}
        self.round += 1
        self._metrics["rounds_run"] += 1

    def predict(self, pool: PromptPool, ref_rows: Sequence[int], acc: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, tuple[float, float]]:
        """``(p_raw, p_hat, (a, b))`` for every pool prompt, from the cached embeddings, given
        the pool positions of the reference prompts and their accuracies."""
        cfg = self.config
        queries = self.embeddings[[self._row[p.prompt_id] for p in pool]]  # [N, d]
        p_raw = attention_predict(queries, queries[list(ref_rows)], acc, cfg.attention_temperature)
        if not cfg.calibrate:
            return p_raw, p_raw, (1.0, 0.0)
        a, b = linear_calibration(p_raw[list(ref_rows)], acc)
        return p_raw, a * p_raw + b, (a, b)

    def reference_accuracies(self, refs: Sequence[Prompt]) -> np.ndarray:
        """``acc_k`` of each reference prompt: ``n`` samples under the current policy, scored by
        its verifier; the samples are charged to the step."""
        run = self.run_ctx
        if run.engine is None or run.policy is None:
            raise RuntimeError(f"{ALIAS} was not set up with a policy and engine (it rolls out its reference set)")
        cfg = self.config
        params = SamplingParams(cfg.temperature, 1.0, cfg.max_new_tokens, (), step_seed(run.seed, "dots-reference",
                                                                                        self.round))
        requests = [GenerationRequest(f"{p.prompt_id}@dots{self.round}", tuple(prompt_tokens(run.policy, p)),
                                      cfg.reference_samples, params) for p in refs]
        acc, tokens = [], 0
        for prompt, completions in zip(refs, run.engine.generate(requests), strict=True):
            if prompt.verifier is None:
                raise ValueError(f"prompt {prompt.prompt_id} has no verifier spec: {ALIAS} cannot score its reference "
                                 "rollouts; use a data source that sets `Prompt.verifier`")
            acc.append(sum(score_text(c.text, prompt.verifier)[1].correct for c in completions) / len(completions))
            tokens += sum(len(c.token_ids) for c in completions)
        rollouts = len(refs) * cfg.reference_samples
        if run.resources is not None:
            run.resources.charge_generation(rollouts, tokens)
        self._metrics["reference_rollouts"] += rollouts
        self._metrics["reference_tokens"] += tokens
        return np.array(acc, dtype=np.float64)

    def embed(self, pool: PromptPool) -> None:
        """Embed the pool prompts not cached yet (one forward pass over their prompt tokens)."""
        new = [p for p in pool if p.prompt_id not in self._row]
        if not new:
            return
        run = self.run_ctx
        if run.policy is None:
            raise RuntimeError(f"{ALIAS} was not set up with a policy (it embeds the prompts with it)")
        rows = [((), prompt_tokens(run.policy, p)) for p in new]
        tokens = sum(len(r) for _, r in rows)
        if run.resources is not None:
            run.resources.charge_scoring(tokens)
        tok = run.policy.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        vectors = fingerprints(run.policy.model, rows, pad, [-1])  # [len(new), d]: last layer, mean over the prompt
        self.use_embeddings([p.prompt_id for p in new], vectors)
        self._metrics["embedded_prompts"] += len(new)
        self._metrics["embedding_tokens"] += tokens

    def use_embeddings(self, prompt_ids: Sequence[str], vectors: np.ndarray) -> None:
        """Add embeddings ``[len(prompt_ids), d]`` to the cache (a run computes them in ``embed``)."""
        vectors = np.asarray(vectors, dtype=np.float32)
        self.embeddings = vectors if not self.embedded else np.concatenate([self.embeddings, vectors])
        for pid in prompt_ids:
            self._row[pid] = len(self.embedded)
            self.embedded.append(pid)

    # --- metrics and checkpoints -----------------------------------------------------------------

    def step_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"round": self.round, **self._metrics,
                                 "selection_left": len(self.selection) - self.cursor, **self.last_round}
        if self._picked:
            out["predicted_mean"] = float(np.mean([p for p, _ in self._picked]))
            out["distance_mean"] = float(np.mean([d for _, d in self._picked]))
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable data: the round counter, the current selection and how much of
        it was dispatched, the latest round's numbers, and the ids of the cached embeddings (the
        vectors are in ``files/embeddings.npy``)."""
        return {"round": self.round, "cursor": self.cursor, "selection": [list(s) for s in self.selection],
                "last_round": dict(self.last_round), "embedded": list(self.embedded)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round, self.cursor = int(state["round"]), int(state["cursor"])
        self.selection = [(str(pid), float(p), float(r)) for pid, p, r in state["selection"]]
        self.last_round = {k: float(v) for k, v in state["last_round"].items()}
        self.embedded = [str(pid) for pid in state["embedded"]]
        self._row = {pid: i for i, pid in enumerate(self.embedded)}

    def save_files(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        np.save(directory / EMBEDDINGS, self.embeddings, allow_pickle=False)

    def load_files(self, directory: Path) -> None:
        self.embeddings = np.load(directory / EMBEDDINGS, allow_pickle=False)
        if self.embeddings.shape[0] != len(self.embedded):
            raise ValueError(f"{ALIAS}: {directory / EMBEDDINGS} holds {self.embeddings.shape[0]} embeddings and the "
                             f"stage state names {len(self.embedded)} prompts; the checkpoint is inconsistent")
