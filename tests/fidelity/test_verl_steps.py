"""Whole update steps against verl: with the verl-compatible settings (``tests/fidelity/verl_steps.py``),
5 seeded steps of GRPO, of REINFORCE++ with baseline (one version stale, the clip exercised) and
of plain REINFORCE++ give, micro-batch by micro-batch, the policy losses and advantages that
verl's own ``core_algos`` functions compute on the same batches (``tests/fidelity/steps/*.json``,
within its float32 ``tolerance``).

The reference is tied to today's code: each run is made again here with ``update.grpo``'s
``save_batches``, and the batch it saves must be the one the reference was computed on (the
same rollouts, rewards and lengths, the same micro-batches, the log-probs to float rounding).
A changed aggregation or estimator setting must break the equality (the check can fail).

Regenerate the reference (verl's source extracted into a scratch folder, never here; see
``docs/fidelity.md``)::

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python scripts/verl_steps.py \\
        --verl /tmp/scratch-verl-steps/verl --site /tmp/scratch-verl-steps/site
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gfcr.registry.catalog import ADVANTAGE_ESTIMATORS, AGGREGATIONS, LOSSES
from gfcr.stages.components.aggregation import Row
from gfcr.stages.testing import scored_group
from gfcr.stages.update.batch_trace import from_hex
from tests.fidelity.cases import steps_status, unit_module_doc
from tests.fidelity.verl_steps import PIPELINE, RUNS, STEPS_DIR, metrics, record

REFERENCES = sorted(p.stem for p in STEPS_DIR.glob("*.json"))
_SAVED: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}


def reference(run: str) -> dict[str, Any]:
    return json.loads((STEPS_DIR / f"{run}.json").read_text())


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The batches of a fresh seeded run, made once per run for the module."""
    def get(run: str, with_metrics: bool = False) -> Any:
        if run not in _SAVED:
            folder = tmp_path_factory.mktemp(run)
            _SAVED[run] = record(run, folder), metrics(folder)
        return _SAVED[run] if with_metrics else _SAVED[run][0]

    return get


def close(a: float, b: float, tol: dict[str, float]) -> bool:
    return math.isclose(a, b, rel_tol=tol["rel"], abs_tol=tol["abs"])


def test_every_run_has_a_reference() -> None:
    assert REFERENCES == sorted(RUNS), "regenerate tests/fidelity/steps with scripts/verl_steps.py"


def test_the_update_states_the_whole_step_status() -> None:
    assert steps_status() in " ".join(unit_module_doc("update.grpo").split()), (
        f"update.grpo's Fidelity paragraph should say {steps_status()!r}")


@pytest.mark.parametrize("run", REFERENCES)
def test_the_reference_is_of_the_run_defined_here(run: str) -> None:
    ref = reference(run)
    assert (ref["pipeline"], ref["overrides"], ref["verl"]) == (PIPELINE, RUNS[run]["overrides"], RUNS[run]["verl"])
    assert len(ref["steps"]) == 5 and all(s["micro_batches"] for s in ref["steps"])


@pytest.mark.parametrize("run", REFERENCES)
def test_gfcr_saves_the_batches_the_reference_was_computed_on(run: str, saved: Any) -> None:
    ref, steps = reference(run), saved(run)
    assert [s["version"] for s in steps] == [s["version"] for s in ref["steps"]]
    for got, want in zip(steps, ref["steps"]):
        rollouts = {k: [r[k] for r in got["rollouts"]] for k in ("id", "group", "reward", "length")}
        assert rollouts == want["rollouts"], f"step {want['version']}: other rollouts than the reference's"
        ids = want["rollouts"]["id"]
        assert [m["rows"] for m in got["micro_batches"]] == [[ids[b] for b in m["rows"]] for m in want["micro_batches"]]
        for g, w in zip(got["micro_batches"], want["micro_batches"]):
            for key in ("log_prob", "old_log_prob") + (("ref_log_prob",) if "ref_log_prob" in w else ()):
                for a, b in zip(g[key], w.get(key, w["log_prob"]), strict=True):  # no old_log_prob: log_prob.detach()
                    assert np.allclose(from_hex(a), from_hex(b), rtol=0, atol=ref["tolerance"]["log_prob_abs"])


@pytest.mark.parametrize("run", REFERENCES)
def test_gfcr_advantages_equal_verls(run: str, saved: Any) -> None:
    ref, steps = reference(run), saved(run)
    for got, want in zip(steps, ref["steps"]):
        gfcr = [r["advantage"] for r in got["rollouts"]]
        assert all(close(a, b, ref["tolerance"]) for a, b in zip(gfcr, want["expected"]["advantages"], strict=True)), (
            f"step {want['version']}: gfcr {gfcr}, verl {want['expected']['advantages']}")


@pytest.mark.parametrize("run", REFERENCES)
def test_gfcr_losses_equal_verls_micro_batch_by_micro_batch(run: str, saved: Any) -> None:
    ref, steps = reference(run), saved(run)
    tol = ref["tolerance"]
    for got, want in zip(steps, ref["steps"]):
        gfcr = [m["loss"] for m in got["micro_batches"]]
        verl = [m["loss"] for m in want["expected"]["micro_batches"]]
        assert all(close(a, b, tol) for a, b in zip(gfcr, verl, strict=True)), (
            f"step {want['version']}: gfcr {gfcr}, verl {verl}")
        assert close(got["loss"], want["expected"]["loss"], tol)
        assert close(got["loss"], want["expected"]["loss_verl_split"], tol)  # verl's own split: the same step loss


