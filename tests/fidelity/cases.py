"""Reference cases computed by the authors' own code, and the one check every fidelity test makes.

Each ``tests/fidelity/<method>.json`` names the ``repository``, ``commit``, ``file`` and
``function`` its cases came from, the gfcr ``stage`` they test, and a ``cases`` list (an
``id``, the ``input`` and the reference's ``expected`` output). The cases were produced by
running the authors' functions in a scratch folder outside this repository (see
``docs/fidelity.md``); none of their source is here.

A case gfcr deliberately computes differently is listed under ``deviations`` with the
``reason`` and the output gfcr gives (``gfcr``): its test asserts that gfcr still differs from
the reference *and* gives exactly that output, so a deviation cannot hide a regression and
the counts in ``docs/fidelity.md`` stay honest.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REL, ABS = 1e-6, 1e-9


def method_files() -> list[Path]:
    return sorted(HERE.glob("*.json"))


def load(method: str) -> dict[str, Any]:
    return json.loads((HERE / f"{method}.json").read_text())


def cases(method: str) -> list[dict[str, Any]]:
    """The method's cases, for ``pytest.mark.parametrize`` (ids via ``case_ids``)."""
    return load(method)["cases"]


def case_ids(method: str) -> list[str]:
    return [c["id"] for c in cases(method)]


def deviations(method: str) -> dict[str, dict[str, Any]]:
    return {d["case"]: d for d in load(method).get("deviations", [])}


def close(actual: Any, expected: Any, rel: float = REL, abs_: float = ABS) -> bool:
    """Equal up to float rounding (relative 1e-6 by default), recursively through lists and dicts."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and actual.keys() == expected.keys() and all(
            close(actual[k], expected[k], rel, abs_) for k in expected)
    if isinstance(expected, (list, tuple)):
        return isinstance(actual, (list, tuple)) and len(actual) == len(expected) and all(
            close(a, e, rel, abs_) for a, e in zip(actual, expected))
    if isinstance(expected, bool) or expected is None or isinstance(expected, str):
        return actual == expected
    if isinstance(expected, (int, float)):
        if isinstance(actual, bool) or not isinstance(actual, (int, float)):
            return False
        if math.isinf(expected) or math.isnan(expected):
            return actual == expected or (math.isnan(expected) and math.isnan(actual))
        return math.isclose(actual, expected, rel_tol=rel, abs_tol=abs_)
    return actual == expected


def check(method: str, case: dict[str, Any], run: Callable[[dict[str, Any]], Any]) -> None:
    """gfcr's output for ``case`` equals the reference's, or the listed deviation's output (within
    the file's ``tolerance``, ``{"rel", "abs"}``, where the reference computes in float32)."""
    actual = run(case["input"])
    tol = load(method).get("tolerance", {"rel": REL, "abs": ABS})
    deviation = deviations(method).get(case["id"])
    if deviation is None:
        assert close(actual, case["expected"], tol["rel"], tol["abs"]), (
            f"{method}/{case['id']}: gfcr gives {actual!r}, the reference {case['expected']!r}")
        return
    assert not close(actual, case["expected"], tol["rel"], tol["abs"]), (
        f"{method}/{case['id']} is listed as a deviation but gfcr now agrees with the reference: "
        "remove it from `deviations`")
    assert close(actual, deviation["gfcr"], tol["rel"], tol["abs"]), (
        f"{method}/{case['id']}: gfcr gives {actual!r}, the recorded deviation {deviation['gfcr']!r}")


def check_setting(method: str, case: dict[str, Any], run: Callable[[dict[str, Any]], Any]) -> None:
    """gfcr's output for ``case`` under a reference-compatible setting (``run`` applies it)
    equals the reference's, deviation or not: the setting a listed deviation names works."""
    actual = run(case["input"])
    tol = load(method).get("tolerance", {"rel": REL, "abs": ABS})
    assert close(actual, case["expected"], tol["rel"], tol["abs"]), (
        f"{method}/{case['id']} with the reference's setting: gfcr gives {actual!r}, "
        f"the reference {case['expected']!r}")


