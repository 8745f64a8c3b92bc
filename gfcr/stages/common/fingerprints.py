"""Reasoning fingerprints: a rollout summarised by the policy's layer-wise states.

The engine protocol gives per-token log-probs and entropies only (``Engine.score``), no
intermediate layers, so both fingerprints are computed here with one extra forward pass of the
policy (``policy.model``, ``output_hidden_states=True``) over prompt + response, without
gradients and in eval mode (its tokens are charged to the step's ``tokens_scored``).

``answer_logits``, MEDS's own (Linxi000/MEDS@2e2b040, ``recipe/MEDS/extract_layer_logits.py``,
run there inside the old-log-prob pass): at the position that predicts the answer's first token
(after the last ``\\boxed{``: ``boxed_anchor``), the logit each decoder layer's hidden state gives
that token through the output head (the logit lens, ``lm_head(h_l)[answer token]``), the last 14
layers kept: 14 floats a rollout. ``filter.meds`` uses it by default.

``fingerprints``, mean-pooled hidden states (``filter.meds``'s ``features: hidden_states``, and
with the last layer the prompt embedding of ``control.dots``, ``control.early_exit`` and the success
predictor of ``control.gps`` / ``control.depo``):

    f_l = mean over the response positions of h_l[t]          (h_l: the output of decoder layer l)
    fingerprint = concat_l ( f_l / ||f_l|| ) / sqrt(L)       (a unit vector of L * d floats)

over the chosen layers (all decoder layers by default): ``L * d * 4`` bytes per fingerprint
(tiny-arith: 2 * 128 * 4 = 1 KiB; SmolLM2-135M: 30 * 576 * 4 = 69 KiB).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

BATCH = 32  # rows per forward pass

# Why a stage that runs these needs the synchronous lifecycle (its Config's ``sync_only``,
# ``gfcr.registry.NeedsSyncLifecycle``): the forward pass reads ``policy.model`` between the
# engine's calls, and under ``pipelined`` or ``async`` the trainer is stepping that model then.
FORWARDS_POLICY = ("forwards the trained policy itself (hidden states, outside the engine), and under an "
                   "overlapped lifecycle the trainer is stepping that model at the same time, so the features "
                   "would belong to no one policy version")


def fingerprints(model: Any, rows: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int,
                 layers: Sequence[int] | None = None) -> np.ndarray:  # [len(rows), L * d] float32
    """The fingerprint of each ``(prompt ids, response ids)`` row (a response has at least one token)."""
    out = _in_batches(model, rows, lambda chunk: _batch(model, chunk, pad_id, layers))
    return np.concatenate(out) if out else np.zeros((0, 0), dtype=np.float32)


def _batch(model: Any, rows: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int,
           layers: Sequence[int] | None) -> np.ndarray:
    import torch

    mask, hidden = _hidden_states(model, [(p, r) for p, r in rows], pad_id)
    width, device = mask.shape[1], mask.device
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


def answer_logits(model: Any, rows: Sequence[tuple[Sequence[int], Sequence[int], int]], pad_id: int,
                  last_layers: int | None = None) -> np.ndarray:  # [len(rows), min(L, last_layers)] float64
    """MEDS's fingerprint (Linxi000/MEDS, ``extract_layer_logits_from_hidden_states``): for each
    ``(prompt ids, response ids, anchor)`` row, the logit the logit lens gives the answer's first
    token at every decoder layer: ``lm_head(h_l[anchor])[response[anchor + 1]]``, ``h_l`` the output
    of layer ``l`` (the last one after the final norm, as the model returns it), ``anchor`` an index
    into the response (-1: the prompt's last token), keeping the last ``last_layers`` layers."""
    out = _in_batches(model, rows, lambda chunk: _answer_batch(model, chunk, pad_id))
    logits = np.concatenate(out) if out else np.zeros((0, 0))
    return logits if last_layers is None else logits[:, -last_layers:]


def _answer_batch(model: Any, rows: Sequence[tuple[Sequence[int], Sequence[int], int]], pad_id: int) -> np.ndarray:
    import torch

    mask, hidden = _hidden_states(model, [(p, r) for p, r, _ in rows], pad_id)
    width, device = mask.shape[1], mask.device
    rows_t = torch.arange(len(rows), device=device)
    at = torch.tensor([width - len(r) + a for _, r, a in rows], device=device)  # left-padded: the response is the tail
    target = torch.tensor([r[a + 1] for _, r, a in rows], device=device)
    head = model.get_output_embeddings()
    per_layer = [head(h[rows_t, at]).float()[rows_t, target] for h in hidden]  # L x [B]
    return torch.stack(per_layer, dim=1).cpu().numpy().astype(np.float64)


def boxed_anchor(response: Sequence[int], boxed: Sequence[int], tokens: Sequence[str]) -> int | None:
    """Where MEDS reads the answer (``find_brace_positions_in_responses``): the index of the
    ``{`` ending the last ``\\boxed{`` (``boxed``: its token ids) in the response; failing that,
    the first token with a ``{`` within 10 tokens of a token that contains "boxed", the last such
    token first (``tokens``: the response's token strings); None without one."""
    ids, n = list(response), len(boxed)
    pos = next((j + n - 1 for j in range(len(ids) - n, -1, -1) if n and ids[j:j + n] == list(boxed)), None)
    for i in range(len(tokens) - 1, -1, -1) if pos is None else ():
        if tokens[i] and "boxed" in tokens[i].lower():
            pos = next((m for m in range(i, min(i + 10, len(tokens))) if tokens[m] and "{" in tokens[m]), None)
            if pos is not None:
                break
    return pos


def first_token_anchor(pieces: Sequence[str]) -> int | None:
    """The response index that predicts its first token with text other than whitespace (-1:
    the prompt's last token), given each response token's decoded text; None if there is none.
    gfcr's reading of the answer for tasks without ``\\boxed{``, whose response is the answer."""
    first = next((i for i, piece in enumerate(pieces) if piece.strip()), None)
    return None if first is None else first - 1


def _in_batches(model: Any, rows: Sequence[Any], forward: Any) -> list[np.ndarray]:
    """``forward`` over ``rows`` in chunks of ``BATCH``, in eval mode without gradients (the
    model's mode restored after)."""
    import torch

    out = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(rows), BATCH):
                out.append(forward(rows[start:start + BATCH]))
    finally:
        model.train(was_training)
    return out


def _hidden_states(model: Any, rows: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int) -> tuple[Any, Any]:
    """One forward over the prompt + response rows, left-padded: the attention mask ``[B, width]``
    and each decoder layer's output (``L x [B, width, d]``)."""
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
                   output_hidden_states=True).hidden_states[1:]
    return mask, hidden
