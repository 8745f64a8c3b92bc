"""aggregation ``lambda_grpo``: lambda-GRPO, learnable token preferences (Wang, Zhao, Zhao, Guan,
Penn and Liu, 2025, "lambda-GRPO: Unifying the GRPO Frameworks with Learnable Token
Preferences", arXiv 2510.06870).

GRPO, DAPO and Dr.GRPO differ in how much each response's tokens weigh; lambda-GRPO weighs
response ``o_i`` of a group of ``G`` by a length preference with one learnable exponent
``lambda``:

    z_i = (|o_i| - mean_j |o_j|) / (std_j |o_j| + 1e-8)      (over the group's responses)
    h_i = 1 + r z_i
    f_i = G * softmax_j(h_j ** lambda)_i
    L   = sum_i f_i sum_t w_it l_it / sum_{i,t} w_it          (over the whole batch)

``lambda = 0`` gives ``f_i = 1``, DAPO's token mean (``token_mean``); ``lambda > 0`` favours
longer responses, ``lambda < 0`` shorter ones. ``lambda`` is a parameter trained by the update's
optimizer with the policy (its own learning rate with ``lr``). ``h_i`` must stay positive for
a real power: a group where ``1 + r z_i <= 0`` is refused, naming it (lower ``r``); with a fixed
group size ``G`` from a Control stage, ``gfcr validate`` already requires ``r < sqrt(G) / (G - 1)``.

Deviations and what could not be verified: only the abstract and third-party summaries of the
paper could be read (they give ``z``, ``h = 1 + r z``, ``h ** lambda`` and the softmax). The
factor ``G`` on the softmax, the batch-wide token normalisation, the unbiased std
(``ddof = 1``; a group of one has ``z = 0``), ``lambda``'s initial value 0 and its learning rate
are this implementation's choices, and ``r`` has no default (the paper's value could not be
confirmed). The response length is its token count ``Row.length``.

Example (a group of a 1-token and a 3-token response, ``r = 0.5``; at ``lambda = 0`` it is the
token mean, ``(4 + 3) / 4``):

>>> import numpy as np, torch
>>> agg = LambdaGRPO(LambdaGRPO.Config(r=0.5))
>>> rows = [Row("g", 2, np.zeros(2), 1, 1.0, 1), Row("g", 2, np.zeros(2), 3, 3.0, 3)]
>>> per_token = torch.tensor([[4.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
>>> weight = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
>>> round(float(agg.reduce(per_token, weight, rows, agg.plan(rows)).detach()), 6)
1.75

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {aggregation: {use: lambda_grpo, with: {r: 0.3}}}}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Sequence

import numpy as np
from pydantic import Field

from gfcr.registry import PipelineProblem
from gfcr.stages.components.aggregation.base import AggregationConfig, Row
from gfcr.stages.components.base import PairingContext


@dataclass(frozen=True)
class LengthPlan:
    """Each group's response lengths in the batch, and the batch's token weight."""

    lengths: dict[str, np.ndarray]  # group id -> [n] lengths of its responses in the batch
    tokens: float


class LambdaGRPO:
    """Token mean with a learnable, length-dependent weight per response."""

    class Config(AggregationConfig):
        r: Annotated[float, Field(gt=0.0, description="scale of the standardised length in h = 1 + r z (no "
                                                      "default: the paper's value could not be confirmed)")]
        lambda_init: float = Field(0.0, description="initial lambda; 0 is the token mean (DAPO)")
        lr: Annotated[float, Field(gt=0.0)] | None = Field(
            None, description="learning rate of lambda; null: the update's lr")

    @staticmethod
    def pairing_problems(config: "LambdaGRPO.Config", ctx: PairingContext) -> list[PipelineProblem]:
        """With a fixed group size G, ``|z| <= (G - 1) / sqrt(G)`` (one response apart from the
        others, sample std), so ``h > 0`` for every group exactly when ``r < sqrt(G) / (G - 1)``."""
        g = ctx.rollouts_per_prompt
        if g is None or g < 2 or config.r * (g - 1) / math.sqrt(g) < 1.0:
            return []
        bound = math.sqrt(g) / (g - 1)
        return [PipelineProblem(
            ("aggregation", "with", "r"),
            f"with {g} rollouts per prompt (`{ctx.rollouts_from}`), a group whose lengths are all equal "
            f"but one has h = 1 + r z <= 0 for r = {config.r}, and lambda_grpo would stop the run",
            f"set `r` below sqrt(G) / (G - 1) = {bound:.4f}")]

    def __init__(self, config: Config):
        import torch

        self.config = config
        self.lam = torch.nn.Parameter(torch.tensor(float(config.lambda_init)))

    def parameters(self, device: Any) -> list[dict[str, Any]]:
        self.lam.data = self.lam.data.to(device)
        group: dict[str, Any] = {"params": [self.lam], "weight_decay": 0.0}
        if self.config.lr is not None:
            group["lr"] = self.config.lr
        return [group]

    def plan(self, rows: Sequence[Row]) -> LengthPlan:
        lengths: dict[str, list[int]] = {}
        for row in rows:
            lengths.setdefault(row.group_id, []).append(row.length)
        plan = LengthPlan({g: np.asarray(v, dtype=np.float64) for g, v in lengths.items()},
                          float(sum(r.token_weight for r in rows)))
        for group_id, values in plan.lengths.items():
            h = self.lifted(values)
            if (h <= 0).any():
                raise ValueError(f"group {group_id}: h = 1 + r z is not positive for lengths {values.tolist()} "
                                 f"(r = {self.config.r}); lower `r` so that h ** lambda is defined")
        return plan

    def lifted(self, lengths: np.ndarray) -> np.ndarray:
        """``h = 1 + r z`` for the lengths of one group."""
        if len(lengths) < 2:
            return np.ones_like(lengths)
        z = (lengths - lengths.mean()) / (lengths.std(ddof=1) + 1e-8)
        return 1.0 + self.config.r * z

    def preference(self, row: Row, plan: LengthPlan, like: Any) -> Any:
        """``f_i = G softmax_j(h_j ** lambda)_i`` of one response (a differentiable scalar)."""
        import torch

        lengths = plan.lengths[row.group_id]
        h = torch.as_tensor(self.lifted(lengths), dtype=like.dtype, device=like.device)  # [n]
        g = h ** self.lam.to(like.dtype)
        mine = int(np.flatnonzero(lengths == row.length)[0])  # equal lengths have equal z, so any match is it
        return len(lengths) * torch.softmax(g, 0)[mine]

    def reduce(self, per_token: Any, weight: Any, rows: Sequence[Row], plan: LengthPlan) -> Any:
        import torch

        f = torch.stack([self.preference(r, plan, per_token) for r in rows])  # [B]
        return (f * (per_token * weight).sum(1)).sum() / plan.tokens

    def metrics(self) -> dict[str, float]:
        return {"lambda": float(self.lam.detach())}

    def state_dict(self) -> dict[str, Any]:
        return {"lambda": float(self.lam.detach())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch

        with torch.no_grad():
            self.lam.fill_(float(state["lambda"]))
