"""Regenerate ``tests/fidelity/steps/<run>.json``: verl's advantages and per-micro-batch policy
losses, computed by verl's own ``core_algos`` functions on the batches gfcr's seeded runs saved
(``update.grpo``'s ``save_batches``; the runs are ``tests/fidelity/verl_steps.py``'s ``RUNS``).

verl is never installed nor copied into this repository: its source is extracted into a scratch
folder and imported from there, with the imports ``core_algos`` needs but these functions do not
stubbed (``tensordict``; ``verl/__init__.py``, which imports its data protocol; and
``verl.workers.config``, whose ``ActorConfig`` is a type hint there and whose import chain needs
``transformers.AutoModelForVision2Seq``, absent from the transformers here). ``omegaconf``, which
``core_algos`` imports, goes into a scratch folder of its own (``--site``), not the venv. The
policy loss gets a stand-in for verl's ``ActorConfig`` with the fields it reads.

Command (from the repo root)::

    mkdir -p /tmp/scratch-verl-steps/verl && git -C <a verl clone> archive b178a3c verl \\
        | tar -x -C /tmp/scratch-verl-steps/verl
    .venv/bin/python -m pip install --target /tmp/scratch-verl-steps/site omegaconf
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python scripts/verl_steps.py \\
        --verl /tmp/scratch-verl-steps/verl --site /tmp/scratch-verl-steps/site [--kl-cases]

(``--kl-cases`` also rewrites ``tests/fidelity/kl_low_var.json``, verl's ``low_var_kl`` KL on
designed log-ratios: the per-function cases of ``update.grpo``'s KL term.)

What verl computes, per saved step: the advantages with its estimator over the whole batch
(``token_level_rewards`` the reward on each response's last token, ``index`` the group), then,
for each of gfcr's micro-batches, ``compute_policy_loss_vanilla`` with ``loss_agg_mode``
``token-mean`` and the engine workers' ``global_batch_info`` (``dp_size`` 1,
``batch_num_tokens`` the batch's response tokens, ``global_batch_size`` its responses), on
gfcr's ``log_prob`` and ``old_log_prob`` (``recomputed``: verl's on-policy ``log_prob.detach()``;
``rollout``: the engine's log-probs, verl's ``use_rollout_log_probs``). It also sums the same
losses over verl's own split (every response in batch order, micro-batches of 8, zero-advantage
ones included), which must give the same step loss.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's gfcr and tests, even where another one is installed

from gfcr.stages.update.batch_trace import from_hex  # noqa: E402
from tests.fidelity.verl_steps import PIPELINE, RUNS, STEPS_DIR, record  # noqa: E402

COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"
CLIP, CLIP_C, MICRO = (0.2, 0.28), 3.0, 8
STUBBED = ("tensordict",)
TOLERANCE = {"rel": 1e-5, "abs": 1e-6, "log_prob_abs": 1e-5}


class _Anything(types.ModuleType):
    """A stubbed module: any name it is asked for is an empty class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> Any:
        module = _Anything(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: Any) -> None:
        pass


def import_core_algos(verl: Path, site: Path) -> Any:
    """verl's ``core_algos`` from the extracted source ``verl`` (its ``verl/`` package inside)."""
    sys.path.append(str(site))
    sys.meta_path.insert(0, _Stubs())
    for name, sub in (("verl", ""), ("verl.workers", "/workers")):  # their __init__ files are not run
        package = types.ModuleType(name)
        package.__path__ = [str(verl / "verl") + sub]
        sys.modules[name] = package
    config = types.ModuleType("verl.workers.config")
    config.ActorConfig = type("ActorConfig", (), {})
    sys.modules["verl.workers.config"] = config
    import verl.trainer.ppo.core_algos as core_algos  # noqa: PLC0415

    return core_algos


class ActorConfigStandIn(dict):
    """The fields of verl's ``ActorConfig`` that ``compute_policy_loss_vanilla`` reads."""

    def __init__(self, batch_tokens: int, batch_size: int):
        super().__init__(clip_ratio_c=CLIP_C)
        self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high = CLIP[0], CLIP[0], CLIP[1]
        self.global_batch_info = {"dp_size": 1, "batch_num_tokens": batch_tokens, "global_batch_size": batch_size,
                                  "loss_scale_factor": None}