def unit_module_doc(unit: str) -> str:
    """The module docstring of a case file's gfcr unit: ``family.name`` of a stage, or
    ``advantage.name`` / ``loss.name`` / ``aggregation.name`` of an update component."""
    import sys

    from gfcr.registry import STAGES
    from gfcr.registry import catalog

    family, _, name = unit.partition(".")
    registries = {"advantage": catalog.ADVANTAGE_ESTIMATORS, "loss": catalog.LOSSES,
                  "aggregation": catalog.AGGREGATIONS, "correction": catalog.CORRECTIONS, "lr_rule": catalog.LR_RULES}
    cls = registries[family].get(name) if family in registries else STAGES.get(unit)
    return sys.modules[cls.__module__].__doc__ or ""


def status(data: dict[str, Any]) -> str:
    """The status line a unit's docstring carries: ``checked against <repo>@<commit>: N/M cases``."""
    total, dev = len(data["cases"]), len(data.get("deviations", []))
    line = f"checked against {data['repository']}@{data['commit'][:7]}: {total - dev}/{total} cases"
    return line + (f", {dev} documented deviation{'s' if dev != 1 else ''}" if dev else "")


def fidelity_markdown() -> str:
    """``docs/fidelity.md``: one row per case file, then each file's deviations with their counts."""
    from collections import Counter

    rows, notes = [], []
    for path in method_files():
        data = json.loads(path.read_text())
        total, dev = len(data["cases"]), len(data.get("deviations", []))
        repo = f"{data['repository']}@{data['commit'][:7]}"
        where = f"`{data['file']}`: {data['function']}".replace("|", "\\|")  # a pipe would split the cell
        rows.append(f"| {data['method']} | `{data['stage']}` | {repo} | {where} "
                    f"| {total} | {total - dev} | {dev} | [{path.name}](../tests/fidelity/{path.name}) |")
        reasons = Counter(d["reason"] for d in data.get("deviations", []))
        notes += [f"- **{data['method']}** ({n} case{'s' if n != 1 else ''}): {reason}" for reason, n in reasons.items()]
    head = ["| method | gfcr unit | reference | file: function | cases | passing | documented deviations | cases file |",
            "|---|---|---|---|---|---|---|---|"]
    return "\n".join([DOC_INTRO, *head, *rows, "", "## Documented deviations", "",
                      *(notes or ["None."]), "", steps_markdown(), "", pending(), ""])


STEPS_INTRO = """## Whole steps against verl

The cases above check one function at a time. `tests/fidelity/steps/` checks whole update steps:
seeded runs of the quickstart (tiny-arith, 8 prompts x 8 rollouts, 5 steps) with `update.grpo` set
to verl's settings (the list in `tests/fidelity/verl_steps.py` and in
[update-catalog.md](update-catalog.md#getting-verls-numbers)) save every step's batch
(`save_batches`: the rollouts, rewards and groups, each micro-batch's log-probs and gfcr's loss);
verl's own `core_algos` functions, imported from its source in a scratch folder, then compute the
advantages over each batch and the loss of each of gfcr's micro-batches with the engine workers'
`global_batch_info`, and the same step's loss over verl's own micro-batch split.
`tests/fidelity/test_verl_steps.py` makes each run again, checks that today's batches are the ones
the reference was computed on, and that gfcr's advantages, micro-batch losses, step losses (and
KL) equal verl's within the file's float32 `tolerance`; a changed aggregation or estimator setting
breaks the equality. A case is one step. Regenerate with

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python scripts/verl_steps.py \\
        --verl /tmp/scratch-verl-steps/verl --site /tmp/scratch-verl-steps/site

(the docstring of `scripts/verl_steps.py` says how to extract verl's source and what is stubbed).
"""


def step_files() -> list[Path]:
    return sorted((HERE / "steps").glob("*.json"))


def steps_status() -> str:
    """``update.grpo``'s status line for the whole-step references (every step passes: the test asserts it)."""
    data = [json.loads(p.read_text()) for p in step_files()]
    total = sum(len(d["steps"]) for d in data)
    return f"checked against {data[0]['repository']}@{data[0]['commit'][:7]}: {total}/{total} cases"


