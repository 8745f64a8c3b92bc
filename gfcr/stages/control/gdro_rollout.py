"""control.gdro_rollout: Rollout-GDRO, rollouts per difficulty bin chosen by one EXP3P per bin
under an exact budget of ``n_bar`` rollouts per prompt on average.

GDRO (Panaganti et al., 2026, "Group Distributionally Robust Optimization-Driven Reinforcement
Learning for LLM Reasoning", arXiv 2601.19280; reference ``kishanpb/verl-gdro``: ``ClassDroExp3p``
in ``verl/trainer/group_dro_grpo.py``, ``algorithm_comparison/run_rollout_groupdro.sh``).
It replaces ``control.fixed_n`` after a selector: every prompt the selector kept gets the
group size of its bin.

Each call:

1. bins every kept prompt with the online pass@k classifier (``passk_bins``: window ``H``,
   edges, hysteresis ``delta``). The windows hold the groups of *earlier* steps only (they
   learn in ``observe``): the allocation uses each prompt's bin as of the previous step;
2. gives each bin ``b`` the arm probabilities of its EXP3P over the arms
   ``A = {n_min, ..., n_max}``: ``p_b(a) = (1 - gamma) softmax(eta * s_b)(a) + gamma / |A|``;
3. picks, by a dynamic program over the bins present, the arms ``n_b`` of maximum joint
   log-probability ``sum_b log p_b(n_b)`` with ``sum_b count_b * n_b = n_bar * |batch|``
   *exactly* (always feasible: ``n_bar`` is an arm, and every bin at ``n_bar`` hits it).

After the step, ``observe`` scores each chosen arm with the Lagrangian
``s_b(n_b) <- s_b(n_b) - (J_b + mu (n_b - n_bar))``, where ``J_b`` is the bin's negative mean
per-sample loss, then moves the dual price ``mu <- mu + alpha_mu (n_hat - n_bar)`` with
``n_hat`` the rollouts generated per kept prompt, and finally adds the step's any-correct
indicators to the classifier. ``step_metrics`` reports ``budget`` (``n_bar * |batch|``),
``spent`` (the rollouts allocated), ``mu`` and, per bin, its prompts and group size; in a
loop block the budget, spend and prompts add up over the step's rounds, each round exact.

Reference (the paper's continuous relaxation, not computed here): with ``v_b`` the
per-prompt gradient variance of bin ``b`` and ``q_b`` its batch share, the optimum of
``max sum_b q_b J_b(n_b)`` s.t. ``sum_b q_b n_b = n_bar`` is the square-root (Neyman) law
``n_b* = n_bar sqrt(v_b) / sum_j q_j sqrt(v_j)``, i.e. ``n_b(mu) = sqrt(v_b / mu)``; the
bandit learns it from the loss signal without estimating ``v_b``.

Defaults are the reference script's: ``n_bar = 4``, arms ``2..12`` (``3 n_bar``),
``eta = 0.65``, ``gamma = 0.01``, ``alpha_mu = 0.05``, ``H = 50``, ``delta = 0.03``, edges
``0.4, 0.75`` (three bins).

Deviations:
- Loss signal: the reference scores an arm with the per-sample policy-gradient loss of
  the actor update. gfcr's update does not report a loss per sample, and on fresh rollouts
  (ratio 1) that loss is ``-A_i``, whose group mean is zero under a mean-centred estimator,
  so it carries no per-bin signal. Here the per-sample loss is the failure ``1 - r_i``
  (the 0/1 loss for binary rewards), ``J_b`` the bin's mean reward minus 1, over the scored
  rollouts of this step's groups of the bin. Since ``1 - r >= 0`` and only the chosen arm
  is scored, a chosen arm's score only grows (``mu`` aside): each bin tends to keep the
  first arm it got (``n_bar``, the tie-break) unless the exact budget forces a move. A
  9-step run of ``pipelines/gdro_arith.yaml`` on 12 prompts kept every bin at 4.
- As in the reference, the arm update is not importance-weighted (textbook EXP3P divides
  by ``p_b(n_b)``) and the arm combination is the DP's argmax, not a draw. The DP breaks
  ties between equally likely combinations by trying arms nearest ``n_bar`` first and
  keeping the first combination found; the softmax subtracts its maximum (same value,
  no overflow). The reference falls back to the nearest total when none is exact; here
  ``n_bar`` must be an arm, so the total is always exact.
- The reference keeps the per-prompt bin list of step ``t - 1``'s batch and applies it *by
  position* to step ``t``'s batch (other prompts, under a shuffled loader), so its
  allocation follows the previous batch's bin counts, not the current prompts' own bins;
  its first step is uniform. Here every current prompt gets its own bin from the windows
  through step ``t - 1`` (a prompt never seen has pass@k 0, bin 0, as in the reference), and
  the first step is uniform too (every prompt in bin 0, uniform arms, ties to ``n_bar``).
- ``n_hat`` counts the rollouts generated for this stage's prompts (loop rounds and
  filters' removals included). The reference computes it from the allocation itself
  (``sum_b count_b n_b / |batch|``), which the exact DP makes ``n_bar`` every step, so its
  ``mu`` never leaves its start; here ``mu`` moves only when generation returns fewer
  rollouts than allocated.
- The classifier's hysteresis over several boundaries at once: see ``passk_bins``.
- Ties between arm combinations of equal probability (uniform scores, as at the first steps):
  arms nearest ``n_bar`` are tried first, so every bin gets ``n_bar``; the reference keeps its
  DP's first combination (arms ascending: the first bin gets the smallest arm, the last the
  largest).

Fidelity: checked against kishanpb/verl-gdro@b391899: 8/10 cases, 2 documented deviations
(``tests/fidelity/gdro_rollout.json``: the arm choice; the score updates are not compared).

Example (two prompts never seen, so both in bin 0; uniform arm probabilities, ties go to
``n_bar``):

>>> from gfcr.records import Allocation, AllocationEntry, Prompt
>>> stage = GdroRollout(GdroRollout.Config())
>>> alloc = Allocation(0, (AllocationEntry(Prompt("p:0", text="0"), 1),
...                        AllocationEntry(Prompt("p:1", text="1"), 1)))
>>> [e.n_rollouts for e in stage.run(alloc)]
[4, 4]
>>> # 2 prompts in bin "0" and 1 in "1", 10 rollouts: (4, 2) or (3, 4); the first is far likelier
>>> best_arms({"0": 2, "1": 1}, arms=(2, 3, 4), log_probs={"0": [-9.0, -9.0, -0.1], "1": [-0.1, -9.0, -9.0]},
...           budget=10, prefer=3)
{'0': 4, '1': 2}

YAML:

.. code-block:: yaml

    stages:
      pick:    {use: control.uniform, with: {batch_size: 16}}
      budget:  {use: control.gdro_rollout, from: pick, with: {mean_rollouts: 4, min_rollouts: 2, max_rollouts: 12}}
      rollout: {use: generate.sample, from: budget}
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import Field, model_validator

from gfcr.records import Allocation, StepReport
from gfcr.registry import StageConfig
from gfcr.stages.common.passk_bins import Edges, Margin, PassKBins, Window, check_edges


def arm_probabilities(scores: np.ndarray, eta: float, gamma: float) -> np.ndarray:
    """EXP3P's arm distribution: ``(1 - gamma) softmax(eta * scores) + gamma / K``."""
    z = eta * np.asarray(scores, dtype=np.float64)
    e = np.exp(z - z.max())
    return (1.0 - gamma) * e / e.sum() + gamma / len(e)


