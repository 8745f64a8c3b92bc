"""The registries gfcr ships: stages (entry-point group ``gfcr.stages``), data sources
(``gfcr.data``), and the update's components: advantage estimators (``gfcr.advantages``), losses
(``gfcr.losses``), aggregations (``gfcr.aggregations``), off-policy corrections
(``gfcr.corrections``) and learning-rate rules (``gfcr.lr_rules``), with the built-ins registered lazily by ``module:attr``. A component
class is checked against the declared extension points (``gfcr.registry.components``) when it
is registered, or first looked up if registered lazily."""

from __future__ import annotations

from gfcr.errors import RegistryError
from gfcr.registry.components import check_component_names
from gfcr.registry.contract import StageInfo, describe_stage
from gfcr.registry.core import Registry

BUILTIN_STAGES = {
    "control.uniform": "gfcr.stages.control.uniform:UniformControl",
    "control.fixed_n": "gfcr.stages.control.fixed_n:FixedN",
    "control.greso": "gfcr.stages.control.greso:Greso",
    "control.beta_thompson": "gfcr.stages.control.beta_thompson:BetaThompson",
    "control.vade": "gfcr.stages.control.vade:Vade",
    "control.sgpo": "gfcr.stages.control.sgpo:Sgpo",
    "control.dars": "gfcr.stages.control.dars:Dars",
    "control.hive": "gfcr.stages.control.hive:Hive",
    "control.dots": "gfcr.stages.control.dots:Dots",
    "control.gps": "gfcr.stages.control.gps:Gps",
    "control.depo": "gfcr.stages.control.depo:Depo",
    "control.gdro_rollout": "gfcr.stages.control.gdro_rollout:GdroRollout",
    "control.xrpo": "gfcr.stages.control.xrpo:Xrpo",
    "control.coba": "gfcr.stages.control.coba:Coba",
    "control.stop_at_target": "gfcr.stages.control.stop_at_target:StopAtTarget",
    "control.early_exit": "gfcr.stages.control.early_exit:EarlyExit",
    "control.truncate_steps": "gfcr.stages.control.truncate_steps:TruncateSteps",
    "control.pilot_commit": "gfcr.stages.control.pilot_commit:PilotCommit",
    "control.ar3po": "gfcr.stages.control.ar3po:Ar3po",
    "control.mc_grpo": "gfcr.stages.control.mc_grpo:McGrpo",
    "filter.nonzero_variance": "gfcr.stages.filter.nonzero_variance:NonzeroVariance",
    "filter.dynamic_sampling": "gfcr.stages.filter.dynamic_sampling:DynamicSampling",
    "filter.verify": "gfcr.stages.filter.verify:Verify",
    "filter.judge": "gfcr.stages.filter.judge:Judge",
    "filter.reward_model": "gfcr.stages.filter.reward_model:RewardModel",
    "filter.rubric": "gfcr.stages.filter.rubric:Rubric",
    "filter.finish_reason": "gfcr.stages.filter.finish_reason:FinishReasonFilter",
    "filter.beta_difficulty": "gfcr.stages.filter.beta_difficulty:BetaDifficulty",
    "filter.overlong": "gfcr.stages.filter.overlong:Overlong",
    "filter.step_reward": "gfcr.stages.filter.step_reward:StepReward",
    "filter.d3s": "gfcr.stages.filter.d3s:D3S",
    "filter.merge_rounds": "gfcr.stages.filter.merge_rounds:MergeRounds",
    "filter.uniqueness": "gfcr.stages.filter.uniqueness:Uniqueness",
    "filter.meds": "gfcr.stages.filter.meds:MEDS",
    "filter.gdro_weights": "gfcr.stages.filter.gdro_weights:GdroWeights",
    "filter.entropy": "gfcr.stages.filter.entropy:EntropyGate",
    "generate.sample": "gfcr.stages.generate.sample:Sample",
    "generate.tree": "gfcr.stages.generate.tree:Tree",
    "generate.partial": "gfcr.stages.generate.partial:Partial",
    "generate.speculative": "gfcr.stages.generate.speculative:Speculative",
    "generate.multi_turn": "gfcr.stages.generate.multi_turn:MultiTurn",
    "generate.elpo": "gfcr.stages.generate.elpo:ELPO",
    "generate.trace": "gfcr.stages.generate.trace:Trace",
    "generate.fake": "gfcr.stages.testing:FakeGenerate",
    "update.grpo": "gfcr.stages.update.grpo:GRPOUpdate",
    "update.fake": "gfcr.stages.testing:FakeUpdate",
    "control.fake_stop": "gfcr.stages.testing:FakeStop",
    "filter.fake_slow": "gfcr.stages.testing:FakeSlowFilter",
    "replay.store": "gfcr.stages.replay.store:Store",
    "replay.rlep": "gfcr.stages.replay.rlep:RLEP",
    "replay.rollout_replay": "gfcr.stages.replay.rollout_replay:RolloutReplay",
    "replay.correct_cache": "gfcr.stages.replay.correct_cache:CorrectCache",
    "replay.pilot_join": "gfcr.stages.replay.pilot_join:PilotJoin",
    "replay.fake_provide": "gfcr.stages.testing:FakeProvide",
    "replay.fake_ingest": "gfcr.stages.testing:FakeIngest",
    "replay.fake_mix": "gfcr.stages.testing:FakeMix",
}

