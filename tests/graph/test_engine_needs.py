"""What a stage needs of the engine (``engine_needs``, gfcr.registry.NeedsOfEngine) against what
``policy.engine`` lacks (``gfcr.spec.models.ENGINE_LACKS``): refused by ``gfcr validate``, never
met at step N. The golden cases (file, line, message, fix) are in tests/spec/test_golden_errors.py."""

from __future__ import annotations

import shlex
from typing import get_args

import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.errors import GraphError
from gfcr.graph import load_pipeline
from gfcr.registry import STAGES, NeedsOfEngine, declares
from gfcr.spec import PolicySpec
from gfcr.spec.models import ENGINE_LACKS, ENGINE_NEEDS
from tests.conftest import REPO

SHIPPED = sorted((REPO / "pipelines").glob("*.yaml"))
# the shipped pipelines `--set policy.engine=vllm` refuses, and the stage keys it points at (none
# today; the check below stays for the next need an engine lacks)
REFUSED_ON_VLLM: dict[str, set[str]] = {}


def test_every_engine_has_a_row_and_every_lack_is_a_known_need():
    assert set(ENGINE_LACKS) == set(get_args(PolicySpec.model_fields["engine"].annotation))
    assert all(set(lacks) <= set(ENGINE_NEEDS) for lacks in ENGINE_LACKS.values())


@pytest.mark.parametrize(("alias", "values", "needs"), [
    ("generate.sample", {}, set()), ("generate.sample", {"top_p": 0.9}, {"top_p"}),
    ("generate.partial", {"top_p": 0.9}, {"top_p"}), ("generate.speculative", {"top_p": 0.9}, {"top_p"}),
    ("generate.tree", {}, set()), ("generate.tree", {"top_p": 0.9}, {"top_p"}),
    ("control.truncate_steps", {}, {"generate_in_steer"}),
])
def test_the_builtin_stages_declare_their_needs(alias, values, needs):
    config = STAGES.get(alias).Config.model_validate(values)
    assert isinstance(config, NeedsOfEngine) and config.engine_needs == needs
    assert needs <= set(ENGINE_NEEDS)


def test_early_exit_needs_nothing_of_the_engine():
    """Its head reads hidden states from the trained policy's forward pass, not from the engine."""
    assert not declares(STAGES.get("control.early_exit").Config, NeedsOfEngine)


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_pipelines_on_vllm_validate_or_are_refused_at_the_stage(path):
    overrides = ["policy.engine=vllm", "tracking.mlflow=null"]
    refused = REFUSED_ON_VLLM.get(path.name)
    if refused is None:
        load_pipeline(path, overrides)
        return
    with pytest.raises(GraphError) as err:
        load_pipeline(path, overrides)
    assert {p.path for p in err.value.problems} == refused
    assert all("`policy.engine: vllm` cannot give" in p.message and "policy.engine: hf" in p.fix
               for p in err.value.problems)
    load_pipeline(path, ["tracking.mlflow=null"])  # the transformers engine runs it


def test_the_hf_engine_takes_nucleus_sampling():
    load_pipeline(REPO / "pipelines" / "quickstart.yaml", ["tracking.mlflow=null", "stages.rollout.with.top_p=0.9"])


def test_the_docs_name_every_refusal_and_show_what_validate_prints(monkeypatch):
    text = (REPO / "docs" / "vllm.md").read_text()
    assert all(f"`{need}`" in text for need in ENGINE_LACKS["vllm"])
    command, printed = text.split("```\n$ gfcr validate ", 1)[1].split("\n```", 1)[0].split("\n", 1)
    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(app, ["validate", *shlex.split(command)])
    assert result.exit_code == 2
    assert all(line in result.output for line in printed.splitlines()), result.output
