"""Params and metrics as MLflow takes them: flattened keys, MLflow's limits, numbers only."""

from __future__ import annotations

from gfcr.graph import load_pipeline
from gfcr.tracking.mlflow_values import MAX_KEY, MAX_PARAM_VALUE, fit_value, metric_values, mlflow_key, spec_params
from tests.conftest import BASE


def test_metrics_are_the_numeric_leaves_of_a_metrics_line_flattened():
    record = {"step": 4, "reward_mean": 0.5, "loss": None, "skip_reason": "no groups", "update_skipped": True,
              "update": {"grad_norm": 1.5, "batch_groups": 3}, "control": {"pick": {"p_easy": 0.25, "why": "x"}},
              "time": {"step_s": 0.3, "stages_s": {"rollout": 0.2}}, "loop_rounds": {}, "clip": [0.2, 0.28]}
    assert metric_values(record) == {
        "reward_mean": 0.5, "update_skipped": 1.0, "update.grad_norm": 1.5, "update.batch_groups": 3.0,
        "control.pick.p_easy": 0.25, "time.step_s": 0.3, "time.stages_s.rollout": 0.2,
    }


def test_params_are_the_resolved_spec_with_stage_defaults(write_spec):
    params = spec_params(load_pipeline(write_spec(BASE)))
    assert params["stages.pick.with.batch_size"] == "4"  # written in the YAML
    assert params["stages.pick.use"] == "control.uniform" and params["run.steps"] == "2"
    assert params["run.seed"] == "0"  # a default, still a param: ablations compare it
    assert params["tracking.mlflow"] == "None"
    assert "data.with.n" in params and params["stages.budget.from"] == "pick"


def test_long_values_and_keys_are_cut_and_say_so():
    value = fit_value("x" * 10_000)
    assert len(value) == MAX_PARAM_VALUE and value.endswith("... [truncated: 10000 chars]")
    long_a, long_b = "a." * 200 + "one", "a." * 200 + "two"
    assert len(mlflow_key(long_a)) == MAX_KEY and mlflow_key(long_a) != mlflow_key(long_b)
    assert mlflow_key("update.with.weird key!") == "update.with.weird key_"
