"""The records of DESIGN.md section 2: the only things that travel between stages.

Port types, the values on the pipeline graph's edges, are ``Allocation``, ``RolloutGroups``,
``UpdateReport`` and ``Provided`` (the Replay provide port); ``PromptPool``, ``StepContext``
and ``StepOutputs`` (the Replay ingest port) are fed to stages by the runtime.
"""

from gfcr.records.allocation import Allocation, AllocationEntry, Budget, ControlReason
from gfcr.records.group import GroupStats, Removal, RolloutGroup, RolloutGroups, TreeIndex, Verdict
from gfcr.records.ids import group_id, prompt_id, rollout_id
from gfcr.records.prompt import Prompt, PromptPool, VerifierSpec
from gfcr.records.replay import Provided, ProvidedKind, ProvidedRollout, StepOutputs
from gfcr.records.report import ControlDecision, StepContext, StepReport, UpdateReport
from gfcr.records.rollout import Origin, Rollout, RolloutStatus, Segment, SegmentOrigin
from gfcr.records.trajectory import Turn, TurnRole
from gfcr.records.stats import Lifecycle, Observation, ObservationSource, PromptStats

PORT_TYPES = (Allocation, RolloutGroups, UpdateReport, Provided)
RUNTIME_INPUTS = (PromptPool, StepContext, StepOutputs)

__all__ = [
    "Allocation", "AllocationEntry", "Budget", "ControlDecision", "ControlReason", "GroupStats", "Lifecycle",
    "Observation", "ObservationSource", "Origin", "PORT_TYPES", "Prompt", "PromptPool", "PromptStats", "Provided",
    "ProvidedKind", "ProvidedRollout", "Removal", "StepOutputs",
    "RUNTIME_INPUTS", "Rollout", "RolloutGroup", "RolloutGroups", "RolloutStatus", "Segment",
    "SegmentOrigin", "StepContext", "StepReport", "TreeIndex", "Turn", "TurnRole", "UpdateReport", "Verdict",
    "VerifierSpec", "group_id", "prompt_id", "rollout_id",
]