def best_arms(counts: dict[str, int], arms: tuple[int, ...], log_probs: dict[str, list[float]],
              budget: int, prefer: int) -> dict[str, int]:
    """The arm of every bin (``counts``: prompts per bin) maximising ``sum log p_b(n_b)`` subject to
    ``sum_b counts[b] * n_b == budget`` exactly; a ValueError when no combination hits it.

    A dynamic program over the bins with the reached total as state. Ties keep the first
    combination found, with arms tried nearest ``prefer`` first."""
    order = sorted(range(len(arms)), key=lambda i: (abs(arms[i] - prefer), arms[i]))
    table: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}  # total -> (log-prob, arm per bin)
    for b, count in counts.items():
        grown: dict[int, tuple[float, tuple[int, ...]]] = {}
        for total, (logp, chosen) in table.items():
            for i in order:
                key, value = total + count * arms[i], logp + log_probs[b][i]
                if key <= budget and (key not in grown or value > grown[key][0]):
                    grown[key] = (value, chosen + (arms[i],))
        table = grown
    if budget not in table:
        raise ValueError(f"no combination of arms {list(arms)} over bins {counts} spends exactly {budget}")
    return dict(zip(counts, table[budget][1]))


class GdroRollout:
    """Rollout-GDRO: EXP3P per difficulty bin over group sizes, exact budget by dynamic programming."""

    class Config(StageConfig):
        sizes_each_group: ClassVar[bool] = True  # a capability: it sizes each prompt's group itself
        mean_rollouts: Annotated[int, Field(ge=1, description=(
            "n_bar: rollouts per kept prompt on average; the step spends exactly n_bar * |batch|"))] = 4
        min_rollouts: Annotated[int, Field(ge=1, description="n_min: the smallest arm (group size)")] = 2
        max_rollouts: Annotated[int, Field(ge=1, description="n_max: the largest arm (the scripts' 3 * n_bar)")] = 12
        eta: Annotated[float, Field(gt=0.0, description="EXP3P learning rate on the arm scores")] = 0.65
        gamma: Annotated[float, Field(ge=0.0, le=1.0, description=(
            "EXP3P uniform exploration mixed into each bin's arms"))] = 0.01
        dual_step: Annotated[float, Field(ge=0.0, description=(
            "alpha_mu: step of the dual price, mu <- mu + alpha_mu (n_hat - n_bar)"))] = 0.05
        initial_dual: float = Field(0.0, description="mu at the start of the run")
        edges: Edges = (0.4, 0.75)
        window: Window = 50
        margin: Margin = 0.03

        @model_validator(mode="after")
        def _arms_hold_the_mean(self) -> "GdroRollout.Config":
            check_edges(self.edges)
            if not self.min_rollouts <= self.mean_rollouts <= self.max_rollouts:
                raise ValueError(
                    f"mean_rollouts ({self.mean_rollouts}) must lie in [min_rollouts, max_rollouts] = "
                    f"[{self.min_rollouts}, {self.max_rollouts}], or no allocation spends the budget exactly; "
                    "the reference uses min_rollouts: 2, mean_rollouts: 4, max_rollouts: 12")
            return self

        @property
        def arms(self) -> tuple[int, ...]:
            return tuple(range(self.min_rollouts, self.max_rollouts + 1))

    def __init__(self, config: Config):
        self.config = config
        self.classifier = PassKBins(config.edges, config.window, config.margin)
        self.scores = np.zeros((self.classifier.num_bins, len(config.arms)))  # [bins, arms] EXP3P scores
        self.pulls = np.zeros((self.classifier.num_bins, len(config.arms)), dtype=np.int64)  # [bins, arms]
        self.mu = config.initial_dual
        self._assigned: dict[str, tuple[int, int]] = {}  # prompt -> (bin, group size), this step
        self._metrics: dict[str, float] = {}  # this step's, summed over the calls of a loop block

    def arm_probabilities(self, b: int) -> np.ndarray:
        return arm_probabilities(self.scores[b], self.config.eta, self.config.gamma)

    def run(self, allocation: Allocation) -> Allocation:
        cfg = self.config
        active = allocation.active()
        bins = {e.prompt_id: self.classifier.assign(e.prompt_id) for e in active}
        counts = Counter(bins[e.prompt_id] for e in active)
        budget = cfg.mean_rollouts * len(active)
        log_probs = {b: np.log(np.maximum(self.arm_probabilities(b), 1e-300)).tolist() for b in sorted(counts)}
        chosen = best_arms({b: counts[b] for b in sorted(counts)}, cfg.arms, log_probs, budget, cfg.mean_rollouts)
        self._assigned.update({pid: (b, chosen[b]) for pid, b in bins.items()})
        entries = [replace(e, n_rollouts=chosen[bins[e.prompt_id]], reason=self._reason(e.reason, bins[e.prompt_id],
                                                                                       chosen))
                   if e.n_rollouts > 0 else e for e in allocation]
        spent = sum(e.n_rollouts for e in entries)
        self._add_metrics(budget, spent, counts, chosen)
        return allocation.with_entries(entries)

    def _reason(self, before: str, b: int, chosen: dict[int, int]) -> str:
        mine = f"gdro_rollout: bin {b}, n {chosen[b]}"
        return f"{before}; {mine}" if before else mine

    def _add_metrics(self, budget: int, spent: int, counts: Counter, chosen: dict[int, int]) -> None:
        """Budget, spend and prompts per bin add up over a step's calls; group sizes are the last call's."""
        m = self._metrics
        m["budget"], m["spent"], m["mu"] = m.get("budget", 0) + budget, m.get("spent", 0) + spent, self.mu
        for b in range(self.classifier.num_bins):
            m[f"prompts_bin{b}"] = m.get(f"prompts_bin{b}", 0) + counts.get(b, 0)
            m[f"n_bin{b}"] = chosen.get(b, 0)

    def step_metrics(self) -> dict[str, float]:
        """This step's budget, spend, dual price, and prompts and group size per bin."""
        return dict(self._metrics)

    def observe(self, report: StepReport) -> None:
        mine = [g for g in report.groups if g.step == report.step and g.prompt_id in self._assigned]
        losses: dict[tuple[int, int], list[float]] = {}  # (bin, group size) -> per-sample losses
        for g in mine:
            losses.setdefault(self._assigned[g.prompt_id], []).extend(
                1.0 - r.reward for r in g.rollouts if r.reward is not None)
        for (b, n), values in sorted(losses.items()):
            if values:
                self._score_arm(b, n, -float(np.mean(values)))
        prompts = len({g.prompt_id for g in mine})
        if prompts:
            n_hat = sum(len(g.generated) for g in mine) / prompts
            self.mu += self.config.dual_step * (n_hat - self.config.mean_rollouts)
        self.classifier.observe(report.groups, report.step)
        self._assigned, self._metrics = {}, {}

    def _score_arm(self, b: int, n: int, j: float) -> None:
        """The reference's update of the chosen arm: ``s_b(n) -= J_b + mu (n - n_bar)``."""
        i = self.config.arms.index(n)
        self.scores[b, i] -= j + self.mu * (n - self.config.mean_rollouts)
        self.pulls[b, i] += 1

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON data: the classifier, the arm scores and pulls, and the dual price."""
        return {"classifier": self.classifier.state_dict(), "scores": self.scores.tolist(),
                "pulls": self.pulls.tolist(), "mu": self.mu}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.classifier.load_state_dict(state["classifier"])
        self.scores = np.array(state["scores"], dtype=np.float64).reshape(self.scores.shape)
        self.pulls = np.array(state["pulls"], dtype=np.int64).reshape(self.pulls.shape)
        self.mu = float(state["mu"])

