"""`gfcr stages --components` and docs/update-catalog.md: every registered component, described
from its own docstring and Config; the page is regenerated from the registries, and its
examples validate."""

from __future__ import annotations

import importlib.util
import re
import shlex

from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.graph import compile_pipeline
from gfcr.registry.catalog import (BUILTIN_ADVANTAGE_ESTIMATORS, BUILTIN_AGGREGATIONS, BUILTIN_CORRECTIONS,
                                   BUILTIN_LOSSES, BUILTIN_LR_RULES)
from gfcr.spec import load_spec_text
from gfcr.stages.components.base import ComponentConfig, Requirement
from gfcr.stages.components.describe import component_infos, describe, first_sentence, markdown_table
from tests.conftest import REPO

cli = CliRunner()
BUILTINS = {"advantage": BUILTIN_ADVANTAGE_ESTIMATORS, "loss": BUILTIN_LOSSES, "aggregation": BUILTIN_AGGREGATIONS,
            "correction": BUILTIN_CORRECTIONS, "lr_rule": BUILTIN_LR_RULES}


def _script():
    spec = importlib.util.spec_from_file_location("update_catalog_doc", REPO / "scripts" / "update_catalog_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_catalog_page_is_up_to_date_with_the_registries():
    script = _script()
    assert script.DOC.read_text(encoding="utf-8") == script.render(), (
        f"docs/update-catalog.md is out of date with the registries; regenerate it: {script.COMMAND}")


def test_every_builtin_component_is_described_once():
    infos, broken = component_infos()
    assert broken == {}
    described = sorted((i.kind, i.alias) for i in infos if i.origin == "gfcr")
    assert described == sorted((kind, alias) for kind, names in BUILTINS.items() for alias in names)


def test_the_description_reads_the_docstring_and_the_config():
    (token_sum,) = [i for i in component_infos()[0] if i.alias == "seq_mean_token_sum"]
    assert token_sum.row() == ("aggregation", "seq_mean_token_sum", "2503.20783",
                               "Dr.GRPO's length-unbiased aggregation",
                               'constant (required), responses="counted", per_response=true', "-",
                               "checked against volcengine/verl@b178a3c: 12/30 cases, 18 documented deviations; "
                               "checked against volcengine/verl@b178a3c: 3/27 cases, 24 documented deviations; "
                               "checked against huggingface/trl@f2cd577: 10/12 cases, 2 documented deviations")
    assert "`per_response: false` gives verl's" in token_sum.deviations
    (ppo,) = [i for i in component_infos()[0] if i.alias == "ppo_clip"]
    assert ppo.defaults == "clip=[0.2, 0.2], dual_clip=null, log_ratio_clamp=null"  # YAML values, as --set takes them


# every setting that gives verl's behaviour where gfcr's default differs (issue 39): named in the
# component's Deviations, which `gfcr stages --components` and docs/update-catalog.md print
VERL_SETTINGS = {"mean_std": ("single_rollout: verl", "precision: float32"), "mean": ("single_rollout: verl",),
                 "dr_grpo": ("single_rollout: verl",), "rloo": ("single_rollout: verl",),
                 "reinforce_pp": ("variance: unbiased", "single_rollout: verl"),
                 "reinforce_pp_plain": ("variance: unbiased",), "gspo": ("log_ratio_cap: 10.0",),
                 "gspo_token": ("log_ratio_cap: 10.0",), "ppo_clip": ("log_ratio_clamp: 20.0", "dual_clip: 3.0"),
                 "seq_mean_token_mean": ("responses: with_tokens", "responses: all"),
                 "seq_mean_token_sum": ("per_response: false", "responses: with_tokens", "responses: all")}


def test_the_listing_shows_each_components_fidelity_and_its_deviations():
    infos = {i.alias: i for i in component_infos()[0]}
    result = cli.invoke(app, ["stages", "--components"], env={"COLUMNS": "400"})
    flat = " ".join(result.output.split())
    for alias, settings in VERL_SETTINGS.items():
        assert "checked against volcengine/verl@b178a3c" in infos[alias].fidelity
        assert all(f"`{s}` gives" in infos[alias].deviations for s in settings), alias
        assert " ".join(infos[alias].deviations.split()) in flat, alias
    assert infos["tic_grpo"].fidelity.startswith("from the abstract: no public code")


def test_first_sentence_drops_the_alias_and_arxiv_citations_but_not_abbreviations():
    doc = ('loss ``x``: Dr. GRPO\'s loss (Liu et al., 2025, arXiv 2503.20783) with ``y``,\n'
           'per token. More here.\n\nDeviations: none.')
    assert first_sentence(doc) == "Dr. GRPO's loss with `y`, per token"
    assert first_sentence("No alias here; one line") == "No alias here; one line"


class _Paired:
    """A component that names its pairing, and a pipeline check; no arXiv id anywhere."""

    requires = (Requirement("aggregation", ("seq_mean_token_sum",), "it sums tokens"),)

    class Config(ComponentConfig):
        k: int

    @staticmethod
    def pairing_problems(config, ctx):
        return []


def test_requirements_and_required_fields_are_listed():
    info = describe("advantage", "paired", _Paired, "my_package")
    assert (info.paper, info.defaults) == ("-", "k (required)")
    assert info.requires == "aggregation seq_mean_token_sum; pipeline checks (gfcr validate)"
    assert "| advantage | `paired` | - |" in markdown_table([info])


def test_stages_components_lists_them_as_a_table_and_as_markdown():
    result = cli.invoke(app, ["stages", "--components"])
    assert result.exit_code == 0, result.output
    assert all(alias in result.output for names in BUILTINS.values() for alias in names)
    markdown = cli.invoke(app, ["stages", "--components", "--format", "markdown"])
    assert markdown.exit_code == 0 and markdown.output == markdown_table(component_infos()[0])
    assert cli.invoke(app, ["stages", "--format", "markdown"]).exit_code == 2  # stages have no Markdown form


def test_the_catalog_page_examples_validate():
    page = (REPO / "docs" / "update-catalog.md").read_text(encoding="utf-8")
    quickstart = (REPO / "pipelines" / "quickstart.yaml").read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", page, re.S)
    assert len(blocks) == 2  # Dr. GRPO's components, and verl's settings
    update_line = next(line for line in quickstart.splitlines() if line.startswith("update:"))
    for yaml_block in blocks:
        compile_pipeline(load_spec_text(quickstart.replace(update_line, yaml_block.rstrip()), "update-catalog.md"))
    commands = re.findall(r"^(gfcr validate .*?)\n```", page, re.M | re.S)
    assert len(commands) == 2  # Dr. GRPO's components, and a correction
    for command in commands:
        args = shlex.split(command.replace("\\\n", " "))
        result = cli.invoke(app, [a.replace("pipelines/", f"{REPO}/pipelines/") for a in args[1:]])
        assert result.exit_code == 0, result.output
