"""Every built-in stage states its fidelity in a fixed form, and every ``checked against`` count
agrees with the reference cases in ``tests/fidelity/*.json``.

To update a stage's status after adding or regenerating its case file, paste the line
``tests.fidelity.cases.status`` writes for it (``python scripts/fidelity_doc.py`` regenerates
``docs/fidelity.md``; ``tests/fidelity/test_doc.py`` prints the expected line when it differs)
as the start of the stage's ``Fidelity:`` paragraph.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.registry import BUILTIN_STAGES, stage_info
from gfcr.registry.stage_docs import FidelityError, parse_fidelity, stage_doc
from tests.fidelity.cases import method_files, status, step_files, steps_status

# The stages whose method has public code (../shared/research/reference_code.md, "Methods with
# code", and seed_methods.md section 9): they are checked against it, or say the cases are
# pending, never "from the abstract".
PUBLIC_CODE = {
    "control.dots": "ASTRAL-Group/data-efficient-llm-rl", "replay.rollout_replay": "ASTRAL-Group/data-efficient-llm-rl",
    "control.coba": "Within-yao/CoBA-RL", "control.pilot_commit": "databricks/pilot-commit",
    "replay.pilot_join": "databricks/pilot-commit", "control.truncate_steps": "davidweidawang/Step-GRPO",
    "generate.speculative": "ShopeeLLM/Spec-RL", "filter.meds": "Linxi000/MEDS", "generate.tree": "THUDM/TreeRL",
    "generate.partial": "777pomingzi/CoPRIS", "control.stop_at_target": "THUDM/slime",
    "control.beta_thompson": "thu-rllab/MoPPS", "filter.beta_difficulty": "thu-rllab/MoPPS",
    "control.greso": "Infini-AI-Lab/GRESO", "control.dars": "yangzhch6/DARS", "control.mc_grpo": "lotusroot-kim/MC-GRPO",
    "control.gdro_rollout": "kishanpb/verl-gdro", "filter.gdro_weights": "kishanpb/verl-gdro",
    "replay.rlep": "Kwai-Klear/RLEP",
}


def _fidelity(alias: str):
    return stage_doc(alias, stage_info(alias).cls).fidelity


def _case_files_of(alias: str) -> list[dict]:
    return [data for data in (json.loads(p.read_text()) for p in method_files()) if data["stage"] == alias]


@pytest.mark.parametrize("alias", sorted(BUILTIN_STAGES))
def test_every_stage_states_its_fidelity_in_a_fixed_form(alias):
    fidelity = _fidelity(alias)  # FidelityError if the paragraph is there but not in a fixed form
    assert fidelity is not None, (
        f"{alias}: add a `Fidelity:` paragraph to its docstring (forms: gfcr.registry.stage_docs.FORMS)")
    assert fidelity.kind in ("checked", "pending", "abstract", "own")


@pytest.mark.parametrize("alias", sorted(BUILTIN_STAGES))
def test_checked_counts_agree_with_the_case_files(alias):
    claims = {c.line for c in _fidelity(alias).checks}
    # update.grpo also claims the whole-step references of tests/fidelity/steps (one case a step)
    steps = {steps_status()} if alias == "update.grpo" and step_files() else set()
    assert claims == {status(data) for data in _case_files_of(alias)} | steps, (
        f"{alias}: its `Fidelity:` paragraph should make exactly the claims of its case files")


@pytest.mark.parametrize("alias", sorted(PUBLIC_CODE))
def test_a_stage_with_public_code_never_says_from_the_abstract(alias):
    fidelity = _fidelity(alias)
    assert fidelity.kind in ("checked", "pending"), f"{alias}: {fidelity.text}"
    assert PUBLIC_CODE[alias] in fidelity.text or fidelity.kind == "checked"


def test_a_status_outside_the_fixed_forms_is_refused_with_the_forms():
    with pytest.raises(FidelityError, match="not in a fixed form; start it with one of .*from the abstract"):
        parse_fidelity("Only the abstract could be read.", where="control.mine")
    with pytest.raises(FidelityError, match="not in a fixed form"):
        parse_fidelity("checked against the paper: 3/3 cases")
    with pytest.raises(FidelityError, match="do not add up to 36 cases"):
        parse_fidelity("checked against Infini-AI-Lab/GRESO@b277843: 34/36 cases")


def test_a_stage_checked_against_two_references_lists_both():
    fidelity = parse_fidelity("checked against THUDM/slime@0123456: 5/5 cases (APRIL); checked against "
                              "777pomingzi/CoPRIS@43ee8c7: 6/7 cases, 1 documented deviation (CoPRIS).")
    assert fidelity.label == "checked 5/5, 6/7"
    assert [c.repository for c in fidelity.checks] == ["THUDM/slime", "777pomingzi/CoPRIS"]


def test_gfcr_stages_shows_the_status_in_a_column_and_in_full():
    cli = CliRunner()
    listed = cli.invoke(app, ["stages", "--family", "control"])
    assert listed.exit_code == 0, listed.output
    assert "fidelity" in listed.output.splitlines()[2]  # the header row
    column = " ".join(" ".join(line.split("│")[5].split()) for line in listed.output.splitlines()
                      if line.startswith("│") and line.split("│")[5].strip())
    assert "checked 34/36" in column and "from the abstract" in column and "gfcr's own" in column
    full = " ".join(cli.invoke(app, ["stages", "control.greso"]).output.split())
    assert "fidelity checked against Infini-AI-Lab/GRESO@b277843: 34/36 cases, 2 documented deviations" in full
    data = json.loads(cli.invoke(app, ["stages", "--json"]).output)
    assert {d["alias"]: d["fidelity"]["label"] for d in data}["control.dars"] == "checked 900/900"


class _PluginStage:
    """A plugin's stage in its own words.

    Fidelity: close to the paper.
    """


def test_a_plugin_s_own_wording_is_refused_strictly_and_shown_leniently():
    with pytest.raises(FidelityError, match="filter.mine: `Fidelity: close to the paper.` is not in a fixed form"):
        stage_doc("filter.mine", _PluginStage)
    doc = stage_doc("filter.mine", _PluginStage, strict=False)  # what `gfcr stages` does for plugins
    assert doc.fidelity is None and "not in a fixed form" in doc.fidelity_problem


class _DeviatingPluginStage:
    """filter.mine: drop the longest groups.

    Deviations: not a published method. DAPO's overlong filtering (Yu et al., 2025, arXiv
    2503.14476) masks the loss of truncated rollouts one by one; this drops whole groups.

    Fidelity: gfcr's own: an example.
    """


def test_the_paper_is_what_the_stage_cites_not_how_it_deviates():
    """Issue 40: a plugin whose only arXiv id is in its Deviations paragraph showed that paragraph,
    minus its first sentence, as its paper; a built-in citing its paper up front keeps it."""
    assert stage_doc("filter.mine", _DeviatingPluginStage).paper is None
    assert "arXiv 2506.02177" in stage_doc("control.greso", stage_info("control.greso").cls).paper
    assert stage_doc("filter.entropy", stage_info("filter.entropy").cls).paper is None  # ids only in Deviations
