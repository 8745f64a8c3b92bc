"""Verification as Ray tasks: ``Lent.map`` under the Ray executor."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import ray


def _apply(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    return [fn(item) for item in items]


_apply_task = ray.remote(num_cpus=1)(_apply)


class RayMap:
    """``Lent.map`` on Ray: at most ``slots`` tasks of at least ``min_batch`` items each,
    so that task overhead (milliseconds) does not dominate scoring (microseconds an item);
    results come back in item order, equal to the in-process map's."""

    def __init__(self, slots: int, min_batch: int = 32):
        self.slots, self.min_batch = slots, min_batch

    def __call__(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        items = list(items)
        if not items:
            return []
        tasks = min(self.slots, math.ceil(len(items) / self.min_batch))
        bounds = [len(items) * t // tasks for t in range(tasks + 1)]
        refs = [_apply_task.remote(fn, items[a:b]) for a, b in zip(bounds, bounds[1:])]
        return [result for batch in ray.get(refs) for result in batch]
