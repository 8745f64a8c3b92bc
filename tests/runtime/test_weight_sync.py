"""The weight group without Ray (gfcr.runtime.weights.collective): a real gloo group in this process,
the source on the main thread and each replica on a thread of its own, over the real
tiny-arith model. About 2 s; the Ray engine group over it is tested in test_ray_executor.py."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import pytest
import torch

from gfcr.engines import load_policy
from gfcr.spec import PolicySpec
from gfcr.runtime.weights.collective import WeightReceiver, WeightSender, WeightSyncError, buckets, check_layout, layout_of

HOST = "127.0.0.1"
SMALL = 2**16  # bytes a bucket: tiny-arith (0.4 MB) goes in several, as a big model does at 64 MiB


@pytest.fixture(scope="module")
def models():
    """The trained model and two replica copies, loaded from the same source."""
    return [load_policy(PolicySpec(model="tiny-arith")).model for _ in range(3)]


def _step(model: Any, seed: int) -> None:
    """An update: every weight moves."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p, generator=torch.Generator().manual_seed(seed)))


def _gap(a: Any, b: Any) -> float:
    """The largest difference between two models' weights."""
    return max((x - y).abs().max().item() for x, y in zip(a.state_dict().values(), b.state_dict().values()))


class Replicas:
    """K replica threads, each a rank of the group, running what the source asks of it."""

    def __init__(self, sender: WeightSender, models: list[Any], timeout_s: float, bucket_bytes: int = SMALL):
        self.errors: list[BaseException] = []
        self.receivers: list[WeightReceiver | None] = [None] * len(models)
        self.models = models
        self._run([lambda i=i: self._join(sender, i, timeout_s, bucket_bytes) for i in range(len(models))],
                  then=sender.join)

    def _join(self, sender: WeightSender, i: int, timeout_s: float, bucket_bytes: int) -> None:
        self.receivers[i] = WeightReceiver(HOST, sender.port, sender.world_size, i + 1, sender.layout,
                                           timeout_s=timeout_s, bucket_bytes=bucket_bytes)

    def receive(self, then: Callable[[], Any], which: range | None = None) -> None:
        which = which or range(len(self.models))
        self._run([lambda i=i: self.receivers[i].receive_into(self.models[i].state_dict()) for i in which], then)

    def _run(self, jobs: list[Callable[[], Any]], then: Callable[[], Any]) -> None:
        def guarded(job: Callable[[], Any]) -> None:
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - reported to the test below
                self.errors.append(exc)

        threads = [threading.Thread(target=guarded, args=(job,)) for job in jobs]
        for t in threads:
            t.start()
        try:
            then()
        finally:
            for t in threads:
                t.join()


def test_the_replicas_equal_the_source_after_each_broadcast_and_a_skipped_one_shows(models):
    source, *copies = models
    layout = layout_of(source.state_dict())
    assert len(buckets(layout, SMALL)) > 3  # flat buckets, not one per tensor nor one in all
    sender = WeightSender(HOST, 3, layout, timeout_s=10, bucket_bytes=SMALL)
    replicas = Replicas(sender, copies, timeout_s=10)
    weights = sum(v.numel() * v.element_size() for v in source.state_dict().values())
    for k in range(3):  # K updates, each broadcast
        _step(source, seed=k)
        sent: list[int] = []
        replicas.receive(then=lambda: sent.append(sender.send(source.state_dict())))
        assert not replicas.errors and sent == [weights]
        assert [_gap(source, c) for c in copies] == [0.0, 0.0], f"after update {k + 1}"

    _step(source, seed=9)  # the mutation: an update whose broadcast is skipped
    assert min(_gap(source, c) for c in copies) > 1e-3, "the check sees a replica that missed a broadcast"
    replicas.receive(then=lambda: sender.send(source.state_dict()))
    assert [_gap(source, c) for c in copies] == [0.0, 0.0]


def test_a_replica_that_does_not_take_part_fails_the_broadcast_within_the_timeout(models):
    source, *copies = models
    sender = WeightSender(HOST, 3, layout_of(source.state_dict()), timeout_s=1.5, bucket_bytes=SMALL)
    replicas = Replicas(sender, copies, timeout_s=1.5)
    start = time.perf_counter()
    with pytest.raises(WeightSyncError, match=r"a weight broadcast failed(.|\n)*fix: the engine group falls back"):
        replicas.receive(then=lambda: sender.send(source.state_dict()), which=range(1))  # replica 2 is stuck
    assert time.perf_counter() - start < 10, "a timeout, not a hang"
    assert sender.group is None, "a failed group is closed: the next sync forms a new one"


def test_a_replica_that_never_joins_fails_the_rendezvous_within_the_timeout(models):
    start = time.perf_counter()
    sender = WeightSender(HOST, 2, layout_of(models[0].state_dict()), timeout_s=1.0)
    with pytest.raises(WeightSyncError, match=r"did not form(.|\n)*fix: check that every engine replica is alive"):
        sender.join()
    assert time.perf_counter() - start < 10


def test_a_replica_with_another_model_is_refused_with_the_tensor_that_differs(models):
    source = models[0].state_dict()
    other = dict(source, **{"lm_head.weight": source["lm_head.weight"].to(torch.float16)})
    with pytest.raises(WeightSyncError, match=r"`lm_head.weight` .* float16 against `lm_head.weight` .* float32"
                                              r"(.|\n)*fix: load the replicas from the same `policy.model`"):
        check_layout(layout_of(source), layout_of(other))  # what a replica checks before it joins
