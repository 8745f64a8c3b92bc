"""Whole update steps against verl: the seeded runs whose batches ``update.grpo`` saves
(``save_batches``), and how a run is made. ``scripts/verl_steps.py`` computes verl's reference
from these batches (``tests/fidelity/steps/<run>.json``); ``test_verl_steps.py`` reruns them and
compares.

Each run is the quickstart (tiny-arith, 8 prompts x 8 rollouts a step, 5 steps, seed 0) with
the update set the way verl computes it (the verl-compatible settings, each a documented
``Deviations:`` item of its component):

- ``mean_std``: ``precision: float32`` (verl computes its group statistics in float32) and
  ``single_rollout: verl``; ``reinforce_pp`` / ``reinforce_pp_plain``: ``variance: unbiased``
  (verl's ``masked_whiten``) and, with the baseline, ``single_rollout: verl``;
- ``ppo_clip``: ``dual_clip: 3.0`` (verl's ``clip_ratio_c``, always on) and ``log_ratio_clamp:
  20.0`` (verl clamps the log-ratio before the exponential); clip ``[0.2, 0.28]``
  (``clip_ratio_low`` / ``clip_ratio_high``);
- ``token_mean`` (verl's default ``loss_agg_mode``), reduced in micro-batches of 8 against the
  whole batch's token count (verl's engine workers' ``global_batch_info``);
- the KL (``grpo_kl``): ``kl_coef: 0.001`` and ``kl_clamp: 10.0``, the k3 estimate to the initial
  policy added to each token's loss, verl's ``use_kl_loss`` with ``kl_loss_coef 0.001`` and
  ``kl_loss_type low_var_kl`` (its GRPO example; the estimate clamped at 10), aggregated like the
  policy loss;
- the ratio: ``recompute_old`` is verl's default (the actor recomputes ``old_log_prob``; with one
  mini-batch and one epoch verl takes ``log_prob.detach()``, so the ratio is exactly 1). The
  REINFORCE++-with-baseline run instead trains one version stale (``lifecycle: pipelined, lag:
  1``, verl's one-step-off-policy schedule) with the correction ``none``: the ratio against the
  engine's log-probs, as verl's ``use_rollout_log_probs``, so ratios move away from 1 and the
  clip is exercised on real tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
STEPS_DIR = Path(__file__).resolve().parent / "steps"
PIPELINE = "pipelines/quickstart.yaml"

COMMON = ["run.steps=5", "eval.every=100", "executor.kind=local", "tracking.mlflow=null",
          "stages.pick.with.batch_size=8", "update.with.micro_batch_size=8",
          "update.with.loss.use=ppo_clip", "update.with.loss.with.clip=[0.2,0.28]",
          "update.with.loss.with.dual_clip=3.0", "update.with.loss.with.log_ratio_clamp=20.0",
          "update.with.aggregation.use=token_mean"]

RUNS: dict[str, dict[str, Any]] = {
    "grpo": {
        "overrides": COMMON + ["update.with.advantage.use=mean_std",
                               "update.with.advantage.with.precision=float32",
                               "update.with.advantage.with.single_rollout=verl",
                               "update.with.correction.use=recompute_old"],
        "verl": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True, "old_log_prob": "recomputed"},
    },
    "grpo_kl": {  # verl's GRPO example: use_kl_loss, kl_loss_coef 0.001, kl_loss_type low_var_kl
        "overrides": COMMON + ["update.with.advantage.use=mean_std",
                               "update.with.advantage.with.precision=float32",
                               "update.with.advantage.with.single_rollout=verl",
                               "update.with.correction.use=recompute_old", "update.with.kl_coef=0.001",
                               "update.with.kl_clamp=10.0"],
        "verl": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True, "old_log_prob": "recomputed",
                 "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl"},
    },
    "reinforce_pp": {
        "overrides": COMMON + ["update.with.advantage.use=reinforce_pp",
                               "update.with.advantage.with.variance=unbiased",
                               "update.with.advantage.with.single_rollout=verl",
                               "update.with.correction.use=none",
                               "lifecycle.mode=pipelined", "lifecycle.lag=1", "lifecycle.overlap=false"],
        "verl": {"adv_estimator": "reinforce_plus_plus_baseline", "old_log_prob": "rollout"},
    },
    "reinforce_pp_plain": {
        "overrides": COMMON + ["update.with.advantage.use=reinforce_pp_plain",
                               "update.with.advantage.with.variance=unbiased",
                               "update.with.correction.use=recompute_old"],
        "verl": {"adv_estimator": "reinforce_plus_plus", "gamma": 1.0, "old_log_prob": "recomputed"},
    },
}


def record(run: str, folder: Path, extra: list[str] = ()) -> list[dict[str, Any]]:
    """Run ``run`` (its overrides, plus ``extra``) in ``folder``, the update saving its batches
    there; the saved steps, in order."""
    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import Run
    from gfcr.stages.update.batch_trace import read_steps

    batches = folder / "batches"
    overrides = RUNS[run]["overrides"] + [f"update.with.save_batches={batches}"] + list(extra)
    Run.start(load_pipeline(REPO / PIPELINE, overrides), folder / "run").train()
    return read_steps(batches)


def metrics(folder: Path) -> list[dict[str, Any]]:
    """The metrics lines of the run ``record`` made in ``folder``."""
    import json

    return [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
