"""The golden table of bad specs: each must fail with the right place, key path and fix, make
`gfcr validate` exit 2, and run nothing. The user errors met when running (a bad checkpoint,
model, run directory, evaluation or data) have their own table: tests/cli/test_golden_cli_errors.py."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.errors import GraphError, SpecError
from gfcr.graph import load_pipeline
from gfcr.registry import STAGES
from gfcr.stages.data.arithmetic import ArithmeticSource
from tests.conftest import BASE, DAPO, REPO

# a generate stage hosting a TEST in-flight controller (control.fake_stop)
STOP = BASE.replace("  rollout: {use: generate.fake, from: budget}",
                    "  stop:    {use: control.fake_stop, with: {groups: 2}}\n"
                    "  rollout: {use: generate.fake, from: budget, in_flight: [stop]}")

# MC-GRPO's paired allocator in place of control.fixed_n
MC_BASE = BASE.replace("{use: control.fixed_n, from: pick, with: {n: 4}}",
                       "{use: control.mc_grpo, from: pick, with: {g: 4}}")

# DARS's two-round top-up loop block (control.dars, filter.merge_rounds) on the fake engine
DARS = textwrap.dedent("""\
    name: golden-dars
    data: {source: arithmetic, with: {n: 50}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 4}}
      topup:   {use: control.dars, from: {allocation: pick, groups: merged}, with: {n: 4, n_max: 16}}
      rollout: {use: generate.fake, from: topup}
      merged:  {use: filter.merge_rounds, from: rollout}
      keep:    {use: filter.nonzero_variance, from: dars}
    loops:
      dars: {stages: [topup, rollout, merged], until: merged, max_rounds: 2}
    update: {use: update.fake, from: keep}
    run: {steps: 2}
    tracking: {mlflow: null}
    """)


@dataclass
class Case:
    id: str
    text: str
    at: str  # a snippet on the offending line, or "--set ..." for an override
    path: str
    message: str
    fix: str
    overrides: list[str] = field(default_factory=list)


def edit(base: str, old: str, new: str) -> str:
    assert old in base, old
    return base.replace(old, new, 1)


# "billion laughs": nine aliases of nine aliases of ... of nine strings, 4.4e9 values from 500 bytes
BOMB = "".join(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9 if i else ["lol"] * 9) + "]\n" for i in range(10))
DEEP = "[" * 100_000 + "]" * 100_000  # PyYAML's composer recursed into a RecursionError
DEEP_BLOCK = "".join("  " * i + f"k{i}:\n" for i in range(100)) + "  " * 100 + "v: 1\n"

QUICK = (REPO / "pipelines" / "quickstart.yaml").read_text()  # generate.sample and update.grpo, with a policy
VLLM_QUICK = edit(QUICK, "engine: hf}", "engine: vllm}")
VLLM_QUICK_CUDA = edit(QUICK, "engine: hf}", "engine: vllm, device: cuda}")  # vLLM's CUDA build's device, set by hand
VLLM_QUICK_CPU = edit(QUICK, "engine: hf}", "engine: vllm, device: cpu}")
# generate.sample recording entropies, then filter.entropy (quantiles over the whole batch), under streaming
STREAM_ENTROPY = edit(edit(edit(QUICK, "max_new_tokens: 8}}", "max_new_tokens: 8, entropy: true}}\n"
                                "  gate:    {use: filter.entropy, from: rollout}"),
                           "{use: filter.verify, from: rollout}", "{use: filter.verify, from: gate}"),
                      "run: {", "lifecycle: {stream_groups: true}\nrun: {")
APRIL_VLLM = edit((REPO / "pipelines" / "april_arith.yaml").read_text(), "engine: hf}", "engine: vllm, device: cpu}")
TREE_VLLM = edit((REPO / "pipelines" / "tree_arith.yaml").read_text(), "engine: hf}", "engine: vllm}")
FINITE_FIX = "write a finite number here: `.inf`, `-.inf` and `.nan` cannot run"
SEED_FIX = "write 0 or a positive integer"
HUMANEVAL_FROM = 'data: {source: arithmetic, with: {n: 4000, seed: 0, digits: 2, operators: ["+", "-"]}}'
MULTI_TURN = (REPO / "pipelines" / "examples" / "multi_turn_calc_arith.yaml").read_text()  # generate.multi_turn

# issue 40: what a stage needs from upstream, checked at validate. UNSCORED: a shipped pipeline with its
# verifier left out (what read `from: reward` reads the generator); QUICK_READS: the quickstart whose
# verifier is replaced by the stage ``line`` (which reads `from: rollout`, and the update reads it)
VERIFY = "  reward:  {use: filter.verify, from: rollout}\n"
NO_REWARDS = "reads the rollouts' rewards, but no stage upstream of it scores them"


def unscored(pipeline: str) -> str:
    text = edit((REPO / "pipelines" / pipeline).read_text(), VERIFY, "")
    return text.replace("from: reward", "from: rollout").replace("rollout, reward,", "rollout,")


def quick_reads(sid: str, line: str) -> str:
    return edit(edit(QUICK, VERIFY, f"  {sid}: {line}\n"), "update: {use: update.grpo, from: reward",
                f"update: {{use: update.grpo, from: {sid}")


def needs_verifier(sid: str) -> str:
    return f"put a verifier between generation and `{sid}`: `reward: {{use: filter.verify, from: rollout}}`"


UPSTREAM_CASES = [
    Case("filter.nonzero_variance before the verifier (issue 40)",
         edit(QUICK, VERIFY, "  keep:    {use: filter.nonzero_variance, from: rollout}\n"
                             "  reward:  {use: filter.verify, from: keep}\n"),
         "keep:    {use: filter.nonzero_variance", "stages.keep.from", NO_REWARDS, needs_verifier("keep")),
    Case("filter.dynamic_sampling outside any loop block (issue 40)",
         edit(QUICK, "update: {use: update.grpo, from: reward",
              "  enough:  {use: filter.dynamic_sampling, from: reward, with: {target_groups: 8}}\n"
              "update: {use: update.grpo, from: enough"),
         "enough:  {use: filter.dynamic_sampling", "stages.enough.use",
         "ends a loop block (it decides when enough is collected), but it is in none",
         "make it the until stage of a loop block: `loops: {collect: {stages: [pick, budget, rollout, reward, "
         "enough], until: enough, max_rounds: 3}}`, and `from: collect` on `update`"),
    Case("filter.merge_rounds outside any loop block", edit(BASE, "  keep:    {use: filter.nonzero_variance, from: rollout}",
                                                           "  merged:  {use: filter.merge_rounds, from: rollout}\n"
                                                           "  keep:    {use: filter.nonzero_variance, from: merged}"),
         "merged:  {use: filter.merge_rounds", "stages.merged.use", "ends a loop block", "until: merged"),
    Case("filter.dynamic_sampling on accuracy with no verifier in its loop",
         edit(edit(edit(unscored("dapo_arith.yaml"), "  keep:    {use: filter.nonzero_variance, from: rollout}\n", ""),
                   "from: keep, with: {target_groups: 16}", "from: rollout, with: {target_groups: 16, metric: acc}"),
              "rollout, keep,", "rollout,"),
         "enough:  {use: filter.dynamic_sampling", "stages.enough.from", NO_REWARDS, needs_verifier("enough")),
    Case("filter.nonzero_variance with no verifier in its loop (the readers after it are not told again)",
         unscored("dapo_arith.yaml"), "keep:    {use: filter.nonzero_variance", "stages.keep.from", NO_REWARDS,
         needs_verifier("keep")),
    Case("update.grpo reading the generator", edit(edit(QUICK, VERIFY, ""), "from: reward", "from: rollout"),
         "update: {use: update.grpo", "update.from", NO_REWARDS, needs_verifier("update")),
    Case("filter.d3s with no verifier", unscored("d3s_arith.yaml"), "from: rollout\n    with:", "stages.d3s.from",
         NO_REWARDS, needs_verifier("d3s")),
    Case("filter.gdro_weights with no verifier", unscored("gdro_arith.yaml"), "weights: {use: filter.gdro_weights",
         "stages.weights.from", NO_REWARDS, needs_verifier("weights")),
    Case("filter.overlong with no verifier",
         quick_reads("penalty", "{use: filter.overlong, from: rollout, with: {max_length: 8, buffer: 4}}"),
         "penalty: {use: filter.overlong", "stages.penalty.from", NO_REWARDS, needs_verifier("penalty")),
    Case("filter.step_reward with no verifier", quick_reads("steps", "{use: filter.step_reward, from: rollout}"),
         "steps: {use: filter.step_reward", "stages.steps.from", NO_REWARDS, needs_verifier("steps")),
    Case("filter.beta_difficulty with no verifier",
         quick_reads("band", "{use: filter.beta_difficulty, from: rollout}"),
         "band: {use: filter.beta_difficulty", "stages.band.from", NO_REWARDS, needs_verifier("band")),
    Case("filter.meds with no verifier", unscored("meds_arith.yaml"), "meds:    {use: filter.meds", "stages.meds.with",
         "nothing upstream of this stage marks rollouts correct", "put it after the verifier"),
    Case("filter.uniqueness with no verifier", unscored("uniqueness_arith.yaml"), "rare:    {use: filter.uniqueness",
         "stages.rare.with", "nothing upstream of this stage marks rollouts correct", "put it after the verifier"),
    Case("the tree advantage with no tree generator upstream",
         edit(QUICK, "lr: 3.0e-4,", "lr: 3.0e-4, advantage: {use: tree},"), "advantage: {use: tree}",
         "update.with.advantage.use", "no stage upstream of the update generates trees", "generate with `generate.tree`"),
    Case("VCPO's OPOB baseline with a token-mean aggregation",
         edit(QUICK, "lr: 3.0e-4,", "lr: 3.0e-4, advantage: {use: opob},"), "advantage: {use: opob}",
         "update.with.aggregation.use", "so it needs aggregation `seq_mean_token_mean` or `seq_mean_token_sum`, "
         "not `token_mean`", "set `aggregation: {use: seq_mean_token_mean}`"),
    Case("PPO-EWMA's proximal policy without its decay",
         edit(QUICK, "lr: 3.0e-4,", "lr: 3.0e-4, correction: {use: ewma_proximal},"), "correction: {use: ewma_proximal}",
         "update.with.correction.with", "off-policy correction `ewma_proximal`: `decay` is required",
         "write `correction: {use: ewma_proximal, with: {decay: ...}}`"),
]


CASES = [
    Case("near-miss stage name", edit(BASE, "control.uniform", "control.unifrom"),
         "control.unifrom", "stages.pick.use", "unknown stage `control.unifrom`", "did you mean `control.uniform`?"),
    Case("unknown stage of one's own: how to load it", edit(BASE, "filter.nonzero_variance", "filter.max_solve_rate"),
         "filter.max_solve_rate", "stages.keep.use", "unknown stage `filter.max_solve_rate`",
         "`plugins: [my_stages]` in the pipeline, or `--plugin my_stages`"),
    Case("plugin that is no module", "plugins: [my stages]\n" + BASE, "plugins", "plugins.0",
         "`my stages` is neither a module name nor a `.py` file", "`my_pkg.stages`"),
    Case("plugin module not found", "plugins: [no_such_stages]\n" + BASE, "plugins", "plugins.0",
         "plugin `no_such_stages`: no module named `no_such_stages`", "put `no_such_stages.py` beside the pipeline"),
    Case("plugin file not found", "plugins: [stages/none.py]\n" + BASE, "plugins", "plugins.0",
         "no such file", "a relative one is read from the pipeline file's folder"),
    Case("unknown top-level key", BASE + "trackng: {mlflow: null}\n",
         "trackng", "trackng", "unknown key `trackng`", "did you mean `tracking`?"),
    Case("unknown key in a stage entry", edit(BASE, "from: pick,", "frm: pick,"),
         "frm: pick", "stages.budget.frm", "unknown key `frm`", "did you mean `from`?"),
    Case("unknown key in a stage config", edit(BASE, "batch_size: 4", "batch_sise: 4"),
         "batch_sise", "stages.pick.with.batch_sise", "unknown key `batch_sise`", "did you mean `batch_size`?"),
    Case("duplicate key", edit(BASE, "update:", "  keep:    {use: filter.nonzero_variance, from: rollout}\nupdate:"),
         "keep:    {use: filter.nonzero_variance, from: rollout}\nupdate", "stages.keep",
         "duplicate key `keep` (first written at line 7)", "delete the other"),
    Case("wrong type", edit(BASE, "steps: 2", "steps: two"),
         "steps: two", "run.steps", "expected an integer, got str `'two'`", "write an integer here"),
    Case("quoted number in a stage config", edit(BASE, "with: {n: 4}", 'with: {n: "4"}'),
         'n: "4"', "stages.budget.with.n", "expected an integer", "no quotes"),
    Case("yes is not a boolean", edit(BASE, "update: {use: update.fake, from: keep}",
                                      "update: {use: update.fake, from: keep, with: {skip_empty: yes}}"),
         "skip_empty: yes", "update.with.skip_empty", "expected `true` or `false`", "write `true` or `false`"),
    Case("from names a missing stage", edit(BASE, "from: rollout}", "from: rollot}"),
         "from: rollot", "stages.keep.from", "`rollot` is not a stage or loop", "did you mean `rollout`?"),
    Case("type mismatch between connected stages", edit(BASE, "from: rollout}", "from: budget}"),
         "filter.nonzero_variance, from: budget", "stages.keep.from",
         "`keep` (filter.nonzero_variance) reads input `groups` of type RolloutGroups, but `budget` "
         "(control.fixed_n) outputs Allocation", "from a stage that outputs RolloutGroups (`rollout`)"),
    Case("cycle outside a loop", edit(BASE, "update:", "  a: {use: filter.nonzero_variance, from: b}\n"
                                                      "  b: {use: filter.nonzero_variance, from: a}\nupdate:"),
         "a: {use", "stages.a.from", "cycle outside a loop block: a -> b -> a", "list them in a loop block"),
    Case("loop without max_rounds", edit(DAPO, ", max_rounds: 3}", "}"),
         "collect: {stages", "loops.collect.max_rounds", "required key `max_rounds` is missing", "add `max_rounds:`"),
    Case("bad --set path", BASE, "--set run.stepz=3", "run.stepz", "`stepz` is not a key here",
         "did you mean `steps`?", ["run.stepz=3"]),
    Case("bad --set value", BASE, "--set run.steps=abc", "run.steps", "expected an integer, got str",
         "write an integer here", ["run.steps=abc"]),
    Case("--set names a missing stage", BASE, "--set stages.pik.use=control.uniform", "stages.pik",
         "there is no `pik` in `stages`", "did you mean `pick`?", ["stages.pik.use=control.uniform"]),
    Case("--set a near-miss stage alias", BASE, "--set stages.keep.use=filter.nonzero_varience", "stages.keep.use",
         "unknown stage `filter.nonzero_varience`", "did you mean `filter.nonzero_variance`?",
         ["stages.keep.use=filter.nonzero_varience"]),
    Case("--set without a value separator", BASE, "--set run.steps", "run.steps", "must look like KEY=VALUE",
         "--set run.steps=20", ["run.steps"]),
    Case("until stage cannot end a loop", edit(DAPO, "until: enough", "until: keep"),
         "until: keep", "loops.collect.until", "`keep` (filter.nonzero_variance) cannot end a loop",
         "filter.dynamic_sampling"),
    Case("until stage outside its loop", edit(DAPO, "keep, enough], until: enough", "keep], until: enough"),
         "until: enough", "loops.collect.until", "the until stage `enough` is not in this loop's `stages`",
         "name one of"),
    Case("reading inside a loop from outside it", edit(DAPO, "from: collect}", "from: keep}"),
         "update: {use", "update.from", "`update` reads `keep`, which is inside loop block `collect`",
         "read `from: collect`"),
    Case("config bound violated", edit(BASE, "batch_size: 4", "batch_size: 0"),
         "batch_size: 0", "stages.pick.with.batch_size", "greater than or equal to 1", "satisfy the bound"),
    Case("missing required config key", edit(BASE, ", with: {n: 4}}", "}"),
         "budget:", "stages.budget.with.n", "required key `n` is missing", "add `n:` here"),
    Case("DOTS replay without the update's stale-ratio clip",
         edit(BASE, "update: {use: update.fake, from: keep}",
              "  replay:  {use: replay.rollout_replay, from: keep}\nupdate: {use: update.grpo, from: replay}"),
         "update: {use: update.grpo", "update.with.correction.use",
         "stage `replay` (replay.rollout_replay) replays groups sampled by earlier policies",
         "set `correction: {use: decoupled_clip}` in the update's `with` (--set update.with.correction.use="
         "decoupled_clip)"),
    Case("Pilot-Commit without the stage that joins its pilots",
         edit(BASE, "{use: control.fixed_n, from: pick, with: {n: 4}}",
              "{use: control.pilot_commit, from: pick, with: {batch_size: 2}}"),
         "control.pilot_commit", "stages.budget.with", "no `replay.pilot_join` stage",
         "add `join: {use: replay.pilot_join"),
    Case("Pilot-Commit's joined pilots without the update's stale-ratio clip",
         edit(edit(BASE, "{use: control.fixed_n, from: pick, with: {n: 4}}",
                   "{use: control.pilot_commit, from: pick, with: {batch_size: 2}}"),
              "keep:    {use: filter.nonzero_variance, from: rollout}\nupdate: {use: update.fake, from: keep}",
              "keep:    {use: replay.pilot_join, from: {groups: rollout, allocation: budget}}\n"
              "update: {use: update.grpo, from: keep}"),
         "update: {use: update.grpo", "update.with.correction.use",
         "stage `keep` (replay.pilot_join) joins pilot rollouts sampled by earlier policies",
         "set `correction: {use: decoupled_clip}` in the update's `with`"),
    Case("Pilot-Commit keeping more pilots than it rolls out",
         edit(BASE, "{use: control.fixed_n, from: pick, with: {n: 4}}",
              "{use: control.pilot_commit, from: pick, with: {n_pilot: 4, n_pilot_effective: 8}}"),
         "n_pilot_effective: 8", "stages.budget.with",
         "keeps more pilots than are rolled out (`n_pilot: 4`): set it to at most n_pilot", ""),  # fix in the message
    Case("update stage among the stages", edit(BASE, "control.fixed_n", "update.fake"),
         "update.fake, from: pick", "stages.budget.use", "is an update stage", "move it to `update:`"),
    Case("non-update stage as the update", edit(BASE, "{use: update.fake, from: keep}",
                                                "{use: filter.nonzero_variance, from: keep}"),
         "update: {use", "update.use", "is a filter stage, but `update:` needs an update stage", "update.fake"),
    Case("output read by nobody", edit(BASE, "update:", "  extra: {use: filter.nonzero_variance, from: rollout}\nupdate:"),
         "extra:", "stages.extra", "the output of `extra` is not read by any stage", "or remove the stage"),
    Case("unknown data source", edit(BASE, "source: arithmetic", "source: arithmetc"),
         "arithmetc", "data.source", "unknown data source `arithmetc`", "did you mean `arithmetic`?"),
    Case("YAML syntax error", edit(BASE, "run: {steps: 2}", "run: {steps: 2"),
         "tracking:", "", "YAML syntax error", "check indentation"),
    Case("near-miss literal", BASE + "executor: {kind: prefekt}\n",
         "prefekt", "executor.kind", "`prefekt` is not one of", "did you mean `prefect`?"),
    Case("required input not connected", edit(BASE, "from: pick, ", ""),
         "budget:", "stages.budget", "input `allocation: Allocation` of `budget` (control.fixed_n) is not connected",
         "(`pick`)"),
    Case("reserved stage id", edit(BASE, "  keep: ", "  update: ").replace("from: keep}", "from: rollout}"),
         "  update: ", "stages.update", "`update` is reserved", "rename this stage"),
    Case("near-miss input name", edit(BASE, "from: pick,", "from: {allocaton: pick},"),
         "allocaton", "stages.budget.from.allocaton", "has no input `allocaton`", "did you mean `allocation`?"),
    Case("invalid stage id", edit(BASE, "  keep: ", "  keep-it: ").replace("from: keep}", "from: rollout}"),
         "keep-it", "stages.keep-it", "`keep-it` is not a valid name", "letters, digits and `_`"),
    Case("from with a number", edit(BASE, "from: pick,", "from: [pick, 3],"),
         "from: [pick, 3]", "stages.budget.from", "`3` is not a stage id", "`from: [pick, replay]`"),
    Case("tracking in the old shape", edit(BASE, "tracking: {mlflow: null}", "tracking: {backend: none}"),
         "backend", "tracking.backend", "unknown key `backend`", "the keys allowed here are `mlflow`"),
    Case("near-miss MLflow setting", edit(BASE, "tracking: {mlflow: null}", "tracking: {mlflow: {url: x.db}}"),
         "url", "tracking.mlflow.url", "unknown key `url`", "did you mean `uri`?"),
    Case("merge keys refused", BASE + "x: &a {steps: 1}\nrun2:\n  <<: *a\n",
         "<<:", "run2", "merge keys (`<<`) are not supported", "write the keys out"),
    Case("in_flight names a missing stage", edit(STOP, "in_flight: [stop]", "in_flight: [stpo]"),
         "in_flight: [stpo]", "stages.rollout.in_flight.0", "`stpo` is not another stage", "did you mean `stop`?"),
    Case("in_flight names a stage that is not a controller", edit(STOP, "in_flight: [stop]", "in_flight: [budget]"),
         "in_flight: [budget]", "stages.rollout.in_flight.0",
         "`budget` (control.fixed_n) is not an in-flight controller", "name a controller stage in `in_flight`"),
    Case("in-flight controller attached to no generate stage", edit(STOP, ", in_flight: [stop]", ""),
         "stop:    {use: control.fake_stop", "stages.stop", "no generate stage lists it",
         "add `in_flight: [stop]` to the generate stage"),
    Case("in-flight controller with from",
         edit(STOP, "{use: control.fake_stop, with", "{use: control.fake_stop, from: pick, with"),
         "stop:    {use: control.fake_stop", "stages.stop.from", "is an in-flight controller: it reads what the engine",
         "remove `from`"),
    Case("in_flight on a stage that cannot host controllers",
         edit(edit(STOP, ", in_flight: [stop]", ""), "from: rollout}", "from: rollout, in_flight: [stop]}"),
         "in_flight: [stop]", "stages.keep.in_flight", "cannot host in-flight controllers",
         "move `in_flight` to a generate stage"),
    Case("Replay provide port fed by a control stage",
         edit(BASE, "rollout: {use: generate.fake, from: budget}",
              "rollout: {use: generate.fake, from: {allocation: budget, provided: pick}}"),
         "provided: pick", "stages.rollout.from.provided",
         "reads input `provided` of type Provided, but `pick` (control.uniform) outputs Allocation",
         "read `provided` from a stage that outputs Provided"),
    Case("control.early_exit with no filter dropping the pruned rows",
         edit(BASE, "  rollout: {use: generate.fake, from: budget}",
              "  prune:   {use: control.early_exit, with: {at_tokens: 2, keep: 2}}\n"
              "  rollout: {use: generate.fake, from: budget, in_flight: [prune]}"),
         "keep: 2", "stages.prune.with.keep", "no `filter.finish_reason` drops `pruned` rollouts",
         "add `gone: {use: filter.finish_reason, from: rollout, with: {reasons: [pruned], action: drop}}`"),
    Case("control.early_exit keeping as many rows as the allocation gives",
         edit(edit(BASE, "  rollout: {use: generate.fake, from: budget}",
                   "  prune:   {use: control.early_exit, with: {at_tokens: 2, keep: 4}}\n"
                   "  rollout: {use: generate.fake, from: budget, in_flight: [prune]}\n"
                   "  gone:    {use: filter.finish_reason, from: rollout, with: {reasons: [pruned], action: drop}}"),
              "filter.nonzero_variance, from: rollout}", "filter.nonzero_variance, from: gone}"),
         "keep: 4", "stages.prune.with.keep", "`keep: 4` leaves nothing to prune: `budget` (control.fixed_n)",
         "oversample: set `budget`'s `n` above 4 (ARRoL's 2x: 8), or lower `keep`"),
    Case("replay.rlep with correction tis and no tis correction in the update",
         edit(edit(BASE, "  keep:    {use: filter.nonzero_variance, from: rollout}",
                   "  rlep:    {use: replay.rlep, from: rollout, with: {correction: tis}}\n"
                   "  keep:    {use: filter.nonzero_variance, from: rlep}"),
              "update: {use: update.fake, from: keep}", "update: {use: update.grpo, from: keep}"),
         "update: {use: update.grpo", "update.with.correction.use",
         "stage `rlep` (replay.rlep) keeps the replayed rollouts' stored behaviour log-probs (`correction: tis`), "
         "which the update's correction `tis` weights by min(pi_old/mu, C), and the update's correction is `none`",
         "set `correction: {use: tis}` in the update's `with` (--set update.with.correction.use=tis)"),
    Case("replay.rlep reads a store that is not a replay.store",
         edit(BASE, "  keep:    {use: filter.nonzero_variance, from: rollout}",
              "  rlep:    {use: replay.rlep, from: rollout, with: {store: budget}}\n"
              "  keep:    {use: filter.nonzero_variance, from: rlep}"),
         "store: budget", "stages.rlep.with.store", "`store`: `budget` is `control.fixed_n`, not a `replay.store`",
         "add a `replay.store` stage before this one, or remove `store`"),
    Case("filter.d3s whose schedule tightens instead of relaxing",
         edit(BASE, "  keep:    {use: filter.nonzero_variance, from: rollout}",
              "  keep:    {use: filter.d3s, from: rollout, with: {sample_keep_start: 0.8, sample_keep_end: 0.5, "
              "token_keep_start: 1.0}}"),
         "sample_keep_start: 0.8", "stages.keep.with",
         "`sample_keep_start` (0.8) is above `sample_keep_end` (0.5)", "swap them"),
    Case("filter.d3s measuring Var(A) with another estimator than the update's",
         edit(edit(BASE, "  keep:    {use: filter.nonzero_variance, from: rollout}",
                   "  keep:    {use: filter.d3s, from: rollout, with: {token_keep_start: 1.0}}"),
              "update: {use: update.fake, from: keep}", "update: {use: update.grpo, from: keep, with: {advantage: {use: rloo}}}"),
         "keep:    {use: filter.d3s", "stages.keep.with.advantage", "is not the update's (`rloo`",
         "set this stage's `advantage` to the update's"),
    Case("filter.d3s token level after a generate.sample that records no entropy",
         edit(edit(BASE, "  keep:    {use: filter.nonzero_variance, from: rollout}",
                   "  keep:    {use: filter.d3s, from: rollout}"),
              "rollout: {use: generate.fake, from: budget}", "rollout: {use: generate.sample, from: budget}"),
         "keep:    {use: filter.d3s", "stages.keep.with.token_keep_start", "does not record entropy",
         "set `entropy: true` on `rollout`"),
    Case("control.dars with a cap below its first stage", edit(DARS, "n_max: 16", "n_max: 2"),
         "n_max: 2", "stages.topup.with", "n_max (2) must be at least n (4)", ""),
    Case("control.dars outside a loop block, reading a generate stage's groups",
         edit(BASE, "  keep:    {use: filter.nonzero_variance, from: rollout}",
              "  topup:   {use: control.dars, from: {allocation: pick, groups: rollout}, with: {n: 4}}\n"
              "  again:   {use: generate.fake, from: topup}\n"
              "  keep:    {use: filter.nonzero_variance, from: again}"),
         "topup:", "stages.topup.with", "`rollout` (generate.fake) is upstream of control.dars",
         "put the stage in a loop block"),
    Case("control.dars sized without std for an update that divides by it",
         edit(DARS, "update: {use: update.fake, from: keep}",
              "update: {use: update.grpo, from: keep, with: {advantage: {use: mean_std}}}"),
         "n_max: 16", "stages.topup.with.std", "std: false sizes the top-up for an advantage not divided by the "
         "group's std, but the update's advantage is `mean_std`",
         "set `std: true` here, or the update's advantage to `mean`"),
    Case("control.xrpo outside a loop block, reading a generate stage's groups",
         edit(BASE, "  keep:    {use: filter.nonzero_variance, from: rollout}",
              "  plan:    {use: control.xrpo, from: {allocation: pick, groups: rollout}}\n"
              "  again:   {use: generate.fake, from: plan}\n"
              "  keep:    {use: filter.nonzero_variance, from: again}"),
         "plan:", "stages.plan.with", "`rollout` (generate.fake) is upstream of control.xrpo",
         "put the stage in a loop block"),
    Case("control.xrpo with a base larger than its budget",
         edit(BASE, "  keep:    {use: filter.nonzero_variance, from: rollout}",
              "  plan:    {use: control.xrpo, from: {allocation: pick, groups: merged}, with: {n_base: 10}}\n"
              "  again:   {use: generate.fake, from: plan}\n"
              "  merged:  {use: filter.merge_rounds, from: again}\n"
              "  keep:    {use: filter.nonzero_variance, from: xrpo}\n"
              "loops:\n"
              "  xrpo: {stages: [plan, again, merged], until: merged, max_rounds: 3}"),
         "n_base: 10", "stages.plan.with", "need n_base <= mean_rollouts <= n_max, got 10, 8, 16", ""),
    Case("MC-GRPO's estimator with a g the paired control.mc_grpo does not allocate",
         edit(MC_BASE, "{use: update.fake, from: keep}",
              "{use: update.grpo, from: keep, with: {advantage: {use: mc_grpo, with: {g: 8}}}}"),
         "update: {use: update.grpo", "update.with.advantage.with.g",
         "MC-GRPO with `g: 8` needs G + 1 = 9 rollouts per prompt, but stage `budget` allocates 5",
         "set `g: 8` on `budget` (--set stages.budget.with.g=8), or set `g: 4`"),
    Case("control.mc_grpo's G + 1 rollouts without MC-GRPO's estimator",
         edit(MC_BASE, "{use: update.fake, from: keep}", "{use: update.grpo, from: keep}"),
         "control.mc_grpo", "stages.budget.with.g", "allocates G + 1 = 5 rollouts for MC-GRPO's median pivot, but the "
         "update's advantage is `mean_std`", "set the update's `advantage: {use: mc_grpo, with: {g: 4}}`"),
    Case("control.ar3po fed by a generate stage instead of its loop's feedback edge",
         edit(BASE, "  keep:    {use: filter.nonzero_variance, from: rollout}",
              "  adapt:   {use: control.ar3po, from: {allocation: pick, groups: rollout}}\n"
              "  again:   {use: generate.fake, from: adapt}\n"
              "  keep:    {use: filter.nonzero_variance, from: again}"),
         "adapt:", "stages.adapt.with", "`rollout` (generate.fake) is upstream of control.ar3po",
         "put the stage in a loop block"),
    Case("control.coba whose mean is above its cap",
         edit(BASE, "{use: control.fixed_n, from: pick, with: {n: 4}}",
              "{use: control.coba, from: pick, with: {mean_rollouts: 200}}"),
         "control.coba", "stages.budget.with", "need n_min <= mean_rollouts <= n_max, got 2, 200, 128", ""),
    Case("TIC-GRPO's trajectory ratio without its mean over trajectories",
         edit(BASE, "{use: update.fake, from: keep}",
              "{use: update.grpo, from: keep, with: {loss: {use: tic_grpo, with: {eps_high: 0.28}}}}"),
         "tic_grpo", "update.with.aggregation.use",
         "TIC-GRPO's objective is a mean over trajectories of one ratio each, so it needs aggregation "
         "`seq_mean_token_mean`, not `token_mean`", "set `aggregation: {use: seq_mean_token_mean}`"),
    Case("SAT's staleness proxy under a decoupled correction (issue 39)",
         edit(BASE, "{use: update.fake, from: keep}",
              "{use: update.grpo, from: keep, with: {loss: {use: sat}, correction: {use: decoupled_clip}}}"),
         "sat", "update.with.correction.use",
         "SAT's staleness proxy is the log-ratio against the behaviour policy, so it needs correction "
         "`none` or `staleness` or `freshness`, not `decoupled_clip`",
         "set `correction: {use: none}` (--set update.with.correction.use=none), or another loss than `sat`"),
    Case("TIC-GRPO's clip bound left to a guess",
         edit(BASE, "{use: update.fake, from: keep}", "{use: update.grpo, from: keep, with: "
                                                        "{loss: {use: tic_grpo}, aggregation: {use: seq_mean_token_mean}}}"),
         "tic_grpo", "update.with.loss.with", "loss `tic_grpo`: `eps_high` is required",
         "write `loss: {use: tic_grpo, with: {eps_high: ...}}`"),
    Case("TR-GRPO whose token weights are all equal (plain GRPO)",
         edit(BASE, "{use: update.fake, from: keep}",
              "{use: update.grpo, from: keep, with: {loss: {use: tr_grpo, with: {tau: 9.0}}}}"),
         "tr_grpo", "update.with.loss.with", "every token weighs the same and this is plain GRPO",
         "lower tau (e.g. 0.1111, i.e. sigmoid(9 p))"),
    Case("control.hive with no generator recording response entropy",
         edit(BASE, "{use: control.uniform, with: {batch_size: 4}}", "{use: control.hive, with: {batch_size: 4}}"),
         "control.hive", "stages.pick.with", "no generate stage records per-token entropy",
         "generate with `generate.sample` and `entropy: true`"),
    Case("control.hive with an empty success band",
         edit(BASE, "{use: control.uniform, with: {batch_size: 4}}",
              "{use: control.hive, with: {batch_size: 4, min_success: 0.5, max_success: 0.5}}"),
         "control.hive", "stages.pick.with", "min_success (0.5) must be below max_success (0.5)",
         "lower `min_success` or raise `max_success`; the defaults are 0 and 1"),
    Case("alias bomb (billion laughs)", BASE + BOMB, "a9: &a9 [*a8", "",
         "aliases would expand this document to 4,412,961,", "write the values out instead of nesting aliases"),
    Case("100,000 nested brackets", edit(BASE, "run: {steps: 2}", f"run: {{steps: 2, x: {DEEP}}}"),
         "run: {steps: 2, x: [[[", "", "the document nests deeper than 64 levels", "flatten the structure"),
    Case("the decode score path on the vLLM engine",
         edit(QUICK, "policy: {model: tiny-arith, engine: hf}", "policy: {model: tiny-arith, engine: vllm, score_path: decode}"),
         "policy: {model: tiny-arith, engine: vllm", "policy",
         "`policy.score_path: decode` is the transformers engine's", "remove `score_path`, or set `engine: hf`"),
    Case("the CPU vLLM engine sharded over workers",
         edit(QUICK, "policy: {model: tiny-arith, engine: hf}",
              "policy: {model: tiny-arith-h64, engine: vllm, device: cpu, vllm: {tensor_parallel_size: 2}}"),
         "policy: {model: tiny-arith-h64, engine: vllm", "policy",
         "`policy.vllm.tensor_parallel_size: 2` with `device: cpu`",
         "remove `tensor_parallel_size`, or set `device: cuda` on a machine with GPUs"),
    Case("the CPU vLLM engine sized by a GPU's share",
         edit(QUICK, "policy: {model: tiny-arith, engine: hf}",
              "policy: {model: tiny-arith-h64, engine: vllm, device: cpu, vllm: {gpu_memory_utilization: 0.3}}"),
         "policy: {model: tiny-arith-h64, engine: vllm", "policy",
         "`policy.vllm.gpu_memory_utilization` with `device: cpu`",
         "size vLLM's KV cache with `policy.vllm.kv_cache_gib` instead"),
    Case("a LoRA adapter on the output layer with the vLLM engine",
         edit(QUICK, "policy: {model: tiny-arith, engine: hf}",
              "policy: {model: tiny-arith-h64, engine: vllm, device: cpu, lora: {target_modules: [q_proj, lm_head]}}"),
         "policy: {model: tiny-arith-h64, engine: vllm", "policy",
         "`target_modules` adapts `lm_head`, which vLLM's LoRA does not load",
         "set `engine: hf` (the transformers engine runs any adapter peft makes), or remove it from `target_modules`"),
    Case("a LoRA rank vLLM cannot load",
         edit(QUICK, "policy: {model: tiny-arith, engine: hf}",
              "policy: {model: tiny-arith-h64, engine: vllm, device: cpu, lora: {rank: 1024}}"),
         "policy: {model: tiny-arith-h64, engine: vllm", "policy",
         "vLLM loads adapters of rank 512 at most, and `rank` is 1024", "or lower `rank`"),
    Case("nucleus sampling on the vLLM engine",
         edit(VLLM_QUICK, "temperature: 1.0,", "temperature: 1.0, top_p: 0.9,"),
         "top_p: 0.9", "stages.rollout.with.top_p",
         "`rollout` (generate.sample) needs nucleus sampling (`top_p` below 1) with the untruncated distribution's "
         "behaviour log-probabilities, which `policy.engine: vllm` cannot give: vLLM records the log-probabilities "
         "of the top-p-truncated", "set `top_p: 1.0` on `rollout`, or use `policy.engine: hf`"),
    Case("nucleus sampling of trees on the vLLM engine, set from the command line", TREE_VLLM,
         "--set stages.rollout.with.top_p=0.95", "stages.rollout.with.top_p",
         "`rollout` (generate.tree) needs nucleus sampling (`top_p` below 1)",
         "set `top_p: 1.0` on `rollout`, or use `policy.engine: hf`", ["stages.rollout.with.top_p=0.95"]),
    Case("in-flight control across Ray engine replicas, vLLM's included", APRIL_VLLM, "in_flight: [stop]",
         "stages.rollout.in_flight", "`rollout` hands in-flight controllers (stop) to the engine, but with "
         "`executor: {kind: ray}` the engine is 2 replica actor(s)",
         "run this pipeline with `executor: {kind: prefect}` (or `local`), or remove `in_flight`",
         ["executor.kind=ray", "stages.rollout.resources.replicas=2"]),
    Case("in-flight weight updates across Ray engine replicas (vLLM replicas run the stale lifecycles)",
         edit(VLLM_QUICK_CPU, "with: {lr:", "with: {correction: {use: tis}, lr:")
         + "lifecycle: {mode: async, max_staleness: 1, in_flight: true}\nexecutor: {kind: ray}\n",
         "in_flight: true", "lifecycle.in_flight", "`lifecycle.in_flight: true` publishes new versions between the "
         "decode steps of a running generate call, but with `executor: {kind: ray}` each engine replica is synced "
         "to one version before a step's generation and takes no version mid-call yet",
         "remove `in_flight` (each step then samples with the newest version the bound allows), or run it on vLLM "
         "with `executor: {kind: prefect}` (or `local`)"),
    Case("GPUs reserved for Ray replicas that would sample on the CPU", VLLM_QUICK_CPU,
         "--set stages.rollout.resources.gpus=1", "stages.rollout.resources.gpus",
         "`rollout` reserves 1 GPU(s) per engine replica, but the policy is on the CPU",
         "set `policy.device: cuda`", ["executor.kind=ray", "stages.rollout.resources.gpus=1"]),
    Case("Ray replicas on cuda without a GPU reserved", VLLM_QUICK_CUDA, "rollout: {use: generate.sample",
         "stages.rollout.resources.gpus", "the policy is on `cuda`, but `rollout` reserves no GPU",
         "set `resources: {gpus: 1}` (or more) on `rollout`, or `policy.device: cpu`", ["executor.kind=ray"]),
    Case("Ray replicas placed by a quantity every node has", QUICK, "--set stages.rollout.resources.node_resource=GPU",
         "stages.rollout.resources.node_resource", "`node_resource: GPU` names a quantity every Ray node has",
         "start those nodes with `ray start --resources '{\"engines\": 1}'` and set `node_resource: engines`",
         ["executor.kind=ray", "stages.rollout.resources.node_resource=GPU"]),
    Case("a Ray placement strategy misspelt", QUICK, "--set stages.rollout.resources.strategy=packed",
         "stages.rollout.resources.strategy", "`packed` is not one of `pack`, `spread`, `strict_pack`, `strict_spread`",
         "did you mean `pack`?", ["executor.kind=ray", "stages.rollout.resources.strategy=packed"]),
    Case("a weight-sync path without Ray replicas", QUICK + "executor: {kind: prefect, weight_sync: collective}\n",
         "weight_sync: collective", "executor.weight_sync", "`executor.weight_sync` chooses how weights reach Ray "
         "engine replicas, but the executor is `prefect`", "set `executor.kind: ray`, or remove `weight_sync`"),
    Case("a weight-sync path misspelt", QUICK + "executor: {kind: ray, weight_sync: object-store}\n",
         "object-store", "executor.weight_sync", "`object-store` is not one of", "did you mean `object_store`?"),
    Case("a stale lifecycle with no declared correction", QUICK + "lifecycle: {mode: pipelined, lag: 1}\n",
         "mode: pipelined", "lifecycle.mode", "`lifecycle: {mode: pipelined, lag: 1}` trains on tokens up to 1 policy "
         "version(s) old, and the update declares no off-policy correction",
         "`correction: {use: tis}` (--set update.with.correction.use=tis"),
    Case("an asynchronous lifecycle with no correction, from the command line", QUICK, "--set lifecycle.mode=async",
         "lifecycle.mode", "`lifecycle: {mode: async, max_staleness: 2}` trains on tokens up to 2 policy version(s) old",
         "or `correction: {use: none}` to train on stale tokens with no correction, knowingly",
         ["lifecycle.mode=async", "lifecycle.max_staleness=2"]),
    Case("an asynchronous lifecycle without its bound", BASE + "lifecycle: {mode: async}\n", "mode: async",
         "lifecycle", "`lifecycle: {mode: async}` needs its bound", "add `max_staleness: K`"),
    Case("the pipelined lag on another lifecycle", BASE + "lifecycle: {mode: async, lag: 2}\n", "mode: async",
         "lifecycle", "`lifecycle.lag` is the pipelined lifecycle's, but `lifecycle.mode` is `async`",
         "set `mode: pipelined`, or remove `lag` (the asynchronous bound is `max_staleness`)"),
    Case("in-flight weight updates on the pipelined lifecycle",
         BASE + "lifecycle: {mode: pipelined, in_flight: true}\n",
         "mode: pipelined", "lifecycle", "`lifecycle.in_flight` is the asynchronous lifecycle's, but `lifecycle.mode` "
         "is `pipelined`", "set `mode: async` (with `max_staleness`), or remove `in_flight`"),
    Case("a lifecycle mode misspelt", BASE + "lifecycle: {mode: asynch, max_staleness: 1}\n", "asynch",
         "lifecycle.mode", "`asynch` is not one of", "did you mean `async`?"),
    Case("a stage that needs the synchronous lifecycle under a pipelined one",
         (REPO / "pipelines" / "meds_arith.yaml").read_text(), "use: filter.meds", "stages.meds.use",
         "`meds` (filter.meds) needs the synchronous lifecycle, and the pipeline declares `lifecycle: {mode: "
         "pipelined, lag: 1}`: it forwards the trained policy itself", "remove `lifecycle` (the default is `{mode: sync}`)",
         ["lifecycle.mode=pipelined", "update.with.correction.use=tis"]),
    Case("streamed groups from a generate stage that cannot hand them over",
         BASE + "lifecycle: {stream_groups: true}\n", "use: generate.fake", "stages.rollout.use",
         "`rollout` (generate.fake) cannot hand its groups over as they finish", "or use `generate.sample`"),
    Case("streamed groups into a stage that reads the whole batch", STREAM_ENTROPY, "use: filter.entropy",
         "stages.gate.use", "`gate` (filter.entropy) runs directly after `rollout` and is not a per-group stage",
         "or put a per-group stage (`filter.verify`, `filter.finish_reason`, ...) directly after `rollout`"),
    Case("streamed groups on the Ray executor", QUICK + "lifecycle: {stream_groups: true}\n", "stream_groups: true",
         "lifecycle.stream_groups", "the Ray executor's engine replicas return a step's generation whole",
         "or use `executor: {kind: local}` or `prefect`", ["executor.kind=ray"]),
    Case("streamed groups from a generate stage in a loop block", DAPO + "lifecycle: {stream_groups: true}\n",
         "rollout: {use: generate.fake", "stages.rollout.use", "`rollout` is in the loop block `collect`",
         "remove `lifecycle.stream_groups`"),
    Case("trainer ranks without the Ray executor", QUICK, "--set update.resources.replicas=2",
         "update.resources.replicas", "the update asks for 2 trainer ranks, which run as Ray actors, but the "
         "executor is", "set `executor: {kind: ray}` (--set executor.kind=ray), or `replicas: 1` on the update",
         ["update.resources.replicas=2"]),
    Case("GPUs reserved for trainer ranks that would train on the CPU", QUICK, "--set update.resources.gpus=1",
         "update.resources.gpus", "the update reserves 1 GPU(s) per trainer rank, but the policy is on the CPU",
         "set `policy.device: cuda`, or remove `gpus` from the update's `resources`",
         ["executor.kind=ray", "update.resources.replicas=2", "update.resources.gpus=1"]),
    Case("sharded trainer ranks without the Ray executor", QUICK, "--set update.resources.sharding=fsdp2",
         "update.resources.sharding", "`sharding: fsdp2` shards the policy over the update's trainer ranks, which run "
         "as Ray actors, but the executor is", "set `executor: {kind: ray}` (--set executor.kind=ray), or remove "
         "`sharding`", ["update.resources.replicas=2", "update.resources.sharding=fsdp2"]),
    Case("sharding asked of an engine's replicas", QUICK, "--set stages.rollout.resources.sharding=fsdp2",
         "stages.rollout.resources.sharding", "`sharding: fsdp2` shards the update's trainer ranks; `rollout` is a "
         "stage whose replicas each hold the whole policy", "remove `sharding` from `rollout`'s resources, and set it "
         "on the update's", ["executor.kind=ray", "stages.rollout.resources.sharding=fsdp2"]),
    Case("sharded trainer ranks with a moving average of the policy", QUICK, "--set update.with.correction.use="
         "ewma_proximal", "update.with.correction.use", "the correction `ewma_proximal` keeps a moving average of the "
         "policy's weights, a copy of the whole model, which sharded ranks do not hold", "remove `sharding` from the "
         "update's resources (replicated ranks), or choose another correction",
         ["executor.kind=ray", "update.resources.replicas=2", "update.resources.sharding=fsdp2",
          "update.with.correction.use=ewma_proximal", "update.with.correction.with.decay=0.9"]),
    Case("a sharding misspelt", QUICK, "--set update.resources.sharding=fsdp", "update.resources.sharding",
         "`fsdp` is not one of `fsdp2`, `replicated`", "did you mean `fsdp2`?",
         ["executor.kind=ray", "update.resources.replicas=2", "update.resources.sharding=fsdp"]),
    Case("infinite learning rate", edit(QUICK, "lr: 3.0e-4", "lr: .inf"),
         "lr: .inf", "update.with.lr", "`lr` must be a finite number, got `inf`", FINITE_FIX),
    Case("infinite sampling temperature", edit(QUICK, "temperature: 1.0", "temperature: .inf"),
         "temperature: .inf", "stages.rollout.with.temperature", "`temperature` must be a finite number, got `inf`",
         FINITE_FIX),
    Case("-inf in an optional float", edit(QUICK, "lr: 3.0e-4,", "lr: 3.0e-4, max_grad_norm: -.inf,"),
         "max_grad_norm: -.inf", "update.with.max_grad_norm", "`max_grad_norm` must be a finite number, got `-inf`",
         FINITE_FIX),
    Case("an update key that became a component", edit(QUICK, "lr: 3.0e-4,", "lr: 3.0e-4, tis_cap: 2.0,"),
         "tis_cap: 2.0", "update.with.tis_cap", "`tis_cap` is no longer a key here",
         "write `correction: {use: tis, with: {cap: 2.0}}` (--set update.with.correction.use=tis --set "
         "update.with.correction.with.cap=2.0)"),
    Case("a correction's staleness limit below zero",
         edit(QUICK, "lr: 3.0e-4,", "lr: 3.0e-4, correction: {use: decoupled_clip, with: {max_staleness: -1}},"),
         "correction: {use: decoupled_clip", "update.with.correction.with",
         "off-policy correction `decoupled_clip`: `max_staleness`", "change `max_staleness` to satisfy the bound"),
    Case("NaN in an update component's float pair", edit(QUICK, "clip: [0.2, 0.28]", "clip: [0.2, .nan]"),
         "clip: [0.2, .nan]", "update.with.loss.with", "loss `ppo_clip`: `clip.1` must be a finite number, got `nan`",
         "give `clip.1` a finite number"),
    Case("NaN in a stage config", edit(BASE, "from: rollout}", "from: rollout, with: {tolerance: .nan}}"),
         "tolerance: .nan", "stages.keep.with.tolerance", "`tolerance` must be a finite number, got `nan`",
         FINITE_FIX),
    Case("infinite float in a stage entry (timeout)", edit(BASE, "from: rollout}", "from: rollout, timeout_s: .inf}"),
         "timeout_s: .inf", "stages.keep.timeout_s", "`timeout_s` must be a finite number, got `inf`", FINITE_FIX),
    Case("infinite loop wall-clock limit", edit(DARS, "max_rounds: 2}", "max_rounds: 2, max_seconds: .inf}"),
         "max_seconds: .inf", "loops.dars.max_seconds", "`max_seconds` must be a finite number, got `inf`",
         FINITE_FIX),
    Case("NaN retry delay of a stage entry", edit(BASE, "from: rollout}", "from: rollout, retry_delay_s: .nan}"),
         "retry_delay_s: .nan", "stages.keep.retry_delay_s", "`retry_delay_s` must be a finite number, got `nan`",
         FINITE_FIX),
    Case("negative run seed", edit(QUICK, "seed: 0, checkpoint_every", "seed: -1, checkpoint_every"),
         "run: {steps: 100, seed: -1", "run.seed", "a seed is a non-negative integer, got `-1`", SEED_FIX),
    Case("negative data seed", edit(QUICK, "n: 4000, seed: 0", "n: 4000, seed: -1"),
         "n: 4000, seed: -1", "data.with.seed", "a seed is a non-negative integer, got `-1`", SEED_FIX),
    Case("negative stage seed", edit(QUICK, "batch_size: 16}", "batch_size: 16, seed: -2}"),
         "batch_size: 16, seed: -2", "stages.pick.with.seed", "a seed is a non-negative integer, got `-2`", SEED_FIX),
    Case("Adam beta2 of 1", edit(QUICK, "lr: 3.0e-4,", "lr: 3.0e-4, betas: [0.9, 1.0],"),
         "betas: [0.9, 1.0]", "update.with.betas", "Adam's betas must each be in [0, 1), got [0.9, 1.0]",
         "write e.g. `betas: [0.9, 0.999]`"),
    Case("negative Adam beta1", edit(QUICK, "lr: 3.0e-4,", "lr: 3.0e-4, betas: [-0.1, 0.999],"),
         "betas: [-0.1, 0.999]", "update.with.betas", "Adam's betas must each be in [0, 1), got [-0.1, 0.999]",
         "write e.g. `betas: [0.9, 0.999]`"),
    Case("empty stop string", edit(QUICK, "max_new_tokens: 8}}", 'max_new_tokens: 8, stop: [""]}}'),
         'stop: [""]', "stages.rollout.with.stop",
         "`stop` holds an empty string (item 0), which would end every response after its first token",
         "remove the empty string from `stop`"),
    Case("100 nested block mappings", BASE + DEEP_BLOCK, "k63:", "", "the document nests deeper than 64 levels",
         "flatten the structure"),
    Case("control.dots whose fresh batch sigma * B is not whole",
         edit(BASE, "{use: control.uniform, with: {batch_size: 4}}", "{use: control.dots, with: {batch_size: 5}}"),
         "control.dots", "stages.pick.with", "fresh_fraction * batch_size = 0.5 * 5 = 2.5 is not a whole number",
         "choose batch_size and fresh_fraction so that sigma * B is an integer"),
    Case("control.dots and replay.rollout_replay at different sigmas",
         edit(edit(BASE, "{use: control.uniform, with: {batch_size: 4}}",
                   "{use: control.dots, with: {batch_size: 4, fresh_fraction: 0.25}}"),
              "update: {use: update.fake, from: keep}",
              "  replay:  {use: replay.rollout_replay, from: keep}\n"
              "update: {use: update.grpo, from: replay, with: {correction: {use: decoupled_clip}}}"),
         "control.dots", "stages.pick.with.fresh_fraction",
         "and `replay` (replay.rollout_replay) fills the batch for fresh_fraction 0.5",
         "set the same `fresh_fraction` on both (`--set stages.replay.with.fresh_fraction=0.25`)"),
    Case("verifier workers with too little memory to start",
         edit(QUICK, "reward:  {use: filter.verify, from: rollout}",
              "reward:  {use: filter.verify, from: rollout, with: {memory_mb: 64}}"),
         "memory_mb: 64", "stages.reward.with.memory_mb",
         "`memory_mb` is 64 MiB, and a verifier worker process needs at least 256 MiB", "write `memory_mb: 2048`"),
    Case("a verifier timeout of zero",
         edit(QUICK, "reward:  {use: filter.verify, from: rollout}",
              "reward:  {use: filter.verify, from: rollout, with: {timeout_s: 0}}"),
         "timeout_s: 0", "stages.reward.with.timeout_s", "greater than 0", "satisfy the bound"),
    Case("an infinite verifier timeout",
         edit(QUICK, "reward:  {use: filter.verify, from: rollout}",
              "reward:  {use: filter.verify, from: rollout, with: {timeout_s: .inf}}"),
         "timeout_s: .inf", "stages.reward.with.timeout_s", "`timeout_s` must be a finite number, got `inf`",
         FINITE_FIX),
    Case("no verifier workers",
         edit(QUICK, "reward:  {use: filter.verify, from: rollout}",
              "reward:  {use: filter.verify, from: rollout, with: {workers: 0}}"),
         "workers: 0", "stages.reward.with.workers", "greater than or equal to 1", "satisfy the bound"),
    Case("a judge template without the response",
         edit(QUICK, "reward:  {use: filter.verify, from: rollout}",
              "reward:  {use: filter.judge, from: rollout, with: {template: 'Is {prompt} hard?'}}"),
         "template:", "stages.reward.with.template",
         "the judge's template has no `{response}` placeholder", "add `{response}` where the response goes"),
    Case("a judge template with a misspelt placeholder",
         edit(QUICK, "reward:  {use: filter.verify, from: rollout}",
              "reward:  {use: filter.judge, from: rollout, with: {template: 'Q {prompt} A {respons}'}}"),
         "template:", "stages.reward.with.template",
         "the judge's template has the placeholder `{respons}`", "did you mean `response`?"),
    Case("a judge number parse without its range",
         edit(QUICK, "reward:  {use: filter.verify, from: rollout}",
              "reward:  {use: filter.judge, from: rollout, with: {parse: {kind: number}}}"),
         "parse:", "stages.reward.with.parse.range", "required key `range` is missing", "add `range:` here"),
    Case("a judge number parse with an empty range",
         edit(QUICK, "reward:  {use: filter.verify, from: rollout}",
              "reward:  {use: filter.judge, from: rollout, with: {parse: {kind: number, range: [10, 0]}}}"),
         "parse:", "stages.reward.with.parse.range",
         "`range: [10, 0]` is empty", "write `[lo, hi]` with lo < hi"),
    Case("a judge under the Ray executor",
         edit(QUICK, "reward:  {use: filter.verify, from: rollout}", "reward:  {use: filter.judge, from: rollout}"),
         "use: filter.judge", "stages.reward.use", "`reward` calls the engine itself with an in-flight controller",
         "run this pipeline with `executor: {kind: prefect}` (or `local`)", ["executor.kind=ray"]),
    Case("a rubric with a judge criterion under the Ray executor",
         edit(QUICK, "reward:  {use: filter.verify, from: rollout}",
              "reward:  {use: filter.rubric, from: rollout, with: {criteria: {ok: {kind: judge}}}}"),
         "use: filter.rubric", "stages.reward.use", "`reward` calls the engine itself with an in-flight controller",
         "run this pipeline with `executor: {kind: prefect}` (or `local`)", ["executor.kind=ray"]),
    Case("a rubric whose criteria all weigh 0",
         edit(QUICK, "reward:  {use: filter.verify, from: rollout}",
              "reward:  {use: filter.rubric, from: rollout, with: {criteria: {ok: {kind: verifier, weight: 0}}}}"),
         "criteria:", "stages.reward.with", "every criterion has weight 0",
         "give at least one criterion a positive `weight`"),
    Case("a rubric regex that does not compile",
         edit(QUICK, "reward:  {use: filter.verify, from: rollout}",
              "reward:  {use: filter.rubric, from: rollout, with: {criteria: {f: {kind: regex, pattern: '(x'}}}}"),
         "pattern:", "stages.reward.with.criteria.f.pattern", "is not a regular expression",
         "escape the characters"),
    Case("a code sandbox with too little memory",
         edit(QUICK, HUMANEVAL_FROM, "data: {source: humaneval, with: {memory_mb: 8}}"),
         "memory_mb: 8", "data.with.memory_mb", "greater than or equal to 64", "satisfy the bound"),
    Case("a code sandbox time limit of NaN",
         edit(QUICK, HUMANEVAL_FROM, "data: {source: humaneval, with: {timeout_s: .nan}}"),
         "timeout_s: .nan", "data.with.timeout_s", "`timeout_s` must be a finite number, got `nan`", FINITE_FIX),
    Case("a code sandbox level that does not exist",
         edit(QUICK, HUMANEVAL_FROM, "data: {source: humaneval, with: {sandbox: docker}}"),
         "sandbox: docker", "data.with.sandbox", "`docker` is not one of `auto`, `bwrap`, `guard`",
         "use one of `auto`, `bwrap`, `guard`"),
    Case("a multi-turn environment misspelt", edit(MULTI_TURN, "use: calculator,", "use: calculatr,"),
         "calculatr", "stages.rollout.with.environment.use", "unknown environment `calculatr`",
         "did you mean `calculator`? Or, name a class as `package.module:Class`, or register it under the "
         "`gfcr.environments` entry point group"),
    Case("a multi-turn environment given an argument it does not take",
         edit(MULTI_TURN, "max_tool_calls: 2", "max_calls: 2"), "environment:", "stages.rollout.with.environment",
         "environment `calculator` does not take these arguments: got an unexpected keyword argument 'max_calls'",
         "give `with` only arguments of Calculator: `max_tool_calls`"),
    Case("a reasoning-gym environment on a dataset that does not exist",
         edit(MULTI_TURN, "{use: calculator, with: {max_tool_calls: 2}}", "{use: reasoning_gym, with: {dataset: chain_sun}}"),
         "environment:", "stages.rollout.with.environment",
         "reasoning_gym: unknown dataset `chain_sun`; did you mean `chain_sum`?", "fix the environment's `with` arguments"),
    Case("an unknown tool parser", edit(MULTI_TURN, "tool_parser: calc", "tool_parser: json"),
         "tool_parser: json", "stages.rollout.with.tool_parser", "unknown tool parser `json`", "use one of: calc"),
    Case("a reasoning-gym task misspelt (issue 42)",
         edit(BASE, "data: {source: arithmetic, with: {n: 50}}",
              "data: {source: reasoning_gym, with: {n: 50, tasks: [{task: chain_summ}]}}"),
         "chain_summ", "data.with.tasks.0.task", "reasoning-gym has no task `chain_summ`", "did you mean `chain_sum`?"),
    Case("a difficulty setting the reasoning-gym task does not have (issue 42)",
         edit(BASE, "data: {source: arithmetic, with: {n: 50}}",
              "data: {source: reasoning_gym, with: {n: 50, tasks: [{task: chain_sum, levels: "
              "[{name: easy, config: {max_digit: 1}}]}]}}"),
         "max_digit", "data.with.tasks.0.levels",
         "level `easy` of task `chain_sum`: `chain_sum` has no difficulty setting `max_digit`",
         "did you mean `max_digits`? (its settings: `min_terms`, `max_terms`, `min_digits`, `max_digits`, "
         "`allow_negation`)"),
    *UPSTREAM_CASES,
]


# the cases of issue 16 (hostile YAML, values that validate but cannot run): also timed, measured
# and checked to write nothing, in one fresh process
HARDENING = [c for c in CASES if c.id.startswith(("alias bomb", "100", "infinite", "-inf", "NaN", "negative",
                                                  "Adam", "negative Adam", "empty stop"))]

_BUDGET_CHILD = textwrap.dedent("""\
    import json, re, sys, time
    from pathlib import Path
    from typer.testing import CliRunner
    from gfcr.cli.main import app
    for file in sys.argv[1:]:
        start = time.perf_counter()
        result = CliRunner().invoke(app, ["validate", file])
        print(json.dumps({"file": file, "exit": result.exit_code, "s": time.perf_counter() - start,
                          "output": result.output}))
    print(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))
    """)


def problems_of(path, overrides):
    with pytest.raises((SpecError, GraphError)) as info:
        load_pipeline(path, overrides)
    return info.value.problems


def expected_where(case: Case, file: str) -> str:
    """``file:line:`` of the case's snippet; a multi-line snippet names its last occurrence."""
    if case.at.startswith("--set"):
        return case.at
    first = case.at.split("\n")[0]
    lines = [n for n, line in enumerate(case.text.split("\n"), start=1) if first in line]
    assert lines, f"snippet {case.at!r} not in the spec"
    return f"{file}:{lines[-1] if chr(10) in case.at else lines[0]}:"


