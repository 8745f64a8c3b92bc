"""Weights from the trainer to the engine replicas through a torch.distributed collective group,
as verl and OpenRLHF send them (docs/ray.md, "Weights").

A weight group is a process group of its own, apart from any default group a process holds (a
trainer's, or vLLM's inside an engine): rank 0 is the weight *source* (today the driver, which
holds the trained policy; a trainer rank 0 actor once the update runs on Ray workers) and ranks
1..K are the engine replicas. After each update the source broadcasts the ``state_dict`` in flat
buckets (one ``torch.cat`` per run of same-dtype tensors, at most ``BUCKET_BYTES`` each) and every
replica copies them into its own model's tensors, in place:

    # rank 0, in any process (the driver, or a Ray actor)
    sender = WeightSender(host, world_size=1 + K, layout=layout_of(state), backend="gloo")
    ...                       # hand (sender.host, sender.port) to the replicas, which join
    sender.join()             # the rendezvous: returns when every rank has joined
    sender.send(state)        # after each update; every replica calls receiver.receive_into(...)

    # rank r in 1..K, in each engine replica
    receiver = WeightReceiver(host, port, world_size=1 + K, rank=r, layout=layout_of(own), backend="gloo")
    receiver.receive_into(model.state_dict())

Both sides know the layout (names, shapes, dtypes, in order) from their own copy of the model, so
nothing but the tensors goes over the wire; a replica whose model differs is refused when it
joins. ``backend`` is ``gloo`` for a policy on the CPU and ``nccl`` on CUDA (NCCL is written the
same way but untested here: no machine with 2 GPUs was lent).

No collective waits forever: the rendezvous (``TCPStore``) and every broadcast time out after
``timeout_s`` and raise ``WeightSyncError``; a member that died breaks the group at once (the
peer's socket closes). The caller decides what to do then (``RayEngineGroup`` falls back to the
object store and forms a new group at the next sync).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Iterator, Literal, Mapping, Sequence

import torch
import torch.distributed as dist

from gfcr.errors import GfcrError

Backend = Literal["gloo", "nccl"]
BUCKET_BYTES = 64 * 2**20  # a bucket's size: a few broadcasts of a 500 MB model, not one per tensor
SOURCE = 0  # the rank that sends


class WeightSyncError(GfcrError):
    """A weight group could not form, or a broadcast failed or timed out."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a ``state_dict`` as the group sees it."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


Layout = tuple[Entry, ...]


