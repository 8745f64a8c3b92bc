"""The turn loop of ``generate.multi_turn``: episodes, one per trajectory, advanced together.

Each turn, every live episode's next model turn is one request of one engine call (continuing
its ids), then each episode's environment answers it. An episode's tokens and segments are
spliced exactly as a resumed rollout's are (``gfcr.stages.engine.splice``); an environment
turn is one segment of origin ``environment`` (zeros for log-probs). See ``multi_turn`` for
the rules; this module holds the mechanics.
"""

from __future__ import annotations

import inspect
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gfcr.errors import GfcrError, ModelError
from gfcr.records import (
    Allocation, AllocationEntry, Rollout, RolloutGroup, RolloutGroups, RolloutStatus, Segment, SegmentOrigin, Turn,
    TurnRole, group_id, rollout_id,
)
from gfcr.spec.problems import fixable
from gfcr.stages.common.seeds import step_seed
from gfcr.stages.engine import Completion, ResponsePrefix, SamplingParams, row_seed, splice
from gfcr.stages.environments import (
    TOOL_PARSERS, Action, ChecksOptions, ClosesEnvironment, EnvironmentFailed, Observation, environment_factory,
)
from gfcr.stages.generate.turn_tokens import TurnBoundary
from gfcr.stages.resources import GenerationRequest, prompt_tokens


class EnvironmentRef(BaseModel):
    """``{use: <environment name or package.module:Class>, with: {<its keyword arguments>}}``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, serialize_by_alias=True,
                              validate_by_name=True, validate_by_alias=True)

    use: str
    with_: dict[str, Any] = Field(default_factory=dict, alias="with", description="the environment's arguments")

    @model_validator(mode="before")
    @classmethod
    def _not_a_bare_name(cls, data: Any) -> Any:
        if isinstance(data, str):
            raise fixable("the environment is a mapping", f"write `environment: {{use: {data}}}`")
        return data

    @field_validator("use")
    @classmethod
    def _known(cls, name: str) -> str:
        try:
            environment_factory(name)
        except GfcrError as exc:
            raise fixable(exc.message, exc.fix or "name a registered environment") from None
        return name

    @model_validator(mode="after")
    def _arguments_fit(self) -> "EnvironmentRef":
        factory = environment_factory(self.use)
        try:
            signature = inspect.signature(factory)
        except ValueError:  # no signature to read (a builtin): the arguments are checked when it is built
            return self
        try:
            signature.bind(**self.with_)
        except TypeError as exc:
            names = ", ".join(f"`{p}`" for p in signature.parameters if p not in ("args", "kwargs")) or "none"
            raise fixable(f"environment `{self.use}` does not take these arguments: {exc}",
                          f"give `with` only arguments of {getattr(factory, '__name__', self.use)}: {names}") from None
        if isinstance(factory, type) and isinstance(factory, ChecksOptions):
            try:
                factory.check_options(**self.with_)
            except ValueError as exc:
                raise fixable(str(exc), "fix the environment's `with` arguments") from None
        return self


@dataclass(eq=False)
class Episode:
    """One trajectory in progress: its ids, segments and turns so far, and its environment."""

    entry: AllocationEntry
    gid: str
    rid: str
    prompt_ids: tuple[int, ...]
    env: Any = None
    tokens: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    status: RolloutStatus = RolloutStatus.RUNNING
    stop_reason: str = ""
    error: str | None = None
    last: Observation | None = None
    replica: str | None = None
    ray_node: str | None = None

    @property
    def live(self) -> bool:
        return self.status == RolloutStatus.RUNNING

    @property
    def model_turns(self) -> int:
        return sum(t.role == TurnRole.MODEL for t in self.turns)

    @property
    def tool_calls(self) -> int:
        return sum(t.tool_call is not None for t in self.turns)

    @property
    def environment_tokens(self) -> int:
        return sum(len(t) for t in self.turns if t.role == TurnRole.ENVIRONMENT)

    def end(self, status: RolloutStatus, why: str = "") -> None:
        self.status, self.stop_reason = status, why

    def request(self, turn: int, params: SamplingParams, budget: int) -> GenerationRequest:
        """This episode's next model turn: its ids so far continued by at most ``budget`` tokens."""
        prefix = ResponsePrefix(tuple(self.tokens), tuple(self.segments)) if self.tokens else None
        return GenerationRequest(f"{self.rid}~t{turn}", self.prompt_ids, 1,
                                 replace(params, max_new_tokens=len(self.tokens) + budget), prefix, self.gid)

    def add_model_turn(self, request: GenerationRequest, c: Completion, version: int, text: str) -> Turn:
        start = len(self.tokens)
        self.tokens, self.segments = splice(request.prefix, c, version)
        self.replica, self.ray_node = c.replica, c.ray_node
        turn = Turn(TurnRole.MODEL, start, len(self.tokens), text)
        self.turns.append(turn)
        return turn

    def add_environment_turn(self, ids: list[int], text: str, version: int, observation: str) -> None:
        """``ids`` tokenised from ``text`` (the observation, within the chat template's boundary when
        the policy has one: then the observation's own text is kept in the turn's ``info``)."""
        start = len(self.tokens)
        self.tokens += ids
        self.segments.append(Segment(start, len(self.tokens), version, np.zeros(len(ids), np.float32),
                                     SegmentOrigin.ENVIRONMENT))
        info = {} if text == observation else {"observation": observation}
        self.turns.append(Turn(TurnRole.ENVIRONMENT, start, len(self.tokens), text, info=info))


