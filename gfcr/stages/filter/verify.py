"""filter.verify: score every unscored rollout against its prompt's ground truth.

For each rollout whose ``reward`` is None, the prompt's verifier (``VerifierSpec`` from the
pool, or the ``verifier`` named in the config) reads ``rollout.text`` and the stage writes

- ``reward = (1 - format_weight) * correct + format_weight * formatted``, in [0, 1];
- ``correct``, ``reward_components = {"correct": 0|1, "format": 0|1}`` and
  ``reward_reason`` (``answer 59 == 59``, ``no answer found``).

Rollouts that already carry a reward (replayed, cached) are left alone. A verifier that
raises, or runs longer than ``timeout_s``, gives reward 0 and says so in the reason
(``verifier error: ValueError: ...``, ``verifier timeout after 5s (worker killed)``); it never stops the
run. Nothing is dropped: groups pass through, scored in place.

Timeouts and memory: each call runs in a worker process of a ``VerifierPool``
(``gfcr.stages.verifiers.pool``), which is killed with its process group when the call runs
past ``timeout_s`` of wall-clock time, and whose address space is capped at ``memory_mb``; the
worker is replaced and the run goes on. So a response that sends sympy into a computation
holding the GIL, or a regular expression into a long search, costs at most ``timeout_s`` and
leaves nothing running (a thread could only be abandoned, still burning a CPU). ``workers``
processes (default: 2, or 1 on a one-CPU machine) score a step's rollouts in parallel; they
start on first use (about 0.3 s each) and end with the run. A verifier function may carry a
``prepare()`` attribute (the ``math`` verifier imports math-verify in it), called once in each
worker, untimed, before its first use. The scoring itself is ``gfcr.stages.verifiers.scoring``
(``score_text``, ``score_rollout``), for callers with no stage in front of them, such as the
runtime's evaluation on a held-out set; there ``timeout_s=None`` calls the verifier in this
thread, unguarded.

Fan-out: the stage scores through ``Lent.map`` (set in ``setup``), which runs a pure
function over ``(text, VerifierSpec)`` items: in this process by default, in batches of Ray
tasks under the Ray executor (docs/ray.md). The scores are then written onto the rollouts
here, so the result is the same wherever the map ran; the worker pool runs wherever the
verifier does (one per Ray worker process). In-process, the stage hands the whole step to the
pool at once, so its ``workers`` score in parallel.

The format term follows DeepSeek-R1's rule-based format reward (Guo et al., 2025, arXiv
2501.12948), added here as a weight on one reward in [0, 1] rather than a separate sum.

Deviations: R1 adds the accuracy and format rewards (range [0, 2]); here they are mixed by
``format_weight`` so the reward stays in [0, 1] and ``format_weight: 0`` (the default) is
the plain correctness reward most GRPO recipes use. A prompt's verifier ``options`` are
kept when ``verifier`` overrides the name only if the names agree (options of one verifier
mean nothing to another).

Fidelity: gfcr's own: rule-based reward from the prompt's verifier, the correctness reward of
R1-style GRPO recipes.

Example:

>>> from gfcr.records import Prompt, PromptPool, RolloutGroups, VerifierSpec
>>> from gfcr.stages.testing import scored_group
>>> pool = PromptPool([Prompt("p:0", text="What is 12 + 47? Answer:", verifier=VerifierSpec("arithmetic", "59"))])
>>> group = scored_group("p:0", [0, 0])
>>> for rollout, text in zip(group.rollouts, [" 59", "Answer: 58"]):
...     rollout.reward, rollout.text = None, text
>>> scored = Verify(Verify.Config()).run(RolloutGroups([group]), pool)
>>> [(r.reward, r.reward_reason) for r in scored.rollouts()]
[(1.0, 'answer 59 == 59'), (0.0, 'answer 58 != 59')]

YAML:

.. code-block:: yaml

    reward: {use: filter.verify, from: rollout, with: {verifier: arithmetic, format_weight: 0.1}}
"""

from __future__ import annotations

import functools
from typing import Annotated, ClassVar

from pydantic import Field, field_validator

