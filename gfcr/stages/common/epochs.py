"""Epochs over a prompt pool: a seeded permutation per epoch, and where the next batch starts.

Shared by the selectors that walk the pool epoch by epoch (``control.uniform``, ``greso``,
``hive``, ``vade``, ``beta_thompson``, ``depo``, ``sgpo``): a batch never spans two epochs;
when fewer than ``batch_size`` prompts are left, the next epoch starts (PyTorch's
``DataLoader(drop_last=True)``), so no prompt appears twice in one batch. The permutation is a
pure function of ``(seed, epoch)``, so a resumed run reads the same order from its cursor.

Example:

>>> start_batch(epoch=0, cursor=8, batch_size=4, pool_size=10)  # 2 left: a new epoch
(1, 0)
>>> sorted(epoch_order(seed=0, epoch=1, pool_size=5).tolist())
[0, 1, 2, 3, 4]
"""

from __future__ import annotations

import numpy as np

from gfcr.errors import GfcrError


def start_batch(epoch: int, cursor: int, batch_size: int, pool_size: int) -> tuple[int, int]:
    """``(epoch, cursor)`` where the next batch starts: a new epoch when the current one has
    fewer than ``batch_size`` prompts left (``drop_last``)."""
    if batch_size > pool_size:
        raise GfcrError(f"a call draws {batch_size} prompts, more than the pool's {pool_size}",
                        "lower the stage's `batch_size` (and `candidate_ratio`, where it has one), "
                        "or give the data more prompts")
    return (epoch + 1, 0) if cursor + batch_size > pool_size else (epoch, cursor)


def epoch_order(seed: int, epoch: int, pool_size: int) -> np.ndarray:  # [pool_size] int
    """The seeded permutation of the pool for one epoch: reproducible from ``(seed, epoch)``."""
    return np.random.default_rng([seed, epoch]).permutation(pool_size)
