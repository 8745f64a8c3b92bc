"""The stale lifecycles on the Ray executor (issue 38, Must show 9; docs/async.md, "On Ray"):
2 engine replicas on the `engines` node and 2 trainer ranks on the `trainers` node of the 3-node
local cluster (``ray.cluster_utils.Cluster``, the fixture of ``test_ray_placement``),
``pipelines/quickstart.yaml`` on tiny-arith.

- ``async, max_staleness: 1``: 2 steps, a stop, ``Run.resume`` to 4 steps. From the lineage, no
  rollout started more than 1 version ahead of the update that trained it, each rollout's tokens
  carry one version in their segments, every rollout appears once; the generation ran ahead (some
  rollouts are 1 version old) and the replicas were synced from the driver's generation copy, not
  from trainer rank 0.
- ``pipelined, lag: 1``, 4 steps, with the 2 ranks or the update in the driver: every step samples
  exactly the version of step t - 1's start, and the replicas sync exactly when it moves; with the
  ranks, 2 steps, a stop and a resume to 4 equal 4 steps run at once (metrics and lineage).
- In both, every step's behaviour log-probs (sampled in the replicas) equal the transformers
  forward pass of the weights of the version their segments record, taken from the schedule's
  history, within the engine conformance tolerance, and are far from the weights the trainer
  holds at that moment wherever those differ. The mutation, an engine group that takes each
  version without syncing its replicas, fails the check.
- A pipeline without a policy (the labelled fake engine and update) runs ``async`` on Ray too.

Slow: the cluster's start and the runs, about 2-3 minutes on the shared 2-core host;
``pytest -m slow tests/runtime/test_ray_lifecycle.py``.
"""

from __future__ import annotations

import textwrap
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run
from gfcr.spec import PolicySpec
from gfcr.stages.resources import prompt_tokens

pytest.importorskip("ray", reason="the Ray executor needs the extra: pip install 'gfcr[ray]' (make test installs it)")
from tests.runtime.test_ray_placement import QUICKSTART, _pending_groups, cluster  # noqa: E402,F401  (the 3 nodes)
from tests.runtime.run_records import lineage as _lineage, metrics as _metrics

TOL = 5e-5  # the engine conformance tolerance, float32 (tests/engines/test_conformance.py)

ON_THE_CLUSTER = ["eval.every=1000", "eval.with.n=16", "tracking.mlflow=null", "executor.kind=ray",
                  "stages.rollout.resources.replicas=2", "stages.rollout.resources.node_resource=engines",
                  "stages.rollout.resources.strategy=strict_pack",
                  "update.resources.replicas=2", "update.resources.node_resource=trainers",
                  "update.resources.strategy=strict_pack", "update.with.correction.use=tis"]


class SampledWith:
    """A hook: after each step is recorded, the gap between its rollouts' behaviour log-probs (from
    the replicas) and the transformers forward of the weights of the version their segments record
    (the schedule's history), and of the weights the trainer holds at that moment."""

    def __init__(self):
        self.run = self.scratch = None
        self.versions: list[int] = []
        self.gaps: list[float] = []
        self.trained_gaps: list[float] = []
        self.trained_versions: list[int] = []

    def step_recorded(self, event) -> None:
        from gfcr.engines import load_policy
        from gfcr.engines.hf import score_batch
        from gfcr.stages.engine import ScoreRequest

        run, report = self.run, event.report
        trained = run.services.lent.policy
        rollouts = [(g, r) for g in report.groups for r in g.rollouts]
        (version,) = {int(v) for _, r in rollouts for v in r.policy_versions()}  # one version a step
        self.versions.append(version)
        self.trained_versions.append(trained.version)
        weights = next(w for v, w in run.runner.schedule.history.records.values() if v == version)
        if self.scratch is None:  # loading draws from torch's RNG: not from the run's
            with torch.random.fork_rng():
                self.scratch = load_policy(run.spec.policy)
        self.scratch.model.load_state_dict(weights)
        requests = [ScoreRequest(tuple(r.context_token_ids or prompt_tokens(trained, run.pool.get(g.prompt_id))),
                                 tuple(r.response_token_ids), 1.0) for g, r in rollouts]
        behaviour = np.concatenate([r.behavior_logprobs for _, r in rollouts])
        with torch.no_grad():
            for model, into in ((self.scratch.model, self.gaps), (trained.model, self.trained_gaps)):
                scored = np.concatenate([s.logprobs for s in score_batch(model, requests,
                                                                         trained.tokenizer.pad_token_id)])
                into.append(float(np.max(np.abs(scored - behaviour))))


def _train(run: Run, check: SampledWith) -> None:
    check.run = run
    run.hooks = run.hooks + (check,)
    try:
        run.train()
    finally:
        run.services.close()  # a failed run leaves no actors behind (closing twice is a no-op)




