"""Advantage estimators for ``update.*`` stages: a registry of their own (see ``base``)."""

from gfcr.stages.components.advantage.base import (AdvantageEstimator, Advantages, AdvantageSpec, EstimatorConfig,
                                               checked_rewards, estimate_all, lower_median)

__all__ = ["AdvantageEstimator", "Advantages", "AdvantageSpec", "EstimatorConfig", "checked_rewards",
           "estimate_all", "lower_median"]
