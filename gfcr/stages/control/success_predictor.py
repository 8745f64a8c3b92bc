"""A shared, online predictor of a prompt's success rate from its embedding plus its own
history: what ``control.gps`` and ``control.depo`` score prompts with, including prompts never
rolled out.

Three parts, each a small function or class:

- ``PromptEmbeddings``: a cache of one vector per prompt, the mean over the prompt's tokens of
  the policy's last hidden state (one forward pass, no gradients; ``fingerprints`` as
  ``control.dots`` uses it), computed the first time a prompt is seen and kept. The tokens
  forwarded are charged to the step's ``tokens_scored`` (``Lent.charge_scoring``). The
  vectors are saved with each checkpoint (``files/embeddings.npy``).
- ``features``: the predictor's inputs, each coordinate standardised over every cached
  embedding (zero mean, unit variance; a coordinate with no spread stays 0) and divided by
  ``sqrt(d)``, so that a feature vector has squared norm about 1. Standardising removes the
  large part every mean-pooled prompt of one template shares (``control.dots``' measurement:
  it dominates raw similarities).
- ``LogisticSuccess``: ``p_model(x) = sigmoid(w . x + b)``, trained online by full-batch
  gradient descent on the binomial log-loss of observed ``(x_j, s_j correct of n_j)``:

      L(w, b) = -sum_j [s_j log p_j + (n_j - s_j) log(1 - p_j)] / sum_j n_j + l2 / 2 * |w|^2
      dL/dw = X^T (n * p - s) / sum n + l2 * w,       dL/db = sum (n * p - s) / sum n

  ``fit`` takes ``steps`` steps of size ``lr`` from the current weights (warm start). Starting
  at ``w = 0, b = 0`` it predicts 0.5 for every prompt.
- ``with_history``: a prompt's own (decayed) evidence ``S`` successes of ``N`` trials
  anchored on the model's prediction as a prior of ``kappa`` pseudo-trials:
  ``p_hat = (kappa * p_model + S) / (kappa + N)``; a prompt never observed has ``p_hat = p_model``.

Example (hand case: one gradient step from zero weights):

>>> import numpy as np
>>> model = LogisticSuccess(2)
>>> model.fit(np.eye(2), np.array([3.0, 0.0]), np.array([4.0, 4.0]), steps=1, lr=1.0, l2=0.0)
0.6931471805599453
>>> model.weights.tolist(), model.bias  # w = -[(2 - 3), (2 - 0)] / 8, b = -(-1 + 2) / 8
([0.125, -0.25], -0.125)
>>> with_history(0.5, successes=6.0, trials=8.0, kappa=4.0)  # (4 * 0.5 + 6) / (4 + 8)
0.6666666666666666
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Annotated, Any, ClassVar, Sequence

import numpy as np
from pydantic import Field

from gfcr.records import Prompt, PromptStats, RolloutGroup
from gfcr.registry import StageConfig
from gfcr.stages.common.fingerprints import FORWARDS_POLICY, fingerprints
from gfcr.stages.common.logistic import LogisticSuccess, sigmoid, with_history  # noqa: F401 (re-exported)
from gfcr.stages.common.prompt_stats import beta_update, observe_group, stats_from_state, stats_to_state, \
    stats_with_prior
from gfcr.stages.resources import Policy, Lent, prompt_tokens

EMBEDDINGS = "embeddings.npy"


def features(vectors: np.ndarray, rows: Sequence[int]) -> np.ndarray:
    """``vectors[rows]`` standardised per coordinate over all of ``vectors``, over ``sqrt(d)``."""
    vectors = np.asarray(vectors, dtype=np.float64)
    d = vectors.shape[1]
    mean, std = vectors.mean(axis=0), vectors.std(axis=0)
    z = np.where(std > 1e-12, (vectors[list(rows)] - mean) / np.where(std > 1e-12, std, 1.0), 0.0)
    return z / np.sqrt(d)


def zero_variance_probability(p: float | np.ndarray, group_size: int) -> float | np.ndarray:
    """``p^G + (1 - p)^G``: the chance that a group of ``G`` independent 0/1 rewards is all equal."""
    return p ** group_size + (1.0 - p) ** group_size


class PromptEmbeddings:
    """Mean-pooled last-layer policy embeddings, one per prompt, computed once and kept."""

    def __init__(self, alias: str):
        self.alias = alias
        self.ids: list[str] = []
        self.vectors = np.zeros((0, 0), dtype=np.float32)
        self.row: dict[str, int] = {}

    def embed(self, prompts: Sequence[Prompt], policy: Policy | None, lent: Lent | None) -> tuple[int, int]:
        """Embed the prompts not cached yet; ``(prompts embedded, tokens forwarded)``."""
        new = [p for p in prompts if p.prompt_id not in self.row]
        if not new:
            return 0, 0
        if policy is None:
            raise RuntimeError(f"{self.alias} was not set up with a policy (it embeds the prompts with it)")
        rows = [((), prompt_tokens(policy, p)) for p in new]
        tokens = sum(len(r) for _, r in rows)
        if lent is not None:
            lent.charge_scoring(tokens)
        tok = policy.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.add([p.prompt_id for p in new], fingerprints(policy.model, rows, pad, [-1]))
        return len(new), tokens

    def add(self, prompt_ids: Sequence[str], vectors: np.ndarray) -> None:
        """Add vectors ``[len(prompt_ids), d]`` (a run computes them in ``embed``)."""
        vectors = np.asarray(vectors, dtype=np.float32)
        self.vectors = vectors if not self.ids else np.concatenate([self.vectors, vectors])
        for pid in prompt_ids:
            self.row[pid] = len(self.ids)
            self.ids.append(pid)

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1]) if self.ids else 0

    def features(self, prompt_ids: Sequence[str]) -> np.ndarray:
        return features(self.vectors, [self.row[pid] for pid in prompt_ids])

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        np.save(directory / EMBEDDINGS, self.vectors, allow_pickle=False)

    def load(self, directory: Path, ids: Sequence[str]) -> None:
        vectors = np.load(directory / EMBEDDINGS, allow_pickle=False)
        if vectors.shape[0] != len(ids):
            raise ValueError(f"{self.alias}: {directory / EMBEDDINGS} holds {vectors.shape[0]} embeddings and the "
                             f"stage state names {len(ids)} prompts; the checkpoint is inconsistent")
        self.ids, self.vectors = [str(p) for p in ids], vectors
        self.row = {pid: i for i, pid in enumerate(self.ids)}


class PredictorConfig(StageConfig):
    """The Config fields of the shared predictor (``control.gps`` and ``control.depo`` extend it)."""

    sync_only: ClassVar[str] = FORWARDS_POLICY  # the prompts' embeddings (gfcr.registry.NeedsSyncLifecycle)

    prior_strength: Annotated[float, Field(gt=0.0, description=(
        "kappa: pseudo-trials the model's prediction counts for against a prompt's own evidence"))] = 4.0
    evidence_decay: Annotated[float, Field(ge=0.0, le=1.0, description=(
        "lambda: weight a prompt's past evidence keeps at each new group (MoPPS's decay; 1 = plain counts)"))] = 0.5
    train_window: Annotated[int, Field(ge=1, description=(
        "(prompt, s, n) observations the predictor is fitted on: the most recent ones"))] = 512
    fit_steps: Annotated[int, Field(ge=0, description="gradient steps on the window after every step")] = 50
    learning_rate: Annotated[float, Field(gt=0.0, description="gradient step size of the predictor")] = 0.5
    l2: Annotated[float, Field(ge=0.0, description="L2 penalty on the predictor's weights")] = 1e-3
    history_size: Annotated[int, Field(ge=0, description=(
        "observations kept per prompt for inspection; they are checkpointed"))] = 4


class SuccessEstimator:
    """Embeddings, the shared logistic model, per-prompt evidence and the training window."""

    def __init__(self, alias: str, config: PredictorConfig):
        self.config = config
        self.embeddings = PromptEmbeddings(alias)
        self.model: LogisticSuccess | None = None  # created at the embeddings' dimension
        self.stats: dict[str, PromptStats] = {}
        self.window: deque[tuple[str, int, int]] = deque(maxlen=config.train_window)
        self.last_loss = float("nan")  # the window's loss before the latest fit
        self._loaded_ids: list[str] = []  # the embedded ids of a loaded state, for load_files

    def ensure(self, prompts: Sequence[Prompt], policy: Policy | None, lent: Lent | None) -> tuple[int, int]:
        """Embed what is new; create the model at the embeddings' dimension."""
        done = self.embeddings.embed(prompts, policy, lent)
        if self.model is None and self.embeddings.dim:
            self.model = LogisticSuccess(self.embeddings.dim)
        return done

    def evidence(self, prompt_id: str) -> tuple[float, float]:
        """``(S, N)``: the prompt's decayed successes and trials (0, 0 when never observed)."""
        stats = self.stats.get(prompt_id)
        return (0.0, 0.0) if stats is None else (stats.beta_alpha, stats.beta_alpha + stats.beta_beta)

    def set_evidence(self, prompt_id: str, successes: float, trials: float) -> None:
        """Set a prompt's evidence by hand (a run accumulates it in ``observe``)."""
        stats = stats_with_prior(self.stats, prompt_id, self.config.history_size, 0.0, 0.0)
        stats.beta_alpha, stats.beta_beta = successes, trials - successes

    def predict(self, prompt_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(p_hat, p_model, N)`` per prompt."""
        if self.model is None:
            raise RuntimeError("the predictor has no embeddings yet (call ensure first)")
        p_model = self.model.predict(self.embeddings.features(prompt_ids))
        s, n = (np.array(v, dtype=np.float64) for v in zip(*[self.evidence(p) for p in prompt_ids])) \
            if prompt_ids else (np.zeros(0), np.zeros(0))
        return with_history(p_model, s, n, self.config.prior_strength), p_model, n

    def observe(self, groups: Sequence[RolloutGroup], step: int, policy_version: int) -> list[tuple[str, int, int]]:
        """Record this step's groups (those of earlier steps are ignored) and refit; the
        ``(prompt, s, n)`` recorded."""
        cfg, seen = self.config, []
        for group in groups:
            obs = observe_group(group, policy_version) if group.step == step else None
            if obs is None or group.prompt_id not in self.embeddings.row:
                continue
            stats = stats_with_prior(self.stats, group.prompt_id, cfg.history_size, 0.0, 0.0)
            stats.record(obs)
            beta_update(stats, obs.n_correct, obs.n, cfg.evidence_decay, 0.0, 0.0)
            stats.last_selected_step = step
            stats.times_selected += 1
            self.window.append((group.prompt_id, obs.n_correct, obs.n))
            seen.append((group.prompt_id, obs.n_correct, obs.n))
        if seen and self.model is not None:
            ids = [pid for pid, _, _ in self.window]
            s = np.array([c for _, c, _ in self.window], dtype=np.float64)
            n = np.array([k for _, _, k in self.window], dtype=np.float64)
            self.last_loss = self.model.fit(self.embeddings.features(ids), s, n, cfg.fit_steps, cfg.learning_rate,
                                            cfg.l2)
        return seen

    def state_dict(self) -> dict[str, Any]:
        """Plain data: the model's weights, the training window, every observed prompt's stats
        and the ids of the cached embeddings (the vectors go to ``files/embeddings.npy``)."""
        return {"model": None if self.model is None else self.model.state_dict(),
                "window": [list(w) for w in self.window],
                "last_loss": None if np.isnan(self.last_loss) else self.last_loss,
                "prompts": {pid: stats_to_state(s) for pid, s in self.stats.items()},
                "embedded": list(self.embeddings.ids)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model = None
        if state["model"] is not None:
            self.model = LogisticSuccess(len(state["model"]["weights"]))
            self.model.load_state_dict(state["model"])
        self.window = deque(((str(p), int(s), int(n)) for p, s, n in state["window"]), maxlen=self.config.train_window)
        self.last_loss = float("nan") if state["last_loss"] is None else float(state["last_loss"])
        self.stats = {pid: stats_from_state(s) for pid, s in state["prompts"].items()}
        self._loaded_ids = [str(p) for p in state["embedded"]]

    def save_files(self, directory: Path) -> None:
        self.embeddings.save(directory)

    def load_files(self, directory: Path) -> None:
        self.embeddings.load(directory, self._loaded_ids)