def test_gfcr_kl_equals_verls_kl_loss(saved: Any) -> None:
    """With ``kl_coef``, gfcr's ``kl`` metric (the k3 estimate's mean over the batch's tokens) is
    the sum of verl's ``kl_loss`` over the micro-batches (``low_var_kl``, token-mean against the
    batch's tokens); the micro-batch losses above already hold ``kl_loss_coef * kl_loss``."""
    ref = reference("grpo_kl")
    steps, lines = saved("grpo_kl", with_metrics=True)
    kls = [sum(m["kl_loss"] for m in s["expected"]["micro_batches"]) for s in ref["steps"]]
    assert kls[0] == 0.0 and min(kls[1:]) > 0.0  # the policy leaves its reference after the first step
    for line, kl in zip(lines, kls, strict=True):
        assert math.isclose(line["update"]["kl"], kl, rel_tol=1e-4, abs_tol=1e-9), (line["step"], kl)


def test_the_stale_run_exercises_the_clip() -> None:
    """One run trains a version stale, so verl's clip binds on some tokens: the losses are not
    just ``-A`` at ratio 1."""
    fractions = [m["pg_clipfrac"] for s in reference("reinforce_pp")["steps"] for m in s["expected"]["micro_batches"]]
    assert max(fractions) > 0.0


def _gfcr_losses(ref: dict[str, Any], step: dict[str, Any], aggregation: str) -> list[float]:
    """gfcr's loss and ``aggregation`` on the reference's own inputs, micro-batch by micro-batch."""
    cls = LOSSES.get("ppo_clip")
    loss = cls(cls.Config(clip=tuple(ref["clip"]), dual_clip=ref["clip_ratio_c"], log_ratio_clamp=20.0))
    agg_cls = AGGREGATIONS.get(aggregation)
    agg = agg_cls(agg_cls.Config())
    lengths, groups = step["rollouts"]["length"], step["rollouts"]["group"]
    rows = [Row(g, groups.count(g), np.zeros(1), n, float(n), n) for g, n in zip(groups, lengths)]
    plan, out = agg.plan(rows), []
    for micro in step["micro_batches"]:
        new = [from_hex(h) for h in micro["log_prob"]]
        old = [from_hex(h) for h in micro.get("old_log_prob", micro["log_prob"])]
        width = max(len(x) for x in new)
        weight = (torch.arange(width)[None, :] < torch.tensor([len(x) for x in new])[:, None]).float()
        adv = torch.tensor([step["expected"]["advantages"][b] for b in micro["rows"]])[:, None].expand(-1, width)
        terms = loss.terms(_padded(new, width) - _padded(old, width), adv, weight)
        out.append(float(agg.reduce(terms.per_token, weight, [rows[b] for b in micro["rows"]], plan)))
    return out


def _padded(rows: list[np.ndarray], width: int) -> torch.Tensor:
    return torch.stack([torch.nn.functional.pad(torch.from_numpy(x), (0, width - len(x))) for x in rows])  # [B, R]


@pytest.mark.parametrize("run", REFERENCES)
def test_a_changed_aggregation_breaks_the_equality(run: str) -> None:
    """On the reference's inputs, gfcr's ``ppo_clip`` and ``token_mean`` give verl's policy losses
    (``pg_loss``, the KL term aside) and ``seq_mean_token_mean`` does not (far outside the
    tolerance): the comparison can fail."""
    ref = reference(run)
    for step in ref["steps"]:
        verl = [m["pg_loss"] for m in step["expected"]["micro_batches"]]
        assert all(close(a, b, ref["tolerance"]) for a, b in zip(_gfcr_losses(ref, step, "token_mean"), verl))
    mutated = [abs(a - b) for step in ref["steps"] for a, b in zip(
        _gfcr_losses(ref, step, "seq_mean_token_mean"), [m["pg_loss"] for m in step["expected"]["micro_batches"]])]
    assert max(mutated) > 100 * ref["tolerance"]["abs"]


def test_a_changed_estimator_setting_breaks_the_equality() -> None:
    """GRPO's population std (``std_ddof: 0``) instead of verl's sample std moves the advantages
    far outside the tolerance."""
    ref = reference("grpo")
    cls = ADVANTAGE_ESTIMATORS.get("mean_std")
    estimator = cls(cls.Config(std_ddof=0, precision="float32", single_rollout="verl"))
    moved = 0.0
    for step in ref["steps"]:
        groups, rewards = step["rollouts"]["group"], step["rollouts"]["reward"]
        for g in dict.fromkeys(groups):
            members = [b for b, x in enumerate(groups) if x == g]
            values = estimator.estimate(scored_group(g, [rewards[b] for b in members])).values
            moved = max(moved, max(abs(float(v) - step["expected"]["advantages"][b]) for v, b in zip(values, members)))
    assert moved > 100 * ref["tolerance"]["abs"]
