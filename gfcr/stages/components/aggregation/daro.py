"""aggregation ``daro``: DARO, Difficulty-Aware Reweighting Policy Optimization (Zhou, Ma, Liang,
Shen, Cui and Zhang, 2025, arXiv 2510.09001).

Responses are grouped by their prompt's difficulty, the empirical pass rate ``mu`` of the
prompt's group (the mean of its binary rewards, ``Row.group_rewards``). Each difficulty group
``mu`` in ``M = {1/G, ..., (G-1)/G}`` is treated as a task of a multi-task loss with a learnable
weight ``w_mu > 0``:

    L_mu = sum_{i in mu} sum_t w_it l_it / sum_{i in mu} sum_t w_it        (token mean within mu)
    L    = sum_{mu in batch} ( w_mu L_mu - ln w_mu )

The weights are trained by the update's optimizer together with the policy; at a stationary
point ``w_mu = 1 / L_mu``, so a difficulty whose loss is small is up-weighted instead of
fading out. Groups with ``mu = 0`` or ``mu = 1`` carry no GRPO signal and are not in ``M``: they
contribute nothing. ``- ln w_mu`` is added once per step (``batch_term``) for each ``mu`` present
in the batch; a difficulty absent from the batch has no term, so its weight stays put.

Parametrisation: ``w_mu = exp(s_mu)`` with ``s_mu`` the learned parameter, initialised to 0
(``w = 1``), so that a weight can never reach 0 or below.

Deviations and what could not be verified: only the paper's abstract and third-party summaries
could be read, not its method section or code. The objective above (``w_mu L_mu - ln w_mu`` per
difficulty group, groups by pass rate, ``mu = 0, 1`` excluded) is what they describe; the
normalisation of ``L_mu`` (token mean within the group), the log parametrisation, the
initial weights and the weights' learning rate (the policy's unless ``lr`` is set) are this
implementation's choices. Rewards must be binary and every group must have ``G`` rewards
(``rollouts_per_prompt``), else ``plan`` raises naming the group.

Example (G = 4; one response of a prompt solved 1 time in 4, two of a prompt solved 2 times in
4; weights 1: ``L = 4/1 + (1 + 3)/2 - ln 1 - ln 1 = 6``):

>>> import numpy as np, torch
>>> agg = DARO(DARO.Config(rollouts_per_prompt=4))
>>> rows = [Row("a", 4, np.array([1., 0., 0., 0.]), 1, 1.0, 1),
...         Row("b", 4, np.array([1., 1., 0., 0.]), 1, 1.0, 1), Row("b", 4, np.array([1., 1., 0., 0.]), 1, 1.0, 1)]
>>> plan = agg.plan(rows)
>>> loss = agg.reduce(torch.tensor([[4.0], [1.0], [3.0]]), torch.ones(3, 1), rows, plan) + agg.batch_term(plan)
>>> float(loss.detach())
6.0

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {aggregation: {use: daro, with: {rollouts_per_prompt: 8}}}}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Sequence

import numpy as np
from pydantic import Field

from gfcr.registry import PipelineProblem
from gfcr.stages.components.aggregation.base import AggregationConfig, Row
from gfcr.stages.components.base import PairingContext


@dataclass(frozen=True)
class DifficultyPlan:
    """The batch's token weight per difficulty index ``k`` (``mu = k / G``)."""

    tokens: dict[int, float]


