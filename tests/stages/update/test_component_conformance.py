"""Every registered advantage estimator, loss, aggregation, off-policy correction and learning-rate rule honours the component contract:
a strict Config whose fields are described, a docstring that cites its paper and states its
deviations, a runnable example and a YAML snippet the update accepts; it takes a real update
step on a toy policy; and it composes with every shipped arithmetic pipeline (its selectors
and generators) in ``gfcr validate``, given the pairings it declares."""

from __future__ import annotations

import doctest
import importlib
import inspect
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from gfcr.graph import load_pipeline
from gfcr.records import Prompt, PromptPool, Rollout, RolloutGroup, RolloutGroups, Segment, TreeIndex
from gfcr.registry.catalog import ADVANTAGE_ESTIMATORS, AGGREGATIONS, CORRECTIONS, LOSSES, LR_RULES
from gfcr.registry.components import declared
from gfcr.spec.yaml_source import parse_yaml
from gfcr.runtime import LocalTrainer
from gfcr.stages.resources import Lent
from gfcr.stages.update.grpo import GRPOUpdate
from tests.stages.update.test_tree_and_off_policy import ToyPolicy

REGISTRIES = {"advantage": ADVANTAGE_ESTIMATORS, "loss": LOSSES, "aggregation": AGGREGATIONS, "correction": CORRECTIONS,
              "lr_rule": LR_RULES}
COMPONENTS = [(kind, alias) for kind, reg in REGISTRIES.items() for alias in reg.names()]
IDS = [f"{k}:{a}" for k, a in COMPONENTS]
PIPELINES = ["quickstart", "greso_arith", "dapo_arith", "mopps_arith"]
REPO = Path(__file__).resolve().parents[3]
ARXIV = re.compile(r"arXiv[: ]+\d{4}\.\d{4,5}")

# what a component needs beyond its defaults to run in the toy update and in the pipelines
SETUP: dict[tuple[str, str], dict] = {
    ("aggregation", "seq_mean_token_sum"): {"with": {"constant": 8}},
    ("advantage", "stratified"): {"with": {"stratum_by": "finish_reason", "alpha": 0.5}},
    ("loss", "cispo"): {"with": {"eps_high": 0.28}},
    ("loss", "tic_grpo"): {"with": {"eps_high": 0.28}},
    ("loss", "tr_grpo"): {"with": {"tau": 0.1111}},
    ("aggregation", "lambda_grpo"): {"with": {"r": 0.5}},
    ("aggregation", "daro"): {"with": {"rollouts_per_prompt": 4}},  # the toy batch's groups of 4
    ("correction", "staleness"): {"with": {"max_staleness": 4}},
    ("correction", "ewma_proximal"): {"with": {"decay": 0.9}},
}
PIPELINE_SETUP: dict[tuple[str, str], dict] = {
    ("aggregation", "daro"): {"with": {"rollouts_per_prompt": 8}},  # the pipelines' control.fixed_n
    ("aggregation", "lambda_grpo"): {"with": {"r": 0.3}},  # below sqrt(8) / 7 for groups of 8
}
PIPELINE_SETS: dict[tuple[str, str], list[str]] = {
    ("advantage", "mc_grpo"): ["stages.budget.with.n=9"],
    ("advantage", "tree"): ["stages.rollout.use=generate.tree"],  # tree advantages need tree groups
}
NEEDS_TREES = {("advantage", "tree")}  # the toy batch's groups get a flat tree: root -> one node per rollout


def _cls(kind: str, alias: str) -> type:
    return REGISTRIES[kind].get(alias)


def _docs(cls: type) -> str:
    return (inspect.getmodule(cls).__doc__ or "") + (cls.__doc__ or "")


def _component(kind: str, alias: str, setup: dict) -> dict:
    return {"use": alias, **setup.get((kind, alias), SETUP.get((kind, alias), {}))}


def _update_config(kind: str, alias: str, setup: dict | None = None) -> dict:
    """The update's ``with`` for ``alias``, with the pairings it requires satisfied."""
    setup = setup or {}
    config = {kind: _component(kind, alias, setup)}
    for req in declared(_cls(kind, alias), "requires"):
        config[req.kind] = _component(req.kind, req.allowed[0], setup)
    return config


def _overrides(kind: str, alias: str) -> list[str]:
    """``--set`` overrides replacing whole components (so the pipeline's own ``loss.with.clip``
    does not reach a loss that has no ``clip``)."""
    sets = [f"update.with.{key}={json.dumps(value)}" for key, value in _update_config(kind, alias, PIPELINE_SETUP).items()]
    return sets + PIPELINE_SETS.get((kind, alias), [])