def setup_turns(stage: Any, lent: Any, alias: str) -> None:
    """Lend ``stage`` (``generate.multi_turn`` or a stage built on its turn loop) its policy and
    engine, and check that the policy's chat template renders each message as written."""
    stage.policy = lent.require_policy(alias)
    stage.engine = lent.require_engine(alias)
    try:
        TurnBoundary(stage.policy, stage.config.observation_role)
    except ValueError as exc:
        raise ModelError(f"{alias}: policy `{stage.policy.name}`: {exc}",
                         "use a policy whose chat template renders each message as written") from None


def call_settings(stage: Any, alias: str, allocation: Allocation,
                  ctx: StepContext | None) -> tuple[SamplingParams, float | None, int]:
    """A turn-loop stage's call: its sampling parameters (seeded by step and round), the deadline of
    ``max_wall_s`` (None: none) and the round; refused when the stage was not set up."""
    if stage.engine is None or stage.policy is None:
        raise RuntimeError(f"{alias} was not set up with a policy and engine")
    cfg = stage.config
    ctx = ctx or StepContext("", allocation.step, 0, 0)
    seed = ctx.seed if cfg.seed is None else cfg.seed
    params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_turn_tokens, tuple(cfg.stop),
                            step_seed(seed, allocation.step, ctx.round or 0))
    deadline = None if cfg.max_wall_s is None else time.monotonic() + cfg.max_wall_s
    return params, deadline, ctx.round or 0


def run_episodes(stage: Any, allocation: Allocation, round_: int, params: SamplingParams,
                 deadline: float | None) -> tuple[RolloutGroups, list[Episode]]:
    """Every allocated trajectory, from reset to its end; their groups (see ``multi_turn``).
    ``stage`` is the ``generate.multi_turn`` stage: its ``config``, ``policy``, ``engine`` and ``make``."""
    episodes = start_episodes(stage, allocation, round_, params.seed)
    advance(stage, episodes, params, deadline)
    finish(stage, episodes)
    return groups_of(allocation, episodes, decoder(stage.policy)), episodes


def start_episodes(stage: Any, allocation: Allocation, round_: int, seed: int) -> list[Episode]:
    """``n`` fresh episodes per active allocation entry, each environment reset on its prompt."""
    episodes: list[Episode] = []
    for entry in allocation.active():
        gid = group_id(entry.prompt_id, allocation.step, round_)
        prompt_ids = tuple(prompt_tokens(stage.policy, entry.prompt))
        for i in range(entry.n_rollouts):
            ep = Episode(entry, gid, rollout_id(gid, i), prompt_ids)
            episodes.append(ep)
            guarded(stage, ep, "reset", lambda ep=ep: reset_episode(stage, ep, seed))
    return episodes


