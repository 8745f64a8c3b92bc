"""Policy losses for ``update.*`` stages: a registry of their own (see ``base``)."""

from gfcr.stages.components.loss.base import Loss, LossConfig, LossSpec, LossTerms, sequence_mean

__all__ = ["Loss", "LossConfig", "LossSpec", "LossTerms", "sequence_mean"]
