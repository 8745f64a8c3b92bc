"""gfcr-stage-example: one Filter stage, registered with gfcr through the `gfcr.stages` entry point."""

from gfcr_stage_example.max_mean_length import MaxMeanLength

__all__ = ["MaxMeanLength"]
