"""``gfcr stages``: the list with each stage's summary, one stage in full, the family filter."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from gfcr.cli.main import app

cli = CliRunner()


def _text(result) -> str:
    return " ".join(result.output.split())  # tables wrap long cells


def _column(output: str, index: int) -> str:
    """A table column's text, its wrapped lines joined: each cell's words stay in order."""
    cells = [line.split("│")[index].strip() for line in output.splitlines() if line.startswith("│")]
    return " ".join(c for c in cells if c)


def test_the_list_says_what_each_stage_does():
    result = cli.invoke(app, ["stages"])
    assert result.exit_code == 0, result.output
    summaries = {s["alias"]: s["summary"] for s in json.loads(cli.invoke(app, ["stages", "--json"]).output)}
    column = _column(result.output, 2)
    for alias in ("filter.nonzero_variance", "control.greso", "update.grpo"):
        assert summaries[alias].replace("``", "`") in column, alias
    assert "what it does" in result.output and "`gfcr stages ALIAS` shows one stage in full" in _text(result)


def test_one_stage_in_full_greso():
    result = cli.invoke(app, ["stages", "control.greso"])
    assert result.exit_code == 0, result.output
    text = _text(result)
    assert "control.greso: GRESO pre-rollout selective rollout" in text
    assert "skip prompts before rollout when their recent groups were all correct or all wrong" in text
    assert "arXiv 2506.02177" in text  # the paper line
    assert "pool: PromptPool -> Allocation" in text
    assert "BeforeStep (before_step), Observes (observe), Stateful (state_dict, load_state_dict)" in text
    assert "PicksBatch (batch_size)" in text  # a capability its Config declares
    assert "batch_size │ int │ (required) │ prompts kept per call" in text
    assert "target_zero_variance │ float │ 0.25 │ alpha: target share of zero-variance groups" in text
    assert "example (YAML): stages: pick: {use: control.greso, with: {batch_size: 16, target_zero_variance: 0.25}}" in text


def test_one_stage_shows_how_faithful_it_is_when_its_docstring_says():
    text = _text(cli.invoke(app, ["stages", "control.vade"]))
    assert "fidelity from the abstract: no public code (a project page only" in text


def test_one_stage_as_json_adds_its_docs_roles_and_capabilities():
    result = cli.invoke(app, ["stages", "control.greso", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["alias"] == "control.greso" and "arXiv 2506.02177" in data["paper"]
    assert data["capabilities"] == ["PicksBatch"] and "Observes (observe)" in data["lifecycle"]
    assert "use: control.greso" in data["yaml"][0] and data["config"]["required"] == ["batch_size"]


def test_an_unknown_stage_is_an_error_with_a_did_you_mean():
    typo = cli.invoke(app, ["stages", "control.gerso"])
    assert typo.exit_code == 2 and "unknown stage `control.gerso`" in typo.output
    assert "did you mean `control.greso`?" in typo.output
    short = cli.invoke(app, ["stages", "greso"])
    assert short.exit_code == 2 and "did you mean `control.greso`?" in short.output
    family = cli.invoke(app, ["stages", "replay"])
    assert family.exit_code == 2 and "gfcr stages --family replay" in family.output


def test_family_replay_lists_only_replay_stages():
    result = cli.invoke(app, ["stages", "--family", "replay"])
    assert result.exit_code == 0, result.output
    aliases = [a for a in _column(result.output, 1).split() if "." in a]
    assert {"replay.store", "replay.rlep", "replay.rollout_replay", "replay.correct_cache"} <= set(aliases)
    assert all(a.startswith("replay.") for a in aliases), aliases
    assert "DOTS rollout replay: fill (1 - sigma) of the update batch" in _column(result.output, 2)