def advance(stage: Any, episodes: list[Episode], params: SamplingParams, deadline: float | None) -> None:
    """Run the live episodes turn by turn until each ends or has ``max_turns`` model turns (an
    episode continued from a prefix starts at its own turn count)."""
    cfg, policy, engine = stage.config, stage.policy, stage.engine
    assert policy is not None and engine is not None
    parser = TOOL_PARSERS[cfg.tool_parser] if cfg.tool_parser else None
    decode = decoder(policy)
    boundary = TurnBoundary(policy, cfg.observation_role)
    positions = context_positions(policy) if cfg.max_context == "model" else cfg.max_context
    for _ in range(cfg.max_turns):
        live = [e for e in episodes if e.live and e.model_turns < cfg.max_turns]
        if deadline is not None and time.monotonic() > deadline:
            for e in live:
                e.end(RolloutStatus.TRUNCATED,
                      f"wall budget of {cfg.max_wall_s}s spent before model turn {e.model_turns + 1}")
            break
        for e in live:
            if cfg.max_tokens - len(e.tokens) < 1:
                e.end(RolloutStatus.TRUNCATED,
                      f"token budget of {cfg.max_tokens} spent before model turn {e.model_turns + 1}")
            elif _room(e, positions) < 1:
                e.end(RolloutStatus.TRUNCATED, f"context limit of {positions} positions reached before model turn "
                                               f"{e.model_turns + 1}")
        live = [e for e in live if e.live]
        if not live:
            break
        requests = [e.request(e.model_turns, params,
                              min(cfg.max_turn_tokens, cfg.max_tokens - len(e.tokens), _room(e, positions)))
                    for e in live]
        results = engine.generate(requests, None, cfg.max_in_flight)
        version = engine.policy_version
        acts: list[tuple[Episode, Turn, Action]] = []
        for e, request, (completion,) in zip(live, requests, results):
            text = decode(completion.token_ids)
            turn = e.add_model_turn(request, completion, version, text)
            call = parser(text) if parser is not None else None
            turn.tool_call = call.state() if call is not None else None
            acts.append((e, turn, Action(text, call)))
        observations = _each(lambda a: guarded(stage, a[0], f"step (model turn {a[0].model_turns})",
                                                lambda: a[0].env.step(a[2])), acts, cfg.env_workers)
        for (e, turn, _), obs in zip(acts, observations):
            if obs is not None:
                _observe(e, turn, obs, boundary, version, cfg.max_tokens, e.model_turns, positions)


def context_positions(policy: Any) -> int | None:
    """The most positions the policy's model takes (prompt and response together): its config's
    ``max_position_embeddings``; None where the config does not say."""
    value = policy.model.config.to_dict().get("max_position_embeddings")
    return int(value) if value else None


def _room(e: Episode, positions: int | None) -> int:
    """New tokens the episode's context can still take (no limit: a large number)."""
    return 1 << 30 if positions is None else positions - len(e.prompt_ids) - len(e.tokens)


def finish(stage: Any, episodes: list[Episode]) -> None:
    """End the episodes still live at the turn budget and close their environments."""
    for e in episodes:
        if e.live:
            e.end(RolloutStatus.TRUNCATED, f"turn budget: {stage.config.max_turns} model turns")
        if isinstance(e.env, ClosesEnvironment):
            guarded(stage, e, "close", e.env.close, ended=True)


