"""The Ray weight movers, ``object_store`` and ``collective`` (``executor.weight_sync``;
registered in ``gfcr.runtime.weights.movers``): the engine group's sync by that path."""

from __future__ import annotations

from gfcr.runtime.ray.collective import WeightSync
from gfcr.runtime.ray.engine_group import RayEngineGroup


class RayPathMover:
    """``object_store`` / ``collective`` (``executor.weight_sync``): the engine group's sync by that
    path (``RayEngineGroup.sync_weights``; the collective one falls back to the object store)."""

    def __init__(self, group: RayEngineGroup, path: WeightSync):
        self.group = group
        group.weight_sync = path

    def move(self, version: int) -> int:
        return self.group.sync_weights(version)


def ObjectStoreMover(group: RayEngineGroup) -> RayPathMover:  # noqa: N802 (a mover factory, named as one)
    return RayPathMover(group, "object_store")


def CollectiveMover(group: RayEngineGroup) -> RayPathMover:  # noqa: N802
    return RayPathMover(group, "collective")
