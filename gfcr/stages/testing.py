"""TEST STAGES: a fake engine, a fake update, a fake in-flight controller and one fake stage
per Replay port, for testing the runtime's logic and trying the DSL without a model. They do
no learning; never use them to measure a method.

``generate.fake`` draws each rollout's reward from a per-prompt success probability
(a stable hash of the prompt id and the seed), so some prompts are easy, some hard, and
zero-variance groups occur as they do in real runs. It hosts in-flight controllers: with
any attached it simulates a decode loop (rows of random lengths, one token per step) and
lets them steer it, as the engine will. ``update.fake`` counts what reaches it (the runtime's trainer
bumps the version). ``control.fake_stop`` stops generation once N groups are complete (APRIL's
rule, on the fake loop). ``filter.fake_slow`` passes groups through, slowly, one by one.
``replay.fake_provide``, ``replay.fake_ingest`` and ``replay.fake_mix``
exercise the provide, ingest and mix ports.

Fidelity: gfcr's own: labelled test stages for the runtime's logic; they implement no method.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, replace
from typing import Annotated, Any, ClassVar, Sequence

import numpy as np
from pydantic import Field

from gfcr.records import (
    Allocation, AllocationEntry, Origin, Provided, ProvidedRollout, Rollout, RolloutGroup, RolloutGroups,
    RolloutStatus, Segment, SegmentOrigin, StepContext, StepOutputs, Turn, TurnRole, UpdateReport, group_id,
    rollout_id,
)
from gfcr.registry import InFlightController, StageConfig
from gfcr.stages.engine import InFlightView, LiveRow, Steer
from gfcr.stages.generate.sample import STATUS
from gfcr.stages.training import TrainBatch, step_here


def scored_group(prompt: str, rewards: list[float], step: int = 0) -> RolloutGroup:
    """A group of one-token rollouts with the given rewards (reward 1 counts as correct)."""
    gid = group_id(prompt, step)
    rollouts = [
        Rollout(rollout_id(gid, i), gid, prompt, [1], [Segment(0, 1, 0, np.zeros(1))],
                reward=float(r), correct=r == 1)
        for i, r in enumerate(rewards)
    ]
    return RolloutGroup(gid, prompt, step, len(rewards), rollouts)


def trajectory(rid: str, parts: Sequence[tuple[int, float | None] | str], prompt: str = "p") -> Rollout:
    """A trajectory rollout ``<group>/<i>`` of labelled tokens: each ``(n, reward)`` a model turn of
    ``n`` tokens with the environment's reward for it, each string an environment turn (one token
    per character, its text the string); its ``reward`` the sum of the turn rewards."""
    tokens: list[int] = []
    segments, turns = [], []
    for part in parts:
        start = len(tokens)
        if isinstance(part, str):
            tokens += [2] * len(part)
            segments.append(Segment(start, len(tokens), 0, np.zeros(len(part)), SegmentOrigin.ENVIRONMENT))
            turns.append(Turn(TurnRole.ENVIRONMENT, start, len(tokens), part))
        else:
            tokens += [1] * part[0]
            segments.append(Segment(start, len(tokens), 0, np.zeros(part[0])))
            turns.append(Turn(TurnRole.MODEL, start, len(tokens), "", part[1]))
    rewards = [t.reward for t in turns if t.reward is not None]
    return Rollout(rid, rid.rsplit("/", 1)[0], prompt, tokens, segments, turns=turns,
                   reward=float(sum(rewards)) if rewards else None)


def prompt_success_probability(prompt_id: str, seed: int) -> float:
    """A stable pseudo-difficulty in [0, 1) for a prompt."""
    return zlib.crc32(f"{seed}:{prompt_id}".encode()) / 2**32




class FakeGenerate:
    """TEST STAGE (fake engine): random tokens, rewards from a per-prompt success rate.

    Hosts in-flight controllers (``in_flight: [...]``): with any attached, each row gets a
    random length in ``[1, length]`` and a simulated decode loop, one token per row per step,
    calls every controller's ``steer`` every ``every`` steps and applies its aborts, prunes
    and stop. A ``provided`` input (from a Replay stage) continues offered partials: the
    first rollouts of a prompt start from a partial's tokens (origin ``resumed``).

    Example:

    >>> from gfcr.records import Allocation, AllocationEntry, Prompt
    >>> stage = FakeGenerate(FakeGenerate.Config(length=4))
    >>> groups = stage.run(Allocation(0, (AllocationEntry(Prompt("p:0", text="x"), 3),)))
    >>> [len(g.rollouts) for g in groups], len(groups.groups[0].rollouts[0])
    ([3], 4)

    YAML:

    .. code-block:: yaml

        rollout: {use: generate.fake, from: budget, with: {length: 8}}
    """

    testing: ClassVar[bool] = True

    class Config(StageConfig):
        length: Annotated[int, Field(ge=1, description="tokens per rollout")] = 8
        vocab_size: Annotated[int, Field(ge=2)] = 64
        seed: int = 0
        latency_s: Annotated[float, Field(ge=0.0, description=(
            "seconds each call sleeps, standing in for an engine's generation time: a step time that the "
            "machine's load barely moves, for tests of wall-clock figures"))] = 0.0
        marks_correct: ClassVar[bool] = True  # a capability (gfcr.registry.MarksCorrect): rewards are its verdicts

    def __init__(self, config: Config):
        self.config = config
        self.controllers: tuple[InFlightController, ...] = ()

    def attach_in_flight(self, controllers: Sequence[InFlightController]) -> None:
        self.controllers = tuple(controllers)

    def run(self, allocation: Allocation, ctx: StepContext | None = None,
            provided: Provided | None = None) -> RolloutGroups:
        ctx = ctx or StepContext("", allocation.step, 0, 0)
        groups = [self._group(e, allocation.step, ctx, provided) for e in allocation.active()]
        if self.controllers:
            self._decode(groups)
        time.sleep(self.config.latency_s)
        return RolloutGroups(groups)

    def _group(self, entry: AllocationEntry, step: int, ctx: StepContext, provided: Provided | None) -> RolloutGroup:
        gid = group_id(entry.prompt_id, step, ctx.round or 0)
        rng = np.random.default_rng(zlib.crc32(f"{self.config.seed}:{gid}".encode()))
        p = prompt_success_probability(entry.prompt_id, self.config.seed)
        partials = provided.for_prompt(entry.prompt_id, "partial") if provided is not None else ()
        rollouts = []
        for i in range(entry.n_rollouts):
            tokens = rng.integers(0, self.config.vocab_size, self.config.length).tolist()
            logprobs = np.log(rng.uniform(0.05, 1.0, self.config.length))
            correct = bool(rng.random() < p)
            rollout = Rollout(rollout_id(gid, i), gid, entry.prompt_id, tokens,
                              [Segment(0, len(tokens), ctx.policy_version, logprobs)],
                              created_step=step, reward=float(correct), correct=correct,
                              reward_reason="fake: Bernoulli(p_prompt)")
            rollouts.append(_continue(partials[i].rollout, rollout) if i < len(partials) else rollout)
        return RolloutGroup(gid, entry.prompt_id, step, entry.n_rollouts, rollouts, sample_weight=entry.sample_weight)

    def _decode(self, groups: list[RolloutGroup]) -> None:
        """The simulated decode loop: rows end at their own length unless a controller ends them."""
        rows = {(g.group_id, i): r for g in groups for i, r in enumerate(g.rollouts)}
        ends = {key: _fake_length(r, self.config.length) for key, r in rows.items()}
        finish: dict[tuple[str, int], str] = {}
        sizes = {g.group_id: len(g.rollouts) for g in groups}
        for decoded in range(1, self.config.length + 1):
            finish.update({k: "stop" for k, end in ends.items() if end == decoded and k not in finish})
            due = [c for c in self.controllers if decoded % c.every == 0]
            if len(finish) == len(rows) or not due:
                continue
            view = InFlightView(decoded, tuple(_live(k, rows[k], min(decoded, ends[k]), finish.get(k)) for k in rows),
                                sizes)
            for controller in due:
                _apply(controller.steer(view), finish, ends, decoded)
        for (gid, i), r in rows.items():
            _cut(r, ends[(gid, i)], finish.get((gid, i), "stop"))


def _continue(partial: Rollout, fresh: Rollout) -> Rollout:
    """``fresh`` continuing ``partial``: the partial's tokens and segments, then fresh tokens."""
    n = max(0, len(fresh) - len(partial))
    out = replace(fresh, response_token_ids=list(partial.response_token_ids), origin=Origin.RESUMED,
                  segments=[replace(s) for s in partial.segments])
    out.append(fresh.response_token_ids[:n], fresh.behavior_logprobs[:n], fresh.segments[0].policy_version)
    return out


