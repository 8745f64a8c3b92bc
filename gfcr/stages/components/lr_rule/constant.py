"""lr_rule ``constant``: the optimizer's learning rate as configured, every step (AdamW with a
constant rate, as GRPO's recipe, arXiv 2402.03300, trains).

Deviations: none; a schedule (warm-up, decay) is not offered yet.

Fidelity: gfcr's own (it reads nothing and returns the factor 1).

Example:

>>> Constant(Constant.Config()).factor([])
(1.0, {})

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {lr: 1.0e-4, lr_rule: {use: constant}}}
"""

from __future__ import annotations

from typing import Any

from gfcr.stages.components.lr_rule.base import LrRuleConfig


class Constant:
    """The configured learning rate, unchanged."""

    class Config(LrRuleConfig):
        pass

    def __init__(self, config: Config):
        self.config = config

    def sums(self, log_seq_weights: Any) -> Any:
        import torch

        return torch.zeros(0, dtype=torch.float64)

    def factor(self, totals: list[float]) -> tuple[float, dict[str, float]]:
        return 1.0, {}