@pytest.mark.parametrize("kind, alias", COMPONENTS, ids=IDS)
def test_config_is_strict_and_described(kind, alias):
    config = _cls(kind, alias).Config
    assert config.model_config.get("extra") == "forbid" and config.model_config.get("frozen")
    undescribed = [name for name, f in config.model_fields.items() if not f.description]
    assert not undescribed, f"{kind} {alias}: describe the Config fields {undescribed}"


@pytest.mark.parametrize("kind, alias", COMPONENTS, ids=IDS)
def test_docstring_cites_the_paper_and_states_deviations(kind, alias):
    docs = _docs(_cls(kind, alias))
    assert ARXIV.search(docs), f"{kind} {alias}: cite the paper's arXiv id"
    assert "Deviations" in docs, f"{kind} {alias}: say where it deviates from its paper or reference code"


@pytest.mark.parametrize("kind, alias", COMPONENTS, ids=IDS)
def test_docstring_example_runs_and_its_yaml_is_a_valid_update(kind, alias):
    cls = _cls(kind, alias)
    module = importlib.import_module(cls.__module__)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in doctest.DocTestFinder().find(module) if t.examples]
    assert tests, f"{kind} {alias}: the docstring needs a runnable example"
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
    blocks = re.findall(r"\.\. code-block:: yaml\n\n((?:(?:    .*)?\n)+)", _docs(cls))
    updates = [parse_yaml(inspect.cleandoc("\n" + b))[0].get("update") for b in blocks]
    uses = [u for u in updates if u and u.get("with", {}).get(kind, {}).get("use") == alias]
    assert uses, f"{kind} {alias}: the docstring needs a YAML `update:` snippet that uses it"
    for update in uses:
        GRPOUpdate.Config.model_validate_json(json.dumps(update["with"]), strict=True)


def _batch() -> tuple[RolloutGroups, PromptPool]:
    """Two groups of four rollouts of 1-3 tokens with spread rewards, fresh from version 0."""
    rng = np.random.default_rng(0)
    prompts, groups = [], []
    for g, rewards in enumerate([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]]):
        prompt = Prompt(f"p:{g}", text="unused", prompt_token_ids=[1, 2 + g], metadata={"reference_reward": 0.5})
        gid = f"p:{g}@s0"
        rollouts = []
        for i, r in enumerate(rewards):
            tokens = [int(t) for t in rng.integers(3, 12, size=1 + (i + g) % 3)]
            rollouts.append(Rollout(f"{gid}#{i}", gid, prompt.prompt_id, tokens,
                                    [Segment(0, len(tokens), 0, np.full(len(tokens), -2.0, dtype=np.float32))],
                                    finish_reason="stop", reward=r, correct=r == 1.0,
                                    reward_components={"answer": r, "format": 1.0}))
        prompts.append(prompt)
        groups.append(RolloutGroup(gid, prompt.prompt_id, 0, len(rollouts), rollouts))
    return RolloutGroups(groups), PromptPool(prompts)


@pytest.mark.parametrize("kind, alias", COMPONENTS, ids=IDS)
def test_it_takes_a_real_update_step(kind, alias):
    policy = ToyPolicy()
    stage = GRPOUpdate(GRPOUpdate.Config.model_validate_json(
        json.dumps({"lr": 1e-2, "micro_batch_size": 3, **_update_config(kind, alias)}), strict=True))
    stage.setup(Lent(policy))
    before = [p.detach().clone() for p in policy.model.parameters()]
    groups, pool = _batch()
    if (kind, alias) in NEEDS_TREES:
        for g in groups:
            ids = [r.rollout_id for r in g.rollouts]
            g.tree = TreeIndex(children={"root": [f"n{i}" for i in range(len(ids))]},
                               leaves={"root": ids, **{f"n{i}": [rid] for i, rid in enumerate(ids)}})
    report = LocalTrainer(policy).update(stage, groups, pool)
    assert not report.skipped, report.skip_reason
    assert math.isfinite(report.loss) and report.policy_version == 1 == policy.version
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.model.parameters()))
    state = stage.state_dict()
    again = GRPOUpdate(stage.config)
    again.setup(Lent(ToyPolicy()))
    again.load_state_dict(state)


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("kind, alias", COMPONENTS, ids=IDS)
def test_it_composes_with_every_shipped_arithmetic_pipeline(kind, alias, pipeline):
    load_pipeline(REPO / "pipelines" / f"{pipeline}.yaml", _overrides(kind, alias))
