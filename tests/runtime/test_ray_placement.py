"""Placement of the engine replicas on the nodes a spec names (issue 32, build item 3 and the
engine half of must-show 1): placement groups, failing fast when the cluster cannot hold them,
and each rollout's Ray node in the lineage.

The rules of ``cannot_hold`` are tested without Ray. The rest runs on a real local multi-node
cluster (``ray.cluster_utils.Cluster``: a head and two worker nodes, each with its own custom
resource), marked ``slow`` (with the trainer ranks' test, must-show 1 of issue 32): 89 s on the shared 2-core machine, 19 s of it starting the cluster
(3 min 10 s under load); ``pytest -m slow tests/runtime/test_ray_placement.py``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gfcr.errors import GfcrError
from gfcr.spec import Resources as Placement

pytest.importorskip("ray", reason="the Ray executor needs the extra: pip install 'gfcr[ray]' (make test installs it)")
ray_placement = pytest.importorskip("gfcr.runtime.ray.placement", exc_type=ImportError)
REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "pipelines" / "quickstart.yaml"

# --- without Ray: can a cluster of these nodes (total resources) ever hold the group? ---------

HEAD = {"CPU": 1.0, "memory": 1e9}
ENGINES = {"CPU": 2.0, "engines": 1.0, "memory": 1e9}  # a node started with --resources '{"engines": 1}'
TRAINERS = {"CPU": 1.0, "trainers": 1.0, "memory": 1e9}
GPU_NODE = {"CPU": 8.0, "GPU": 1.0, "engines": 1.0}
CLUSTER = [HEAD, ENGINES, TRAINERS]


@pytest.mark.parametrize(("placement", "nodes", "reason"), [
    (Placement(replicas=2, node_resource="engines"), CLUSTER, None),
    (Placement(replicas=2, node_resource="engines", strategy="strict_pack"), CLUSTER, None),
    (Placement(replicas=4), CLUSTER, None),  # pack without a node resource: anywhere, 4 CPUs in all
    (Placement(replicas=3, node_resource="engines"), CLUSTER,
     "the nodes that qualify have room for 2 of the 3 (1 CPU, 0 GPU on a node with `engines` each)"),
    (Placement(replicas=5), CLUSTER, "the nodes that qualify have room for 4 of the 5"),
    (Placement(replicas=2, node_resource="engines", strategy="strict_spread"), CLUSTER,
     "`strict_spread` puts each of the 2 on its own node, and 1 node(s) can hold one"),
    (Placement(replicas=3, strategy="strict_spread"), CLUSTER, None),
    (Placement(replicas=3, strategy="strict_pack"), CLUSTER,
     "`strict_pack` puts all 3 on one node, which needs 3 CPU, 0 GPU; the largest node that qualifies has 2 CPU"),
    (Placement(node_resource="gpu-nodes"), CLUSTER, "no node of the cluster declares the resource `gpu-nodes` "
                                                    "(the nodes declare CPU, engines, memory, trainers)"),
    (Placement(gpus=1), CLUSTER, "no node of the cluster has a GPU"),
    (Placement(cpus=4, node_resource="engines"), CLUSTER, "no node has room for one (4 CPU, 0 GPU on a node "
                                                          "with `engines`)"),
    (Placement(replicas=2, gpus=1, node_resource="engines"), [*CLUSTER, GPU_NODE], "room for 1 of the 2"),
    (Placement(replicas=1000, cpus=0.001, node_resource="engines"), CLUSTER, None),  # NODE_SHARE: 1,000 a node
])
def test_cannot_hold_says_why_a_cluster_can_never_hold_the_group(placement, nodes, reason):
    found = ray_placement.cannot_hold(ray_placement.placement_bundles(placement), placement.strategy, nodes)
    assert found == reason if reason is None else reason in found


def test_unequal_bundles_are_checked_by_their_sums():
    trainer, engine = {"CPU": 1.0, "trainers": 0.001}, {"CPU": 2.0, "engines": 0.001}
    assert ray_placement.cannot_hold([engine, trainer], "spread", CLUSTER) is None
    assert "no node has room for one" in ray_placement.cannot_hold([engine, {"CPU": 2.0, "trainers": 0.001}],
                                                                   "pack", CLUSTER)
    assert ray_placement.cannot_hold([engine, engine, trainer], "pack", [*CLUSTER, ENGINES]) is None
    assert "the nodes that qualify have 4 CPU" in ray_placement.cannot_hold([engine, engine, {"CPU": 1.0}], "pack",
                                                                            [ENGINES, ENGINES])


def test_bundles_hold_the_cpus_gpus_and_a_share_of_the_node_resource():
    assert ray_placement.placement_bundles(Placement(cpus=0.5, replicas=2)) == [{"CPU": 0.5}, {"CPU": 0.5}]
    assert ray_placement.placement_bundles(Placement(gpus=2, node_resource="engines")) == [
        {"CPU": 1.0, "GPU": 2.0, "engines": ray_placement.NODE_SHARE}]
    assert ray_placement.bundles(2, cpus=1, node_resource="trainers") == [{"CPU": 1.0, "trainers": 0.001}] * 2


# --- on a local cluster of three nodes -----------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    """A head (1 CPU) and two workers: `engines` (2 CPUs) and `trainers` (2 CPUs); the test process
    is the driver, so runs find Ray started and use it (as a notebook's would)."""
    import ray
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized(), "no Ray may be running in the test process yet"
    nodes = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, include_dashboard=False))
    try:
        engines = nodes.add_node(num_cpus=2, resources={"engines": 1})
        trainers = nodes.add_node(num_cpus=2, resources={"trainers": 1})
        ray.init(address=nodes.address, log_to_driver=False, namespace="gfcr")
        yield {"engines": engines.node_id, "trainers": trainers.node_id}
    finally:
        ray.shutdown()
        nodes.shutdown()


