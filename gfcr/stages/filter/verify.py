"""filter.verify: score every unscored rollout against its prompt's ground truth.

For each rollout whose ``reward`` is None, the prompt's verifier (``VerifierSpec`` from the
pool, or the ``verifier`` named in the config) reads ``rollout.text`` and the stage writes

- ``reward = (1 - format_weight) * correct + format_weight * formatted``, in [0, 1];
- ``correct``, ``reward_components = {"correct": 0|1, "format": 0|1}`` and
  ``reward_reason`` (``answer 59 == 59``, ``no answer found``).

Rollouts that already carry a reward (replayed, cached) are left alone. A verifier that
raises, or runs longer than ``timeout_s``, gives reward 0 and says so in the reason
(``verifier error: ValueError: ...``, ``verifier timeout after 5.0s``); it never stops the
run. Nothing is dropped: groups pass through, scored in place.

Timeouts: each call runs in a daemon worker thread that the stage waits on for
``timeout_s``. CPython cannot kill a thread, so a call that overruns is abandoned, not
stopped: it keeps its thread (and possibly a CPU, holding the GIL part of the time) until
it returns on its own, and its late result is ignored; and a call stuck inside C code that
holds the GIL (a catastrophic regular expression) delays even the wait. Signals would interrupt the call
for real, but they work only in the main thread, where the Prefect runner's tasks do not
run; processes would too, at a cost of milliseconds per rollout. Verifiers are expected to
be fast and pure; the timeout is a guard against the rare pathological input. A verifier
function may carry a ``prepare()`` attribute (the ``math`` verifier imports math-verify in
it), called once, untimed, before its first use.
``score_text`` and ``score_rollout`` are the same scoring for callers with no pool, such
as the runtime's evaluation on a held-out set.

Fan-out: the stage scores through ``Resources.map`` (set in ``setup``), which runs a pure
function over ``(text, VerifierSpec)`` items: in this process by default, in batches of Ray
tasks under the Ray executor (docs/ray.md). The scores are then written onto the rollouts
here, so the result is the same wherever the map ran; the timeout guard runs wherever the
verifier does.

The format term follows DeepSeek-R1's rule-based format reward (Guo et al., 2025, arXiv
2501.12948), added here as a weight on one reward in [0, 1] rather than a separate sum.

Deviations: R1 adds the accuracy and format rewards (range [0, 2]); here they are mixed by
``format_weight`` so the reward stays in [0, 1] and ``format_weight: 0`` (the default) is
the plain correctness reward most GRPO recipes use. A prompt's verifier ``options`` are
kept when ``verifier`` overrides the name only if the names agree (options of one verifier
mean nothing to another).

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
import threading
from typing import Annotated

from pydantic import Field, field_validator

from gfcr.records import PromptPool, Rollout, RolloutGroups, VerifierSpec
from gfcr.registry import Registry, StageConfig
from gfcr.stages.resources import Map, Resources, in_process_map
from gfcr.stages.verifiers import VERIFIERS, Score, Verifier, check_verifier_name

ALIAS = "filter.verify"


class _Overran(Exception):
    """The verifier did not return within the timeout (distinct from a TimeoutError it raises)."""


def _call_with_timeout(verifier: Verifier, text: str, spec: VerifierSpec, timeout_s: float) -> Score:
    """Run ``verifier`` in a daemon thread; _Overran if it has not returned in time."""
    outcome: list = []

    def target() -> None:
        try:
            outcome.append(verifier(text, spec.ground_truth, dict(spec.options)))
        except BaseException as exc:  # handed to the caller's thread, which reports it
            outcome.append(exc)

    worker = threading.Thread(target=target, name=f"gfcr-verifier-{spec.name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        raise _Overran(f"verifier timeout after {timeout_s}s")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


@functools.cache
def _prepare(verifier: Verifier) -> None:
    """Run the verifier's optional ``prepare()`` once, untimed: a first call that imports
    heavy packages (math-verify, sympy: about a second) must not count against ``timeout_s``."""
    prepare = getattr(verifier, "prepare", None)
    if callable(prepare):
        prepare()


def score_text(text: str, spec: VerifierSpec, *, format_weight: float = 0.0, timeout_s: float | None = 5.0,
               verifiers: Registry[Verifier] = VERIFIERS) -> tuple[float, Score]:
    """(reward, score) of ``text`` against ``spec``. A verifier error or timeout scores 0
    with the reason recorded; an unknown verifier name is a RegistryError (a configuration
    mistake, not a bad response). ``timeout_s=None`` calls the verifier in this thread, unguarded."""
    verifier = verifiers.get(spec.name)
    _prepare(verifier)
    try:
        if timeout_s is None:
            score = verifier(text, spec.ground_truth, dict(spec.options))
        else:
            score = _call_with_timeout(verifier, text, spec, timeout_s)
    except _Overran as exc:
        return 0.0, Score(False, False, None, str(exc))
    except Exception as exc:
        return 0.0, Score(False, False, None, f"verifier error: {type(exc).__name__}: {exc}")
    reward = (1.0 - format_weight) * float(score.correct) + format_weight * float(score.formatted)
    return reward, score


def score_item(item: tuple[str, VerifierSpec], *, format_weight: float = 0.0, timeout_s: float | None = 5.0,
               verifiers: Registry[Verifier] = VERIFIERS) -> tuple[float, Score]:
    """``score_text`` of one ``(text, spec)`` pair: the pure function ``Resources.map`` runs."""
    text, spec = item
    return score_text(text, spec, format_weight=format_weight, timeout_s=timeout_s, verifiers=verifiers)


def score_rollout(rollout: Rollout, spec: VerifierSpec, *, format_weight: float = 0.0,
                  timeout_s: float | None = 5.0, verifiers: Registry[Verifier] = VERIFIERS) -> None:
    """Score ``rollout.text`` against ``spec`` and write reward, correct, components and reason."""
    reward, score = score_text(_text(rollout), spec, format_weight=format_weight, timeout_s=timeout_s,
                               verifiers=verifiers)
    write_score(rollout, reward, score)


def _text(rollout: Rollout) -> str:
    if rollout.text is None:
        raise ValueError(f"rollout {rollout.rollout_id} has no text to verify; "
                         "the generate stage must decode responses into `Rollout.text`")
    return rollout.text


def write_score(rollout: Rollout, reward: float, score: Score) -> None:
    """Write a verifier's verdict onto ``rollout``: reward, correct, components and reason."""
    rollout.reward, rollout.correct = reward, score.correct
    rollout.reward_components = {"correct": float(score.correct), "format": float(score.formatted)}
    rollout.reward_reason = score.reason


class Verify:
    """Score unscored rollouts with their prompt's verifier; reward in [0, 1]."""

    class Config(StageConfig):
        verifier: str | None = Field(None, description="verifier for every prompt; default: each prompt's own")
        format_weight: Annotated[float, Field(ge=0.0, le=1.0, description="weight of the format term")] = 0.0
        timeout_s: Annotated[float, Field(gt=0.0, description="seconds per verifier call")] = 5.0

        @field_validator("verifier")
        @classmethod
        def _known(cls, name: str | None) -> str | None:
            return None if name is None else check_verifier_name(name)

    def __init__(self, config: Config, verifiers: Registry[Verifier] = VERIFIERS):
        self.config = config
        self.verifiers = verifiers
        self.map: Map = in_process_map

    def setup(self, resources: Resources) -> None:
        self.map = resources.map  # in-process, or Ray tasks under the Ray executor

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
        items = [(_text(r), self.spec_for(r.prompt_id, pool)) for r in todo]
        score = functools.partial(score_item, format_weight=cfg.format_weight, timeout_s=cfg.timeout_s,
                                  verifiers=self.verifiers)
        for rollout, (reward, verdict) in zip(todo, self.map(score, items), strict=True):
            write_score(rollout, reward, verdict)
        return groups
