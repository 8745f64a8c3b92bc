"""Off-policy corrections for ``update.*`` stages: a registry of their own (see ``base``)."""

from gfcr.stages.components.correction.base import (Correction, CorrectionConfig, CorrectionSpec, CorrectionStats,
                                                TokenCorrection, kept_tokens, proximal_correction)

__all__ = ["Correction", "CorrectionConfig", "CorrectionSpec", "CorrectionStats", "TokenCorrection", "kept_tokens",
           "proximal_correction"]