def steps_markdown() -> str:
    """The whole-step section of ``docs/fidelity.md``: one row per run of ``tests/fidelity/steps``."""
    rows = ["| run | verl | gfcr settings (`--set` on pipelines/quickstart.yaml) | steps | micro-batches | file |",
            "|---|---|---|---|---|---|"]
    for path in step_files():
        d = json.loads(path.read_text())
        verl = ", ".join(f"{k} {v}" for k, v in d["verl"].items())
        shown = ("update.with.advantage", "update.with.correction", "update.with.kl_", "lifecycle.")
        sets = ", ".join(f"`{o}`" for o in d["overrides"] if o.startswith(shown))
        micro = sum(len(s["micro_batches"]) for s in d["steps"])
        rows.append(f"| {path.stem} | {d['repository']}@{d['commit'][:7]}: {verl} | {sets} | {len(d['steps'])} "
                    f"| {micro} | [{path.name}](../tests/fidelity/steps/{path.name}) |")
    common = "Every run: `loss: {use: ppo_clip, with: {clip: [0.2, 0.28], dual_clip: 3.0, log_ratio_clamp: 20.0}}`, " \
             "`aggregation: {use: token_mean}`, `micro_batch_size: 8`."
    return "\n".join([STEPS_INTRO, *rows, "", common])


DOC_INTRO = """# Fidelity to the authors' code

<!-- Generated by `python scripts/fidelity_doc.py` from tests/fidelity/*.json; do not edit by hand.
     tests/fidelity/test_doc.py fails while this page or a unit's docstring status is stale. -->

Each row is a file of reference cases: inputs designed to cover the edge cases (ties, empty
groups, all-correct, all-wrong, window boundaries, first steps) and the outputs the authors'
own functions computed from them, run in a scratch folder outside this repository (their
source is never copied here). `tests/fidelity/test_<file>.py` feeds every case to the gfcr
unit: a case passes when gfcr gives the reference's output (to float rounding, or the file's
`tolerance` where the reference computes in float32); a case gfcr deliberately computes
differently is listed under the file's `deviations` with the reason and gfcr's own output,
and its test asserts both, so "passing" and "documented deviations" always add up to
"cases". Each unit's docstring carries the same status line (`checked against
<repo>@<commit>: N/M cases`).
"""

