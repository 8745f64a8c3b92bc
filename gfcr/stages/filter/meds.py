"""filter.meds: MEDS, a reward penalty on rollouts that repeat a mistake the policy made before
on the same prompt, found by clustering their reasoning fingerprints.

MEDS, "The Past Is Not Past: Memory-Enhanced Dynamic Reward Shaping" (Liu et al., 2026, arXiv
2604.11297), code Linxi000/MEDS @ 2e2b040: ``recipe/MEDS/layer_logits_utils.py``
(``cluster_and_log``), ``recipe/MEDS/extract_layer_logits.py`` and the estimator registered as
"MEDS" in ``verl/trainer/ppo/core_algos.py``, run by ``recipe/MEDS/run_meds.sh``. Per step, this
stage

1. fingerprints each fresh rollout of the shaped kind (``target``: ``wrong``, the script's; the
   code's default ``both`` adds the right ones, ``right`` only those) with one extra no-grad
   forward pass of the policy (``gfcr.stages.common.fingerprints.answer_logits``): at the token that
   predicts the answer (the ``{`` of the last ``\\boxed{``), the logit each of the last 14 decoder
   layers gives the answer's first token through the output head. A response without
   ``\\boxed{`` is not fingerprinted (``no_answer``) and keeps its reward, as in the reference;
   ``anchor: first_token`` reads the answer at the response's first token that is not whitespace
   instead (tasks whose whole response is the answer, like tiny-arith);
2. sizes each fingerprint against its (prompt, correctness) memory of past fingerprints
   (``gfcr.stages.filter.error_memory``): the majority HDBSCAN label of its ``k = 3`` nearest past
   fingerprints (cosine), the size ``|C|`` the number of past members with that label (noise
   counted like a cluster, as in the reference; 0 at first sight);
3. shapes the reward with ``p = min(alpha ln(|C| + 1), beta)``: a wrong rollout ``r - p``, a right
   one ``r / (1 + p)``, and records the change in ``reward_components["meds"]`` (0.0 on every other
   rollout of the group, so every rollout carries the component);
4. adds the new fingerprints to the memory and relabels it with HDBSCAN (``min_cluster_size = 2``,
   ``min_samples = 1``, Euclidean on L2-normalised fingerprints).

The memory is stage state, saved with each checkpoint and restored on resume. Metrics per step
(``stages.<id>``): ``fingerprinted``, ``no_answer``, ``penalised``, ``penalty_mean`` (over the
penalised), ``penalty_max``, ``error_clusters`` (clusters in the memories the step touched),
``memory_prompts``, ``memory_entries``, ``tokens_fingerprinted`` (also charged to the step's
``tokens_scored``).

Cost: one no-grad forward pass of the policy over prompt + response of each fingerprinted rollout
(the reference reads the same logits from its old-log-prob pass; gfcr's engine exposes no hidden
states, so the pass is extra), the output head on one position per layer, 14 floats per stored
fingerprint, and per prompt one kNN and one HDBSCAN over its memory.

Defaults: the reference's (``penalty_coef`` 0.1, ``C = 2`` so ``beta = 0.2``, ``k = 3``,
``min_cluster_size = 2``, ``use_last_n_layers = 14``, an unbounded memory) and ``run_meds.sh``'s
``cluster_penalty_target = wrong``.

Deviations:
- HDBSCAN is scikit-learn's (``sklearn.cluster.HDBSCAN``), the reference's the ``hdbscan``
  package; they agree except on exact distance ties, which they break differently (1 reference
  case; on random 14-dimensional memories of 2 to 40 points, 0 of 1000 labelled differently with
  continuous values, 2 of 1000 rounded to 0.1, 19 of 1000 rounded to integers).
- the memory is keyed by gfcr's prompt id (the reference hashes the question text); it can be
  bounded (``memory_per_prompt``, ``max_prompts``: unbounded by default, as in the reference).
- a rollout whose ``{`` is its last token is not fingerprinted (the reference reads a padding
  token as the answer there, or skips the row).
- ``features: hidden_states`` (mean-pooled hidden states of the response, gfcr's earlier
  fingerprint) and ``anchor: first_token`` are gfcr options, not the reference. With
  ``first_token`` on a task without reasoning before the answer (tiny-arith), the context up to the
  anchor is the prompt alone, so two answers share a fingerprint exactly when they start with the
  same token: wrong answers cluster by their first digit.
- only fresh rollouts of included groups are shaped; a rollout reused from an earlier step
  (replayed) or that already carries a ``meds`` component is left alone.
- the penalty spreads the rewards of an all-wrong group: put a zero-variance filter that reads
  correctness (``filter.dynamic_sampling`` with ``metric: acc``) rather than rewards after it, as
  verl's DAPO filters on ``acc``.

Fidelity: checked against Linxi000/MEDS@2e2b040: 9/9 cases (``tests/fidelity/meds.json``: the
shaped reward and advantage given the cluster sizes); checked against Linxi000/MEDS@2e2b040:
27/28 cases, 1 documented deviation (``meds_clusters.json``: kNN assignment, HDBSCAN memory,
target and penalty over multi-step traces); checked against Linxi000/MEDS@2e2b040: 34/34 cases (``meds_fingerprints.json``:
the answer anchor and the last 14 layers' answer logits on SmolLM2-135M and tiny-arith).

Example (tiny-arith's answers have no ``\\boxed{``: the answer is read at its first digit;
four identical wrong answers, then two more: at first sight nothing, then each new one
joins the past cluster of 4 and loses ``min(0.1 ln 5, 0.2) = 0.1609``; the right one keeps its reward):

>>> from gfcr.engines import load_policy
>>> from gfcr.records import Prompt, PromptPool, Rollout, RolloutGroup, RolloutGroups, Segment, StepContext
>>> from gfcr.spec import PolicySpec
>>> from gfcr.stages.resources import Lent
>>> policy = load_policy(PolicySpec(model="tiny-arith"))
>>> ids = lambda text: list(policy.tokenizer.encode(text, add_special_tokens=False))
>>> def rollout(step, i, text, correct):
...     return Rollout(f"a:0@s{step}/{i}", f"a:0@s{step}", "a:0", ids(text),
...                    [Segment(0, len(ids(text)), 0, [0.0] * len(ids(text)))], reward=float(correct), correct=correct)
>>> def group(step, answers):
...     return RolloutGroup(f"a:0@s{step}", "a:0", step, len(answers), [rollout(step, i, *a) for i, a in enumerate(answers)])
>>> stage = MEDS(MEDS.Config(anchor="first_token"))
>>> stage.setup(Lent(policy))
>>> pool = PromptPool([Prompt("a:0", text="What is 12 + 30? Answer:")])
>>> for step, answers in [(0, [(" 41", False)] * 4), (1, [(" 41", False), (" 41", False), (" 42", True)])]:
...     stage.before_step(StepContext("r", step, 0, step))
...     g = group(step, answers)
...     _ = stage.run(RolloutGroups([g]), pool)
...     print([round(r.reward, 4) for r in g.rollouts])
[0.0, 0.0, 0.0, 0.0]
[-0.1609, -0.1609, 1.0]
>>> stage.step_metrics()["memory_entries"]
6

YAML:

.. code-block:: yaml

    reward: {use: filter.verify, from: rollout}
    meds:   {use: filter.meds, from: reward, with: {alpha: 0.1, beta: 0.2, target: wrong, anchor: boxed}}
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from gfcr.records import PromptPool, Rollout, RolloutGroup, RolloutGroups, StepContext
from gfcr.registry import MarksCorrect, PipelineProblem, StageConfig
from gfcr.stages.common.fingerprints import FORWARDS_POLICY, answer_logits, boxed_anchor, check_layers, fingerprints, first_token_anchor
from gfcr.stages.filter.error_memory import ErrorMemory, Key
from gfcr.stages.resources import Policy, Lent, prompt_tokens

COMPONENT = "meds"
COUNTS = ("fingerprinted", "no_answer", "penalised", "error_clusters", "tokens_fingerprinted")
TARGETS = {"wrong": (False,), "right": (True,), "both": (False, True)}  # the correctness each target shapes


def meds_penalty(cluster_size: int, alpha: float, beta: float) -> float:
    """``min(alpha * ln(|C| + 1), beta)`` for a rollout in a cluster of ``cluster_size``; 0 at size 0."""
    if cluster_size < 0:
        raise ValueError(f"a cluster size is >= 0 (0: first sight), got {cluster_size}")
    return 0.0 if cluster_size == 0 else min(alpha * math.log(cluster_size + 1), beta)


def shaped(reward: float, correct: bool, penalty: float) -> float:
    """The MEDS estimator's score: ``r - penalty`` for a wrong rollout, ``r / (1 + penalty)`` for a right one."""
    return reward / (1.0 + penalty) if correct else reward - penalty


