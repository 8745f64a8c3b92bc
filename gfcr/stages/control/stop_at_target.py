"""control.stop_at_target: APRIL's active partial rollouts, the abort half (an in-flight controller).

Generate over-provisioned groups (an upstream control allocates more prompts than the step
needs); while the engine decodes, once ``groups`` groups are complete (all their rows ended
with end-of-sequence, a stop string or the length cap), every unfinished row, running or
queued, is aborted with its partial response kept (status ``aborted_partial``). The long
tail of a batch then no longer holds the step up. The generate stage drops the groups that
hold a partial (reason "stopped in flight ... (partial kept)").

It is not a step stage: it has ``steer`` and ``every`` and no ``run``; a Generate stage
names it under ``in_flight`` and the engine calls ``steer`` every ``every`` decode steps.

Reference: APRIL, Active Partial Rollouts (arXiv 2509.18521, 2025; code ``RLsys-Foundation/APRIL``,
``slime/rollout/sglang_example.py``): over-sample ``N' >= N`` groups (README example 64 for
32), ``abort_all`` once ``N`` groups are collected, keep each partial and resume it next
round from its token ids.

Deviations:

- APRIL counts a group once its rewards are computed (and, optionally, it passes a dynamic
  filter); here a group counts once its rows have ended, before verification: rewards are
  computed after generation in gfcr, so a group that a later filter drops still counts.
- The check runs every ``every`` decode steps (APRIL reacts as each request returns), so
  up to ``every - 1`` extra tokens per row may be decoded after the target is reached.
- Resuming partials next step (APRIL's buffer) is a Replay stage's job; this stage only
  aborts. Without one, the partials are dropped with their groups.
- When more groups end at the stopping step than the target needs, every one of them is kept;
  slime keeps exactly ``rollout_batch_size`` (which of the tied groups follows asyncio's done
  set) and leaves the others out of both the batch and its partial buffer (3 reference cases).

Fidelity: checked against THUDM/slime@624b824: 8/11 cases, 3 documented deviations
(``tests/fidelity/stop_at_target.json``: ``generate_rollout_async`` and ``abort`` of
``slime/rollout/sglang_rollout.py`` with partial rollout on, every row decoding one token a step:
the step of the abort, the groups ended by then and those aborted with a partial, against this
stage's ``steer`` every step).

Example:

>>> from gfcr.stages.engine import GenerationRequest, SamplingParams
>>> from gfcr.engines import FakeEngine
>>> engine = FakeEngine()
>>> stop = StopAtTarget(StopAtTarget.Config(groups=2))
>>> requests = [GenerationRequest(f"g{i}", engine.encode(f"{i}+{i}="), 4, SamplingParams(max_new_tokens=40))
...             for i in range(6)]
>>> results = engine.generate(requests, controller=stop)
>>> complete = [all(c.finish_reason in ("stop", "length") for c in group) for group in results]
>>> sum(complete) >= 2
True
>>> all(c.finish_reason == "aborted" for ok, group in zip(complete, results) if not ok
...     for c in group if c.finish_reason not in ("stop", "length"))
True

YAML (``in_flight`` on the generate stage is the lifecycle's port; see docs):

.. code-block:: yaml

    stop:    {use: control.stop_at_target, with: {groups: 8}}
    rollout: {use: generate.sample, from: budget, in_flight: [stop]}
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from gfcr.registry import StageConfig
from gfcr.stages.engine import InFlightView, Steer


class StopAtTarget:
    """Abort every unfinished row once ``groups`` groups are complete (APRIL)."""

    every: int  # decode steps between steer calls (the in-flight controller role)

    class Config(StageConfig):
        groups: Annotated[int, Field(ge=1, description="complete groups to wait for, then abort the rest")]
        every: Annotated[int, Field(ge=1, description="check every this many decode steps")] = 1

    def __init__(self, config: Config):
        self.config = config
        self.every = config.every

    def steer(self, view: InFlightView) -> Steer:
        complete = len(view.complete_groups())
        if complete < self.config.groups:
            return Steer()
        why = f"control.stop_at_target: {complete} groups complete (target {self.config.groups}), the rest aborted"
        return Steer(stop=True, why={(r.request_id, r.sample_index): why for r in view.rows if r.finish_reason is None})
