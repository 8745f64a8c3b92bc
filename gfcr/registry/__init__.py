"""Registries: stages and data sources by alias, built-in, registered in code or by plugins."""

from gfcr.registry.catalog import (
    BUILTIN_DATA_SOURCES, BUILTIN_STAGES, DATA_SOURCES, STAGES, make_data_registry, make_stage_registry,
    stage_info, stage_infos,
)
from gfcr.registry.contract import FAMILIES, FilePath, Port, Seed, StageConfig, StageInfo, describe_stage, path_keys
from gfcr.registry.core import Registry
from gfcr.registry.lifecycle import (
    BeforeStep, ChecksPipeline, EndsLoop, HandsOverGroups, HostsInFlight, InFlightController, NeedsOfUpdate, Observes, OwnsFiles,
    HostNote, OwnsStore, PipelineProblem, ReportsMetrics, SetsUp, Stage, Stateful, Trains, TrainsSharded,
    UpdateNeed, declares, has_role,
)
from gfcr.registry.lifecycle import (  # capabilities: what a stage's Config says it is
    BuildsTrees, ChecksHost, ChecksRows, CountsPrompts, DeclaresCorrection, DropsFinishes, EstimatesAdvantages,
    FixesGroupSize, LoadsModels, LoadsRewardModels, MarksCorrect, NeedsOfEngine, NeedsSyncLifecycle, PerGroup,
    PicksBatch, ReadsRewards, RecordsEntropy,
    ReplaysFresh, ServesStore, SizesEachGroup, SteersItsEngineCalls, UPSTREAM_NEEDS, UpstreamNeed,
)

__all__ = [
    "BuildsTrees", "ChecksHost", "ChecksPipeline", "ChecksRows", "CountsPrompts", "DeclaresCorrection", "DropsFinishes",
    "EstimatesAdvantages", "FixesGroupSize", "LoadsModels", "LoadsRewardModels", "MarksCorrect", "NeedsOfEngine",
    "NeedsSyncLifecycle", "PerGroup", "PicksBatch",
    "ReadsRewards", "RecordsEntropy", "ReplaysFresh", "ServesStore", "SizesEachGroup", "SteersItsEngineCalls",
    "BeforeStep", "EndsLoop", "HandsOverGroups", "HostsInFlight", "InFlightController", "NeedsOfUpdate", "Observes", "OwnsFiles",
    "HostNote", "PipelineProblem", "ReportsMetrics", "SetsUp",
    "OwnsStore", "Stage", "Stateful", "Trains", "TrainsSharded", "UPSTREAM_NEEDS", "UpdateNeed", "UpstreamNeed", "declares", "has_role",
    "BUILTIN_DATA_SOURCES", "BUILTIN_STAGES", "DATA_SOURCES", "FAMILIES", "Port", "Registry", "STAGES",
    "FilePath", "Seed", "StageConfig", "StageInfo", "describe_stage", "path_keys", "make_data_registry", "make_stage_registry",
    "stage_info", "stage_infos",
]
