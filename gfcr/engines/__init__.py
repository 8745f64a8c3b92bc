"""Engines behind one protocol (``gfcr.stages.resources.Engine``): the transformers engine on
CPU, sharing the trained model object, and the vLLM engine on GPU, which loads the trained
weights after every update. Importing this package imports torch; vLLM is imported only when
a ``VLLMEngine`` starts."""

from gfcr.engines.fake import FakeEngine
from gfcr.engines.hf import TransformersEngine
from gfcr.engines.models import ALIASES, ModelError, resolve_model
from gfcr.engines.policy import HFPolicy, load_policy
from gfcr.engines.vllm_engine import EngineError, VLLMEngine, require_vllm

__all__ = ["ALIASES", "EngineError", "FakeEngine", "HFPolicy", "ModelError", "TransformersEngine", "VLLMEngine", "load_policy",
           "require_vllm", "resolve_model"]
