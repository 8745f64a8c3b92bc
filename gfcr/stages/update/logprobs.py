"""Per-token log-probabilities of responses under a model, and padding of per-token arrays:
the tensors an update's loss is built from (torch is imported inside the functions, so that
compiling a pipeline never imports it)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def response_logprobs(model: Any, items: Sequence[Any], temperature: float) -> tuple[Any, Any]:
    """log pi(y_t) at every response position: ``[B, R]`` log-probs and ``[B, R]`` mask.

    ``items`` have ``prompt_ids`` and ``rollout``. The batch is ``[left-padded prompt |
    right-padded response]``, and the model computes logits only for the last ``R + 1``
    positions (the response's predictors)."""
    import torch

    prompts = [i.prompt_ids for i in items]
    responses = [i.rollout.response_token_ids for i in items]
    p_len, r_len = max(len(p) for p in prompts), max(len(r) for r in responses)
    ids = torch.zeros((len(items), p_len + r_len), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, p_len - len(p):p_len] = torch.tensor(p, dtype=torch.long)
        ids[b, p_len:p_len + len(r)] = torch.tensor(r, dtype=torch.long)
        attention[b, p_len - len(p):p_len + len(r)] = 1
    device = next(model.parameters()).device  # the policy trains on the GPU beside the vLLM engine
    ids, attention = ids.to(device), attention.to(device)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions,
                   logits_to_keep=r_len + 1).logits[:, :-1, :].float()  # [B, R, V]
    if temperature != 1.0:
        logits = logits / temperature
    targets = ids[:, p_len:]  # [B, R]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    mask = attention[:, p_len:].to(logp.dtype)
    return logp * mask, mask


def padded(arrays: Sequence[np.ndarray], width: int, device: Any = None) -> Any:
    """``[B, width]`` float32 tensor of right-zero-padded per-token arrays."""
    import torch

    out = torch.zeros((len(arrays), width), dtype=torch.float32)
    for b, a in enumerate(arrays):
        out[b, :len(a)] = torch.from_numpy(np.asarray(a, dtype=np.float32))
    return out if device is None else out.to(device)


def k3_kl(ref: Any, logp: Any, clamp: float | None = None) -> Any:
    """The k3 estimate of KL(pi || pi_ref) at every token, ``exp(x) - x - 1`` with
    ``x = log pi_ref - log pi`` (GRPO's KL term; verl's ``low_var_kl``). With ``clamp``, verl's
    numerics: ``x`` clamped to [-20, 20] and the estimate to [-clamp, clamp] (verl: 10), past which
    a token carries no gradient."""
    import torch

    x = ref - logp
    if clamp is None:
        return torch.exp(x) - x - 1
    x = x.clamp(-20.0, 20.0)
    return (torch.exp(x) - x - 1).clamp(-clamp, clamp)
