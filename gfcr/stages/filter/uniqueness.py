"""filter.uniqueness: uniqueness-aware RL, a rollout's advantage scaled down by the size of its strategy cluster.

"Rewarding the Rare: Uniqueness-Aware RL for Creative Problem Solving in LLMs" (Hu et al., 2026,
arXiv 2601.08763) clusters the rollouts of one problem by high-level solution strategy and
reweights each rollout's policy advantage inversely with the size of its cluster, so that a
correct answer reached by a rare strategy gets more credit than one of many alike. For each
included group, this stage clusters the group's correct rollouts (``correct is True``) with the
Config's ``clustering`` (``gfcr.stages.filter.strategy_clusters``) and gives rollout ``i`` of
cluster ``C`` the weight

    w_i = |C| ** (-alpha)          (alpha = 1: the inverse of the cluster size; a singleton keeps 1)

which it multiplies into ``Rollout.sample_weight``. That field is how a per-rollout weight
reaches the update: ``update.grpo`` scales each rollout's advantage by the group's and the
rollout's sample weight after the estimator ran (``A_i <- g.sample_weight * r.sample_weight *
A_i``), so with GRPO's estimator the rollout's advantage becomes ``w_i * (r_i - mean) / std``:
the group baseline is the unweighted one, and only the size of the step on each rollout changes.
Incorrect rollouts keep weight 1 unless ``weight_incorrect`` is set, in which case the group's
incorrect rollouts are clustered among themselves and weighted by the same rule (a common
mistake then pushes down less per copy). Nothing is dropped; rewards are not changed.

Metrics per step (``stages.<id>``): ``groups_clustered`` (groups with a rollout to cluster),
``clusters_per_group`` (mean number of clusters of the correct rollouts), ``weight_mean`` and
``weight_min`` (over the rollouts weighted), ``singleton_fraction`` (weighted rollouts alone in
their cluster).

Defaults: ``alpha = 1`` (the issue's "inverse of the cluster size"; a third-party summary of the
paper writes ``w = 1 / f ** alpha``); correct rollouts only; ``clustering: {use: embedding,
threshold: 0.9}`` with all-MiniLM-L6-v2.

Deviations:
- The paper's clustering is an LLM judge prompted to group rollouts by high-level strategy while
  ignoring wording; gfcr has no judge model offline on CPU, so the default clustering is by
  sentence embeddings of the response text (all-MiniLM-L6-v2, single linkage at cosine
  ``threshold``), which sees wording as well as strategy: two rollouts with the same idea in
  different words may land in different clusters. This is the main deviation; a judge is a
  further ``clustering`` strategy.
- Rules come from the abstract and third-party summaries (the paper's text was not readable
  here): the exact weight (raw ``|C|^-alpha``, not normalised to mean 1 over the group), which
  rollouts are clustered (only the correct ones, as the abstract's "rewards correct solutions
  that exhibit rare strategies"; ``weight_incorrect`` scales negative advantages too) and the
  default ``alpha`` are this stage's choices.
- The weight multiplies ``sample_weight``, so it composes with any other stage's weight and is
  applied after the advantage estimator (the baseline does not see it).
- A rollout with no verdict (``correct is None``) in an included group is an error: put the
  stage after ``filter.verify``.

Fidelity: from the abstract: no public code; the rules above are this stage's reading.

Example (the ``exact`` clustering, so the clusters are visible: tokens [7] twice, [8] once):

>>> from gfcr.records import Rollout, RolloutGroup, RolloutGroups, Segment
>>> def rollout(i, token, correct):
...     return Rollout(f"g/{i}", "g", "p", [token], [Segment(0, 1, 0, [0.0])], reward=float(correct), correct=correct)
>>> group = RolloutGroup("g", "p", 0, 4, [rollout(0, 7, True), rollout(1, 7, True), rollout(2, 8, True),
...                                      rollout(3, 9, False)])
>>> stage = Uniqueness(Uniqueness.Config(clustering={"use": "exact"}))
>>> _ = stage.run(RolloutGroups([group]))
>>> [r.sample_weight for r in group.rollouts]  # clusters of 2, 2, 1; the wrong one is not weighted
[0.5, 0.5, 1.0, 1.0]
>>> stage.step_metrics()["clusters_per_group"]
2.0

YAML:

.. code-block:: yaml

    reward: {use: filter.verify, from: rollout}
    rare:   {use: filter.uniqueness, from: reward, with: {alpha: 1.0, clustering: {use: embedding, threshold: 0.9}}}
"""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Any

from pydantic import Field

