"""Tracking: MLflow runs and lineage, and reports over runs (hooks on the runtime)."""