def _fake_length(rollout: Rollout, length: int) -> int:
    return 1 + zlib.crc32(rollout.rollout_id.encode()) % length


def _live(key: tuple[str, int], r: Rollout, n: int, finish: str | None) -> LiveRow:
    return LiveRow(key[0], key[1], tuple(r.response_token_ids[:n]), r.behavior_logprobs[:n], None, finish)


def _apply(steer: Any, finish: dict, ends: dict, decoded: int) -> None:
    """Apply a Steer (read by attribute: the engine's or this module's) to the fake loop."""
    for reason, keys in (("aborted", steer.abort), ("pruned", steer.prune)):
        for key in keys:
            if tuple(key) not in finish:
                finish[tuple(key)], ends[tuple(key)] = reason, decoded
    if steer.stop:
        for key in ends:
            if key not in finish:
                finish[key], ends[key] = "aborted", decoded


def _cut(r: Rollout, n: int, finish: str) -> None:
    """Keep the first ``n`` tokens of ``r`` and set its status from how it ended."""
    if n < len(r):
        r.response_token_ids = r.response_token_ids[:n]
        r.segments = [Segment(s.start, min(s.end, n), s.policy_version, s.behavior_logprobs[: min(s.end, n) - s.start],
                              s.origin) for s in r.segments if s.start < n]
    r.status, r.finish_reason = STATUS[finish], finish