BUILTIN_ADVANTAGE_ESTIMATORS = {
    "mean_std": "gfcr.stages.components.advantage.mean_std:MeanStd",
    "mean": "gfcr.stages.components.advantage.mean:Mean",
    "median": "gfcr.stages.components.advantage.median:Median",
    "gapo": "gfcr.stages.components.advantage.gapo:GAPO",
    "mc_grpo": "gfcr.stages.components.advantage.mc_grpo:MCGRPO",
    "rloo": "gfcr.stages.components.advantage.rloo:RLOO",
    "reinforce_pp": "gfcr.stages.components.advantage.reinforce_pp:ReinforcePP",
    "reinforce_pp_plain": "gfcr.stages.components.advantage.reinforce_pp_plain:ReinforcePPPlain",
    "dr_grpo": "gfcr.stages.components.advantage.dr_grpo:DrGRPO",
    "krpo": "gfcr.stages.components.advantage.krpo:KRPO",
    "pvpo": "gfcr.stages.components.advantage.pvpo:PVPO",
    "gdpo": "gfcr.stages.components.advantage.gdpo:GDPO",
    "stratified": "gfcr.stages.components.advantage.stratified:Stratified",
    "grpo_lead": "gfcr.stages.components.advantage.grpo_lead:GRPOLead",
    "xrpo": "gfcr.stages.components.advantage.xrpo:XRPO",
    "tic_grpo": "gfcr.stages.components.advantage.tic_grpo:TICLengthCorrected",
    "tree": "gfcr.stages.components.advantage.tree:TreeAdvantage",
    "opob": "gfcr.stages.components.advantage.opob:OPOB",
    "hgpo": "gfcr.stages.components.advantage.hgpo:HGPO",
}

BUILTIN_LOSSES = {
    "ppo_clip": "gfcr.stages.components.loss.ppo_clip:PPOClip",
    "gspo": "gfcr.stages.components.loss.gspo:GSPO",
    "gspo_token": "gfcr.stages.components.loss.gspo_token:GSPOToken",
    "cispo": "gfcr.stages.components.loss.cispo:CISPO",
    "tic_grpo": "gfcr.stages.components.loss.tic_grpo:TICGRPO",
    "tr_grpo": "gfcr.stages.components.loss.tr_grpo:TRGRPO",
    "m2po": "gfcr.stages.components.loss.m2po:M2PO",
    "sat": "gfcr.stages.components.loss.sat:SAT",
    "sat_gspo": "gfcr.stages.components.loss.sat_gspo:SATGSPO",
    "sao": "gfcr.stages.components.loss.sao:SAO",
    "mu_grpo": "gfcr.stages.components.loss.mu_grpo:MuGRPO",
}

BUILTIN_AGGREGATIONS = {
    "token_mean": "gfcr.stages.components.aggregation.token_mean:TokenMean",
    "seq_mean_token_mean": "gfcr.stages.components.aggregation.seq_mean_token_mean:SeqMeanTokenMean",
    "seq_mean_token_sum": "gfcr.stages.components.aggregation.seq_mean_token_sum:SeqMeanTokenSum",
    "daro": "gfcr.stages.components.aggregation.daro:DARO",
    "lambda_grpo": "gfcr.stages.components.aggregation.lambda_grpo:LambdaGRPO",
}

