"""Down-sampling rules shared by ``filter.d3s``: the max-variance subset, the top-fraction token
mask and the linear keep-ratio schedule. Pure numpy functions on hand-checkable values.

Max-variance subset (PODS, Xu, Savani, Fang, Kolter, 2025, arXiv 2504.13818): among the
subsets of ``m`` of ``n`` values, one with the largest (population) variance is made of the
``k`` largest and the ``m - k`` smallest values for some ``k`` in ``0..m``; trying every ``k``
with prefix sums over the sorted values costs ``O(n log n)``.

>>> max_variance_subset(np.array([0.0, 1.0, 0.0, 0.0, 0.5, 1.0, 0.0, 0.0]), 4).tolist()
[0, 1, 2, 5]
>>> top_fraction(np.array([0.2, 1.0, 0.6, 0.5]), 0.5).tolist()
[False, True, True, False]
>>> [linear_ratio(0.5, 1.0, 100, step) for step in (0, 50, 100, 150)]
[0.5, 0.75, 1.0, 1.0]
"""

from __future__ import annotations

import math

import numpy as np

TIE = 1e-12  # variances closer than this are equal (so ties are broken by rule, not by rounding)


def kept_count(ratio: float, n: int, floor: int = 1) -> int:
    """``ceil(ratio * n)``, at least ``floor`` and at most ``n`` (a hair below an integer
    product is that integer: ``0.3 * 10`` is 3, not 4)."""
    return min(n, max(floor, math.ceil(ratio * n - 1e-9)))


def max_variance_subset(values: np.ndarray, m: int) -> np.ndarray:
    """Indices, ascending, of ``m`` of ``values`` whose population variance is largest: the
    ``k`` largest and ``m - k`` smallest for the best ``k``. Ties between ``k``s prefer more of
    the largest values (a larger ``k``); among equal values the lower index is taken first, at
    both ends (the value multiset is the same whichever equal values are taken)."""
    values = np.asarray(values, dtype=np.float64)  # [n]
    n = len(values)
    if not 0 < m <= n:
        raise ValueError(f"cannot keep {m} of {n} values (need 0 < m <= n)")
    order = np.lexsort((np.arange(n), values))  # ascending by value, ties by index
    s = values[order]
    sums = np.concatenate([[0.0], np.cumsum(s)])  # [n + 1]
    squares = np.concatenate([[0.0], np.cumsum(s * s)])
    best_k, best = m, -math.inf
    for k in range(m, -1, -1):
        low = m - k
        total = sums[low] + sums[n] - sums[n - k]
        sq = squares[low] + squares[n] - squares[n - k]
        var = sq / m - (total / m) ** 2
        if var > best + TIE:
            best_k, best = k, var
    bottom = order[:m - best_k]  # the smallest, lowest index first among equals
    taken = set(bottom.tolist())
    largest = np.lexsort((np.arange(n), -values))  # descending by value, ties by index
    top = [i for i in largest.tolist() if i not in taken][:best_k]
    return np.sort(np.concatenate([bottom, np.asarray(top, dtype=np.int64)]))


def top_fraction(scores: np.ndarray, ratio: float) -> np.ndarray:
    """``[N]`` bool: the ``ceil(ratio * N)`` highest scores (at least one when ``N > 0``); equal
    scores are taken in index order."""
    scores = np.asarray(scores, dtype=np.float64)  # [N]
    keep = np.zeros(len(scores), dtype=bool)
    if len(scores):
        order = np.argsort(-scores, kind="stable")
        keep[order[:kept_count(ratio, len(scores))]] = True
    return keep


def linear_ratio(start: float, end: float, ramp_steps: int, step: int) -> float:
    """The keep ratio at ``step``: ``start`` at step 0, linear to ``end`` at ``ramp_steps``,
    ``end`` after."""
    progress = min(1.0, max(0, step) / ramp_steps)
    return start + (end - start) * progress