def _pending_groups() -> list[dict]:
    from ray.util import placement_group_table

    return [g for g in placement_group_table().values() if g["state"] not in ("REMOVED", "CREATED")]


@pytest.mark.slow
def test_quickstart_places_both_replicas_on_the_named_node(cluster, tmp_path):
    """Must-show 1, the engine half: 2 replicas on the `engines` node, read back from Ray (the
    placement group's bundles, each actor's own node) and from every rollout's lineage row."""
    from typer.testing import CliRunner

    from gfcr.cli.main import app
    from gfcr.graph import load_pipeline
    from gfcr.runtime.store.lineage import read_lineage
    from gfcr.runtime.loop.session import Run

    overrides = ["run.steps=2", "eval.every=1000", "eval.with.n=16", "tracking.mlflow=null", "executor.kind=ray",
                 "stages.rollout.resources.replicas=2", "stages.rollout.resources.node_resource=engines",
                 "stages.rollout.resources.strategy=strict_pack"]
    run = Run.start(load_pipeline(QUICKSTART, overrides), tmp_path / "run")
    group = run.services.lent.engine
    assert group.reservation.nodes() == [cluster["engines"]] * 2  # Ray's placement-group table
    assert group.nodes == [cluster["engines"]] * 2  # each actor's runtime context
    run.train()

    lineage = read_lineage(tmp_path / "run" / "lineage")
    assert lineage.num_rows == 2 * 16 * 8
    assert set(lineage.column("ray_node").to_pylist()) == {cluster["engines"]}
    assert set(lineage.column("replica").to_pylist()) == {"ray-0", "ray-1"}
    last = lineage.column("rollout_id")[-1].as_py()  # `gfcr lineage RUN ROLLOUT` reads it too
    chain = CliRunner().invoke(app, ["lineage", str(tmp_path / "run"), last, "--json"])
    assert chain.exit_code == 0 and json.loads(chain.output)["row"]["ray_node"] == cluster["engines"], chain.output
    assert group.replicas == [] and group.reservation is None, "the run released its replicas and placement group"
    assert _pending_groups() == []


