"""The ``arithmetic`` data source: procedural integer arithmetic, seeded.

Each prompt asks for the value of ``a op b`` (or a longer chain) with operands of
``digits`` digits; the ground truth is the exact integer. Prompt ids are
``arithmetic:<split>-<seed>:<index>``, the same in every run with the same settings.

Example:

>>> pool = ArithmeticSource(ArithmeticSource.Config(n=3, seed=0)).load()
>>> len(pool), pool[0].prompt_id
(3, 'arithmetic:train-0:0')
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from gfcr.records import Prompt, PromptPool, VerifierSpec, prompt_id
from gfcr.registry import StageConfig



def evaluate(operands: list[int], ops: list[str]) -> int:
    """``operands[0] ops[0] operands[1] ...`` with the usual precedence (``*`` before ``+``/``-``)."""
    products, signs = [operands[0]], []
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            products[-1] *= x
        else:
            signs.append(op)
            products.append(x)
    value = products[0]
    for sign, x in zip(signs, products[1:]):
        value = value + x if sign == "+" else value - x
    return value


class ArithmeticSource:
    """Seeded arithmetic problems; difficulty by operand digits and number of operators."""

    class Config(StageConfig):
        n: Annotated[int, Field(ge=1, description="number of problems")] = 1000
        seed: Annotated[int, Field(ge=0, description="seed of the problems; the same seed gives the same pool")] = 0
        split: Annotated[str, Field(pattern=r"^[a-z0-9_]+$", description="a name for the pool, part of its prompt ids")] = "train"
        digits: Annotated[int, Field(ge=1, le=6, description="digits per operand")] = 2
        operators: Annotated[list[Literal["+", "-", "*"]], Field(min_length=1, description="operators drawn from")] = ["+", "-"]
        terms: Annotated[int, Field(ge=2, le=4, description="operands per problem")] = 2
        template: str = Field("What is {expr}? Answer:", description="`{expr}` is replaced by the problem")

    def __init__(self, config: Config):
        self.config = config

    def count_prompts(self, up_to: int) -> int:
        """The pool's size (at most ``up_to``), known without generating it."""
        return min(self.config.n, up_to)

    def load(self, on_error: Literal["fail", "skip"] = "fail") -> PromptPool:
        """The pool; ``on_error`` is accepted for the data-source protocol (generated rows are never bad)."""
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, cfg.digits, cfg.terms])
        low, high = (0 if cfg.digits == 1 else 10 ** (cfg.digits - 1)), 10**cfg.digits
        prompts = []
        for i in range(cfg.n):
            operands = [int(x) for x in rng.integers(low, high, cfg.terms)]
            ops = [cfg.operators[int(j)] for j in rng.integers(0, len(cfg.operators), cfg.terms - 1)]
            expr = " ".join([str(operands[0])] + [f"{op} {x}" for op, x in zip(ops, operands[1:])])
            value = evaluate(operands, ops)
            prompts.append(Prompt(
                prompt_id("arithmetic", f"{cfg.split}-{cfg.seed}", i),
                text=cfg.template.format(expr=expr),
                verifier=VerifierSpec("arithmetic", str(value)),
                metadata={"expr": expr, "digits": cfg.digits, "terms": cfg.terms},
            ))
        return PromptPool(prompts, name=f"arithmetic/{cfg.split}")
