"""What ``update.grpo`` does for an advantage estimator that weighs by gradients
(``gfcr.registry.components.WeighsByGradients``: VCPO's OPOB baseline): each trajectory's own
gradient before the step's backward pass, the table of them summed over the trainer ranks, and
the advantages from it.

Per trajectory ``i`` (one forward and one backward pass; the reference's ``update_policy_per_traj``
takes one backward per trajectory too): ``||g_i||^2``, with ``g_i`` the gradient of its loss at
advantage 1 summed over its counted tokens (its ratio and the correction's weights as the update
takes them; no KL term), ``log w_i = sum_t log pi_old - log mu`` over the counted tokens, its reward
``R_i`` and its counted tokens ``L_i``. The forward items are numbered in ``prepare``
(``number_groups``), so that a rank fills its own columns of the ``[4, N]`` table and, after the
sum over the ranks, holds every group whole, whichever rank trained its other members.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from gfcr.stages.components.lr_rule import sequence_log_weights
from gfcr.stages.training import Ranks
from gfcr.stages.update.logprobs import padded, response_logprobs

Measure = Callable[[Any], tuple[float, float, float, float]]


def number_groups(forward: list[Any]) -> None:
    """Give each forward item its place (``index``), its group's places (``slots``) and the forward
    count (``forward_count``): what every rank needs, whatever shard an item lands in."""
    places: dict[str, list[int]] = {}
    for index, item in enumerate(forward):
        item.index, item.forward_count = index, len(forward)
        places.setdefault(_group_key(item), []).append(index)
    for item in forward:
        item.slots = tuple(places[_group_key(item)])


def refine_shard(shard: list[Any], measure: Measure, estimator: Any, ranks: Ranks, device: Any) -> list[float]:
    """Each shard item's advantage (times its ``scale``, the sample weights) from its group's
    columns of the ``[4, N]`` table (``measure`` gives an item's column), summed over the ranks;
    written onto the items and their rollouts, and returned in shard order."""
    import torch

    n = shard[0].forward_count if shard else 0
    table = torch.zeros(4, n, dtype=torch.float64)  # [4, N]: ||g_i||^2, log w_i, R_i, L_i
    for item in shard:
        table[:, item.index] = torch.tensor(measure(item), dtype=torch.float64)
    if ranks.world_size > 1:
        moved = table.to(device)
        ranks.all_reduce_sum([moved])
        table = moved.cpu()
    values = table.numpy()
    refined: dict[tuple[int, ...], np.ndarray] = {}
    out = []
    for item in shard:
        if item.slots not in refined:
            sq, log_w, rewards, lengths = (values[row, list(item.slots)] for row in range(4))
            refined[item.slots] = np.asarray(estimator.refine_group(rewards, sq, log_w, lengths))
        a = float(refined[item.slots][item.slots.index(item.index)]) * item.scale
        item.advantage = a
        item.rollout.advantage = a
        out.append(a)
    return out


def trajectory_gradient(model: Any, item: Any, ratio: Callable[..., tuple[Any, Any]], loss: Any, temperature: float,
                        needs_logprobs: bool) -> tuple[float, float, float, float]:
    """``(||g||^2, log w, R, L)`` of one trajectory (the module docstring); ``ratio(chunk, logp,
    behaviour, weight)`` is the update's ``(log_ratio, correction)``."""
    import torch

    logp, mask = response_logprobs(model, [item], temperature)  # [1, R]
    behaviour = padded([item.rollout.behavior_logprobs], mask.shape[1], logp.device)  # [1, R]
    weight = mask if item.weights is None else mask * padded([item.weights], mask.shape[1], logp.device)
    log_ratio, correction = ratio([item], logp, behaviour, weight)
    extra = {"logprobs": logp.detach()} if needs_logprobs else {}
    terms = loss.terms(log_ratio, torch.ones_like(logp), weight, **extra)
    per_token = terms.per_token if correction is None else terms.per_token * correction.weight
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad((per_token * weight).sum(), params, allow_unused=True)
    sq = float(sum(g.detach().double().pow(2).sum() for g in grads if g is not None))
    log_w = float(sequence_log_weights(logp, behaviour, weight)[0])
    return sq, log_w, float(item.rollout.reward), float((weight > 0).sum())


def write_back_advantages(items: list[Any], shards: list[list[float] | None]) -> None:
    """The advantages the ranks computed, in the shards' order (which is the items'), onto the
    driver's items and rollouts."""
    values = [a for shard in shards for a in (shard or [])]
    for item, a in zip(items, values, strict=True):
        item.advantage = a
        item.rollout.advantage = a


def _group_key(item: Any) -> str:
    return item.group.group_id if item.group is not None else item.rollout.rollout_id
