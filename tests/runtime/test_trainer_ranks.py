"""The update as trainer ranks on a real local Ray cluster (issue 32, Build item 1, Must show 2).

Two ``TrainerRank`` actors over torch.distributed (gloo), each with its own copy of the real
tiny-arith policy and of ``update.grpo``: the summed gradient of the two shards equals the
single-process gradient of the whole batch (and an all-reduce that averages is caught); a seeded
run with 2 ranks gives the local runner's metrics; a checkpoint of a run with ranks resumes with
its optimizer state. The same with the policy sharded over the ranks by FSDP2 (``sharding: fsdp2``,
issue 43, Must show 3): the gradients and the parameters after one step equal one process's, each rank
holds half, a run gives the local runner's metrics and resumes. One cluster serves the module; the tests on it are ``slow``
(``pytest -m slow tests/runtime/test_trainer_ranks.py``); the validate rules run without Ray.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gfcr.errors import GraphError
from gfcr.graph import load_pipeline
from gfcr.records import Allocation, AllocationEntry, Prompt, PromptPool
from gfcr.spec import PolicySpec
from gfcr.spec import Resources as Placement
from gfcr.stages.generate.sample import Sample
from gfcr.runtime.training import split_balanced
from gfcr.stages.resources import Lent
from gfcr.stages.training import Ranks
from gfcr.stages.update.grpo import GRPOUpdate
from tests.runtime.test_metric_fixtures import _flat, assert_same_run

pytest.importorskip("ray", reason="the Ray executor needs the extra: pip install 'gfcr[ray]' (make test installs it)")
ray_executor = pytest.importorskip("gfcr.runtime.ray.executor", exc_type=ImportError)
from gfcr.runtime.ray.trainer_ranks import RayTrainerGroup, optimizer_gradients  # noqa: E402  (after the Ray check)

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "pipelines" / "quickstart.yaml"
TWO_RANKS = Placement(replicas=2)
TWO_SHARDED = Placement(replicas=2, sharding="fsdp2")  # FSDP2: each rank holds half the policy and AdamW
PROMPTS = [Prompt(f"a:{i}", text=f"What is {10 + i} + {20 + 3 * i}? Answer:") for i in range(6)]
POOL = PromptPool(PROMPTS)
REWARDS = [[1, 0, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0], [0, 1, 0, 0], [1, 0, 0, 1], [0, 1, 1, 1]]
LOSSES = {"grpo (ppo_clip)": {}, "cispo": {"loss": {"use": "cispo", "with": {"eps_high": 0.28}}}}
# an aggregation with learned weights and a once-a-step term (-ln w), added on rank 0 only
DARO = {"aggregation": {"use": "daro", "with": {"rollouts_per_prompt": 4}}}


# --- without Ray ---------------------------------------------------------------------------

@pytest.mark.parametrize(("overrides", "path", "fix"), [
    (["update.resources.replicas=2"], "update.resources.replicas", "executor: {kind: ray}"),
    (["update.resources.replicas=2", "executor.kind=ray", "update.resources.gpus=1"], "update.resources.gpus",
     "policy.device: cuda"),
])
def test_validate_refuses_ranks_it_cannot_place_with_the_fix(overrides, path, fix):
    with pytest.raises(GraphError) as caught:
        load_pipeline(QUICKSTART, overrides)
    assert path in str(caught.value) and fix in str(caught.value)


def test_two_ranks_on_ray_validate():
    pipeline = load_pipeline(QUICKSTART, ["update.resources.replicas=2", "executor.kind=ray"])
    assert ray_executor.trainer_placement(pipeline.spec) == TWO_RANKS


def test_two_sharded_ranks_on_ray_validate():
    pipeline = load_pipeline(QUICKSTART, ["update.resources.replicas=2", "update.resources.sharding=fsdp2",
                                          "executor.kind=ray"])
    assert ray_executor.trainer_placement(pipeline.spec) == TWO_SHARDED


@pytest.mark.parametrize(("overrides", "path", "fix"), [
    (["update.with.advantage.use=opob", "update.with.aggregation.use=seq_mean_token_mean"],
     "update.with.advantage.use", "remove `sharding` from the update's resources"),
    (["policy.lora.rank=8"], "update.resources.sharding", "remove `sharding` (or set `sharding: replicated`)"),
])
def test_validate_refuses_what_sharded_ranks_cannot_do_with_the_fix(overrides, path, fix):
    sharded = ["update.resources.replicas=2", "update.resources.sharding=fsdp2", "executor.kind=ray"]
    with pytest.raises(GraphError) as caught:
        load_pipeline(QUICKSTART, sharded + overrides)
    assert path in str(caught.value) and fix in str(caught.value)


def test_shards_are_contiguous_and_balanced_by_tokens():
    class _Sized:
        def __init__(self, n):
            self.rollout = [0] * n

    items = [_Sized(n) for n in (8, 8, 8, 2, 2, 2, 2, 8, 8, 8)]
    shards = split_balanced(items, [len(i.rollout) for i in items], 2)
    assert [x for shard in shards for x in shard] == items  # contiguous, in order
    assert [sum(len(x.rollout) for x in shard) for shard in shards] == [28, 28]


# --- on a local Ray cluster ----------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    """A local cluster with room for one engine replica, two trainer ranks and verification, twice."""
    import ray

    assert not ray.is_initialized(), "no Ray may be running in the test process yet"
    release = ray_executor.connect(None, Placement(replicas=3), TWO_RANKS)
    yield ray
    release()


@pytest.fixture(scope="module")
def batch():
    """A batch of 24 tiny-arith rollouts (6 prompts x 4), scored by hand, as if sampled by an older policy."""
    from gfcr.engines import TransformersEngine, load_policy

    policy = load_policy(PolicySpec(model="tiny-arith"))
    sample = Sample(Sample.Config(max_new_tokens=8, seed=0))
    sample.setup(Lent(policy, TransformersEngine(policy)))
    groups = sample.run(Allocation(0, tuple(AllocationEntry(p, len(r)) for p, r in zip(PROMPTS, REWARDS))))
    noise = np.random.default_rng(0)
    for g, rewards in zip(groups, REWARDS):
        for rollout, reward in zip(g.rollouts, rewards):
            rollout.reward, rollout.correct = float(reward), reward == 1
            # behaviour log-probs off the policy's, so that ratios leave 1 and the losses clip differently
            for segment in rollout.segments:
                segment.behavior_logprobs += noise.normal(0.0, 0.3, segment.behavior_logprobs.shape).astype(np.float32)
    return policy, groups


def _one_process(policy, groups, config):
    """The forward items, the plan and the gradients of one process, by name."""
    stage = GRPOUpdate(config)
    stage.setup(Lent(policy))
    items, _, _ = stage._batch(groups, POOL)
    plan = stage.aggregation.plan([i.row() for i in items])
    forward = [i for i in items if len(i.rollout) and i.has_signal()]
    policy.model.zero_grad(set_to_none=True)
    stage.shard_gradients(forward, plan, policy.version, Ranks())
    grads = optimizer_gradients(stage.optimizer)
    stage.optimizer.zero_grad(set_to_none=True)
    return forward, plan, grads


def all_reduce_mean(tensors):
    """The mutation: what DDP does by default (the mean over ranks), wrong for a batch-wide plan."""
    import torch.distributed as dist

    for t in tensors:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.slow
def test_the_two_losses_give_different_gradients_on_the_batch(batch):
    """So that the equality below is shown for two gradients, not one twice (on fresh rollouts,
    ratio 1, ppo_clip and cispo have the same gradient)."""
    grads = [_one_process(*batch, GRPOUpdate.Config(micro_batch_size=5, **LOSSES[loss]))[2] for loss in LOSSES]
    assert _max_diff(*grads) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("loss", [*LOSSES, "daro"])
def test_two_ranks_sum_to_the_single_process_gradient(cluster, batch, loss):
    policy, groups = batch
    config = GRPOUpdate.Config(lr=1e-3, micro_batch_size=5, **(DARO if loss == "daro" else LOSSES[loss]))
    forward, plan, single = _one_process(policy, groups, config)
    assert len(forward) == 20 and all(g.abs().sum() > 0 for g in single.values())
    ranks = RayTrainerGroup.start(PolicySpec(model="tiny-arith"), TWO_RANKS, GRPOUpdate, config)
    try:
        shards = split_balanced(forward, [len(i.rollout) for i in forward], 2)
        assert all(shards)
        answers = [ranks.ranks[r].gradients.remote(shard, plan, 0) for r, shard in enumerate(shards)]
        summed = cluster.get(answers)
        meaned = cluster.get([ranks.ranks[r].gradients.remote(shard, plan, 0, reduce=all_reduce_mean)
                              for r, shard in enumerate(shards)])
    finally:
        ranks.close()
    diff = _max_diff(summed[0], single)
    print(f"{loss}: max |2-rank - 1-process| gradient = {diff:.3g}; mean-reduce mutation: "
          f"{_max_diff(meaned[0], single):.3g}")
    assert _max_diff(summed[0], summed[1]) == 0.0  # every rank holds the same sum
    assert diff < 1e-6
    assert _max_diff(meaned[0], single) > 1e-6  # the mutation is caught
    if loss == "daro":  # DARO's log-weights have gradients too, summed like the policy's
        assert any(key.startswith("1.") for key in single)


def _fresh_policy():
    from gfcr.engines import load_policy

    return load_policy(PolicySpec(model="tiny-arith"))


@pytest.mark.slow
@pytest.mark.parametrize("loss", [*LOSSES, "daro"])
def test_two_sharded_ranks_sum_to_the_single_process_gradient(cluster, batch, loss):
    """Issue 43, Must show 3: FSDP2 (``sharding: fsdp2``) on 2 ranks over gloo gives the gradient of
    one process; the shards are cut unevenly (3 micro-batches against 1), so the rank with fewer
    takes empty passes to meet the other's collectives."""
    policy, groups = batch
    config = GRPOUpdate.Config(lr=1e-3, micro_batch_size=5, **(DARO if loss == "daro" else LOSSES[loss]))
    forward, plan, single = _one_process(policy, groups, config)
    ranks = RayTrainerGroup.start(PolicySpec(model="tiny-arith"), TWO_SHARDED, GRPOUpdate, config)
    try:
        shards = [forward[:15], forward[15:]]
        summed = cluster.get([ranks.ranks[r].gradients.remote(shard, plan, 0) for r, shard in enumerate(shards)])
    finally:
        ranks.close()
    diff = _max_diff(summed[0], single)
    print(f"{loss}: max |2 FSDP2 ranks - 1 process| gradient = {diff:.3g} "
          f"(largest gradient {max(float(g.abs().max()) for g in single.values()):.3g})")
    assert _max_diff(summed[0], summed[1]) == 0.0  # both ranks gathered the same whole gradient
    assert diff < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("placement", [TWO_RANKS, TWO_SHARDED], ids=["replicated", "fsdp2"])