def _placed(run: Run, cluster) -> None:
    engines, trainers = run.services.lent.engine, run.runner.trainer.group
    assert engines.reservation.nodes() == engines.nodes == [cluster["engines"]] * 2
    assert trainers.world_size == 2 and trainers.reservation.nodes() == trainers.nodes == [cluster["trainers"]] * 2
    assert engines.policy is not run.services.lent.policy  # the replicas follow the generation copy


@pytest.mark.slow
def test_async_on_ray_holds_its_bound_from_the_lineage_and_resumes(cluster, tmp_path):
    """Must show 9 of issue 38: async with max_staleness 1, 2 replicas, 2 ranks, 4 steps (2, a stop,
    a resume), the bound held (read from the lineage) and every step sampled with the weights of the
    version its segments record."""
    run_dir, bound = tmp_path / "run", 1
    overrides = ON_THE_CLUSTER + ["lifecycle.mode=async", f"lifecycle.max_staleness={bound}", "run.steps=2",
                                  "run.checkpoint_every=2"]
    checks, syncs = [SampledWith(), SampledWith()], []
    run = Run.start(load_pipeline(QUICKSTART, overrides), run_dir)
    _placed(run, cluster)
    _train(run, checks[0])
    syncs += run.services.lent.engine.syncs
    run = Run.resume(run_dir, steps=4)  # a new driver, new replicas and ranks, from the checkpoint of step 2
    assert run.runner.step == 2
    _placed(run, cluster)
    _train(run, checks[1])
    syncs += run.services.lent.engine.syncs

    records = _metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert not any(r["update_skipped"] for r in records) and records[-1]["policy_version"] == 4, records
    steps = _lineage(run_dir)
    ids = [row["rollout_id"] for rows in steps for row in rows]
    assert len(ids) == len(set(ids)) == 4 * 16 * 8  # every rollout once, across the stop
    ages = []
    for r, rows in zip(records, steps):
        trained_on = r["policy_version"] - 1  # the version the step's update trained (none skipped)
        assert all(row["policy_version_min"] == row["policy_version_max"] for row in rows)  # one version a row
        ages += [trained_on - row["policy_version_min"] for row in rows]  # started this far ahead of its update
        assert all(row["staleness"] <= bound for row in rows if row["in_update"]), r["step"]
        assert all(int(age) <= bound for age in r["staleness"]), r
        assert {row["ray_node"] for row in rows} == {cluster["engines"]}
    print(f"\nasync on Ray: rollouts by versions ahead {dict(zip(*np.unique(ages, return_counts=True)))}; "
          f"steps sampled versions {checks[0].versions + checks[1].versions}; largest gap to the recorded "
          f"version's weights {max(checks[0].gaps + checks[1].gaps):.2e}; syncs "
          f"{[(s.version, s.path, s.source) for s in syncs]}")
    assert 0 <= min(ages) and max(ages) == bound  # the bound held, and generation ran ahead up to it
    assert max(checks[0].gaps + checks[1].gaps) <= TOL  # each replica sampled the version it recorded
    stale = [g for c in checks for g, v, t in zip(c.trained_gaps, c.versions, c.trained_versions) if v != t]
    assert stale and min(stale) > 100 * TOL, checks  # not the trainer's weights: the check can fail
    assert syncs and all(s.source == "driver" for s in syncs)  # from the generation copy, not trainer rank 0
    assert _pending_groups() == []


def _pipelined(cluster, run_dir: Path, ranks: bool, steps: int = 4) -> tuple[SampledWith, list[int]]:
    check = SampledWith()
    overrides = ON_THE_CLUSTER + ["lifecycle.mode=pipelined", "lifecycle.lag=1", f"run.steps={steps}"]
    if not ranks:  # the update in the driver, beside the producer thread
        overrides = [o for o in overrides if not o.startswith("update.resources")]
    run = Run.start(load_pipeline(QUICKSTART, overrides), run_dir)
    if ranks:
        _placed(run, cluster)
    else:
        assert run.runner.trainer.__class__.__name__ == "LocalTrainer"
    _train(run, check)
    at_start = [0] + [r["policy_version"] for r in _metrics(run_dir)]
    return check, [at_start[max(0, step - 1)] for step in range(steps)]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [True, False], ids=["2 trainer ranks", "the update in the driver"])