# every method with public code in shared/research/reference_code.md (and the trainers' update
# components): case file stem -> what to check; those without a file are listed as not yet checked
EXPECTED = {
    "dots": "DOTS + rollout replay (ASTRAL-Group/data-efficient-llm-rl: selection, select_buffer)",
    "coba": "CoBA-RL (Within-yao/CoBA-RL: BetaAllocator)",
    "pilot_commit": "Pilot-Commit (databricks/pilot-commit: filter_batch, exclude_batch, replay buffer)",
    "step_grpo": "Step-GRPO (davidweidawang/Step-GRPO: answer_confidence, should_early_exit, compute_score)",
    "spec_rl": "SPEC-RL (ShopeeLLM/Spec-RL: spec_cut)",
    "meds": "MEDS (Linxi000/MEDS: penalty, kNN cluster assignment)",
    "tree": "TreeRL (THUDM/TreeRL: entropy_guided_chain)",
    "hgpo": "HGPO (langfengQ/verl-agent recipe/hgpo, as OliverLeeXZ/SERL carries it: hgpo_advantage_estimate)",
    "copris": "CoPRIS (777pomingzi/CoPRIS: pool rules)",
    "april": "APRIL (THUDM/slime: partial-rollout buffer order)",
    "mopps": "MoPPS (thu-rllab/MoPPS: PosteriorSampler)",
    "greso": "GRESO", "gapo": "GAPO", "mc_grpo": "MC-GRPO", "dars": "DARS", "gdro_weights": "Prompt-GDRO",
    "gdro_rollout": "Rollout-GDRO (kishanpb/verl-gdro: rollout_choose_arms)",
    "rollout_replay": "DOTS rollout replay (ASTRAL-Group/data-efficient-llm-rl: select_buffer)",
    "rlep": "RLEP (Kwai-Klear/RLEP: the experience-replay candidates of rl_dataset.py and the rollout)",
    "beta_difficulty": "MoPPS's posterior band (thu-rllab/MoPPS: PosteriorSampler.train, the threshold band)",
    "pilot_join": "Pilot-Commit's update groups (databricks/pilot-commit: the pilot + commit batch, its advantages)",
    "mc_grpo_allocation": "MC-GRPO's G + 1 allocation (lotusroot-kim/MC-GRPO: the use_extra_rollout block)",
    "stop_at_target": "APRIL's abort (THUDM/slime: generate_rollout_async, abort)",
    # the update components whose reference lives in a well-known trainer (verl, OpenRLHF)
    "mean_std": "GRPO advantage (verl: compute_grpo_outcome_advantage)",
    "dr_grpo": "Dr.GRPO advantage (verl: compute_grpo_outcome_advantage, norm_adv_by_std_in_grpo False)",
    "mean": "mean-centred advantage (verl: compute_grpo_outcome_advantage, norm_adv_by_std_in_grpo False)",
    "rloo": "RLOO (verl: compute_rloo_outcome_advantage)",
    "reinforce_pp": "REINFORCE++ with baseline (OpenRLHF: compute_advantages_and_returns, reinforce_baseline)",
    "reinforce_pp_plain": "REINFORCE++ (OpenRLHF: compute_advantages_and_returns, reinforce)",
    "reinforce_pp_plain_verl": "REINFORCE++ (verl: compute_reinforce_plus_plus_outcome_advantage)",
    "ppo_clip": "PPO clip, DAPO's clip-higher, dual clip (verl: compute_policy_loss_vanilla)",
    "ppo_clip_edges": "PPO clip on its bounds and past the log-ratio clamp (verl: compute_policy_loss_vanilla)",
    "gspo": "GSPO (verl: compute_policy_loss_gspo)", "gspo_token": "GSPO-token (verl: compute_policy_loss_gspo)",
    "cispo": "CISPO (verl: compute_policy_loss_cispo)",
    "m2po": "M2PO (Infini-AI-Lab/M2PO: compute_m2po_policy_loss, kpo_clip_harmful_tokens)",
    "sao": "SAO (Human-Agent-Society/reef: compute_sao_loss)",
    "vcpo": ("VCPO (mit-han-lab/vcpo: compute_ess_info and the ESS learning-rate rule of "
             "_optimizer_step_with_buffer; compute_opob_baseline)"),
    "vcpo_ess": "VCPO's learning-rate rule (mit-han-lab/vcpo: compute_ess_info, _optimizer_step_with_buffer)",
    "opob": "VCPO's OPOB baseline (mit-han-lab/vcpo: compute_opob_baseline, _update_grad_buffers)",
    "ewma_proximal": "PPO-EWMA's proximal policy (openai/ppo-ewma: compute_losses, EwmaModel.update)",
    "seq_tis": "sequence-level truncated IS (verl's rollout_is sequence, as mit-han-lab/vcpo carries it)",
    "token_mean": "DAPO's token-level aggregation (verl: agg_loss token-mean)",
    "seq_mean_token_mean": "GRPO's aggregation (verl: agg_loss seq-mean-token-mean)",
    "seq_mean_token_sum": "Dr.GRPO's aggregation (verl: agg_loss seq-mean-token-sum, seq-mean-token-sum-norm)",
    "token_mean_micro": "token-mean in micro-batches (verl: agg_loss with the engine workers' global_batch_info)",
    "seq_mean_token_mean_micro": "seq-mean-token-mean in micro-batches (verl: agg_loss, global_batch_info)",
    "seq_mean_token_sum_micro": "seq-mean-token-sum(-norm) in micro-batches (verl: agg_loss, global_batch_info)",
    "gspo_cap": "GSPO's log-ratio cap (verl: compute_policy_loss_gspo)",
    "gspo_token_cap": "GSPO-token's log-ratio cap (verl: compute_policy_loss_gspo)",
    "overlong": "DAPO's overlong penalty (OpenRLHF: apply_overlong_penalty)",
    "finish_reason": "DAPO's overlong filtering (SkyRL: apply_overlong_filtering)",
}


def pending() -> str:
    have = {p.stem for p in method_files()}
    missing = [f"- {what}" for stem, what in EXPECTED.items() if stem not in have]
    return "\n".join(["## Not yet checked", "", *(missing or ["Nothing."])])