class DARO:
    """Per-difficulty learnable loss weights with a ``-ln w`` regulariser."""

    class Config(AggregationConfig):
        rollouts_per_prompt: Annotated[int, Field(ge=2, description="G, the group size: difficulties are "
                                                                    "mu = k/G, k = 1..G-1")]
        lr: Annotated[float, Field(gt=0.0)] | None = Field(
            None, description="learning rate of the log-weights; null: the update's lr")

    @staticmethod
    def pairing_problems(config: Config, ctx: PairingContext) -> list[PipelineProblem]:
        g = ctx.rollouts_per_prompt
        if g is None or g == config.rollouts_per_prompt:
            return []
        return [PipelineProblem(
            ("aggregation", "with", "rollouts_per_prompt"),
            f"DARO's difficulties are pass rates k/{config.rollouts_per_prompt}, but stage "
            f"`{ctx.rollouts_from}` allocates {g} rollouts per prompt",
            f"set `rollouts_per_prompt: {g}` (--set update.with.aggregation.with.rollouts_per_prompt={g})")]

    def __init__(self, config: Config):
        import torch

        self.config = config
        # log_w[k - 1] = s_mu for mu = k / G
        self.log_w = torch.nn.Parameter(torch.zeros(config.rollouts_per_prompt - 1))

    def parameters(self, device: Any) -> list[dict[str, Any]]:
        self.log_w.data = self.log_w.data.to(device)
        group: dict[str, Any] = {"params": [self.log_w], "weight_decay": 0.0}
        if self.config.lr is not None:
            group["lr"] = self.config.lr
        return [group]

    def difficulty(self, row: Row) -> int:
        """``k`` with ``mu = k / G`` (0 and G: outside ``M``)."""
        rewards, g = np.asarray(row.group_rewards, dtype=np.float64), self.config.rollouts_per_prompt
        if rewards.shape != (g,) or not np.isin(rewards, (0.0, 1.0)).all():
            raise ValueError(f"group {row.group_id}: DARO needs {g} binary rewards (its pass rate is the "
                             f"difficulty), got {rewards.tolist()}; set `rollouts_per_prompt` to the group size "
                             "and use a 0/1 verifier")
        return int(rewards.sum())

    def plan(self, rows: Sequence[Row]) -> DifficultyPlan:
        tokens: dict[int, float] = {}
        for row in rows:
            k = self.difficulty(row)
            if 0 < k < self.config.rollouts_per_prompt and row.token_weight > 0:
                tokens[k] = tokens.get(k, 0.0) + row.token_weight
        return DifficultyPlan(tokens)

    def reduce(self, per_token: Any, weight: Any, rows: Sequence[Row], plan: DifficultyPlan) -> Any:
        import torch

        ks = [self.difficulty(r) for r in rows]
        inside = [k in plan.tokens for k in ks]
        index = torch.tensor([k - 1 if i else 0 for k, i in zip(ks, inside)], device=per_token.device)
        scale = torch.tensor([1.0 / plan.tokens[k] if i else 0.0 for k, i in zip(ks, inside)],
                             dtype=per_token.dtype, device=per_token.device)  # [B]: 1 / tokens of its mu
        w = torch.exp(self.log_w).to(per_token.dtype)[index]  # [B]: w_mu of each response
        return (w * scale * (per_token * weight).sum(1)).sum()

    def batch_term(self, plan: DifficultyPlan) -> Any:
        if not plan.tokens:
            return None
        return -self.log_w[[k - 1 for k in sorted(plan.tokens)]].sum()  # -sum ln w_mu

    def weights(self) -> dict[str, float]:
        g = self.config.rollouts_per_prompt
        return {f"{k}/{g}": float(w) for k, w in enumerate(self.log_w.detach().exp().tolist(), start=1)}

    def metrics(self) -> dict[str, float]:
        return {f"daro_weight_{k.replace('/', '_of_')}": w for k, w in self.weights().items()}

    def state_dict(self) -> dict[str, Any]:
        return {"log_weights": self.log_w.detach().cpu().tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch

        values = torch.tensor(state["log_weights"], dtype=self.log_w.dtype)
        if values.shape != self.log_w.shape:
            raise ValueError(f"DARO state has {values.numel()} weights, this Config expects {self.log_w.numel()} "
                             f"(rollouts_per_prompt={self.config.rollouts_per_prompt})")
        with torch.no_grad():
            self.log_w.copy_(values.to(self.log_w.device))
