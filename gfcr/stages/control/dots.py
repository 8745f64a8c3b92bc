"""control.dots: every ``mu`` steps, roll out a small random reference set under the current
policy, predict every prompt's success rate from it with a trained attention predictor, and
sample the prompts whose prediction is nearest 0.5 for the next ``mu`` steps.

DOTS, Difficulty-targeted Online daTa Selection (Sun et al., 2025, "Improving Data Efficiency
for LLM Reinforcement Fine-tuning Through Difficulty-targeted Online Data Selection and
Rollout Replay", NeurIPS 2025, arXiv 2506.05316), rebuilt from its code,
ASTRAL-Group/data-efficient-llm-rl@59df918: the selection block of
``rl_training/verl/verl/trainer/ppo/ray_trainer.py`` (``RayPPOTrainer.fit``), the predictor of
``adaptive_difficulty_prediction`` (``model.py``, ``train.py``; here
``gfcr.stages.control.dots_predictor``) and its online calibration
(``teacher_utils.py``, ``TeacherModelWorker.predict``). Defaults: ``run_bash/final_ds_teacher_replay.sh``
(mu 2, reference set 256, alpha 0.5, tau 1e-3, sigma 0.5, n 8, temperature 0.6; the predictor's
hidden size 896 and 3 layers) and ``adaptive_difficulty_prediction/run_bash/run_train.sh``
(binary cross-entropy, 20 epochs, lr 1e-3, batch 256, the linear warm-up schedule with
``train.py``'s 100 warm-up steps). Its Replay half is ``replay.rollout_replay``.

**A selection round** (the first call, then whenever the round's selection is used up, i.e.
every ``mu`` calls: every ``mu`` steps without a loop block):

1. **Embeddings.** Every pool prompt gets ``e = mean over its prompt tokens of the policy's
   last hidden state`` (one forward pass, no gradients) the first time a round sees it, and
   keeps it: a frozen embedding, as the reference's. The tokens forwarded are charged to the
   step's ``tokens_scored``; the cache (``N * d`` float32) is saved with each checkpoint
   (``files/embeddings.npy``).
2. **Reference set.** ``K`` prompts drawn uniformly without replacement from the pool (seeded
   by ``(seed, round)``), each sampled ``n`` times through the engine under the current policy
   and scored by its verifier: ``acc_k = correct_k / n``.
3. **Training, once** (the first round). The reference trains its predictor once, before RL,
   on other models' measured success rates, and freezes it. Here, in the first round,
   ``train_prompts`` more prompts (disjoint from the reference set) are sampled ``n`` times
   under the initial policy, and the predictor is trained on them as the reference's
   ``train_full_epoch`` does (queries: these prompts and their rates; references: ``K`` of the
   reference set with its rates; binary cross-entropy, Adam, ``train_epochs`` epochs), then
   frozen for the run (``files/predictor.safetensors``).
4. **Prediction.** ``p_raw`` for every pool prompt: the frozen predictor given the round's
   reference set and its ``acc`` (``dots_predictor``: projections, attention at temperature
   ``attention_temperature``, the calibration MLP). Then (``calibrate: true``, the reference's
   ``predict``) the least-squares line ``acc_k ~ a * p_raw(k) + b`` over the reference prompts
   is applied to every prompt: ``p_hat = a * p_raw + b`` (not clipped, as in the reference).
5. **Sampling.** ``m = mu * sigma * B`` prompts (the first round: ``mu * B``) drawn from the
   whole pool without replacement, each draw with probability ``softmax(-|p_hat - alpha| /
   tau_s)`` (float32, ``torch.multinomial`` seeded by ``(seed, round)``), then shuffled, as the
   reference does; the selection is dispatched in that order, ``m / mu`` prompts a call
   (``sigma * B``; ``B`` in the first round), each with ``n_rollouts`` (default 1: put
   ``control.fixed_n`` downstream for the group size).

The reference and training samples are not trained on; they are charged to the step's
``rollouts_generated`` and ``tokens_generated`` (``Lent.charge_generation``), as the paper
counts them in its compute.

Every dispatched entry's ``ControlReason`` is ``difficulty_targeted`` with ``p_hat`` as the
decisive number (``predicted_success``) and its ``distance`` ``|p_hat - alpha|``, ``target``,
``raw_prediction``, ``position`` (its place in the round's shuffled selection), ``round`` and
the round's ``reference_accuracy_mean``. ``step_metrics`` (``stages.<id>`` in
``metrics.jsonl``, and MLflow): ``round`` (rounds run so far), ``rounds_run`` (this step),
``reference_rollouts`` / ``reference_tokens`` (what this step's reference and training
rollouts cost; the step's ``rollouts_generated`` / ``tokens_generated`` include them),
``embedded_prompts`` / ``embedding_tokens`` (this step's forward pass), ``dispatched``,
``predicted_mean`` and ``distance_mean`` (over the prompts dispatched this step),
``selection_left``, the latest round's ``reference_accuracy_mean``, ``predicted_pool_mean``,
``calibration_slope`` and ``calibration_intercept``, and, on the step that trained the
predictor, ``train_prompts``, ``train_accuracy_mean`` and ``train_loss`` (its last epoch's
mean binary cross-entropy).

With ``replay.rollout_replay`` (``fresh_fraction`` sigma, checked equal by ``gfcr validate``)
the update sees ``sigma * B`` fresh groups and ``(1 - sigma) * B`` replayed ones; in the first
round the ``B`` fresh groups a step make the replay stage add ``B (1 - sigma) / sigma`` more
once its buffer holds them (from the second step on).

Fidelity: checked against ASTRAL-Group/data-efficient-llm-rl@59df918: 24/24 cases
(``tests/fidelity/dots.json``: the sampling distribution); checked against
ASTRAL-Group/data-efficient-llm-rl@59df918: 12/12 cases (``dots_predictor.json``: the
predictor's forward, ``model.py``); checked against ASTRAL-Group/data-efficient-llm-rl@59df918: 6/6 cases
(``dots_training.json``: ``train_full_epoch``'s loss, optimiser and schedule); checked against
ASTRAL-Group/data-efficient-llm-rl@59df918: 17/17 cases (``dots_selection.json``: the online
calibration and the draw, index for index). Not compared: the embedder and the training data
(see the deviations).

Deviations (the cases above are unchanged by them):
- **Embeddings from the policy**, not from Qwen2.5-Math-1.5B-Instruct (the reference's frozen
  embedder, which cannot be loaded offline here): the last hidden layer of the policy, mean
  over the prompt tokens (the reference's ``TextEncoder`` pooling for a non-BERT model). A
  prompt is embedded once, by the policy of the round that first sees it, and never again;
  for a fixed pool that is the initial policy, a frozen embedder as in the reference. The
  offline sentence embedder (all-MiniLM-L6-v2) was the other choice; it is blind to what
  makes one tiny-arith sum harder than another for this policy (see ``control.gps``).
- **Training data from the run, not from other models.** The reference trains on success
  rates measured offline for several models on 10,240 DeepScaleR prompts (one group a model)
  against a separate reference pool; gfcr has no such table, so the predictor is trained on
  one group: the initial policy's rates on ``train_prompts`` prompts of the pool, against the
  first round's reference set (``K`` references every batch, the reference's ``ref_size``
  256 being its ``K``). Those rollouts are extra compute the reference spends offline.
  Measured (``benchmarks/dots_predictor.py``, BENCHMARKS.md "DOTS predictor"): tiny-arith's
  initial policy, the 400-prompt pool of ``pipelines/dots_arith.yaml``, p_hat against held-out
  prompts' success rates from 16 samples, mean of 5 seeds. With K 16 and 128 training
  prompts, Pearson 0.51 trained with the reference's 20 epochs, 0.56 with 200, against 0.48
  for the untrained LayerNorm attention this stage used before; with K 64 and 256 prompts,
  0.35 (one seed -0.35), 0.63 and 0.54. Twenty epochs of one batch are 20 Adam steps, where
  the reference's 20 epochs over its table are hundreds: the shipped tiny-arith pipelines set
  ``train_epochs: 200``.
- References are projected once per batch, not once per query (``dots_predictor``): the same
  forward; in training, one dropout mask serves a batch's queries.
- Rounds are counted in calls (a round's selection lasts ``mu`` calls); in a loop block that
  is ``mu`` rounds, not ``mu`` steps. The reference prompts are drawn from the whole pool
  (they may also be selected), and a prompt selected in one round may be selected again in
  the next. A pool smaller than a round's selection (or than ``K``, or than ``K +
  train_prompts`` in the first round) is an error, not a shorter round. The reference samples
  use this stage's ``temperature`` and ``max_new_tokens`` (set them as the rollout stage's)
  and the engine's per-row seeding.

Example (embeddings, weights and reference accuracies given by hand; a run computes them):

>>> import torch
>>> from gfcr.stages.control.dots_predictor import DifficultyPredictor, predict
>>> _ = torch.manual_seed(0)
>>> model = DifficultyPredictor(input_size=4, hidden_size=8, num_layers=3)
>>> refs, acc = torch.randn(6, 4), torch.tensor([0.0, 0.25, 0.5, 0.5, 0.75, 1.0])
>>> p = predict(model, torch.randn(3, 4), refs, acc)
>>> p.shape, bool(((p > 0) & (p < 1)).all())
(torch.Size([3]), True)
>>> np.round(selection_probabilities(np.array([0.5, 0.6, 0.3]), 0.5, 0.1), 4)  # exp(-[0, 1, 2]) / sum
array([0.6652, 0.2447, 0.09  ], dtype=float32)
>>> sorted(draw_selection(np.array([0.9, 0.52, 0.1, 0.49]), 0.5, 1e-3, 2, seed=0))  # the two nearest 0.5
[1, 3]
>>> linear_calibration(np.array([0.2, 0.4]), np.array([0.0, 0.5]))  # acc = 2.5 p_raw - 0.5
(2.5, -0.5)

YAML:

.. code-block:: yaml

    stages:
      pick:    {use: control.dots, with: {batch_size: 16, interval: 2, fresh_fraction: 0.5,
                                          reference_prompts: 32, reference_samples: 4, train_prompts: 128,
                                          hidden_size: 64, max_new_tokens: 8}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 8}}
      rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 8}}
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Sequence

import numpy as np
from pydantic import Field, model_validator

from gfcr.records import Allocation, AllocationEntry, ControlReason, Prompt, PromptPool, StepContext
from gfcr.registry import PipelineProblem, ReplaysFresh, StageConfig
from gfcr.spec.problems import fixable
from gfcr.stages.common.fingerprints import FORWARDS_POLICY, fingerprints
from gfcr.stages.common.run_context import RunContext
from gfcr.stages.common.seeds import step_seed
from gfcr.stages.resources import GenerationRequest, Lent, SamplingParams, prompt_tokens
from gfcr.stages.verifiers.scoring import score_text

if TYPE_CHECKING:  # torch is imported where it is used: `gfcr validate` stays on the light layers
    import torch

    from gfcr.stages.control.dots_predictor import DifficultyPredictor

ALIAS = "control.dots"
EMBEDDINGS, PREDICTOR = "embeddings.npy", "predictor.safetensors"
_REFERENCE = 0x52454653  # salt of the reference draw


# --- calibration and the sampling law (pure functions) -------------------------------------------

def linear_calibration(predicted: np.ndarray, acc: np.ndarray) -> tuple[float, float]:
    """``(a, b)`` of the least-squares line ``acc ~ a * predicted + b``; ``(0, mean acc)`` when
    the predictions are all equal (no slope to fit)."""
    x, y = np.asarray(predicted, dtype=np.float64), np.asarray(acc, dtype=np.float64)
    spread = float(((x - x.mean()) ** 2).sum())
    if spread <= 1e-18:
        return 0.0, round(float(y.mean()), 12)
    slope = float(((x - x.mean()) * (y - y.mean())).sum()) / spread
    return round(slope, 12), round(float(y.mean() - slope * x.mean()), 12)


def _selection_logits(p_hat: np.ndarray, alpha: float, tau_s: float, dtype: torch.dtype) -> torch.Tensor:
    import torch
    logits = -torch.abs(torch.as_tensor(np.asarray(p_hat), dtype=dtype) - alpha) / tau_s
    return logits - logits.max()


def selection_probabilities(p_hat: np.ndarray, alpha: float, tau_s: float) -> np.ndarray:
    """The probability of each prompt at a single draw: ``softmax(-|p_hat - alpha| / tau_s)``,
    in float32 as the reference computes it."""
    import torch
    return torch.softmax(_selection_logits(p_hat, alpha, tau_s, torch.float32), dim=0).numpy()


def draw_selection(p_hat: np.ndarray, alpha: float, tau_s: float, m: int, seed: int) -> list[int]:
    """``m`` indices drawn without replacement with ``selection_probabilities`` (``torch.multinomial``
    on a generator seeded with ``seed``), then shuffled by the same generator: the reference's
    draw, index for index, given the same seed. Where float32 leaves fewer than ``m`` prompts
    a non-zero probability, torch fills the draw with zero-probability prompts, as in the reference."""
    import torch
    probs = torch.softmax(_selection_logits(p_hat, alpha, tau_s, torch.float32), dim=0)
    generator = torch.Generator().manual_seed(seed)
    picked = torch.multinomial(probs, m, replacement=False, generator=generator)
    return [int(i) for i in picked[torch.randperm(m, generator=generator)]]


# --- the stage ------------------------------------------------------------------------------------

class Dots:
    """DOTS: a reference set rolled out every mu steps, a trained predictor of difficulty, prompts near 0.5."""

    class Config(StageConfig):
        sync_only: ClassVar[str] = FORWARDS_POLICY  # the prompt embeddings (gfcr.registry.NeedsSyncLifecycle)
        batch_size: Annotated[int, Field(ge=1, description=(
            "B: the update batch of the pipeline; a call dispatches sigma * B prompts (B in the first round)"))]
        interval: Annotated[int, Field(ge=1, description=(
            "mu: calls (steps) between selection rounds; a round selects mu * sigma * B prompts"))] = 2
        fresh_fraction: Annotated[float, Field(gt=0.0, le=1.0, description=(
            "sigma: the fresh share of the update batch (as replay.rollout_replay's fresh_fraction)"))] = 0.5
        reference_prompts: Annotated[int, Field(ge=2, description=(
            "K: reference prompts rolled out each round"))] = 256
        reference_samples: Annotated[int, Field(ge=1, description=(
            "n: samples per reference (and training) prompt; acc_k = correct / n"))] = 8
        target: Annotated[float, Field(ge=0.0, le=1.0, description=(
            "alpha: the predicted success rate the sampling favours"))] = 0.5
        selection_temperature: Annotated[float, Field(gt=0.0, description=(
            "tau_s: probabilities softmax(-|p_hat - alpha| / tau_s); small is near greedy"))] = 1e-3
        attention_temperature: Annotated[float, Field(gt=0.0, description=(
            "tau: softmax temperature of the predictor's attention over the reference set"))] = 1.0
        calibrate: Annotated[bool, Field(description=(
            "apply the least-squares line of acc on p_raw over the reference set (the reference's calibration)"))] = True
        train_prompts: Annotated[int, Field(ge=1, description=(
            "prompts sampled n times under the initial policy in the first round to train the predictor"))] = 1024
        hidden_size: Annotated[int, Field(ge=1, description="the predictor's projection width")] = 896
        num_layers: Annotated[int, Field(ge=1, description="linear layers of each projection")] = 3
        train_epochs: Annotated[int, Field(ge=1, description="epochs of the predictor's training")] = 20
        learning_rate: Annotated[float, Field(gt=0.0, description="Adam's learning rate for the predictor")] = 1e-3
        train_batch_size: Annotated[int, Field(ge=1, description="queries per training batch")] = 256
        warmup_steps: Annotated[int, Field(ge=0, description=(
            "linear warm-up steps (at most a tenth of the training's), then linear decay to 0"))] = 100
        n_rollouts: Annotated[int, Field(ge=1, description="rollouts marked per dispatched prompt")] = 1
        temperature: Annotated[float, Field(ge=0.0, description="reference sampling temperature")] = 0.6
        max_new_tokens: Annotated[int, Field(ge=1, description=(
            "reference response length cap (set it as the rollout stage's)"))] = 64
        seed: int | None = Field(None, description="reference, training and selection seed; default: the run's")

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
        self.selection: list[tuple[str, float, float]] = []  # (prompt id, p_hat, p_raw) in dispatch order
        self.cursor = 0  # selection entries dispatched
        self.last_round: dict[str, float] = {}  # the latest round's reference and calibration numbers
        self.embedded: list[str] = []  # prompt ids of the cached embeddings, in row order
        self.embeddings = np.zeros((0, 0), dtype=np.float32)  # [len(embedded), d]
        self._row: dict[str, int] = {}
        self.predictor: DifficultyPredictor | None = None  # trained in the first round, then frozen
        self._trained = False  # a restored state's word on the predictor, until load_files reads it
        self.run_ctx = RunContext(config.seed)
        self._metrics: dict[str, float] = {}
        self._picked: list[tuple[float, float]] = []  # (p_hat, distance) of this step's dispatched prompts

    def setup(self, lent: Lent) -> None:
        self.run_ctx.setup(lent, ALIAS, policy=True, engine=True)

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

    def _entry(self, prompt: Prompt, p_hat: float, p_raw: float, position: int) -> AllocationEntry:
        distance = abs(p_hat - self.config.target)
        self._picked.append((p_hat, distance))
        why = ControlReason("difficulty_targeted", "predicted_success", p_hat, {
            "distance": distance, "target": self.config.target, "raw_prediction": p_raw, "position": position + 1,
            "round": self.round - 1, "reference_accuracy_mean": self.last_round["reference_accuracy_mean"]})
        return AllocationEntry(prompt, self.config.n_rollouts, why=why, reason=(
            f"dots: round {self.round - 1}, selection {position + 1}, predicted success {p_hat:.4f}"))

    # --- a selection round -----------------------------------------------------------------------

    def run_round(self, pool: PromptPool) -> None:
        """Embed what is new, roll out the reference set (and, the first time, train the
        predictor), predict, draw the next selection."""
        cfg, m = self.config, self.round_size(self.round == 0)
        training = self.predictor is None
        needed = cfg.reference_prompts + (cfg.train_prompts if training else 0)
        if len(pool) < max(m, needed):
            raise ValueError(
                f"{ALIAS}: the pool holds {len(pool)} prompts; a round needs {m} to select "
                f"(interval * {'batch_size' if self.round == 0 else 'fresh_fraction * batch_size'}) and "
                f"{cfg.reference_prompts} reference prompts" + (f" (+ {cfg.train_prompts} train_prompts in the "
                                                               "first round)" if training else "")
                + "; use a larger data source or lower batch_size, interval, reference_prompts or train_prompts")
        self.embed(pool)
        rng = np.random.default_rng([self.run_ctx.seed, self.round, _REFERENCE])
        drawn = rng.permutation(len(pool))
        ref_rows = sorted(int(i) for i in drawn[: cfg.reference_prompts])
        train_rows = sorted(int(i) for i in drawn[cfg.reference_prompts : needed])
        acc_all = self.reference_accuracies([pool[i] for i in ref_rows + train_rows])
        acc = acc_all[: len(ref_rows)]
        if training:
            self.train(pool, ref_rows, acc, train_rows, acc_all[len(ref_rows):])
        p_raw, p_hat, (a, b) = self.predict(pool, ref_rows, acc)
        order = draw_selection(p_hat, cfg.target, cfg.selection_temperature, m,
                               step_seed(self.run_ctx.seed, "dots-select", self.round))
        self.selection = [(pool[i].prompt_id, float(p_hat[i]), float(p_raw[i])) for i in order]
        self.cursor = 0
        self.last_round = {"reference_accuracy_mean": float(np.mean(acc)), "predicted_pool_mean": float(np.mean(p_hat)),
                           "calibration_slope": a, "calibration_intercept": b}
        self.round += 1
        self._metrics["rounds_run"] += 1

    def _vectors(self, pool: PromptPool, rows: Sequence[int]) -> torch.Tensor:
        import torch
        return torch.from_numpy(self.embeddings[[self._row[pool[i].prompt_id] for i in rows]])

    def train(self, pool: PromptPool, ref_rows: Sequence[int], acc: np.ndarray, train_rows: Sequence[int],
              train_acc: np.ndarray) -> None:
        """Train a fresh predictor on the training prompts' rates against the reference set (one
        group: the current policy), seeded by the stage's seed; it stays frozen afterwards."""
        import torch
        from gfcr.stages.control.dots_predictor import DifficultyPredictor, train_predictor
        cfg = self.config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(step_seed(self.run_ctx.seed, "dots-predictor"))
            model = DifficultyPredictor(self.embeddings.shape[1], cfg.hidden_size, cfg.num_layers)
            losses = train_predictor(
                model, self._vectors(pool, train_rows), torch.tensor(train_acc, dtype=torch.float32),
                [0] * len(train_rows), self._vectors(pool, ref_rows), torch.tensor(acc, dtype=torch.float32)[None],
                epochs=cfg.train_epochs, lr=cfg.learning_rate, batch_size=cfg.train_batch_size,
                ref_size=len(ref_rows), warmup_steps=cfg.warmup_steps, tau=cfg.attention_temperature)
        self.predictor = model
        self._metrics.update(train_prompts=len(train_rows), train_accuracy_mean=float(np.mean(train_acc)),
                             train_loss=losses[-1])

    def predict(self, pool: PromptPool, ref_rows: Sequence[int], acc: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, tuple[float, float]]:
        """``(p_raw, p_hat, (a, b))`` for every pool prompt, from the cached embeddings and the
        trained predictor, given the pool positions of the reference prompts and their accuracies."""
        import torch
        from gfcr.stages.control.dots_predictor import predict
        if self.predictor is None:
            raise RuntimeError(f"{ALIAS}: the predictor is trained in the first round; predict came before it")
        cfg = self.config
        p_raw = predict(self.predictor, self._vectors(pool, range(len(pool))), self._vectors(pool, ref_rows),
                        torch.tensor(acc, dtype=torch.float32), cfg.attention_temperature).double().numpy()
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
        if run.lent is not None:
            run.lent.charge_generation(rollouts, tokens)
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
        if run.lent is not None:
            run.lent.charge_scoring(tokens)
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
        it was dispatched, the latest round's numbers, the ids of the cached embeddings (the
        vectors are in ``files/embeddings.npy``) and whether the predictor is trained (its
        weights are in ``files/predictor.safetensors``)."""
        return {"round": self.round, "cursor": self.cursor, "selection": [list(s) for s in self.selection],
                "last_round": dict(self.last_round), "embedded": list(self.embedded),
                "trained": self.predictor is not None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round, self.cursor = int(state["round"]), int(state["cursor"])
        self.selection = [(str(pid), float(p), float(r)) for pid, p, r in state["selection"]]
        self.last_round = {k: float(v) for k, v in state["last_round"].items()}
        self.embedded = [str(pid) for pid in state["embedded"]]
        self._row = {pid: i for i, pid in enumerate(self.embedded)}
        self._trained = bool(state["trained"])

    def save_files(self, directory: Path) -> None:
        from safetensors.torch import save_file
        directory.mkdir(parents=True, exist_ok=True)
        np.save(directory / EMBEDDINGS, self.embeddings, allow_pickle=False)
        if self.predictor is not None:
            save_file(self.predictor.state_dict(), str(directory / PREDICTOR))

    def load_files(self, directory: Path) -> None:
        from safetensors.torch import load_file
        from gfcr.stages.control.dots_predictor import DifficultyPredictor
        self.embeddings = np.load(directory / EMBEDDINGS, allow_pickle=False)
        if self.embeddings.shape[0] != len(self.embedded):
            raise ValueError(f"{ALIAS}: {directory / EMBEDDINGS} holds {self.embeddings.shape[0]} embeddings and the "
                             f"stage state names {len(self.embedded)} prompts; the checkpoint is inconsistent")
        self.predictor = None
        if self._trained:
            if not (directory / PREDICTOR).is_file():
                raise ValueError(f"{ALIAS}: the stage state says the predictor was trained and {directory / PREDICTOR} "
                                 "is missing; the checkpoint is incomplete")
            cfg = self.config
            self.predictor = DifficultyPredictor(self.embeddings.shape[1], cfg.hidden_size, cfg.num_layers)
            self.predictor.load_state_dict(load_file(str(directory / PREDICTOR)))
            self.predictor.eval()
