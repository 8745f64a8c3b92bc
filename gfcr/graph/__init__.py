"""Compile a spec into a type-checked networkx graph and an execution plan."""

from gfcr.graph.compile import compile_pipeline, entry_problems, load_pipeline
from gfcr.graph.model import Binding, CompiledPipeline, DataBinding, LoopBlock, Node, PlanItem

__all__ = ["Binding", "CompiledPipeline", "DataBinding", "LoopBlock", "Node", "PlanItem", "compile_pipeline", "entry_problems", "load_pipeline"]