def cluster_sizes(memory: ErrorMemory, keys: list[Key], vectors: np.ndarray) -> list[int]:
    """Each new fingerprint's cluster size among its key's past (``ErrorMemory.assign``), then
    every key's new fingerprints join its memory; sizes in input order."""
    sizes = [0] * len(keys)
    for key in dict.fromkeys(keys):
        rows = [i for i, k in enumerate(keys) if k == key]
        for i, size in zip(rows, memory.assign(key, vectors[rows])[1]):
            sizes[i] = size
        memory.add(key, vectors[rows])
    return sizes


class MEDS:
    """Shape rollouts in recurring clusters: wrong ``r - p``, right (target both/right) ``r / (1 + p)``."""

    class Config(StageConfig):
        sync_only: ClassVar[str] = FORWARDS_POLICY  # the fingerprints (gfcr.registry.NeedsSyncLifecycle)
        alpha: Annotated[float, Field(ge=0.0, description="scale of the penalty alpha * ln(|C| + 1) (penalty_coef)")] = 0.1
        beta: Annotated[float, Field(ge=0.0, description=(
            "the largest penalty (the cap of min(..., beta)); the reference caps ln(|C| + 1) at 2, so alpha * 2"))] = 0.2
        target: Annotated[Literal["wrong", "right", "both"], Field(description=(
            "which rollouts are shaped (cluster_penalty_target): wrong ones lose the penalty, right ones are "
            "divided by 1 + penalty"))] = "wrong"
        features: Annotated[Literal["answer_logits", "hidden_states"], Field(description=(
            "the fingerprint: the logit lens of the answer's first token at each of the last layers (the "
            "reference's), or the mean-pooled hidden states of the response"))] = "answer_logits"
        anchor: Annotated[Literal["boxed", "first_token"], Field(description=(
            "where the answer starts, for answer_logits: after the last \\boxed{ (the reference's: a response "
            "without one is not fingerprinted), or at the response's first token that is not whitespace"))] = "boxed"
        last_layers: Annotated[int | None, Field(ge=1, description=(
            "answer_logits keeps the last this many decoder layers (use_last_n_layers); null: all"))] = 14
        layers: list[int] | None = Field(None, description=(
            "hidden_states: decoder layers whose states make the fingerprint (0 is the first, -1 the last); null: all"))
        k: Annotated[int, Field(ge=1, description="neighbours in the kNN vote that assigns a new rollout a past cluster")] = 3
        min_cluster_size: Annotated[int, Field(ge=2, description="HDBSCAN's min_cluster_size over a memory")] = 2
        memory_per_prompt: Annotated[int | None, Field(ge=1, description=(
            "fingerprints kept per prompt and correctness, the newest; null: all (the reference)"))] = None
        max_prompts: Annotated[int | None, Field(ge=1, description=(
            "most (prompt, correctness) memories; the least recently updated leaves first; null: no cap"))] = None

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
        self.memory = ErrorMemory(config.memory_per_prompt, config.max_prompts, config.k, config.min_cluster_size)
        self._policy: Policy | None = None
        self._resources: Lent | None = None
        self._counts: dict[str, int] = dict.fromkeys(COUNTS, 0)
        self._penalties: list[float] = []

    def setup(self, lent: Lent) -> None:
        self._resources = lent
        self._policy = lent.require_policy("filter.meds")
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
        wanted = TARGETS[self.config.target]
        chosen = [r for g in included for r in g.rollouts if _fresh(r) and r.correct in wanted and len(r) > 0]
        anchors = [self._anchor(r) for r in chosen]
        self._counts["no_answer"] += sum(a is None for a in anchors)
        marked = [(r, a) for r, a in zip(chosen, anchors) if a is not None]
        vectors = self._features(marked, pool)
        keys = [(r.prompt_id, bool(r.correct)) for r, _ in marked]
        sizes = cluster_sizes(self.memory, keys, vectors)
        self._counts["error_clusters"] += sum(self.memory.clusters(k) for k in dict.fromkeys(keys))
        penalties = {r.rollout_id: meds_penalty(size, self.config.alpha, self.config.beta)
                     for (r, _), size in zip(marked, sizes)}
        self._penalties += [p for p in penalties.values() if p > 0]
        self._counts["penalised"] += sum(p > 0 for p in penalties.values())
        for g in included:
            for r in g.rollouts:
                if _fresh(r):
                    _shape(r, penalties.get(r.rollout_id, 0.0))
        return groups

    def _anchor(self, r: Rollout) -> int | None:
        """The response index predicting the answer's first token (-1: the prompt's last token)."""
        cfg, tok = self.config, self._require_policy().tokenizer
        if cfg.features == "hidden_states":
            return -1
        if cfg.anchor == "first_token":
            return first_token_anchor([tok.decode([t]) for t in r.response_token_ids])
        at = boxed_anchor(r.response_token_ids, tok.encode("\\boxed{", add_special_tokens=False),
                          tok.convert_ids_to_tokens(list(r.response_token_ids)))
        return at if at is not None and at + 1 < len(r) else None  # the answer's first token must follow

    def _features(self, marked: list[tuple[Rollout, int]], pool: PromptPool) -> np.ndarray:  # [len(marked), D]
        if not marked:
            return np.zeros((0, 0))
        policy = self._require_policy()
        prompts = [r.context_token_ids or prompt_tokens(policy, pool.get(r.prompt_id)) for r, _ in marked]
        tokens = sum(len(p) + len(r) for p, (r, _) in zip(prompts, marked))
        if self._resources is not None:
            self._resources.charge_scoring(tokens)
        self._counts["fingerprinted"] += len(marked)
        self._counts["tokens_fingerprinted"] += tokens
        tok = policy.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if self.config.features == "hidden_states":
            rows = [(p, r.response_token_ids) for p, (r, _) in zip(prompts, marked)]
            return fingerprints(policy.model, rows, pad, self.config.layers).astype(np.float64)
        rows = [(p, r.response_token_ids, a) for p, (r, a) in zip(prompts, marked)]
        return answer_logits(policy.model, rows, pad, self.config.last_layers)

    def _require_policy(self) -> Policy:
        if self._policy is None:
            raise RuntimeError("filter.meds fingerprints rollouts with the policy: call setup(lent) first")
        return self._policy

    def step_metrics(self) -> dict[str, float]:
        p = self._penalties
        return {**self._counts, "penalty_mean": sum(p) / len(p) if p else 0.0, "penalty_max": max(p, default=0.0),
                "memory_prompts": self.memory.prompts, "memory_entries": self.memory.entries}

    # --- checkpoint ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.memory.load_state_dict(state["memory"])


def _fresh(r: Rollout) -> bool:
    """A rollout this stage may shape: generated this step, not shaped yet."""
    return not r.reused and COMPONENT not in r.reward_components


def _shape(r: Rollout, penalty: float) -> None:
    new = shaped(r.reward, bool(r.correct), penalty)
    r.reward_components = {**r.reward_components, COMPONENT: new - r.reward}
    r.reward = new


def _check_scored(group: RolloutGroup) -> None:
    unscored = [r.rollout_id for r in group.rollouts if r.reward is None or r.correct is None]
    if unscored:
        raise ValueError(f"group {group.group_id}: rollouts {', '.join(unscored)} have no reward or verdict; "
                         "filter.meds penalises scored incorrect rollouts: put it after the stage that scores "
                         "them (`from: reward`, where reward is filter.verify)")
