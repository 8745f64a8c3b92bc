"""Loss aggregations for ``update.*`` stages: a registry of their own (see ``base``)."""

from gfcr.stages.components.aggregation.base import Aggregation, AggregationConfig, AggregationSpec, Row, counted_lengths

__all__ = ["Aggregation", "AggregationConfig", "AggregationSpec", "Row", "counted_lengths"]
