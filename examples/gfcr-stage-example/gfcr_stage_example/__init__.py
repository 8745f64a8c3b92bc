"""gfcr-stage-example: a Filter and a Control stage, registered with gfcr through the `gfcr.stages` entry point."""

from gfcr_stage_example.max_mean_length import MaxMeanLength
from gfcr_stage_example.skip_solved import SkipSolved

__all__ = ["MaxMeanLength", "SkipSolved"]
