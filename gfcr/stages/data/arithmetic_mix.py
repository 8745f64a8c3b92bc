"""The ``arithmetic_mix`` data source: arithmetic of graded difficulty, split train / eval.

Each prompt asks for ``a op b`` from one of eight *categories* that mix operand sizes
(one or two digits) and operators (``+``, ``-``, ``*``), and tell apart problems whose
units column carries (or borrows) from those where it does not:

===================  ==============================================================  =====
category             problems                                                        count
===================  ==============================================================  =====
``1d+1d``            ``a + b``, ``a, b`` in 0..9                                     100
``1d*1d``            ``a * b``, ``a, b`` in 0..9                                     100
``2d+2d no carry``   ``a + b``, ``a, b`` in 10..99, units sum < 10                   4,455
``2d+2d carry``      ``a + b``, ``a, b`` in 10..99, units sum >= 10                  3,645
``2d-2d no borrow``  ``a - b``, ``a, b`` in 10..99, ``|a - b|`` needs no borrow      4,860
``2d-2d borrow``     ``a - b``, ``a, b`` in 10..99, ``|a - b|`` needs a borrow       3,240
``2d*1d no carry``   ``a * b``, ``a`` in 10..99, ``b`` in 2..9, units product < 10   198
``2d*1d carry``      ``a * b``, ``a`` in 10..99, ``b`` in 2..9, units product >= 10  522
===================  ==============================================================  =====

(A one-digit multiplier of 0 or 1 would make ``2d*1d`` trivial, hence 2..9.) The
categories exist so that a policy's accuracy can be reported per category: every
prompt's ``metadata`` names its ``category`` and ``expr``. The ground truth is the exact
integer, scored by the ``arithmetic`` verifier.

Splits: a fixed fifth of all problems (``crc32(expr) % 5 == 0``, ``expr`` as printed: ``"47 + 12"``) is
the ``eval`` split, the rest ``train``; the two never share a problem, and
``scripts/train_tiny_arith_mix.py`` never trains the ``tiny-arith-mix`` policy on the
``eval`` split either. Prompt ``i`` is from category ``categories[i % len(categories)]``
(so every category gets the same number of prompts); within a category the split's
problems come in a seeded random order, starting over once all were used (only the small
one-digit categories, ~20 eval problems each, repeat in an eval pool of 200). Prompt ids
are ``arithmetic_mix:<split>-<seed>:<index>``, the same in every run with the same
settings.

Deviations: none (gfcr's own task; no paper).

Example:

>>> pool = ArithmeticMixSource(ArithmeticMixSource.Config(n=8, seed=0, split="eval")).load()
>>> pool[0].prompt_id, pool[0].metadata["category"]
('arithmetic_mix:eval-0:0', '1d+1d')
>>> sorted({p.metadata["category"] for p in pool}) == sorted(CATEGORIES)
True

YAML:

.. code-block:: yaml

    data: {source: arithmetic_mix, with: {split: train, n: 4000, seed: 0}}
    eval: {source: arithmetic_mix, with: {split: eval, n: 200, seed: 1}, every: 20}
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Literal, get_args

import numpy as np
from pydantic import Field, field_validator

from gfcr.records import Prompt, PromptPool, VerifierSpec, prompt_id
from gfcr.registry import Seed, StageConfig

CategoryName = Literal["1d+1d", "1d*1d", "2d+2d no carry", "2d+2d carry", "2d-2d no borrow",
                       "2d-2d borrow", "2d*1d no carry", "2d*1d carry"]
Split = Literal["train", "eval"]
EVAL_MOD = 5  # problems with crc32(expr) % 5 == 0 form the eval split


@dataclass(frozen=True)
class Category:
    """Problems ``a op b`` with ``a`` in ``left``, ``b`` in ``right``, the units column
    carrying (or borrowing) iff ``carry`` (either way when None)."""

    op: str
    left: range
    right: range
    carry: bool | None = None


ONE, TWO = range(0, 10), range(10, 100)
CATEGORIES: dict[str, Category] = {
    "1d+1d": Category("+", ONE, ONE),
    "1d*1d": Category("*", ONE, ONE),
    "2d+2d no carry": Category("+", TWO, TWO, False),
    "2d+2d carry": Category("+", TWO, TWO, True),
    "2d-2d no borrow": Category("-", TWO, TWO, False),
    "2d-2d borrow": Category("-", TWO, TWO, True),
    "2d*1d no carry": Category("*", TWO, range(2, 10), False),
    "2d*1d carry": Category("*", TWO, range(2, 10), True),
}
assert set(CATEGORIES) == set(get_args(CategoryName))


def answer(a: int, op: str, b: int) -> int:
    """The exact value of ``a op b``."""
    return a + b if op == "+" else a - b if op == "-" else a * b


def units_carry(a: int, op: str, b: int) -> bool:
    """Whether the units column carries (``+``, ``*`` by a one-digit ``b``) or borrows
    (``-``, computed as ``big - small`` with the sign in front)."""
    if op == "+":
        return a % 10 + b % 10 >= 10
    if op == "-":
        return max(a, b) % 10 < min(a, b) % 10
    return (a % 10) * b >= 10


def expression(a: int, op: str, b: int) -> str:
    return f"{a} {op} {b}"


def split_of(a: int, op: str, b: int) -> Split:
    """``eval`` for a fixed fifth of the problems (a CRC-32 of the expression), else ``train``."""
    return "eval" if zlib.crc32(expression(a, op, b).encode()) % EVAL_MOD == 0 else "train"


def category_of(a: int, op: str, b: int) -> str | None:
    """The category ``a op b`` belongs to, or None if it is in none."""
    for name, cat in CATEGORIES.items():
        if op == cat.op and a in cat.left and b in cat.right and \
                (cat.carry is None or units_carry(a, op, b) == cat.carry):
            return name
    return None


@lru_cache(maxsize=None)
def problems(category: str, split: Split) -> tuple[tuple[int, str, int], ...]:
    """All problems ``(a, op, b)`` of ``category`` in ``split``, in a fixed order."""
    cat = CATEGORIES[category]
    return tuple((a, cat.op, b) for a in cat.left for b in cat.right
                 if (cat.carry is None or units_carry(a, cat.op, b) == cat.carry)
                 and split_of(a, cat.op, b) == split)


class ArithmeticMixSource:
    """Arithmetic in eight categories of graded difficulty, with a held-out ``eval`` split."""

    class Config(StageConfig):
        n: Annotated[int, Field(ge=1, description="number of prompts")] = 1000
        seed: Seed = Field(0, description="orders each category's problems")
        split: Split = Field("train", description="`eval`: the held-out fifth of the problems; `train`: the rest")
        categories: list[CategoryName] = Field(
            list(CATEGORIES), min_length=1,
            description="categories to draw from, in turn (prompt i is from categories[i % len])")
        template: str = Field("What is {expr}? Answer:", description="`{expr}` is replaced by the problem")

        @field_validator("categories")
        @classmethod
        def _unique(cls, value: list[str]) -> list[str]:
            if len(set(value)) != len(value):
                raise ValueError("each category may be named once; fix: remove the repeated names")
            return value

    def __init__(self, config: Config):
        self.config = config

    def load(self, on_error: Literal["fail", "skip"] = "fail") -> PromptPool:
        """The pool; ``on_error`` is accepted for the data-source protocol (generated rows are never bad)."""
        cfg = self.config
        orders = {name: np.random.default_rng([cfg.seed, list(CATEGORIES).index(name)])
                  .permutation(len(problems(name, cfg.split))) for name in cfg.categories}
        prompts = []
        for i in range(cfg.n):
            name = cfg.categories[i % len(cfg.categories)]
            order = orders[name]
            a, op, b = problems(name, cfg.split)[int(order[(i // len(cfg.categories)) % len(order)])]
            expr = expression(a, op, b)
            prompts.append(Prompt(
                prompt_id("arithmetic_mix", f"{cfg.split}-{cfg.seed}", i),
                text=cfg.template.format(expr=expr),
                verifier=VerifierSpec("arithmetic", str(answer(a, op, b))),
                metadata={"expr": expr, "category": name},
            ))
        return PromptPool(prompts, name=f"arithmetic_mix/{cfg.split}")