from gfcr.records import PromptPool, RolloutGroups, VerifierSpec
from gfcr.registry import Registry, StageConfig
from gfcr.spec.problems import fixable
from gfcr.stages.resources import Map, Lent, in_process_map
from gfcr.stages.verifiers import VERIFIERS, Verifier, check_verifier_name
from gfcr.stages.verifiers.scoring import DEFAULT_MEMORY_MB, response_text, score_item, score_texts, write_score

MIN_MEMORY_MB = 256  # a worker's Python, pydantic and math-verify need about 150 MB of address space

ALIAS = "filter.verify"


class Verify:
    """Score unscored rollouts with their prompt's verifier; reward in [0, 1]."""

    class Config(StageConfig):
        marks_correct: ClassVar[bool] = True  # a capability (gfcr.registry.MarksCorrect)
        per_group: ClassVar[bool] = True  # a capability (gfcr.registry.PerGroup): scores each rollout alone
        verifier: str | None = Field(None, description="verifier for every prompt; default: each prompt's own")
        format_weight: Annotated[float, Field(ge=0.0, le=1.0, description="weight of the format term")] = 0.0
        timeout_s: Annotated[float, Field(gt=0.0, le=3600.0, description=(
            "wall-clock seconds per verifier call; past it the worker process is killed and the "
            "rollout scores 0"))] = 5.0
        memory_mb: Annotated[int, Field(le=1 << 20, description=(
            "address-space limit of each verifier worker process, in MiB"))] = DEFAULT_MEMORY_MB
        workers: Annotated[int, Field(ge=1, le=256, description=(
            "verifier worker processes; default: 2, or 1 on a one-CPU machine"))] | None = None

        @field_validator("verifier")
        @classmethod
        def _known(cls, name: str | None) -> str | None:
            return None if name is None else check_verifier_name(name)

        @field_validator("memory_mb")
        @classmethod
        def _room_to_start(cls, memory_mb: int) -> int:
            if memory_mb < MIN_MEMORY_MB:
                raise fixable(f"`memory_mb` is {memory_mb} MiB, and a verifier worker process needs at least "
                              f"{MIN_MEMORY_MB} MiB of address space to start (Python, pydantic, math-verify)",
                              f"write `memory_mb: {DEFAULT_MEMORY_MB}` (the default) or more")
            return memory_mb

    def __init__(self, config: Config, verifiers: Registry[Verifier] = VERIFIERS):
        self.config = config
        self.verifiers = verifiers
        self.map: Map = in_process_map

    def setup(self, lent: Lent) -> None:
        self.map = lent.map  # in-process, or Ray tasks under the Ray executor

    def spec_for(self, prompt_id: str, pool: PromptPool) -> VerifierSpec:
        if prompt_id not in pool:
            raise ValueError(f"prompt {prompt_id} is not in the pool {pool.name!r}; {ALIAS} scores prompts of "
                             "the run's data pool (score held-out prompts with `score_rollout`)")
        spec = pool.get(prompt_id).verifier
        if spec is None:
            raise ValueError(f"prompt {prompt_id} has no verifier spec (no ground truth); "
                             "use a data source that sets `Prompt.verifier`")
        name = self.config.verifier
        if name is None or name == spec.name:
            return spec
        return VerifierSpec(name, spec.ground_truth)

    def run(self, groups: RolloutGroups, pool: PromptPool) -> RolloutGroups:
        cfg = self.config
        todo = [r for r in groups.rollouts() if r.reward is None]
        items = [(response_text(r), self.spec_for(r.prompt_id, pool)) for r in todo]
        if self.map is in_process_map:  # the whole step at once, so the pool's workers run in parallel
            results = score_texts(items, format_weight=cfg.format_weight, timeout_s=cfg.timeout_s,
                                  memory_mb=cfg.memory_mb, workers=cfg.workers, verifiers=self.verifiers)
        else:
            score = functools.partial(score_item, format_weight=cfg.format_weight, timeout_s=cfg.timeout_s,
                                      memory_mb=cfg.memory_mb, workers=cfg.workers, verifiers=self.verifiers)
            results = self.map(score, items)
        for rollout, (reward, verdict) in zip(todo, results, strict=True):
            write_score(rollout, reward, verdict)
        return groups