def _each(call: Callable[[Any], Any], items: list[Any], workers: int) -> list[Any]:
    """``call`` on every item, in order; on up to ``workers`` threads at once (environments whose steps
    wait on a process, such as the code environment's tests, overlap). The first exception, in the
    items' order, is raised once every call has ended."""
    if workers <= 1 or len(items) <= 1:
        return [call(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="gfcr-env") as pool:
        futures = [pool.submit(call, item) for item in items]
        wait(futures)
    return [f.result() for f in futures]


def reset_episode(stage: Any, ep: Episode, seed: int) -> None:
    ep.env = stage.make()
    ep.env.reset(ep.entry.prompt, row_seed(seed, ep.rid, 0))


def _observe(e: Episode, turn: Turn, obs: Observation, boundary: TurnBoundary, version: int, max_tokens: int,
             k: int, positions: int | None = None) -> None:
    """Write the environment's answer to model turn ``k``: its reward, the end, or its turn."""
    e.last = obs
    turn.info = dict(obs.metadata)
    if obs.reward is not None:
        turn.reward = float(obs.reward)
        e.rewards.append(float(obs.reward))
    if obs.done:
        e.end(RolloutStatus.COMPLETED)
        return
    ids, text = boundary.ids(obs.text, e.tokens[turn.start:turn.end]) if obs.text or boundary.template else ([], "")
    if len(e.tokens) + len(ids) >= max_tokens:  # no room for the environment's turn and one more model token
        e.end(RolloutStatus.TRUNCATED, f"token budget of {max_tokens} spent after model turn {k}")
        return
    if _room(e, positions) - len(ids) < 1:  # the environment's turn and one more model token past the model's context
        e.end(RolloutStatus.TRUNCATED, f"context limit of {positions} positions reached after model turn {k}")
        return
    if ids:
        e.add_environment_turn(ids, text, version, obs.text)


def guarded(stage: Any, e: Episode, where: str, call: Callable[[], Any], ended: bool = False) -> Any:
    """``call()``, or, when the environment raises, the episode ends by ``on_env_error``."""
    if not (e.live or ended):
        return None
    try:
        return call()
    except Exception as exc:  # an environment is user code: any exception ends its trajectory only
        cfg = stage.config
        message = (f"environment `{cfg.environment.use}` raised in {where} of trajectory {e.rid}: "
                   f"{type(exc).__name__}: {exc}")
        if cfg.on_env_error == "fail":
            raise EnvironmentFailed(message, "fix the environment, or set `on_env_error: drop` on the stage to "
                                             "drop the trajectories it fails on and go on") from exc
        e.error = message
        e.end(RolloutStatus.FAILED, message)
        return None


def groups_of(allocation: Allocation, episodes: list[Episode], decode: Callable[[Any], str]) -> RolloutGroups:
    groups: dict[str, RolloutGroup] = {}
    for e in episodes:
        g = groups.get(e.gid)
        if g is None:
            g = groups[e.gid] = RolloutGroup(e.gid, e.entry.prompt_id, allocation.step, e.entry.n_rollouts,
                                             sample_weight=e.entry.sample_weight)
        g.rollouts.append(rollout_of(e, allocation.step, decode))
        if e.error is not None:
            g.remove(e.rid, e.error)
    return RolloutGroups(list(groups.values()))


def rollout_of(e: Episode, step: int, decode: Callable[[Any], str]) -> Rollout:
    meta = e.last.metadata if e.last is not None else {}
    done = e.status == RolloutStatus.COMPLETED
    # an episode the environment ended scores what it gave (None when it gave nothing: filter.verify's
    # to score); one a budget ended scores what it was given so far, 0 if nothing
    reward = sum(e.rewards) if e.rewards else (None if done or e.error is not None else 0.0)
    correct = meta.get("correct") if done else (False if e.error is None else None)
    reason = e.stop_reason if not done else str(meta.get("reason", ""))
    components = {"environment": float(sum(e.rewards)), "turns": float(e.model_turns),
                  "tool_calls": float(e.tool_calls)}
    return Rollout(e.rid, e.gid, e.entry.prompt_id, list(e.tokens), list(e.segments), status=e.status,
                   finish_reason="stop" if done else ("" if e.error else "length"), stop_reason=e.stop_reason,
                   created_step=step, text=decode(e.tokens), replica=e.replica, ray_node=e.ray_node,
                   reward=reward, correct=None if correct is None else bool(correct), reward_reason=reason,
                   reward_components=components, turns=list(e.turns))


def decoder(policy: Any) -> Callable[[Any], str]:
    return lambda ids: policy.tokenizer.decode(list(ids), skip_special_tokens=True)