def padded(rows: list[np.ndarray], width: int) -> Any:
    import torch

    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for b, row in enumerate(rows):
        out[b, :len(row)] = torch.from_numpy(row)
    return out


def verl_advantages(core: Any, run: str, rollouts: list[dict[str, Any]]) -> Any:
    """``[B, R]`` advantages from verl's estimator over the whole batch."""
    import torch

    lengths = [r["length"] for r in rollouts]
    if min(lengths) < 1:
        raise SystemExit(f"{run}: an empty response has no token to carry verl's outcome reward")
    width = max(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()  # [B, R]
    rewards = torch.zeros((len(rollouts), width), dtype=torch.float32)
    for b, r in enumerate(rollouts):
        rewards[b, r["length"] - 1] = r["reward"]
    index = np.array([r["group"] for r in rollouts], dtype=object)
    verl = RUNS[run]["verl"]
    if verl["adv_estimator"] == "grpo":
        adv, _ = core.compute_grpo_outcome_advantage(rewards, mask, index, epsilon=1e-6,
                                                     norm_adv_by_std_in_grpo=verl["norm_adv_by_std_in_grpo"])
    elif verl["adv_estimator"] == "reinforce_plus_plus_baseline":
        adv, _ = core.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index, epsilon=1e-6)
    else:
        from verl.trainer.config import AlgoConfig  # noqa: PLC0415

        adv, _ = core.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=AlgoConfig(
            gamma=verl["gamma"]))
    return adv, mask


def policy_loss(core: Any, run: str, log_prob: Any, old: Any, adv: Any, mask: Any, config: ActorConfigStandIn,
                ref: Any = None) -> dict[str, float]:
    """One micro-batch's loss as verl's engine workers' ``ppo_loss`` makes it: the policy loss,
    plus, with ``use_kl_loss``, ``kl_loss_coef`` times the aggregated KL to the reference."""
    pg_loss, metrics = core.compute_policy_loss_vanilla(old_log_prob=old, log_prob=log_prob, advantages=adv,
                                                        response_mask=mask, loss_agg_mode="token-mean", config=config)
    out = {"pg_loss": float(pg_loss), "pg_clipfrac": metrics["actor/pg_clipfrac"],
           "pg_clipfrac_lower": metrics["actor/pg_clipfrac_lower"], "ppo_kl": metrics["actor/ppo_kl"]}
    verl = RUNS[run]["verl"]
    total = pg_loss
    if "kl_loss_coef" in verl:
        kld = core.kl_penalty(logprob=log_prob, ref_logprob=ref, kl_penalty=verl["kl_loss_type"])
        kl_loss = core.agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode="token-mean", **config.global_batch_info)
        total = pg_loss + kl_loss * verl["kl_loss_coef"]
        out["kl_loss"] = float(kl_loss)
    return {"loss": float(total), **out}


def reference_step(core: Any, run: str, step: dict[str, Any]) -> dict[str, Any]:
    """One saved step's inputs (what verl needs of it) and verl's outputs."""
    rollouts = step["rollouts"]
    if any(r["weights"] is not None for r in rollouts):
        raise SystemExit(f"{run}: token weights other than the response mask have no verl counterpart")
    adv, mask = verl_advantages(core, run, rollouts)
    where = {r["id"]: b for b, r in enumerate(rollouts)}
    config = ActorConfigStandIn(int(mask.sum()), len(rollouts))
    recomputed = RUNS[run]["verl"]["old_log_prob"] == "recomputed"
    inputs, outputs, log_probs = [], [], {}
    for micro in step["micro_batches"]:
        rows = [where[i] for i in micro["rows"]]
        new = [from_hex(h) for h in micro["log_prob"]]
        old = new if recomputed else [from_hex(h) for h in micro["old_log_prob"]]
        ref = [from_hex(h) for h in micro["ref_log_prob"]] if "ref_log_prob" in micro else None
        width = max(len(x) for x in new)
        log_probs.update({b: (n, o, ref[k] if ref else None) for k, (b, n, o) in enumerate(zip(rows, new, old))})
        outputs.append(policy_loss(core, run, padded(new, width), padded(old, width), adv[rows, :width],
                                   mask[rows, :width], config, padded(ref, width) if ref else None))
        entry = {"rows": rows, "log_prob": micro["log_prob"]}
        if not recomputed:
            entry["old_log_prob"] = micro["old_log_prob"]
        if ref:
            entry["ref_log_prob"] = micro["ref_log_prob"]
        inputs.append(entry)
    per_rollout = []
    for b, r in enumerate(rollouts):
        row = adv[b, :r["length"]]
        if not bool((row == row[0]).all()):
            raise SystemExit(f"{run}: verl gave rollout {r['id']} per-token advantages")
        per_rollout.append(float(row[0]))
        if b not in log_probs and per_rollout[-1] != 0.0:
            raise SystemExit(f"{run}: gfcr left rollout {r['id']} out of the forward pass, verl's advantage "
                             f"is {per_rollout[-1]!r}")
    return {"version": step["version"],
            "rollouts": {k: [r[k] for r in rollouts] for k in ("id", "group", "reward", "length")},
            "micro_batches": inputs,
            "expected": {"advantages": per_rollout, "micro_batches": outputs,
                         "loss": float(sum(o["loss"] for o in outputs)),
                         "loss_verl_split": verl_split_loss(core, run, adv, mask, log_probs, config)}}


