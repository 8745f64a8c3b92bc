"""A pipeline built in Python, not YAML: GRPO on tiny-arith with APRIL's stop-at-target.

The control stages over-provision (12 prompts x 8 rollouts); the in-flight controller
``control.stop_at_target`` watches the engine's decode loop and, once 6 groups are complete,
aborts every unfinished row. generate.sample drops the groups that hold a partial (their
rollouts stay on the record, status ``aborted_partial``), the verifier scores the rollouts,
filter.nonzero_variance drops the groups whose rewards are all equal, and GRPO updates on
the groups still included.

Run it from the repository root (about half a minute on 2 CPU cores):

    python examples/python_pipeline.py
"""

from __future__ import annotations

import sys

from gfcr.graph import compile_pipeline
from gfcr.records import RolloutStatus
from gfcr.runtime import LocalRunner
from gfcr.runtime.loop.session import build_services, step_record
from gfcr.spec import PipelineSpec, StageSpec, load_spec_text


def build_spec(seed: int = 0) -> PipelineSpec:
    return PipelineSpec(
        name="python-april",
        policy={"model": "tiny-arith", "engine": "hf"},
        data={"source": "arithmetic", "with": {"n": 400, "seed": 0, "digits": 2, "operators": ["+", "-"]}},
        stages={
            "pick": StageSpec(use="control.uniform", with_={"batch_size": 12}),
            "budget": StageSpec(use="control.fixed_n", from_="pick", with_={"n": 8}),
            "stop": StageSpec(use="control.stop_at_target", with_={"groups": 6}),
            "rollout": StageSpec(use="generate.sample", from_="budget", in_flight=["stop"],
                                 with_={"temperature": 1.0, "max_new_tokens": 8}),
            "reward": StageSpec(use="filter.verify", from_="rollout"),
            "keep": StageSpec(use="filter.nonzero_variance", from_="reward"),
        },
        update=StageSpec(use="update.grpo", from_="keep",
                         with_={"lr": 3.0e-4, "loss": {"use": "ppo_clip", "with": {"clip": [0.2, 0.28]}}}),
        run={"steps": 2, "seed": seed},
    )


def main(steps: int = 2) -> None:
    spec = build_spec()
    assert load_spec_text(spec.to_yaml()) == spec  # the same spec, as YAML
    pipeline = compile_pipeline(spec)  # type-checks the graph; the controller hangs off `rollout`
    runner = LocalRunner(pipeline, services=build_services(spec))  # loads tiny-arith, starts its engine
    for report in runner.run(steps):
        m = step_record(report, None, seconds=0.0)  # the step's metrics.jsonl line (no eval, no clock)
        aborted = sum(r.status == RolloutStatus.ABORTED_PARTIAL for g in report.groups for r in g.rollouts)
        loss = f"skipped ({m['skip_reason']})" if m["update_skipped"] else f"{m['loss']:.4g}"
        print(f"step {m['step']}: groups {m['groups']}, kept {m['groups_kept']}, "
              f"rollouts {m['rollouts_generated']} ({aborted} aborted in flight), "
              f"tokens {m['tokens_generated']}, reward_mean {m['reward_mean']}, "
              f"loss {loss}, policy_version {m['policy_version']}")

if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
