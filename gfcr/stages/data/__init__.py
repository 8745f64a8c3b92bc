"""Data sources: where a run's prompt pool comes from."""