def test_the_parameters_after_one_step_equal_one_process(cluster, batch, placement):
    """One AdamW step (clipped) on 2 ranks, replicated or sharded, against one process: the weights
    rank 0 gathers afterwards, and what each rank holds (under FSDP2, half)."""
    _, groups = batch
    config = GRPOUpdate.Config(lr=1e-3, micro_batch_size=5)
    policy = _fresh_policy()
    stage = GRPOUpdate(config)
    stage.setup(Lent(policy))
    items, _, _ = stage._batch(groups, POOL)
    plan = stage.aggregation.plan([i.row() for i in items])
    forward = [i for i in items if len(i.rollout) and i.has_signal()]
    stage.train_shard(forward, plan, 0, Ranks())
    ranks = RayTrainerGroup.start(PolicySpec(model="tiny-arith"), placement, GRPOUpdate, config)
    try:
        shards = split_balanced(forward, [len(i.rollout) for i in forward], 2)
        outcomes = ranks.step(shards, plan, 0)
        weights = ranks.weights()
        held = cluster.get([rank.held.remote() for rank in ranks.ranks])
    finally:
        ranks.close()
    single = policy.model.state_dict()
    diff = max(float((weights[n] - single[n]).abs().max()) for n in single)
    print(f"{placement.sharding}: max |2 ranks - 1 process| parameter after one step = {diff:.3g} (lr 1e-3); "
          f"bytes held per rank: {[h['bytes'] for h in held]}")
    assert weights.keys() == single.keys() and all(o.skip_reason is None for o in outcomes)
    assert diff < 0.05 * config.lr  # AdamW's first step moves each weight by about lr
    whole = sum(p.numel() * 4 for p in {id(p): p for p in policy.model.parameters()}.values())  # float32 bytes
    share = 1 if placement == TWO_RANKS else 2  # FSDP2: each rank keeps half (give or take a padded row)
    for h in held:
        assert abs(h["bytes"]["params"] - whole / share) <= 4096, (h, whole)
        assert abs(h["bytes"]["optimizer"] - 2 * whole / share) <= 8192, (h, whole)  # AdamW's two moments


