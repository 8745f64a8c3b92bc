"""Learning-rate rules for ``update.*`` stages: a registry of their own (see ``base``)."""

from gfcr.stages.components.lr_rule.base import LrRule, LrRuleConfig, LrRuleSpec, sequence_log_weights

__all__ = ["LrRule", "LrRuleConfig", "LrRuleSpec", "sequence_log_weights"]
