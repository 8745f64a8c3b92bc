"""The source's side of the weight group with the engine replicas (``executor.weight_sync:
collective``): the driver, or trainer rank 0, broadcasts through ``gfcr.runtime.weights.collective``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import ray

from gfcr.runtime.weights.collective import WeightSender, layout_of

SYNC_TIMEOUT_S = 120.0  # a weight group's rendezvous, or one broadcast of a bucket (64 MiB)
WeightSync = Literal["collective", "object_store"]


@dataclass(frozen=True, slots=True)
class SyncRecord:
    """One weight sync of the engine group: the version sent, by which path, its wall seconds and
    bytes (the weights' bytes times the replicas, on either path)."""

    version: int
    path: WeightSync
    seconds: float
    bytes: int
    source: str = "driver"  # who broadcast the collective sync: the driver, or "trainer rank 0"


class CollectiveSync:
    """The source's side of a weight group with the replicas: the source is rank 0, replica ``i``
    is rank ``i + 1``. The source is the driver, or, where the update runs on trainer ranks, trainer
    rank 0 (``source``: its actor, which holds a ``WeightSender`` of its own), as in verl and
    OpenRLHF: the weights then go from the trainer to the engines without passing through the driver.
    The group forms at the first sync and again whenever the replicas or the source changed (a
    restarted actor is a new member) or the last broadcast failed."""

    def __init__(self, timeout_s: float = SYNC_TIMEOUT_S):
        self.timeout_s = timeout_s
        self.sender: WeightSender | None = None  # the driver's, when it is the source
        self.formed = False
        self.source: Any = None  # the source actor the group was formed with (None: the driver)
        self.members: list[Any] = []  # the replica handles the group was formed with

    def send(self, replicas: list[Any], state: dict[str, Any], version: int, source: Any = None) -> None:
        """Broadcast the weights to every replica, which loads them into its policy and engine:
        ``state`` from the driver, or ``source``'s own (a trainer rank holding ``state``'s weights)."""
        if not self.formed or source is not self.source or len(replicas) != len(self.members) or any(
                a is not b for a, b in zip(replicas, self.members)):
            self._form(replicas, state, source)
        received = [r.receive_weights.remote(version) for r in replicas]
        try:
            if source is None:
                assert self.sender is not None
                self.sender.send(state)
                ray.get(received, timeout=self.timeout_s)
            else:
                ray.get([source.send_weights.remote()] + received, timeout=self.timeout_s)
        except BaseException:
            self.close()
            raise

    def _form(self, replicas: list[Any], state: dict[str, Any], source: Any) -> None:
        self.close()
        layout = layout_of(state)
        backend = "nccl" if next(iter(state.values())).is_cuda else "gloo"
        world_size = len(replicas) + 1
        if source is None:
            self.sender = WeightSender(ray.util.get_node_ip_address(), world_size, layout, backend, self.timeout_s)
            host, port = self.sender.host, self.sender.port
        else:
            host, port = ray.get(source.open_weight_source.remote(world_size, layout, backend, self.timeout_s),
                                 timeout=self.timeout_s)
        joined = [r.join_weight_group.remote(host, port, world_size, rank, layout, backend, self.timeout_s)
                  for rank, r in enumerate(replicas, start=1)]
        if source is None:
            assert self.sender is not None
            self.sender.join()
            ray.get(joined, timeout=self.timeout_s)
        else:
            ray.get([source.join_weight_source.remote()] + joined, timeout=self.timeout_s)
        self.formed, self.source, self.members = True, source, list(replicas)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.source is not None:
            self.source.close_weight_source.remote()  # not awaited: the source may be gone
        self.sender, self.formed, self.source, self.members = None, False, None, []