def _records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        r.pop("time")
        assert r.pop("ray", {"replica_restarts": 0}) == {"replica_restarts": 0}  # the Ray executor's own
    return records


def _max_metric_diff(got: list[dict], expected: list[dict]) -> float:
    """The largest absolute difference of a float metric (nested ones included) between two runs."""
    pairs = [(_flat(g), _flat(e)) for g, e in zip(got, expected)]
    return max(abs(g[k] - e[k]) for g, e in pairs for k in e if isinstance(e[k], float) and not isinstance(e[k], bool))


CUT = ["stages.pick.with.batch_size=8", "eval.every=1000", "eval.with.n=16", "tracking.mlflow=null"]


@pytest.mark.slow
def test_a_seeded_run_with_two_ranks_gives_the_local_runners_metrics(cluster, tmp_path):
    """Must show 2: 20 seeded steps of quickstart.yaml (8 prompts x 8 a step) with 2 trainer ranks
    on Ray equal the local runner's, to float rounding."""
    from gfcr.runtime.loop.session import Run

    steps = ["run.steps=20", "run.checkpoint_every=1000"]
    ray_run, local_run = tmp_path / "ray", tmp_path / "local"
    run = Run.start(load_pipeline(QUICKSTART, CUT + steps + ["executor.kind=ray", "update.resources.replicas=2"]),
                    ray_run)
    run.train()
    Run.start(load_pipeline(QUICKSTART, CUT + steps + ["executor.kind=local"]), local_run).train()
    got, expected = _records(ray_run), _records(local_run)
    print(f"20 steps, 2 ranks against the local runner: max |metric difference| = {_max_metric_diff(got, expected):.3g}")
    assert sum(not r["update_skipped"] for r in got) >= 15
    # the replica sampled every step after the first from weights trainer rank 0 broadcast to it
    assert {(s.path, s.source) for s in run.services.lent.engine.syncs} == {("collective", "trainer rank 0")}
    assert_same_run(got, expected)
    assert run.services.closers == [], "the run stopped its ranks and replicas at the end"


