"""generate.sample: independent samples per prompt from the policy's engine (GRPO's rollouts).

For every allocation entry with ``n_rollouts > 0`` the engine draws that many independent
completions of the prompt's token ids (tokenized once, chat template applied by the
policy). Each completion becomes a ``Rollout`` holding its token ids, one segment with the
current policy version and the per-token behaviour log-probabilities, its status
(``completed`` at end-of-sequence or a stop string, ``truncated`` at ``max_new_tokens``)
and its decoded text for the verifiers. The rollouts of one prompt form one group.

Seeding: the engine's seed is derived from ``(seed, step, loop round)``, so a step samples
the same tokens whether the run was interrupted or not.

Deviations: none from GRPO's independent sampling (Shao et al., 2024, arXiv 2402.03300);
sampling uses ``top_k = 0`` (no top-k truncation) as the peer baselines do, and the
recorded log-probabilities are those of the tempered distribution before top-p truncation.

Example (the ``tiny-arith`` policy on the transformers engine):

>>> from gfcr.engines import TransformersEngine, load_policy
>>> from gfcr.records import Allocation, AllocationEntry, Prompt, StepContext
>>> from gfcr.spec import PolicySpec
>>> from gfcr.stages.resources import Resources
>>> policy = load_policy(PolicySpec(model="tiny-arith"))
>>> stage = Sample(Sample.Config(max_new_tokens=8))
>>> stage.setup(Resources(policy, TransformersEngine(policy)))
>>> groups = stage.run(Allocation(0, (AllocationEntry(Prompt("a:0", text="What is 12 + 30? Answer:"), 4),)),
...                    StepContext("run", step=0, seed=0, policy_version=0))
>>> group = groups.groups[0]
>>> len(group.rollouts), group.rollouts[0].rollout_id
(4, 'a:0@s0/0')
>>> all(len(r.behavior_logprobs) == len(r) for r in group.rollouts)
True

YAML:

.. code-block:: yaml

    rollout: {use: generate.sample, from: budget, with: {temperature: 1.0, max_new_tokens: 32}}
"""

from __future__ import annotations

import zlib
from typing import Annotated

from pydantic import Field

from gfcr.records import (
    Allocation, Rollout, RolloutGroup, RolloutGroups, RolloutStatus, Segment, StepContext, group_id, rollout_id,
)
from gfcr.registry import StageConfig
from gfcr.stages.resources import Engine, GenerationRequest, Policy, Resources, SamplingParams, prompt_tokens


def step_seed(*parts: object) -> int:
    """A 31-bit seed from any parts (stable across processes, unlike ``hash``)."""
    return zlib.crc32(":".join(map(str, parts)).encode()) & 0x7FFFFFFF


class Sample:
    """Independent samples of every allocated prompt, grouped by prompt."""

    class Config(StageConfig):
        temperature: Annotated[float, Field(ge=0.0, description="0 samples greedily")] = 1.0
        top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
        max_new_tokens: Annotated[int, Field(ge=1)] = 64
        stop: list[str] = Field(default_factory=list, description="stop strings (kept in the response)")
        seed: int | None = Field(None, description="sampling seed; default: the run's seed")

    def __init__(self, config: Config):
        self.config = config
        self.policy: Policy | None = None
        self.engine: Engine | None = None

    def setup(self, resources: Resources) -> None:
        self.policy = resources.require_policy("generate.sample")
        self.engine = resources.require_engine("generate.sample")

    def run(self, allocation: Allocation, ctx: StepContext | None = None) -> RolloutGroups:
        if self.engine is None or self.policy is None:
            raise RuntimeError("generate.sample was not set up with a policy and engine")
        ctx = ctx or StepContext("", allocation.step, 0, 0)  # the runtime passes the current one
        cfg, round_ = self.config, ctx.round or 0
        seed = ctx.seed if cfg.seed is None else cfg.seed
        params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, tuple(cfg.stop),
                                step_seed(seed, allocation.step, round_))
        entries = allocation.active()
        requests = [GenerationRequest(group_id(e.prompt_id, allocation.step, round_),
                                      tuple(prompt_tokens(self.policy, e.prompt)), e.n_rollouts) for e in entries]
        results = self.engine.generate(requests, params)
        version = self.engine.policy_version
        groups = []
        for entry, request, completions in zip(entries, requests, results):
            gid = request.request_id
            rollouts = [
                Rollout(rollout_id(gid, i), gid, entry.prompt_id, list(c.token_ids),
                        [Segment(0, len(c.token_ids), version, c.logprobs)],
                        status=RolloutStatus.COMPLETED if c.finish_reason == "stop" else RolloutStatus.TRUNCATED,
                        finish_reason=c.finish_reason, created_step=allocation.step, text=c.text,
                        replica=c.replica)
                for i, c in enumerate(completions)
            ]
            groups.append(RolloutGroup(gid, entry.prompt_id, allocation.step, entry.n_rollouts, rollouts,
                                       sample_weight=entry.sample_weight))
        return RolloutGroups(groups)