def test_pipelined_on_ray_samples_exactly_the_lagging_version(cluster, tmp_path, ranks):
    """``pipelined, lag: 1`` with 2 replicas (and 2 ranks, or the update in the driver): step t
    samples the version of step t - 1's start, in every replica (the log-probs), and the lineage
    says so."""
    run_dir = tmp_path / "run"
    check, scheduled = _pipelined(cluster, run_dir, ranks)
    records = _metrics(run_dir)
    assert check.versions == scheduled == [0, 0, 1, 2]
    for step, rows in enumerate(_lineage(run_dir)):
        assert {(row["policy_version_min"], row["policy_version_max"]) for row in rows} == \
            {(scheduled[step], scheduled[step])}
    assert [list(r["staleness"]) for r in records] == [["0"], ["1"], ["1"], ["1"]], records  # exactly lag 1
    moves = [r["time"]["weight_move_s"] for r in records]
    print(f"\npipelined on Ray ({'ranks' if ranks else 'driver'}): largest gap to the scheduled weights "
          f"{max(check.gaps):.2e}, smallest to the trainer's {min(check.trained_gaps[1:]):.2e}; weight_move_s {moves}")
    assert max(check.gaps) <= TOL
    assert min(check.trained_gaps[1:]) > 100 * TOL, check.trained_gaps
    assert [m > 0 for m in moves] == [False, False, True, True], moves  # the replicas synced when the version moved


@pytest.mark.slow
def test_a_resumed_pipelined_run_on_ray_equals_the_uninterrupted_one(cluster, tmp_path):
    """``pipelined, lag: 1`` with 2 replicas and 2 ranks: 2 steps, a stop, a resume to 4 (new
    replicas and ranks, the schedule's weight history and the ranks' AdamW from the checkpoint)
    gives the metrics and lineage of 4 steps run at once."""
    overrides = ON_THE_CLUSTER + ["lifecycle.mode=pipelined", "lifecycle.lag=1", "run.checkpoint_every=2"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    _train(Run.start(load_pipeline(QUICKSTART, overrides + ["run.steps=4"]), whole), SampledWith())
    _train(Run.start(load_pipeline(QUICKSTART, overrides + ["run.steps=2"]), part), SampledWith())
    resumed = Run.resume(part, steps=4)
    assert resumed.runner.step == 2
    _train(resumed, SampledWith())

    untimed = partial(_metrics, drop=("time",))
    unnamed = partial(_lineage, drop=("run_id",))

    assert [r["step"] for r in untimed(part)] == [0, 1, 2, 3]
    assert untimed(whole) == untimed(part)
    assert unnamed(whole) == unnamed(part)


def keep_initial_weights(monkeypatch, policy: PolicySpec) -> None:
    """The mutation the lifecycle tests on Ray must catch: ``RayEngineGroup.sync_weights`` hands each
    replica the version the schedule picked but loads it with ``policy``'s initial weights."""
    import ray

    from gfcr.engines import load_policy
    from gfcr.runtime.ray.engine_group import RayEngineGroup
    from gfcr.stages.resources import policy_weights

    with torch.random.fork_rng():  # loading draws from torch's RNG: not from the run's
        initial = policy_weights(load_policy(policy))  # version 0's weights

    def versions_only(self, policy_version):
        weights = ray.put(initial)
        ray.get([r.load_weights.remote(weights, policy_version) for r in self.replicas])
        self._version = policy_version
        return 0

    monkeypatch.setattr(RayEngineGroup, "sync_weights", versions_only)


@pytest.mark.slow
def test_replicas_that_take_each_version_but_keep_their_weights_are_caught(cluster, tmp_path, monkeypatch):
    """The mutation: the engine group hands each replica the version the schedule picked but not its
    weights (the replicas are loaded with the initial ones again), so their segments record versions
    they did not sample with; the log-prob check above then fails."""
    keep_initial_weights(monkeypatch, load_pipeline(QUICKSTART).spec.policy)
    check, scheduled = _pipelined(cluster, tmp_path / "run", ranks=False, steps=3)
    print(f"\ngaps to the recorded versions' weights, the replicas kept the initial ones: {check.gaps}")
    assert scheduled == [0, 0, 1] and max(check.gaps[:2]) <= TOL  # steps 0 and 1 sample version 0 either way
    assert check.gaps[2] > 100 * TOL, check.gaps


FAKE = textwrap.dedent("""\
    name: async-fake-ray
    data: {source: arithmetic, with: {n: 200}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 4}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.fake, from: budget, with: {latency_s: 0.0}}
    update: {use: update.fake, from: rollout, with: {latency_s: 0.1}}
    lifecycle: {mode: async, max_staleness: 2}
    run: {steps: 8}
    executor: {kind: ray}
    tracking: {mlflow: null}
    """)


@pytest.mark.slow
def test_async_without_a_policy_on_ray_holds_its_bound(cluster, write_spec, tmp_path):
    """The labelled fake engine, made fast, and the fake update: generation runs ahead until the
    bound holds it back (read from the lineage), under the Ray executor."""
    run_dir = tmp_path / "run"
    Run.start(load_pipeline(write_spec(FAKE)), run_dir).train()
    ages = []
    for r, rows in zip(_metrics(run_dir), _lineage(run_dir)):
        trained_on = r["policy_version"] - (0 if r["update_skipped"] else 1)
        ages += [trained_on - row["policy_version_min"] for row in rows]
    assert len(_metrics(run_dir)) == 8 and max(ages) == 2, ages