def verl_split_loss(core: Any, run: str, adv: Any, mask: Any, log_probs: dict[int, tuple[Any, Any, Any]],
                    config: ActorConfigStandIn) -> float:
    """The step's loss over verl's own micro-batches: every response in batch order, ``MICRO`` a
    pass. A response gfcr did not forward has advantage 0 (checked above) and there is no KL term
    (with one, gfcr forwards every response), so its terms are 0 whatever its log-probs: it enters
    with ``log_prob = old_log_prob = 0``."""
    kl = "kl_loss_coef" in RUNS[run]["verl"]
    if kl and len(log_probs) < adv.shape[0]:
        raise SystemExit(f"{run}: with a KL term gfcr must forward every response")
    total, n, width = 0.0, adv.shape[0], adv.shape[1]
    zero = (np.zeros(0, dtype=np.float32),) * 3
    for start in range(0, n, MICRO):
        rows = list(range(start, min(start + MICRO, n)))
        new, old, ref = ([log_probs.get(b, zero)[k] for b in rows] for k in range(3))
        total += policy_loss(core, run, padded(new, width), padded(old, width), adv[rows], mask[rows], config,
                             padded(ref, width) if kl else None)["loss"]
    return total


def reference(core: Any, run: str, steps: list[dict[str, Any]]) -> dict[str, Any]:
    return {"method": f"{run}: 5 seeded update steps against verl", "repository": "volcengine/verl",
            "commit": COMMIT, "file": "verl/trainer/ppo/core_algos.py",
            "functions": [_estimator_function(run), "compute_policy_loss_vanilla", "agg_loss (token-mean)"]
            + (["kl_penalty (low_var_kl)"] if "kl_loss_coef" in RUNS[run]["verl"] else []),
            "driver": ("scripts/verl_steps.py: the run's batches saved by update.grpo "
                       "(save_batches), then verl's estimator over each step's batch and its policy loss "
                       "per gfcr micro-batch with the engine workers' global_batch_info"),
            "pipeline": PIPELINE, "overrides": RUNS[run]["overrides"], "verl": RUNS[run]["verl"],
            "clip": list(CLIP), "clip_ratio_c": CLIP_C, "tolerance": TOLERANCE,
            "steps": [reference_step(core, run, s) for s in steps]}


def _estimator_function(run: str) -> str:
    return {"grpo": "compute_grpo_outcome_advantage",
            "reinforce_plus_plus_baseline": "compute_reinforce_plus_plus_baseline_outcome_advantage",
            "reinforce_plus_plus": "compute_reinforce_plus_plus_outcome_advantage"}[RUNS[run]["verl"]["adv_estimator"]]


KL_REASON = ("verl's low_var_kl clamps the estimate to [-10, 10] and the log-ratio log(pi_ref / pi) to [-20, 20] "
             "(no gradient past either); gfcr's k3 KL is unclamped by default (set `kl_clamp: 10.0` for verl's)")


