"""DOTS's difficulty predictor: a prompt's success rate from its embedding and a reference set's.

Rebuilt from ASTRAL-Group/data-efficient-llm-rl@59df918, ``adaptive_difficulty_prediction``
(``model.py``: ``build_projection``, ``RegressionHead``, ``ResidualHead`` with ``scaling:
group_logit_temp``; ``train.py``: ``train_full_epoch``; ``run_bash/run_train.sh`` for the
defaults), checked case by case in ``tests/fidelity/dots_predictor.json``.

The forward, for query embeddings ``q [B, d]``, reference embeddings ``r [K, d]`` and the
references' observed success rates ``v [B, K]`` (one row per query: the rates under the policy
the query is predicted for):

    Q = P_q(q), R = P_r(r)                  P = LayerNorm(d), (Linear, GELU, Dropout) x (L-1), Linear, LayerNorm(h)
    w = softmax(Q R^T / sqrt(h) / tau)      attention over the references          [B, K]
    base = sum_k w_k v_k                    the references' rates, weighted
    T, b = softplus(m_0), tanh(m_1) with m = MLP(mean v, std v)   (Linear(2, 10), ReLU, Linear(10, 2))
    p = sigmoid(logit(clamp(base, 1e-4, 1 - 1e-4)) / clamp(T, 0.01, 10) + b)

Training (``train_predictor``) is the reference's: binary cross-entropy of ``p`` against the
queries' observed rates, Adam, a linear warm-up over ``min(warmup_steps, total // 10)`` steps
then a linear decay to 0 (``get_linear_schedule_with_warmup``), shuffled batches of queries,
each batch with one random draw of ``ref_size`` references (``v`` taken from each query's
group: in the reference a group is a model whose rates were measured offline).

Differs from the reference in one place, invisible at evaluation: the references are projected
once per batch and broadcast to its queries, where the reference expands them to ``[B, K, d]``
first; the forward is the same, but in training the reference draws an independent dropout
mask for every query-reference pair and here one mask serves a batch's queries (expanding
costs ``B * K`` projections: 65,536 rows a batch at the script's 256 x 256).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def projection(input_size: int, hidden_size: int, num_layers: int, dropout: float = 0.1) -> nn.Sequential:
    """``LayerNorm(d)``, ``num_layers`` linear layers (GELU and dropout between them), ``LayerNorm(h)``."""
    layers: list[nn.Module] = [nn.LayerNorm(input_size)]
    for i in range(num_layers):
        layers.append(nn.Linear(input_size if i == 0 else hidden_size, hidden_size))
        if i < num_layers - 1:
            layers += [nn.GELU(), nn.Dropout(dropout)]
    layers.append(nn.LayerNorm(hidden_size))
    return nn.Sequential(*layers)


class DifficultyPredictor(nn.Module):
    """Attention over reference embeddings weighted by their success rates, calibrated in logit space."""

    def __init__(self, input_size: int, hidden_size: int = 896, num_layers: int = 3, dropout: float = 0.1):
        super().__init__()
        # registered in the reference's order (query, reference, calibration): one seed, one initialisation
        self.query_proj = projection(input_size, hidden_size, num_layers, dropout)
        self.ref_proj = projection(input_size, hidden_size, num_layers, dropout)
        self.calibration = nn.Sequential(nn.Linear(2, 10), nn.ReLU(), nn.Linear(10, 2))

    def attention(self, queries: torch.Tensor, refs: torch.Tensor, ref_values: torch.Tensor,
                  tau: float = 1.0) -> torch.Tensor:
        """``base [B]``: the references' rates ``ref_values [B, K]`` weighted by the attention of
        the projected queries ``[B, d]`` over the projected references ``[K, d]``."""
        q, r = self.query_proj(queries), self.ref_proj(refs)  # [B, h], [K, h]
        scores = q @ r.T / math.sqrt(r.shape[-1]) / tau  # [B, K]
        weights = torch.softmax(scores - scores.max(dim=-1, keepdim=True).values, dim=-1)
        return (weights * ref_values).sum(dim=-1)

    def forward(self, queries: torch.Tensor, refs: torch.Tensor, ref_values: torch.Tensor,
                tau: float = 1.0) -> torch.Tensor:
        """``p [B]``: the predicted success rate of each query."""
        base = self.attention(queries, refs, ref_values, tau)
        stats = torch.stack([ref_values.mean(dim=-1), ref_values.std(dim=-1)], dim=-1)  # [B, 2]
        m = self.calibration(stats)
        temperature, bias = F.softplus(m[:, 0]).clamp(1e-2, 10), torch.tanh(m[:, 1])
        return torch.sigmoid(torch.logit(base.clamp(1e-4, 1 - 1e-4)) / temperature + bias)


def train_predictor(model: DifficultyPredictor, queries: torch.Tensor, query_rates: torch.Tensor,
                    query_groups: Sequence[int], refs: torch.Tensor, ref_rates: torch.Tensor, *,
                    epochs: int = 20, lr: float = 1e-3, batch_size: int = 256, ref_size: int = 256,
                    warmup_steps: int = 100, tau: float = 1.0) -> list[float]:
    """Train ``model`` in place as ``train_full_epoch`` does; return each epoch's mean batch loss.

    ``queries [N, d]`` with observed rates ``query_rates [N]`` and group ``query_groups [N]``;
    ``refs [R, d]`` with rates ``ref_rates [G, R]`` (row g: under group g's policy). Draws
    (the shuffle, the references of a batch, dropout) come from torch's global generator:
    seed it, or wrap the call in ``torch.random.fork_rng``.
    """
    if ref_size > refs.shape[0]:
        raise ValueError(f"ref_size {ref_size} exceeds the {refs.shape[0]} reference embeddings given")
    from transformers import get_linear_schedule_with_warmup

    groups = torch.as_tensor(list(query_groups), dtype=torch.long)
    n_batches = math.ceil(queries.shape[0] / batch_size)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    total = n_batches * epochs
    schedule = get_linear_schedule_with_warmup(optimizer, min(warmup_steps, total // 10), total)
    losses = []
    model.train()
    for _ in range(epochs):
        order, epoch_loss = torch.randperm(queries.shape[0]), 0.0
        for start in range(0, queries.shape[0], batch_size):
            batch = order[start : start + batch_size]
            picked = torch.randperm(refs.shape[0])[:ref_size]
            preds = model(queries[batch], refs[picked], ref_rates[groups[batch]][:, picked], tau)
            loss = F.binary_cross_entropy(preds, query_rates[batch])
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            epoch_loss += loss.item()
        losses.append(epoch_loss / n_batches)
    model.eval()
    return losses


@torch.no_grad()
def predict(model: DifficultyPredictor, queries: torch.Tensor, refs: torch.Tensor, ref_rates: torch.Tensor,
            tau: float = 1.0, chunk: int = 1024) -> torch.Tensor:
    """``p [N]`` for ``queries [N, d]`` given one reference set ``refs [K, d]`` with rates ``[K]``
    (evaluation mode: no dropout)."""
    model.eval()
    out = [model(q, refs, ref_rates.expand(q.shape[0], -1), tau) for q in torch.split(queries, chunk)]
    return torch.cat(out) if out else torch.zeros(0)
