"""DOTS (``control.dots`` and its predictor) against ASTRAL-Group/data-efficient-llm-rl: the
selection distribution and draw of the trainer, the predictor's forward (``model.py``), its
training (``train.py``'s ``train_full_epoch``) and the online linear calibration
(``teacher_utils.py``)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
import torch

from gfcr.registry import STAGES
from gfcr.stages.control.dots_predictor import DifficultyPredictor, predict, train_predictor
from tests.fidelity.cases import case_ids, cases, check

# the reference's parameter names -> gfcr's (same layers, same order)
RENAMES = {"regressor.sim_head.query_proj.": "query_proj.", "regressor.sim_head.ref_proj.": "ref_proj.",
           "regressor.mlp.": "calibration."}


def dots_module():
    return sys.modules[STAGES.get("control.dots").__module__]


def predictor_with(inp: dict[str, Any]) -> DifficultyPredictor:
    d = len(inp["queries"][0])
    model = DifficultyPredictor(d, inp["hidden_size"], inp["num_layers"])
    state = {}
    for name, value in inp["weights"].items():
        prefix = next(p for p in RENAMES if name.startswith(p))
        state[RENAMES[prefix] + name[len(prefix):]] = torch.tensor(value, dtype=torch.float32)
    model.load_state_dict(state)
    return model.eval()


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


# --- the sampling distribution (dots.json) ------------------------------------------------------

def probabilities(inp: dict[str, Any]) -> list[float]:
    return [float(w) for w in dots_module().selection_probabilities(inp["p_hat"], inp["alpha"], inp["tau"])]


@pytest.mark.parametrize("case", cases("dots"), ids=case_ids("dots"))
def test_dots_sampling_distribution_matches_the_reference(case):
    check("dots", case, probabilities)


# --- the predictor's forward (dots_predictor.json) -----------------------------------------------

def forward(inp: dict[str, Any]) -> dict[str, list[float]]:
    model = predictor_with(inp)
    q, r, v = t(inp["queries"]), t(inp["refs"]), t(inp["ref_values"])
    with torch.no_grad():
        return {"base": model.attention(q, r, v, inp["tau"]).tolist(), "p": model(q, r, v, inp["tau"]).tolist()}


@pytest.mark.parametrize("case", cases("dots_predictor"), ids=case_ids("dots_predictor"))
def test_dots_predictor_forward_matches_the_reference(case):
    check("dots_predictor", case, forward)


# --- the predictor's training (dots_training.json) -----------------------------------------------

def trained(inp: dict[str, Any]) -> dict[str, list[float]]:
    model = predictor_with(inp)
    refs, ref_rates = t(inp["refs"]), t(inp["ref_rates"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # one batch an epoch, every reference, no dropout: the draws only permute sums
        losses = train_predictor(model, t(inp["queries"]), t(inp["query_rates"]), inp["query_groups"], refs,
                                 ref_rates, epochs=inp["epochs"], lr=inp["lr"], batch_size=inp["batch_size"],
                                 ref_size=inp["ref_size"], warmup_steps=inp["warmup_steps"])
    held = predict(model, t(inp["held_out"]), refs, ref_rates[0])
    return {"epoch_losses": losses, "held_out_p": held.tolist()}


@pytest.mark.parametrize("case", cases("dots_training"), ids=case_ids("dots_training"))
def test_dots_predictor_training_matches_the_reference(case):
    check("dots_training", case, trained)


# --- calibration and the draw (dots_selection.json) ----------------------------------------------

def calibrated(inp: dict[str, Any]) -> list[float]:
    p = np.asarray(inp["predicted"], dtype=np.float32).astype(np.float64)
    a, b = dots_module().linear_calibration(p[inp["ref_indices"]], np.asarray(inp["ref_labels"]))
    return [float(x) for x in a * p + b]


def selected(inp: dict[str, Any]) -> dict[str, list]:
    module = dots_module()
    stage = module.Dots(module.Dots.Config(batch_size=inp["batch_size"], interval=inp["mu"],
                                           fresh_fraction=inp["sigma"]))
    m = stage.round_size(inp["first_round"])
    return {"probabilities": [float(w) for w in module.selection_probabilities(inp["p_hat"], inp["alpha"], inp["tau"])],
            "selected": module.draw_selection(np.asarray(inp["p_hat"], dtype=np.float32), inp["alpha"], inp["tau"], m,
                                              inp["torch_seed"])}


def selection_case(inp: dict[str, Any]) -> Any:
    return selected(inp) if "torch_seed" in inp else calibrated(inp)


@pytest.mark.parametrize("case", cases("dots_selection"), ids=case_ids("dots_selection"))
def test_dots_calibration_and_draw_match_the_reference(case):
    check("dots_selection", case, selection_case)