BUILTIN_CORRECTIONS = {
    "none": "gfcr.stages.components.correction.none:NoCorrection",
    "tis": "gfcr.stages.components.correction.tis:TIS",
    "decoupled_clip": "gfcr.stages.components.correction.decoupled_clip:DecoupledClip",
    "recompute_old": "gfcr.stages.components.correction.recompute_old:RecomputeOld",
    "staleness": "gfcr.stages.components.correction.staleness:Staleness",
    "freshness": "gfcr.stages.components.correction.freshness:Freshness",
    "ewma_proximal": "gfcr.stages.components.correction.ewma_proximal:EWMAProximal",
    "seq_tis": "gfcr.stages.components.correction.seq_tis:SeqTIS",
}

BUILTIN_LR_RULES = {
    "constant": "gfcr.stages.components.lr_rule.constant:Constant",
    "vcpo_ess": "gfcr.stages.components.lr_rule.vcpo_ess:VCPOESS",
}

BUILTIN_DATA_SOURCES = {
    "arithmetic": "gfcr.stages.data.arithmetic:ArithmeticSource",
    "arithmetic_mix": "gfcr.stages.data.arithmetic_mix:ArithmeticMixSource",
    "jsonl": "gfcr.stages.data.jsonl:JsonlSource",
    "gsm8k": "gfcr.stages.data.gsm8k:Gsm8kSource",
    "humaneval": "gfcr.stages.data.humaneval:HumanEvalSource",
    "reasoning_gym": "gfcr.stages.data.reasoning_gym:ReasoningGymSource",
}


def _own_stage_fix(alias: str) -> str:
    """How to make a stage of one's own known, for the unknown-stage error."""
    return (f"if `{alias}` is your own stage, import the module that registers it: `plugins: [my_stages]` in the "
            "pipeline, or `--plugin my_stages` (a module name or a `.py` file); a package declares it in the "
            "`gfcr.stages` entry-point group and is pip-installed (docs/writing-a-stage.md)")


def make_stage_registry(builtins: bool = True, entry_points: bool = True) -> Registry[type]:
    # a class registered eagerly is checked at once (a lazy one when first looked up)
    registry: Registry[type] = Registry("stage", "gfcr.stages" if entry_points else None, check=describe_stage,
                                        unknown_fix=_own_stage_fix)
    if builtins:
        for alias, target in BUILTIN_STAGES.items():
            registry.register_lazy(alias, target, origin="gfcr")
    return registry


def make_data_registry() -> Registry[type]:
    registry: Registry[type] = Registry("data source", "gfcr.data")
    for name, target in BUILTIN_DATA_SOURCES.items():
        registry.register_lazy(name, target, origin="gfcr")
    return registry


def make_component_registry(kind: str, group: str, builtins: dict[str, str]) -> Registry[type]:
    """A registry of the update's components of one ``kind`` (``update.with.<key>.use``): the
    built-ins, lazily, and third parties' through the entry-point ``group``; a class whose public
    name nearly matches an extension point is refused (``check_component_names``)."""
    def check(name: str, cls: type, origin: str) -> None:
        check_component_names(kind, name, cls)

    registry: Registry[type] = Registry(kind, group, check=check, check_lazy=True)
    for name, target in builtins.items():
        registry.register_lazy(name, target, origin="gfcr")
    return registry


STAGES = make_stage_registry()
DATA_SOURCES = make_data_registry()
ADVANTAGE_ESTIMATORS = make_component_registry("advantage estimator", "gfcr.advantages", BUILTIN_ADVANTAGE_ESTIMATORS)
LOSSES = make_component_registry("loss", "gfcr.losses", BUILTIN_LOSSES)
AGGREGATIONS = make_component_registry("aggregation", "gfcr.aggregations", BUILTIN_AGGREGATIONS)
CORRECTIONS = make_component_registry("off-policy correction", "gfcr.corrections", BUILTIN_CORRECTIONS)
LR_RULES = make_component_registry("learning-rate rule", "gfcr.lr_rules", BUILTIN_LR_RULES)


def stage_info(alias: str, registry: Registry[type] = STAGES) -> StageInfo:
    """Look up ``alias`` and describe it (RegistryError if unknown or not a valid stage)."""
    return describe_stage(alias, registry.get(alias), registry.origin(alias))


def stage_infos(registry: Registry[type] = STAGES, family: str | None = None
                ) -> tuple[list[StageInfo], dict[str, RegistryError]]:
    """Every stage of ``family`` (or all), and the aliases that failed to load, with why: one
    broken plugin does not hide the others."""
    infos, broken = [], {}
    for alias in registry.names():
        if family is not None and alias.partition(".")[0] != family:
            continue
        try:
            infos.append(stage_info(alias, registry))
        except RegistryError as exc:
            broken[alias] = exc
    return infos, broken