def layout_of(state: Mapping[str, torch.Tensor]) -> Layout:
    """The names, shapes and dtypes of ``state``, in its order."""
    return tuple(Entry(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in state.items())


def check_layout(source: Layout, own: Layout) -> None:
    """Refuse weights laid out otherwise than the model they go into (another model, another dtype)."""
    if source != own:
        differ = next((f"`{a.name}` {a.shape} {a.dtype} against `{b.name}` {b.shape} {b.dtype}"
                       for a, b in zip(own, source) if a != b), f"{len(own)} against {len(source)} tensors")
        raise WeightSyncError(f"the weight source's model and this replica's differ ({differ})\n    fix: "
                              "load the replicas from the same `policy.model` as the trainer")


def _nbytes(entry: Entry) -> int:
    return entry.numel * getattr(torch, entry.dtype).itemsize


def buckets(layout: Layout, bucket_bytes: int = BUCKET_BYTES) -> list[list[Entry]]:
    """Consecutive runs of same-dtype entries of at most ``bucket_bytes`` (a bigger tensor alone)."""
    out: list[list[Entry]] = []
    size = 0
    for entry in layout:
        nbytes = _nbytes(entry)
        if not out or out[-1][0].dtype != entry.dtype or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(entry)
        size += nbytes
    return out


def _process_group(store: dist.Store, rank: int, world_size: int, backend: Backend,
                   timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A group on its own store, not the process's default group (which a trainer or vLLM may hold)."""
    if backend == "nccl":  # untested here (no 2-GPU machine was lent)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


class _Member:
    """What the source and the replicas share: the group, its layout and the broadcast of a bucket."""

    def __init__(self, layout: Layout, backend: Backend, timeout_s: float, bucket_bytes: int):
        self.layout, self.backend, self.timeout = layout, backend, datetime.timedelta(seconds=timeout_s)
        self.buckets = buckets(layout, bucket_bytes)
        self.group: dist.ProcessGroup | None = None

    def _form(self, store: dist.Store, rank: int, world_size: int) -> None:
        try:
            self.group = _process_group(store, rank, world_size, self.backend, self.timeout)
        except RuntimeError as exc:  # a member that never came (timeout) or a store that went away
            raise WeightSyncError(f"the weight group (rank {rank} of {world_size}) did not form: {_first_line(exc)}\n"
                                  "    fix: check that every engine replica is alive and can reach the source's "
                                  "address (`GLOO_SOCKET_IFNAME` picks the network interface), or use "
                                  "`executor: {weight_sync: object_store}`") from exc

    def _broadcast(self, flat: torch.Tensor) -> None:
        if self.group is None:
            raise WeightSyncError("this weight group is closed\n    fix: form a new one (the engine group does at "
                                  "its next sync)")
        options = dist.BroadcastOptions()
        options.rootRank = SOURCE
        try:
            self.group.broadcast([flat], options).wait()
        except RuntimeError as exc:  # a member died (connection reset) or did not take part (timeout)
            self.close()
            raise WeightSyncError(f"a weight broadcast failed: {_first_line(exc)}\n    fix: the engine group "
                                  "falls back to the object store and forms a new group at its next sync") from exc

    def close(self) -> None:
        self.group = None  # the ProcessGroup frees its sockets when the last reference goes


class WeightSender(_Member):
    """Rank 0 of a weight group: opens the rendezvous on ``host`` (the port is picked free and
    read back as ``port``), then ``join`` waits for the replicas and ``send`` broadcasts."""

    def __init__(self, host: str, world_size: int, layout: Layout, backend: Backend = "gloo",
                 timeout_s: float = 300.0, bucket_bytes: int = BUCKET_BYTES):
        super().__init__(layout, backend, timeout_s, bucket_bytes)
        self.host, self.world_size = host, world_size
        self.store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=self.timeout,
                                   wait_for_workers=False)
        self.port = self.store.port

    def join(self) -> None:
        """Block until ranks 1..world_size-1 have joined (or ``timeout_s`` passed: ``WeightSyncError``)."""
        self._form(self.store, SOURCE, self.world_size)

    def send(self, state: Mapping[str, torch.Tensor]) -> int:
        """Broadcast ``state`` (its layout must be the group's); returns the bytes each replica got."""
        check_layout(layout_of(state), self.layout)
        sent = 0
        for bucket in self.buckets:
            flat = torch.cat([state[e.name].detach().reshape(-1) for e in bucket])
            if self.backend == "nccl" and not flat.is_cuda:  # weights gathered on the CPU (sharded trainer ranks)
                flat = flat.cuda()
            self._broadcast(flat)
            sent += flat.numel() * flat.element_size()
        return sent


class WeightReceiver(_Member):
    """Rank ``rank`` (1..world_size-1) of a weight group: joins on construction (blocks until
    the whole group has), then ``receive_into`` takes one broadcast."""

    def __init__(self, host: str, port: int, world_size: int, rank: int, layout: Layout,
                 backend: Backend = "gloo", timeout_s: float = 300.0, bucket_bytes: int = BUCKET_BYTES):
        super().__init__(layout, backend, timeout_s, bucket_bytes)
        try:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=self.timeout)
        except RuntimeError as exc:
            raise WeightSyncError(f"rank {rank} could not reach the weight source at {host}:{port}: "
                                  f"{_first_line(exc)}\n    fix: check that the source is running and reachable "
                                  "from this node") from exc
        self._form(store, rank, world_size)

    def receive_into(self, state: Mapping[str, torch.Tensor]) -> int:
        """Receive one broadcast and copy it into ``state``'s tensors in place (a model's
        ``state_dict()`` shares its parameters' storage); returns the bytes received."""
        check_layout(self.layout, layout_of(state))
        received = 0
        device = next(iter(state.values())).device
        for bucket in self.buckets:
            flat = torch.empty(sum(e.numel for e in bucket), dtype=getattr(torch, bucket[0].dtype), device=device)
            self._broadcast(flat)
            with torch.no_grad():
                for entry, chunk in zip(bucket, _split(flat, bucket)):
                    state[entry.name].copy_(chunk)
            received += flat.numel() * flat.element_size()
        return received


def _split(flat: torch.Tensor, bucket: Sequence[Entry]) -> Iterator[torch.Tensor]:
    for entry, chunk in zip(bucket, torch.split(flat, [e.numel for e in bucket])):
        yield chunk.view(entry.shape)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
