"""The DSL: pydantic models of a pipeline and a strict YAML loader with positions."""

from gfcr.spec.loader import build_spec, load_spec, load_spec_text
from gfcr.spec.models import (
    UPDATE_ID, DataSpec, EvalSpec, ExecutorSpec, LifecycleSpec, LoopSpec, LoraSpec, PipelineSpec, PolicySpec,
    Resources, RunSpec, StageSpec, TrackingSpec,
)
from gfcr.spec.yaml_source import SourceMap

__all__ = [
    "UPDATE_ID", "DataSpec", "EvalSpec", "ExecutorSpec", "LifecycleSpec", "LoopSpec", "LoraSpec", "PipelineSpec",
    "PolicySpec", "Resources", "RunSpec", "SourceMap", "StageSpec", "TrackingSpec", "build_spec", "load_spec",
    "load_spec_text",
]
