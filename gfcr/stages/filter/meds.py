"""filter.meds: MEDS, a reward penalty on incorrect rollouts that fall in a recurring error cluster.

MEDS, "The Past Is Not Past: Memory-Enhanced Dynamic Reward Shaping" (Liu et al., 2026, arXiv
2604.11297): a memoryless verifier scores each rollout alone, so a policy can keep sampling the
same mistake. MEDS keeps an online memory of the internal representations ("reasoning
fingerprints") of past incorrect rollouts, clusters it with HDBSCAN, and penalises an incorrect
rollout by the size of the error cluster it falls in:

    r~(x, y) = r(x, y) - min(alpha * log(|C_k| + 1), beta)     (y incorrect, in cluster C_k)

with ``log`` the natural logarithm; an incorrect rollout that HDBSCAN leaves as noise, and every
correct rollout, keeps its reward. Per step, for each prompt, this stage

1. fingerprints the group's incorrect rollouts with one extra forward pass of the policy
   (``gfcr.stages.common.fingerprints``: per-layer mean-pooled hidden states of the response,
   unit-normalised and concatenated);
2. clusters the prompt's memory together with the new fingerprints (``gfcr.stages.filter.
   error_memory``; HDBSCAN, ``min_cluster_size``), so ``|C_k|`` counts past and present members;
3. subtracts the penalty from each new incorrect rollout's reward and records it in
   ``reward_components["meds"]`` (``-penalty``; 0.0 on every other rollout of the group, so every
   rollout carries the component);
4. adds the new fingerprints to the memory (the newest ``memory_per_prompt`` per prompt, at most
   ``max_prompts`` prompts).

The memory is stage state, saved with each checkpoint and restored on resume. Metrics per step
(``stages.<id>``): ``errors_fingerprinted``, ``penalised``, ``penalty_mean`` (over the penalised),
``penalty_max``, ``error_clusters`` (clusters found, summed over the step's prompts),
``memory_prompts``, ``memory_entries``; the fingerprint pass's response tokens are charged to the
step's ``tokens_scored``.

Cost: one no-grad forward pass of the policy over prompt + response of each incorrect rollout,
``L * d * 4`` bytes of memory per stored fingerprint (1 KiB on tiny-arith, 69 KiB on SmolLM2-135M:
bound it with ``memory_per_prompt``, ``max_prompts`` and ``layers``), and one HDBSCAN per prompt
over at most ``memory_per_prompt`` + G points.

Deviations (the paper's text was not readable here: the rules come from its abstract and
third-party summaries, which give the penalty formula but not the values of alpha and beta):
- fingerprint: the paper uses "layer-wise logits" of the forward pass; the engine exposes no
  intermediate layers, so this stage runs its own forward pass and keeps each layer's
  mean-pooled hidden state of the response (what the logit lens projects to logits), d floats per
  layer instead of V; the pooling (mean over response tokens) is this stage's choice.
- the memory is per prompt (recurring errors on the same problem), FIFO with caps;
  ``memory_per_prompt = 32`` and ``max_prompts = 1024`` are this stage's choices. ``alpha = 0.1``,
  ``beta = 0.2`` and ``min_cluster_size = 2`` are the reference's (``penalty_coef`` 0.1, the cap
  ``C = 2`` on ``ln(|C| + 1)``, HDBSCAN's ``min_cluster_size``).
- only incorrect rollouts are penalised. The reference's estimator (target "both", its
  default) also divides a correct rollout's reward by ``1 + penalty`` when it falls in a past
  cluster of correct answers (2 of the 9 reference cases). Its cluster sizes come from a kNN
  vote (k 3, cosine) of each new rollout over the prompt's past HDBSCAN labels, over the last
  14 layers' logits; here the memory and the new fingerprints are clustered together.
- HDBSCAN runs with ``allow_single_cluster`` (identical wrong answers must cluster, not be noise)
  and only on 3 or more points (two points are always one HDBSCAN cluster).
- only incorrect rollouts of included groups are fingerprinted and remembered; a rollout reused
  from an earlier step (replayed) or that already carries a ``meds`` component is left alone, and
  an empty response has nothing to fingerprint.
- the penalty spreads the rewards of an all-wrong group: put a zero-variance filter that reads
  correctness (``filter.dynamic_sampling`` with ``metric: acc``) rather than rewards after it, as
  verl's DAPO filters on ``acc``.

Fidelity: checked against Linxi000/MEDS@2e2b040: 7/9 cases, 2 documented deviations
(``tests/fidelity/meds.json``: the penalty and advantage given the cluster sizes; the
clustering itself is not compared).

Example (four identical wrong answers of tiny-arith: one cluster of 4, so each loses
``min(0.1 * ln 5, 0.2) = 0.1609``; the correct one keeps its reward):

>>> from gfcr.engines import load_policy
>>> from gfcr.records import Prompt, PromptPool, Rollout, RolloutGroup, RolloutGroups, Segment, StepContext
>>> from gfcr.spec import PolicySpec
>>> from gfcr.stages.resources import Resources
>>> policy = load_policy(PolicySpec(model="tiny-arith"))
>>> ids = lambda text: list(policy.tokenizer.encode(text, add_special_tokens=False))
>>> def rollout(i, text, correct):
...     return Rollout(f"a:0@s0/{i}", "a:0@s0", "a:0", ids(text), [Segment(0, len(ids(text)), 0, [0.0] * len(ids(text)))],
...                    reward=float(correct), correct=correct)
>>> group = RolloutGroup("a:0@s0", "a:0", 0, 5, [rollout(i, " 41", False) for i in range(4)] + [rollout(4, " 42", True)])
>>> stage = MEDS(MEDS.Config())
>>> stage.setup(Resources(policy))
>>> stage.before_step(StepContext("r", 0, 0, 0))
>>> _ = stage.run(RolloutGroups([group]), PromptPool([Prompt("a:0", text="What is 12 + 30? Answer:")]))
>>> [round(r.reward, 4) for r in group.rollouts]
[-0.1609, -0.1609, -0.1609, -0.1609, 1.0]
>>> stage.step_metrics()["memory_entries"]
4

YAML:

.. code-block:: yaml

    reward: {use: filter.verify, from: rollout}
    meds:   {use: filter.meds, from: reward, with: {alpha: 0.1, beta: 0.5, min_cluster_size: 2, memory_per_prompt: 32}}
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Annotated, Any

import numpy as np
from pydantic import Field

from gfcr.records import PromptPool, Rollout, RolloutGroup, RolloutGroups, StepContext
from gfcr.registry import MarksCorrect, PipelineProblem, StageConfig
from gfcr.stages.common.fingerprints import check_layers, fingerprints
from gfcr.stages.filter.error_memory import ErrorMemory, clusters
from gfcr.stages.resources import Policy, Resources, prompt_tokens

COMPONENT = "meds"
COUNTS = ("errors_fingerprinted", "penalised", "error_clusters", "tokens_fingerprinted")


def meds_penalty(cluster_size: int, alpha: float, beta: float) -> float:
    """``min(alpha * ln(|C| + 1), beta)`` for a rollout in an error cluster of ``cluster_size``; 0 for noise."""
    if cluster_size < 0:
        raise ValueError(f"a cluster size is >= 0 (0: noise), got {cluster_size}")
    return 0.0 if cluster_size == 0 else min(alpha * math.log(cluster_size + 1), beta)


class MEDS:
    """Penalise incorrect rollouts in recurring error clusters: ``r - min(alpha * ln(|C| + 1), beta)``."""

    class Config(StageConfig):
        alpha: Annotated[float, Field(ge=0.0, description="scale of the penalty alpha * ln(|C| + 1)")] = 0.1
        beta: Annotated[float, Field(ge=0.0, description=(
            "the largest penalty (the cap of min(..., beta)); the reference caps ln(|C| + 1) at 2, so alpha * 2"))] = 0.2
        min_cluster_size: Annotated[int, Field(ge=2, description=(
            "HDBSCAN's min_cluster_size: the fewest errors (past and present) that make a recurring cluster"))] = 2
        memory_per_prompt: Annotated[int, Field(ge=1, description=(
            "fingerprints of incorrect rollouts kept per prompt, the newest"))] = 32
        max_prompts: Annotated[int | None, Field(ge=1, description=(
            "most prompts remembered; the least recently updated leaves first; null: no cap"))] = 1024
        layers: list[int] | None = Field(None, description=(
            "decoder layers whose states make the fingerprint (0 is the first, -1 the last); null: all"))

    @staticmethod
    def check_pipeline(config: "MEDS.Config", view: Any) -> list[PipelineProblem]:
        """Correctness must be known: a verifier upstream."""
        if view.having(MarksCorrect, upstream=True):
            return []
        return [PipelineProblem((), "nothing upstream of this stage marks rollouts correct, so there are no errors to "
                                    "remember", "put it after the verifier: `from: reward`, where reward is "
                                                "`{use: filter.verify}`")]

    def __init__(self, config: Config):
        self.config = config
        self.memory = ErrorMemory(config.memory_per_prompt, config.max_prompts)
        self._policy: Policy | None = None
        self._resources: Resources | None = None
        self._counts: dict[str, int] = dict.fromkeys(COUNTS, 0)
        self._penalties: list[float] = []

    def setup(self, resources: Resources) -> None:
        self._resources = resources
        self._policy = resources.require_policy("filter.meds")
        try:
            check_layers(self.config.layers, int(self._policy.model.config.num_hidden_layers))
        except ValueError as exc:
            from gfcr.errors import ModelError

            raise ModelError(f"filter.meds: {exc}", "fix `layers` in the stage's `with`") from None

    def before_step(self, ctx: StepContext) -> None:
        self._counts, self._penalties = dict.fromkeys(COUNTS, 0), []  # summed over the step's loop rounds

    def run(self, groups: RolloutGroups, pool: PromptPool) -> RolloutGroups:
        included = list(groups.included())
        for g in included:
            _check_scored(g)
        errors = [r for g in included for r in g.rollouts if _remembered(r)]
        vectors = self._fingerprints(errors, pool)
        by_prompt: dict[str, list[int]] = defaultdict(list)
        for i, r in enumerate(errors):
            by_prompt[r.prompt_id].append(i)
        penalties: dict[str, float] = {}
        for prompt, rows in by_prompt.items():
            penalties.update(self._penalise(prompt, [errors[i] for i in rows], vectors[rows]))
        for g in included:
            for r in g.rollouts:
                if COMPONENT not in r.reward_components and not r.reused:
                    _shape(r, penalties.get(r.rollout_id, 0.0))
        return groups

    def _fingerprints(self, errors: list[Rollout], pool: PromptPool) -> np.ndarray:  # [len(errors), D]
        if not errors:
            return np.zeros((0, 0), dtype=np.float32)
        policy = self._require_policy()
        rows = [(r.context_token_ids or prompt_tokens(policy, pool.get(r.prompt_id)), r.response_token_ids)
                for r in errors]
        tokens = sum(len(p) + len(r) for p, r in rows)
        if self._resources is not None:
            self._resources.charge_scoring(tokens)
        self._counts["errors_fingerprinted"] += len(errors)
        self._counts["tokens_fingerprinted"] += tokens
        tok = policy.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return fingerprints(policy.model, rows, pad, self.config.layers)

    def _penalise(self, prompt: str, errors: list[Rollout], vectors: np.ndarray) -> dict[str, float]:
        """Each new error's penalty, by rollout id; the new fingerprints join the memory after."""
        past = self.memory.of(prompt, vectors.shape[1])
        labels, sizes = clusters(np.concatenate([past, vectors]), self.config.min_cluster_size)
        self._counts["error_clusters"] += len({x for x in labels if x >= 0})
        out = {}
        for r, size in zip(errors, sizes[len(past):]):
            out[r.rollout_id] = meds_penalty(size, self.config.alpha, self.config.beta)
            if size:
                self._counts["penalised"] += 1
                self._penalties.append(out[r.rollout_id])
        self.memory.add(prompt, vectors)
        return out

    def _require_policy(self) -> Policy:
        if self._policy is None:
            raise RuntimeError("filter.meds fingerprints rollouts with the policy: call setup(resources) first")
        return self._policy

    def step_metrics(self) -> dict[str, float]:
        p = self._penalties
        return {**self._counts, "penalty_mean": sum(p) / len(p) if p else 0.0, "penalty_max": max(p, default=0.0),
                "memory_prompts": len(self.memory.rows), "memory_entries": self.memory.entries}

    # --- checkpoint ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.memory.load_state_dict(state["memory"])


def _remembered(r: Rollout) -> bool:
    """An error this stage fingerprints: incorrect, fresh this step, not shaped yet, not empty."""
    return r.correct is False and not r.reused and COMPONENT not in r.reward_components and len(r) > 0


def _shape(r: Rollout, penalty: float) -> None:
    r.reward_components = {**r.reward_components, COMPONENT: -penalty}
    r.reward -= penalty


def _check_scored(group: RolloutGroup) -> None:
    unscored = [r.rollout_id for r in group.rollouts if r.reward is None or r.correct is None]
    if unscored:
        raise ValueError(f"group {group.group_id}: rollouts {', '.join(unscored)} have no reward or verdict; "
                         "filter.meds penalises scored incorrect rollouts: put it after the stage that scores "
                         "them (`from: reward`, where reward is filter.verify)")