class FakeStop:
    """TEST STAGE (fake in-flight controller): stop generation once ``groups`` groups are complete.

    APRIL's stop-at-target rule on the fake decode loop of ``generate.fake``; the real one is
    ``control.stop_at_target``. Counts its ``steer`` calls per step (``observe`` sums them).

    Example:

    >>> stop = FakeStop(FakeStop.Config(groups=1))
    >>> view = InFlightView(3, (LiveRow("g", 0, (1,), np.zeros(1), None, "stop"),), {"g": 1})
    >>> stop.steer(view).stop
    True

    YAML:

    .. code-block:: yaml

        stop:    {use: control.fake_stop, with: {groups: 2}}
        rollout: {use: generate.fake, from: budget, in_flight: [stop]}
    """

    testing: ClassVar[bool] = True
    every: int

    class Config(StageConfig):
        groups: Annotated[int, Field(ge=1, description="stop once this many groups are complete")]
        every: Annotated[int, Field(ge=1, description="decode steps between steer calls")] = 1

    def __init__(self, config: Config):
        self.config = config
        self.every = config.every
        self.calls, self.total_calls = 0, 0

    def before_step(self, ctx: StepContext) -> None:
        self.calls = 0

    def steer(self, view: Any) -> Steer:
        self.calls += 1
        return Steer(stop=len(view.complete_groups()) >= self.config.groups)

    def observe(self, report: Any) -> None:
        self.total_calls += self.calls

    def state_dict(self) -> dict[str, Any]:
        return {"total_calls": self.total_calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total_calls = int(state["total_calls"])


class FakeSlowFilter:
    """TEST STAGE (a slow per-group filter): passes every group through unchanged, sleeping
    ``latency_s`` per group (a verifier's or judge's time), and records when it finished each
    group (``seen``: ``(group id, time.monotonic())``), for tests of streamed groups.

    Example:

    >>> slow = FakeSlowFilter(FakeSlowFilter.Config(latency_s=0.0))
    >>> out = slow.run(RolloutGroups([scored_group("p:0", [0, 1])]))
    >>> [g.group_id for g in out], [gid for gid, _ in slow.seen]
    (['p:0@s0'], ['p:0@s0'])

    YAML:

    .. code-block:: yaml

        slow: {use: filter.fake_slow, from: rollout, with: {latency_s: 0.05}}
    """

    testing: ClassVar[bool] = True

    class Config(StageConfig):
        latency_s: Annotated[float, Field(ge=0.0, description="seconds it sleeps per group")] = 0.0
        per_group: ClassVar[bool] = True  # a capability (gfcr.registry.PerGroup): each group alone

    def __init__(self, config: Config):
        self.config = config
        self.seen: list[tuple[str, float]] = []  # clock readings: for tests, never reported as metrics

    def run(self, groups: RolloutGroups) -> RolloutGroups:
        for group in groups:
            time.sleep(self.config.latency_s)
            self.seen.append((group.group_id, time.monotonic()))
        return groups


class FakeProvide:
    """TEST STAGE (Replay provide port): offer every allocated prompt a partial to continue.

    The partial is ``tokens`` fixed tokens (id 1) from policy version 0; ``generate.fake``
    continues it in its first rollout of the prompt.

    Example:

    >>> from gfcr.records import Allocation, AllocationEntry, Prompt
    >>> offered = FakeProvide(FakeProvide.Config()).run(Allocation(0, (AllocationEntry(Prompt("p:0", text="x"), 2),)))
    >>> [(p.kind, p.prompt_id, len(p.rollout)) for p in offered]
    [('partial', 'p:0', 2)]

    YAML:

    .. code-block:: yaml

        offer:   {use: replay.fake_provide, from: budget}
        rollout: {use: generate.fake, from: {allocation: budget, provided: offer}}
    """

    testing: ClassVar[bool] = True

    class Config(StageConfig):
        tokens: Annotated[int, Field(ge=1, description="length of each offered partial")] = 2

    def __init__(self, config: Config):
        self.config = config

    def run(self, allocation: Allocation) -> Provided:
        n = self.config.tokens
        items = []
        for e in allocation.active():
            gid = f"{e.prompt_id}@partial{allocation.step}"
            partial = Rollout(rollout_id(gid, 0), gid, e.prompt_id, [1] * n, [Segment(0, n, 0, np.zeros(n))],
                              status=RolloutStatus.ABORTED_PARTIAL, finish_reason="aborted")
            items.append(ProvidedRollout("partial", partial))
        return Provided(allocation.step, tuple(items))


class FakeIngest:
    """TEST STAGE (Replay ingest port): keep the groups a step kept; replay them the next step.

    Reads ``StepOutputs`` (the runtime's record of what the step produced so far) and
    returns the previous step's kept groups as replayed copies (origin ``replayed``).

    Example:

    >>> from gfcr.records import StepOutputs
    >>> stage = FakeIngest(FakeIngest.Config())
    >>> first = stage.run(StepOutputs(0, (scored_group("p:0", [0, 1]),)), StepContext("r", 0, 0, 0))
    >>> again = stage.run(StepOutputs(1), StepContext("r", 1, 0, 1))
    >>> len(first), [r.origin.value for r in again.rollouts()]
    (0, ['replayed', 'replayed'])

    YAML:

    .. code-block:: yaml

        past: {use: replay.fake_ingest}
    """

    testing: ClassVar[bool] = True

    class Config(StageConfig):
        max_groups: Annotated[int, Field(ge=0, description="groups kept for the next step")] = 4

    def __init__(self, config: Config):
        self.config = config
        self.buffer: list[RolloutGroup] = []

    def run(self, produced: StepOutputs, ctx: StepContext) -> RolloutGroups:
        replayed = [_replayed(g, ctx.step) for g in self.buffer]
        self.buffer = [g for g in produced.kept() if g.step == ctx.step][: self.config.max_groups]
        return RolloutGroups(replayed)


def _replayed(group: RolloutGroup, step: int) -> RolloutGroup:
    gid = f"{group.group_id}~replay{step}"
    rollouts = [replace(r, rollout_id=rollout_id(gid, i), group_id=gid, origin=Origin.REPLAYED,
                        replayed_from=r.rollout_id, segments=list(r.segments))
                for i, r in enumerate(group.rollouts)]
    return RolloutGroup(gid, group.prompt_id, step, group.target_size, rollouts, sample_weight=group.sample_weight)


class FakeMix:
    """TEST STAGE (Replay mix port): the fresh kept groups, then at most ``max_replayed`` replayed ones.

    Example:

    >>> mixed = FakeMix(FakeMix.Config(max_replayed=1)).run(
    ...     RolloutGroups([scored_group("p:0", [0, 1])]),
    ...     RolloutGroups([scored_group("p:1", [1, 0]), scored_group("p:2", [0, 1])]))
    >>> [g.prompt_id for g in mixed]
    ['p:0', 'p:1']

    YAML:

    .. code-block:: yaml

        mix:    {use: replay.fake_mix, from: {fresh: keep, replayed: past}}
        update: {use: update.fake, from: mix}
    """

    testing: ClassVar[bool] = True

    class Config(StageConfig):
        max_replayed: Annotated[int, Field(ge=0, description="replayed groups added to the batch")] = 2

    def __init__(self, config: Config):
        self.config = config

    def run(self, fresh: RolloutGroups, replayed: RolloutGroups) -> RolloutGroups:
        extra = replayed.included().groups[: self.config.max_replayed]
        return RolloutGroups(fresh.included().groups + extra)


class FakeUpdate:
    """TEST STAGE (fake update): counts the rollouts and tokens it receives; learns nothing. It
    plays the ``Trains`` role as ``update.grpo`` does: the runtime's trainer bumps the version.

    Example:

    >>> from gfcr.records import RolloutGroups
    >>> from gfcr.runtime import LocalTrainer
    >>> report = LocalTrainer().update(FakeUpdate(FakeUpdate.Config()), RolloutGroups([scored_group("p:0", [0, 1])]))
    >>> report.policy_version, report.rollouts_in_update
    (1, 2)

    YAML:

    .. code-block:: yaml

        update: {use: update.fake, from: keep}
    """

    testing: ClassVar[bool] = True

    class Config(StageConfig):
        skip_empty: bool = Field(True, description="an empty batch skips the update (no version bump)")
        latency_s: Annotated[float, Field(ge=0.0, description=(
            "seconds each update sleeps, standing in for a trainer's step time (lifecycle tests)"))] = 0.0

        def declared_correction(self) -> str | None:
            """``none``: the fake update has no loss, so stale tokens change nothing it does."""
            return "none"

    def __init__(self, config: Config):
        self.config = config

    def run(self, groups: RolloutGroups) -> UpdateReport:
        """One step without the runtime (the trainer calls the three methods below)."""
        return step_here(self, 0, groups)

    def prepare(self, groups: RolloutGroups) -> TrainBatch:
        rollouts = list(groups.rollouts())
        skip = "empty batch" if not rollouts and self.config.skip_empty else None
        return TrainBatch(rollouts, [len(r) for r in rollouts], skip_reason=skip)

    def train_shard(self, shard: list[Rollout], plan: Any, version: int, ranks: Any) -> tuple[int, int]:
        time.sleep(self.config.latency_s)  # a trainer's step time, for the lifecycle tests
        return len(shard), sum(len(r) for r in shard)

    def finish(self, batch: TrainBatch, outcomes: list[tuple[int, int]]) -> UpdateReport:
        if batch.skip_reason is not None:
            return UpdateReport(batch.version, skipped=True, skip_reason=batch.skip_reason)
        return UpdateReport(batch.version, sum(n for n, _ in outcomes), sum(t for _, t in outcomes))