@pytest.mark.slow
def test_quickstart_with_engines_on_one_node_and_trainer_ranks_on_the_other(cluster, tmp_path):
    """Must-show 1 of issue 32: `pipelines/quickstart.yaml` with 2 engine replicas on the `engines`
    node and 2 trainer ranks on the `trainers` node, read back from Ray (each placement group's
    bundles, each actor's own node) and from the lineage (every rollout's `ray_node`)."""
    from gfcr.graph import load_pipeline
    from gfcr.runtime.store.lineage import read_lineage
    from gfcr.runtime.loop.session import Run

    overrides = ["run.steps=2", "eval.every=1000", "eval.with.n=16", "tracking.mlflow=null", "executor.kind=ray",
                 "stages.rollout.resources.replicas=2", "stages.rollout.resources.node_resource=engines",
                 "stages.rollout.resources.strategy=strict_pack",
                 "update.resources.replicas=2", "update.resources.node_resource=trainers",
                 "update.resources.strategy=strict_pack"]
    run = Run.start(load_pipeline(QUICKSTART, overrides), tmp_path / "run")
    engines, trainers = run.services.lent.engine, run.runner.trainer.group
    assert engines.reservation.nodes() == engines.nodes == [cluster["engines"]] * 2
    assert trainers is not None and trainers.world_size == 2
    assert trainers.reservation.nodes() == trainers.nodes == [cluster["trainers"]] * 2
    run.train()

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert not any(r["update_skipped"] for r in records) and records[-1]["policy_version"] == 2, records
    assert all(r["time"]["sync_bytes"] > 0 for r in records)  # the ranks' weights reached the replicas
    # from trainer rank 0 (on `trainers`) to the replicas (on `engines`) through the weight group
    assert [(s.path, s.source) for s in engines.syncs] == [("collective", "trainer rank 0")] * 2, engines.syncs
    lineage = read_lineage(tmp_path / "run" / "lineage")
    assert lineage.num_rows == 2 * 16 * 8
    assert set(lineage.column("ray_node").to_pylist()) == {cluster["engines"]}
    assert trainers.ranks == [] and trainers.reservation is None, "the run released its ranks and placement group"
    assert _pending_groups() == []


@pytest.mark.slow
@pytest.mark.parametrize(("resources", "message"), [
    (["replicas=3"], "room for 2 of the 3"),
    (["replicas=2", "strategy=strict_spread"], "`strict_spread` puts each of the 2 on its own node"),
])
def test_a_spec_asking_more_than_the_nodes_have_fails_at_once_with_the_fix(cluster, tmp_path, resources, message):
    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import Run

    overrides = ["run.steps=1", "tracking.mlflow=null", "executor.kind=ray",
                 "stages.rollout.resources.node_resource=engines"]
    overrides += [f"stages.rollout.resources.{r}" for r in resources]
    started = time.monotonic()
    with pytest.raises(GfcrError, match="the engine replicas .* cannot be placed on this Ray cluster") as error:
        Run.start(load_pipeline(QUICKSTART, overrides), tmp_path / "run")
    assert message in str(error.value) and "fix: lower `resources.replicas`" in str(error.value)
    assert time.monotonic() - started < ray_placement.READY_TIMEOUT_S  # refused before any wait
    assert _pending_groups() == []


@pytest.mark.slow
def test_reserve_places_actors_of_any_kind_on_the_node_asked_for(cluster):
    """The function the trainer ranks use: a reservation on the `trainers` node and an actor
    started with its bundle's scheduling strategy run there."""
    import ray

    @ray.remote(num_cpus=1)
    class Where:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    reservation = ray_placement.reserve(ray_placement.bundles(1, cpus=1, node_resource="trainers"), "pack",
                                        what="the trainer ranks", lower="`workers`")
    try:
        actor = Where.options(scheduling_strategy=reservation.strategies[0]).remote()
        assert ray.get(actor.node.remote()) == reservation.nodes()[0] == cluster["trainers"]
        ray.kill(actor)
    finally:
        reservation.release()


@pytest.mark.slow
def test_a_group_the_nodes_could_hold_but_others_occupy_times_out_with_the_fix(cluster):
    """The `engines` node's 2 CPUs held by another group: a second one waits `timeout_s`, no
    longer, and is removed (nothing stays pending)."""
    holder = ray_placement.reserve(ray_placement.bundles(2, cpus=1, node_resource="engines"), "pack",
                                   what="the first group", lower="it")
    try:
        with pytest.raises(GfcrError, match=r"(?s)the trainer ranks \(1 x 1 CPU, 0 GPU on a node with `engines`, "
                                            r"strategy `pack`\) could not be reserved within 1s.*fix: stop what"):
            ray_placement.reserve(ray_placement.bundles(1, cpus=1, node_resource="engines"), "pack",
                                  what="the trainer ranks", lower="`workers`", timeout_s=1)
        assert _pending_groups() == []
    finally:
        holder.release()
