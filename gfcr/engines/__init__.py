"""Engines behind one protocol (``gfcr.stages.resources.Engine``): the transformers engine on
CPU, sharing the trained model object. Importing this package imports torch."""

from gfcr.engines.hf import TransformersEngine
from gfcr.engines.models import ALIASES, ModelError, resolve_model
from gfcr.engines.policy import HFPolicy, load_policy

__all__ = ["ALIASES", "HFPolicy", "ModelError", "TransformersEngine", "load_policy", "resolve_model"]
