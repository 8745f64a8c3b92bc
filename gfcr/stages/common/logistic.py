"""A logistic success model and a history-anchored estimate: the shared success predictor of
``control.gps`` / ``control.depo`` (``gfcr.stages.control.success_predictor``) and of
``generate.trace``'s turn-prefix anchors.

- ``LogisticSuccess``: ``p(x) = sigmoid(w . x + b)``, trained online by full-batch gradient
  descent on the binomial log-loss of observed ``(x_j, s_j successes of n_j)``:

      L(w, b) = -sum_j [s_j log p_j + (n_j - s_j) log(1 - p_j)] / sum_j n_j + l2 / 2 * |w|^2

  ``fit`` takes ``steps`` steps of size ``lr`` from the current weights (warm start); at
  ``w = 0, b = 0`` it predicts 0.5 everywhere.
- ``with_history``: ``(kappa * p_model + S) / (kappa + N)``, the model's prediction as a prior of
  ``kappa`` pseudo-trials updated with ``S`` successes of ``N`` trials of one's own.

>>> with_history(0.5, successes=6.0, trials=8.0, kappa=4.0)
0.6666666666666666
"""

from __future__ import annotations

from typing import Any

import numpy as np


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(z, dtype=np.float64)))


def with_history(p_model: float | np.ndarray, successes: float | np.ndarray, trials: float | np.ndarray,
                 kappa: float) -> float | np.ndarray:
    """``(kappa * p_model + S) / (kappa + N)``: the model's prediction as a prior of ``kappa``
    pseudo-trials, updated with the prompt's own evidence."""
    return (kappa * p_model + successes) / (kappa + trials)


class LogisticSuccess:
    """``sigmoid(w . x + b)``, fitted by gradient descent on the binomial log-loss."""

    def __init__(self, dim: int):
        self.weights = np.zeros(dim, dtype=np.float64)
        self.bias = 0.0

    def predict(self, x: np.ndarray) -> np.ndarray:
        return sigmoid(np.asarray(x, dtype=np.float64) @ self.weights + self.bias)

    def loss(self, x: np.ndarray, s: np.ndarray, n: np.ndarray, l2: float) -> float:
        p = np.clip(self.predict(x), 1e-12, 1.0 - 1e-12)
        nll = -(s * np.log(p) + (n - s) * np.log(1.0 - p)).sum() / n.sum()
        return float(nll + 0.5 * l2 * float(self.weights @ self.weights))

    def fit(self, x: np.ndarray, s: np.ndarray, n: np.ndarray, steps: int, lr: float, l2: float) -> float:
        """``steps`` gradient steps on ``(x, s of n)``; returns the loss before the first step."""
        x, s, n = (np.asarray(a, dtype=np.float64) for a in (x, s, n))
        if not len(n) or n.sum() <= 0:
            return float("nan")
        before = self.loss(x, s, n, l2)
        for _ in range(steps):
            residual = (n * self.predict(x) - s) / n.sum()
            self.weights = self.weights - lr * (x.T @ residual + l2 * self.weights)
            self.bias = self.bias - lr * float(residual.sum())
        return before

    def state_dict(self) -> dict[str, Any]:
        return {"weights": [float(w) for w in self.weights], "bias": float(self.bias)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weights = np.array(state["weights"], dtype=np.float64)
        self.bias = float(state["bias"])