def kl_cases(core: Any) -> dict[str, Any]:
    """``tests/fidelity/kl_low_var.json``: verl's ``kl_penalty`` (``low_var_kl``) on designed
    log-ratios ``x = log pi_ref - log pi`` around its two clamps, and gfcr's own output where the
    default (unclamped) ``k3_kl`` differs."""
    import torch

    from tests.fidelity.cases import close
    from tests.fidelity.test_kl_low_var import estimate

    rng = np.random.default_rng(0)

    def case(cid: str, x: Any, logp: Any = None) -> dict[str, Any]:
        x = np.asarray(x, dtype=np.float32)  # [B, R]
        logp = rng.uniform(-3, -0.05, size=x.shape).astype(np.float32) if logp is None else np.asarray(logp, np.float32)
        ref = (logp + x).astype(np.float32)
        lp = torch.tensor(logp, requires_grad=True)
        kld = core.kl_penalty(logprob=lp, ref_logprob=torch.tensor(ref), kl_penalty="low_var_kl")
        kld.sum().backward()
        return {"id": cid, "input": {"log_prob": logp.tolist(), "ref_log_prob": ref.tolist()},
                "expected": {"kl": kld.detach().tolist(), "grad": lp.grad.tolist()}}

    cases = [case("zero", np.zeros((2, 3))), case("small_random", rng.normal(0, 0.1, (3, 5))),
             case("moderate_random", rng.normal(0, 0.8, (3, 5))),
             case("policy_up_2", [[-2.0, -1.0, -0.5], [0.5, 1.0, 2.0]]),
             case("just_under_cap", [[2.6, -10.9, 1.0]]), case("ref_13x_above_policy", [[2.7, 3.0, 0.1]]),
             case("ref_far_above_policy", [[8.0, 0.2, -0.2]]), case("policy_far_above_ref", [[-11.5, -15.0, 0.3]]),
             case("past_log_ratio_clamp", [[25.0, -25.0, 0.0]], logp=[[-30.0, -0.01, -1.0]]),
             case("mixed_rows", [[0.05, 3.5, -0.4, -12.0], [1.2, -0.7, 0.0, 2.0]])]
    tol = {"rel": 1e-5, "abs": 1e-6}
    deviations = [{"case": c["id"], "gfcr": got, "reason": KL_REASON} for c in cases
                  if not close(got := estimate(c["input"]), c["expected"], tol["rel"], tol["abs"])]
    return {"method": "k3 KL to the reference policy (verl's low_var_kl)", "stage": "update.grpo",
            "repository": "volcengine/verl", "commit": COMMIT, "file": "verl/trainer/ppo/core_algos.py",
            "function": "kl_penalty (kl_penalty low_var_kl, kl_penalty_forward)",
            "driver": ("scripts/verl_steps.py --kl-cases: core_algos imported from the extracted source with its "
                       "unrelated imports stubbed; float32 log_prob and ref_log_prob = log_prob + x for designed "
                       "log-ratios x = log pi_ref - log pi (zero, small, moderate, around the estimate's clamp at 10, "
                       "past the log-ratio clamp at 20); expected is the per-token estimate and the gradient of its "
                       "sum w.r.t. log_prob. gfcr: update.grpo's k3_kl on the same tensors."),
            "tolerance": tol, "cases": cases, "deviations": deviations}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verl", type=Path, required=True, help="a folder holding verl's extracted verl/ package")
    parser.add_argument("--site", type=Path, required=True, help="a folder where omegaconf is installed (--target)")
    parser.add_argument("--runs", nargs="*", default=list(RUNS))
    parser.add_argument("--kl-cases", action="store_true", help="also write tests/fidelity/kl_low_var.json")
    args = parser.parse_args()
    core = import_core_algos(args.verl.resolve(), args.site.resolve())
    if args.kl_cases:
        path = ROOT / "tests" / "fidelity" / "kl_low_var.json"
        path.write_text(json.dumps(kl_cases(core), indent=1) + "\n")
        print(f"wrote {path.relative_to(ROOT)}")
    STEPS_DIR.mkdir(exist_ok=True)
    for run in args.runs:
        with tempfile.TemporaryDirectory(prefix=f"verl-steps-{run}-") as tmp:
            data = reference(core, run, record(run, Path(tmp)))
        path = STEPS_DIR / f"{run}.json"
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