@pytest.mark.slow
def test_a_run_with_ranks_resumes_with_its_optimizer_state(cluster, tmp_path):
    """A checkpoint taken from rank 0 (AdamW's moments) is loaded into every rank on resume, and
    the resumed steps equal an uninterrupted run's."""
    from gfcr.runtime.loop.session import Run
    from gfcr.runtime.store.state_tree import read_tree

    ranks = CUT + ["executor.kind=ray", "update.resources.replicas=2", "run.checkpoint_every=2"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    Run.start(load_pipeline(QUICKSTART, ranks + ["run.steps=4"]), whole).train()
    Run.start(load_pipeline(QUICKSTART, ranks + ["run.steps=2"]), cut).train()
    resumed = Run.resume(cut, steps=4)
    saved = read_tree(resumed.last_checkpoint / "stages" / "update")["optimizer"]
    update = resumed.runner.stages["update"]
    assert update.state_dict()["optimizer"] is None  # the driver's copy holds no optimizer: the ranks do
    live = resumed.runner.trainer.state_dict(update)["optimizer"]  # rank 0's, after the load
    assert saved["state"] and saved["state"].keys() == live["state"].keys()
    for index, moments in saved["state"].items():
        for name, value in moments.items():  # step, exp_avg, exp_avg_sq
            assert torch.equal(torch.as_tensor(live["state"][index][name]), torch.as_tensor(value)), (index, name)
    resumed.train()
    assert_same_run(_records(cut), _records(whole))


@pytest.mark.slow
def test_a_sharded_run_gives_the_local_runners_metrics_and_resumes(cluster, tmp_path):
    """Issue 43: quickstart.yaml with 2 FSDP2 ranks (`sharding: fsdp2`) equals the local runner's metrics;
    its checkpoint holds AdamW's state whole (one process's layout), and a resume from it equals the
    uninterrupted run."""
    from gfcr.runtime.loop.session import Run
    from gfcr.runtime.store.state_tree import read_tree

    sharded = CUT + ["executor.kind=ray", "update.resources.replicas=2", "update.resources.sharding=fsdp2",
                     "run.checkpoint_every=2"]
    whole, cut, local = tmp_path / "whole", tmp_path / "cut", tmp_path / "local"
    run = Run.start(load_pipeline(QUICKSTART, sharded + ["run.steps=4"]), whole)
    run.train()
    assert {(s.path, s.source) for s in run.services.lent.engine.syncs} == {("collective", "trainer rank 0")}
    Run.start(load_pipeline(QUICKSTART, CUT + ["run.steps=4", "run.checkpoint_every=2", "executor.kind=local"]),
              local).train()
    got, expected = _records(whole), _records(local)
    print(f"4 steps, 2 FSDP2 ranks against the local runner: max |metric difference| = "
          f"{_max_metric_diff(got, expected):.3g}")
    assert sum(not r["update_skipped"] for r in got) >= 3
    assert_same_run(got, expected)
    Run.start(load_pipeline(QUICKSTART, sharded + ["run.steps=2"]), cut).train()
    resumed = Run.resume(cut, steps=4)
    saved = read_tree(resumed.last_checkpoint / "stages" / "update")["optimizer"]
    shapes = [tuple(p.shape) for p in resumed.services.lent.policy.model.parameters()]
    assert [tuple(torch.as_tensor(saved["state"][i]["exp_avg"]).shape) for i in sorted(saved["state"], key=int)] == shapes
    resumed.train()
    assert_same_run(_records(cut), _records(whole))


def _descendants(root: int) -> list[int]:
    """Every process under ``root`` (a local Ray cluster's workers are under the driver's raylet)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _kill_a_rank_mid_update(driver: subprocess.Popen, run_dir: Path, deadline_s: float = 600.0) -> str:
    """SIGKILL the first trainer rank seen running ``step`` (Ray titles the process after its task)
    once the run has recorded a step (and checkpointed it)."""
    start, metrics = time.monotonic(), run_dir / "metrics.jsonl"
    while time.monotonic() - start < deadline_s and driver.poll() is None:
        if not (metrics.is_file() and metrics.read_text().strip()):
            time.sleep(0.2)
            continue
        for pid in _descendants(driver.pid):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            except OSError:
                continue
            if title.startswith("ray::TrainerRank.step"):
                os.kill(pid, signal.SIGKILL)
                return title
        time.sleep(0.02)
    raise AssertionError("no trainer rank was seen stepping")


@pytest.mark.slow
def test_a_rank_killed_mid_update_stops_the_run_with_the_resume_command(tmp_path):
    """Issue 32 item 5 (trainer half): a rank SIGKILLed while it steps stops `gfcr run` (exit 1) with
    the `gfcr resume` that continues it, and the resume gives the undisturbed run's metrics."""
    run_dir = tmp_path / "run"
    cli = [sys.executable, "-m", "gfcr.cli.main"]
    sets = [a for s in CUT + ["executor.kind=ray", "update.resources.replicas=2", "run.checkpoint_every=1"]
            for a in ("--set", s)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    driver = subprocess.Popen(cli + ["run", str(QUICKSTART), "--steps", "3", "--run-dir", str(run_dir)] + sets,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    killed = _kill_a_rank_mid_update(driver, run_dir)
    out, err = driver.communicate(timeout=600)
    assert driver.returncode == 1, out + err
    assert "trainer rank died" in err and f"gfcr resume {run_dir}" in err, err
    assert "Traceback" not in err, err
    stopped_at = len(_records(run_dir))
    assert 1 <= stopped_at < 3, f"{killed} was killed, yet {stopped_at} steps were recorded"
    resumed = subprocess.run(cli + ["resume", str(run_dir)], capture_output=True, text=True, env=env, cwd=tmp_path,
                             timeout=900)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    from gfcr.runtime.loop.session import Run

    Run.start(load_pipeline(QUICKSTART, CUT + ["run.steps=3", "executor.kind=local"]), tmp_path / "local").train()
    got, expected = _records(run_dir), _records(tmp_path / "local")
    print(f"killed {killed} at step {stopped_at}; resumed run against the local runner: max |metric difference| = "
          f"{_max_metric_diff(got, expected):.3g}")
    assert_same_run(got, expected)