def test_the_table_is_big_enough():
    assert len(CASES) >= 20


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_golden_error(case, write_spec):
    path = write_spec(textwrap.dedent(case.text), "bad.yaml")
    problems = problems_of(path, case.overrides)
    where = expected_where(case, str(path))
    rendered = "\n".join(map(str, problems))
    matching = [p for p in problems if str(p.where).startswith(where) and p.path == case.path]
    assert matching, f"no problem at {where} / {case.path} in:\n{rendered}"
    assert any(case.message in p.message and case.fix in (p.fix or "") for p in matching), rendered


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_golden_error_cli_exits_2_and_runs_nothing(case, write_spec, monkeypatch):
    made = []
    for alias in STAGES.names():
        monkeypatch.setattr(STAGES.get(alias), "__init__", lambda self, *a, _made=made, **k: _made.append(self))
    monkeypatch.setattr(ArithmeticSource, "load", lambda self, _made=made: _made.append("data loaded"))
    path = write_spec(textwrap.dedent(case.text), "bad.yaml")
    args = ["validate", str(path)] + [a for o in case.overrides for a in ("--set", o)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert case.message.split("`")[0] in result.output
    assert made == []


def test_schema_and_stage_problems_are_reported_together(write_spec):
    text = edit(edit(BASE, "steps: 2", "steps: two"), "control.uniform", "control.unifrom")
    problems = problems_of(write_spec(text), [])
    assert {p.path for p in problems} >= {"run.steps", "stages.pick.use"}


def test_reference_and_config_problems_are_reported_together(write_spec):
    text = edit(edit(BASE, "from: rollout}", "from: rollot}"), "batch_size: 4", "batch_size: 0")
    problems = problems_of(write_spec(text), [])
    assert {p.path for p in problems} >= {"stages.keep.from", "stages.pick.with.batch_size"}


def test_hardening_cases_exit_2_within_5_s_and_200_mb_and_write_nothing(tmp_path):
    """Each case of issue 16's table through `gfcr validate` in one fresh process (started in an
    empty folder): exit 2 with the file's line and a fix, under 5 s each, under 200 MB peak RSS
    for the whole process, and no file written anywhere under the folder or beside the spec."""
    import json
    import os
    import subprocess
    import sys

    assert len(HARDENING) >= 15
    specs, work = tmp_path / "specs", tmp_path / "cwd"
    specs.mkdir(), work.mkdir()
    files = []
    for n, case in enumerate(HARDENING):
        files.append(specs / f"case{n}.yaml")
        files[-1].write_text(textwrap.dedent(case.text))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", _BUDGET_CHILD, *map(str, files)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=work)
    *results, peak = done.stdout.strip().split("\n")
    assert len(results) == len(HARDENING), done.stdout + done.stderr
    for case, file, line in zip(HARDENING, files, results):
        result = json.loads(line)
        assert result["exit"] == 2 and "fix: " in result["output"], (case.id, result)
        assert expected_where(case, str(file)) in result["output"], (case.id, result["output"])
        assert result["s"] < 5.0, (case.id, result["s"])
    assert int(peak) < 200 * 1024, f"peak RSS {int(peak) // 1024} MB"
    assert list(work.iterdir()) == [] and sorted(specs.iterdir()) == sorted(files)


@pytest.mark.parametrize("case", UPSTREAM_CASES, ids=[c.id for c in UPSTREAM_CASES])
def test_a_missing_upstream_stage_stops_gfcr_run_before_anything_is_written(case, tmp_path, monkeypatch):
    """What a stage needs from upstream (issue 40): `gfcr run` exits 2 with file:line and the fix, no
    traceback, and leaves no run directory (the default `runs/` one or a given one)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text(textwrap.dedent(case.text))
    for extra in ([], ["--run-dir", "given"]):
        result = CliRunner().invoke(app, ["run", "bad.yaml", *extra])
        assert result.exit_code == 2, result.output
        assert expected_where(case, "bad.yaml") in result.output and "fix: " in result.output
        assert case.fix in " ".join(result.output.split())
        assert "Traceback" not in result.output
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_only_the_first_reader_without_a_verifier_is_told(write_spec):
    """The shipped DAPO without its verifier: `keep` is told to read a verifier; `enough` (on accuracy)
    and the update, after it, are fixed by the same verifier and not told again."""
    text = edit(unscored("dapo_arith.yaml"), "target_groups: 16}", "target_groups: 16, metric: acc}")
    problems = problems_of(write_spec(text, "bad.yaml"), [])
    assert [p.path for p in problems] == ["stages.keep.from"]