from gfcr.records import Rollout, RolloutGroup, RolloutGroups, StepContext
from gfcr.registry import MarksCorrect, PipelineProblem, StageConfig
from gfcr.stages.filter.strategy_clusters import Clustering, EmbeddingClustering



class Uniqueness:
    """Scale each correct rollout's advantage by ``|C| ** -alpha``, ``C`` its strategy cluster in the group."""

    class Config(StageConfig):
        alpha: Annotated[float, Field(ge=0.0, description=(
            "exponent of the weight |C|^-alpha of a rollout in a cluster of |C| (1: the inverse of the "
            "cluster size; 0: every weight is 1)"))] = 1.0
        weight_incorrect: bool = Field(False, description=(
            "also cluster the group's incorrect rollouts among themselves and weight them by the same "
            "rule (their negative advantages shrink with their cluster size)"))
        clustering: Clustering = Field(EmbeddingClustering(use="embedding"), description=(
            "how rollouts are grouped into strategies: {use: embedding, threshold: 0.9, embedder: "
            "all-MiniLM-L6-v2} or {use: exact} (identical response token ids)"))

    @staticmethod
    def check_pipeline(config: "Uniqueness.Config", view: Any) -> list[PipelineProblem]:
        """Correctness must be known: a verifier upstream."""
        if view.having(MarksCorrect, upstream=True):
            return []
        return [PipelineProblem((), "nothing upstream of this stage marks rollouts correct, so there are no "
                                    "correct rollouts to cluster",
                                "put it after the verifier: `from: reward`, where reward is `{use: filter.verify}`")]

    def __init__(self, config: Config):
        self.config = config
        self.clusterer = config.clustering.build()
        self._metrics = _empty_metrics()

    def setup(self, lent: Any) -> None:
        self.clusterer.setup()  # the embedding model loads before the first step, or its error shows

    def before_step(self, ctx: StepContext) -> None:
        self._metrics = _empty_metrics()  # summed over the step's loop rounds

    def run(self, groups: RolloutGroups) -> RolloutGroups:
        subsets = [s for g in groups.included() for s in self._subsets(g)]
        labels = self.clusterer.labels([rollouts for _, rollouts in subsets])
        for (correct, rollouts), subset_labels in zip(subsets, labels):
            self._weigh(rollouts, subset_labels, correct)
        return groups

    def _subsets(self, group: RolloutGroup) -> list[tuple[bool, list[Rollout]]]:
        _check_judged(group)
        found = [(True, [r for r in group.rollouts if r.correct])]
        if self.config.weight_incorrect:
            found.append((False, [r for r in group.rollouts if not r.correct]))
        return [(correct, rollouts) for correct, rollouts in found if rollouts]

    def _weigh(self, rollouts: list[Rollout], labels: list[int], correct: bool) -> None:
        sizes = Counter(labels)
        for r, label in zip(rollouts, labels):
            weight = uniqueness_weight(sizes[label], self.config.alpha)
            r.sample_weight *= weight
            self._metrics["weights"].append(weight)
            self._metrics["singletons"] += int(sizes[label] == 1)
        if correct:
            self._metrics["clusters"].append(len(sizes))
        self._metrics["groups"].add(rollouts[0].group_id)

    def step_metrics(self) -> dict[str, float]:
        m = self._metrics
        weights, clusters = m["weights"], m["clusters"]
        return {"groups_clustered": len(m["groups"]),
                "clusters_per_group": sum(clusters) / len(clusters) if clusters else 0.0,
                "weight_mean": sum(weights) / len(weights) if weights else 1.0,
                "weight_min": min(weights, default=1.0),
                "singleton_fraction": m["singletons"] / len(weights) if weights else 0.0}


def uniqueness_weight(cluster_size: int, alpha: float) -> float:
    """``cluster_size ** -alpha``: 1 for a singleton, smaller for a common strategy."""
    if cluster_size < 1:
        raise ValueError(f"a cluster has at least one rollout, got {cluster_size}")
    return float(cluster_size) ** -alpha


def _empty_metrics() -> dict[str, Any]:
    return {"weights": [], "clusters": [], "singletons": 0, "groups": set()}


def _check_judged(group: RolloutGroup) -> None:
    unjudged = [r.rollout_id for r in group.rollouts if r.correct is None]
    if unjudged:
        raise ValueError(f"group {group.group_id}: rollouts {', '.join(unjudged)} have no verdict (`correct` is "
                         "None); filter.uniqueness clusters correct rollouts: put it after the stage that "
                         "scores them (`from: reward`, where reward is filter.verify)")
