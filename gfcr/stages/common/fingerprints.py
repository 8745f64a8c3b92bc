"""Reasoning fingerprints: a rollout summarised by the policy's layer-wise states.

``filter.meds`` fingerprints whole rollouts; ``control.dots``, ``control.early_exit`` and the
success predictor of ``control.gps`` / ``control.depo`` embed a prompt (or a partial
response) with the last layer's fingerprint.

MEDS (arXiv 2604.11297) describes each rollout by the layer-wise logits of the policy's forward
pass. The engine protocol gives per-token log-probs and entropies only (``Engine.score``), no
intermediate layers, so the fingerprint is computed here with one extra forward pass of the
policy (``policy.model``, ``output_hidden_states=True``) over prompt + response, without
gradients and in eval mode:

    f_l = mean over the response positions of h_l[t]          (h_l: the output of decoder layer l)
    fingerprint = concat_l ( f_l / ||f_l|| ) / sqrt(L)       (a unit vector of L * d floats)

over the chosen layers (all decoder layers by default). The hidden state is the quantity the
logit lens projects onto the vocabulary; keeping it instead of the ``[V]`` logits per layer keeps
a fingerprint ``d / V`` times smaller (128 vs 30 floats per layer on tiny-arith, 576 vs 49152 on
SmolLM2-135M). Cost: one forward pass over the fingerprinted rollouts' prompt and response
tokens (charged to the step's ``tokens_scored``), ``L * d * 4`` bytes per fingerprint
(tiny-arith: 2 * 128 * 4 = 1 KiB; SmolLM2-135M: 30 * 576 * 4 = 69 KiB).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

BATCH = 32  # rows per forward pass


def fingerprints(model: Any, rows: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int,
                 layers: Sequence[int] | None = None) -> np.ndarray:  # [len(rows), L * d] float32
    """The fingerprint of each ``(prompt ids, response ids)`` row (a response has at least one token)."""
    import torch

    out = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(rows), BATCH):
                out.append(_batch(model, rows[start:start + BATCH], pad_id, layers))
    finally:
        model.train(was_training)
    return np.concatenate(out) if out else np.zeros((0, 0), dtype=np.float32)


def _batch(model: Any, rows: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int,
           layers: Sequence[int] | None) -> np.ndarray:
    import torch

    sequences = [list(p) + list(r) for p, r in rows]
    width = max(len(s) for s in sequences)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    hidden = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                   output_hidden_states=True).hidden_states[1:]  # L x [B, width, d]: each decoder layer's output
    chosen = [hidden[i] for i in (range(len(hidden)) if layers is None else layers)]
    response = torch.zeros((len(rows), width), dtype=torch.float32, device=device)  # [B, width]
    for i, (_, r) in enumerate(rows):
        response[i, width - len(r):] = 1.0  # left-padded: the response is each row's tail
    parts = []
    for h in chosen:
        pooled = (h.float() * response[..., None]).sum(1) / response.sum(1, keepdim=True)  # [B, d]
        parts.append(torch.nn.functional.normalize(pooled, dim=-1))
    return (torch.cat(parts, dim=-1) / len(chosen) ** 0.5).cpu().numpy().astype(np.float32)


def check_layers(layers: Sequence[int] | None, n_layers: int) -> None:
    """Raise ValueError unless every index names one of the model's ``n_layers`` decoder layers."""
    bad = [i for i in layers or () if not -n_layers <= i < n_layers]
    if bad:
        raise ValueError(f"`layers` {list(layers)}: {bad} out of range for a policy with {n_layers} decoder layers; "
                         f"use indices in [-{n_layers}, {n_layers - 1}] or null for all layers")
