"""filter.gdro_weights: Prompt-GDRO, advantage weights that lean toward the difficulty bins
with the highest recent loss.

GDRO (Panaganti et al., 2026, arXiv 2601.19280; reference ``kishanpb/verl-gdro``:
``ClassDroExp3p.compute_weights`` / ``update_with_losses`` in ``verl/trainer/group_dro_grpo.py``,
``algorithm_comparison/run_groupdro.sh``). A Filter stage: it drops nothing and sets each
included group's ``sample_weight``, which ``update.grpo`` multiplies into every rollout's
advantage (``A_ij <- A_ij * w``).

Each call (after a stage that scores the rollouts; an unscored rollout of an included group
is refused with a ValueError naming its group) bins the included groups' prompts with the online pass@k classifier
(``passk_bins``; windows hold earlier steps only). For the ``B`` bins present in the batch,
with ``S(b)`` the bin's score (0 for a bin never scored):

    omega(b) = exp(eta_q * S(b))     (S clipped to [-C, C] first when score_clip is set)
    q(b)     = (1 - gamma) * omega(b) / sum_j omega(j) + gamma / B

Every rollout gets ``q`` of its bin; the weights are renormalised to mean 1 over the
rollouts of the batch, capped at ``omega_max``, and multiplied into the group's
``sample_weight``. After the step, ``observe`` updates the scores of the bins weighted this
step from their per-sample losses ``l`` (EMA-debiased):

    lbar(b) = mean of l over the bin's scored rollouts   (divided by the bin's share of
              those rollouts when normalize_by_share: the scripts' loss_norm_by_class)
    S(b)   <- lbar(b) at a bin's first score, else (1 - beta) S(b) + beta lbar(b)

and adds the step's any-correct indicators to the classifier. With ``exclude_extremes`` (the
3-bin script's ``passk_exclude_extremes``), a prompt whose windowed pass@k is exactly 0 or 1
(an unseen prompt included) joins no pass@k bin: it goes to one more class, ``excluded``
(bin ``-1``), which is scored and weighted like the others, as the reference's
``accbin_excl``; its hysteresis memory is left as it was. ``step_metrics`` reports, per
bin, the groups weighted, their weight and the bin's score.

Defaults are the reference scripts' (3-bin case): ``eta_q = 0.65``, ``gamma = 0.01``,
``omega_max = 15``, ``beta = 0.12``, normalisation by share on, ``H = 50``,
``delta = 0.03``, edges ``0.4, 0.75``, extremes excluded; scores unclipped (the reference
clips only z-scored scores, an option its scripts leave off).

Fidelity: checked against kishanpb/verl-gdro@b391899: 15/15 cases (``tests/fidelity/gdro_weights.json``).

Deviations:
- Loss signal: the reference's per-sample loss is the policy-gradient loss of the actor
  update (plus KL). gfcr's update reports no per-sample loss, and on fresh rollouts that
  loss is ``-A_i``, whose group mean is zero under a mean-centred estimator. Here
  ``l = 1 - r`` (the failure; the 0/1 loss for binary rewards): bins that fail more weigh more.
- ``score_clip`` (off by default) applies the paper's ``clip(S, -C, C)`` to the raw score;
  the reference does not clip it (it clips only z-scored scores, at ``z_cap = 3``). With
  ``score_clip: 3`` a bin normalised by a small share (score above 3) weighs less than in
  the reference.
- The weight is the code's (``q`` renormalised to mean 1, then capped), not the paper's
  ``min(omega, omega_max)``; they agree up to a global scale before the cap. The reference
  also caps ``q`` before the renormalisation (a no-op, ``q <= 1``); here the cap applies
  after it, as the seed notes state it. After the cap the mean may be below 1.
- The classifier's hysteresis over several boundaries at once: see ``passk_bins``.

Example (first step: no scores, so every class weighs the same; unseen prompts, at pass@k 0,
are excluded from the bins):

>>> from gfcr.records import RolloutGroups, StepReport
>>> from gfcr.stages.testing import scored_group
>>> stage = GdroWeights(GdroWeights.Config(window=2))
>>> groups = RolloutGroups([scored_group("a", [0, 0]), scored_group("b", [1, 1])])
>>> [g.sample_weight for g in stage.run(groups)]  # both prompts unseen: the excluded class
[1.0, 1.0]
>>> stage.observe(StepReport("run", 0, 1, tuple(groups), None, {}, {}))
>>> stage.classifier.passk("a"), stage.classifier.passk("b")  # still extreme: excluded next step too
(0.0, 1.0)
>>> stage.scores  # the excluded class's first score: mean failure 0.5 over its 4 rollouts, share 1
{-1: 0.5}

YAML:

.. code-block:: yaml

    reward:  {use: filter.verify, from: rollout}
    weights: {use: filter.gdro_weights, from: reward, with: {eta_q: 0.65, max_weight: 15.0}}
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import Field, model_validator

from gfcr.records import RolloutGroup, RolloutGroups, StepReport
from gfcr.registry import StageConfig
from gfcr.stages.common.passk_bins import Edges, Margin, PassKBins, Window, check_edges


EXCLUDED = -1  # the class of prompts at pass@k exactly 0 or 1, with exclude_extremes


def bin_weights(scores: dict[int, float], present: list[int], eta: float, gamma: float,
                clip: float | None = None) -> dict[int, float]:
    """``q(b)`` of each bin present: EXP3P-style exponential weights of the scores (clipped to
    ``[-clip, clip]`` when given), mixed with ``gamma / B`` uniform exploration."""
    s = np.array([scores.get(b, 0.0) for b in present], dtype=np.float64)
    if clip is not None:
        s = np.clip(s, -clip, clip)
    omega = np.exp(eta * (s - s.max()))  # the max cancels in the normalisation
    q = (1.0 - gamma) * omega / omega.sum() + gamma / len(present)
    return dict(zip(present, q.tolist()))


def sample_weights(per_sample: np.ndarray, cap: float) -> np.ndarray:
    """Per-sample weights renormalised to mean 1, then capped at ``cap``."""
    w = np.asarray(per_sample, dtype=np.float64)
    return np.minimum(w / w.mean(), cap)


class GdroWeights:
    """Prompt-GDRO: weight each group's advantages by its difficulty bin's adversarial weight."""

    class Config(StageConfig):
        reads_rewards: ClassVar[bool] = True  # a capability (gfcr.registry.ReadsRewards): a verifier must be upstream
        eta_q: Annotated[float, Field(gt=0.0, description="learning rate of the exponential bin weights")] = 0.65
        gamma: Annotated[float, Field(ge=0.0, le=1.0, description=(
            "uniform exploration mixed into the bin weights"))] = 0.01
        max_weight: Annotated[float, Field(gt=0.0, description="omega_max: cap on a sample's weight after "
                                                               "renormalising to mean 1")] = 15.0
        ema: Annotated[float, Field(gt=0.0, le=1.0, description="beta: EMA step of the bin scores")] = 0.12
        score_clip: Annotated[float | None, Field(gt=0.0, description=(
            "C: clip scores to [-C, C] before eta_q (the paper's clip); None: unclipped, as the reference"))] = None
        exclude_extremes: bool = Field(True, description=(
            "prompts at pass@k exactly 0 or 1 form one more class instead of a pass@k bin "
            "(the 3-bin script's passk_exclude_extremes)"))
        normalize_by_share: bool = Field(True, description=(
            "divide a bin's mean loss by its share of the step's scored rollouts (loss_norm_by_class)"))
        edges: Edges = (0.4, 0.75)
        window: Window = 50
        margin: Margin = 0.03

        @model_validator(mode="after")
        def _edges_ordered(self) -> "GdroWeights.Config":
            check_edges(self.edges)
            return self

    def __init__(self, config: Config):
        self.config = config
        self.classifier = PassKBins(config.edges, config.window, config.margin)
        self.scores: dict[int, float] = {}  # bin -> EMA-debiased score S(b)
        self._assigned: dict[str, int] = {}  # group id -> bin, this step
        self._metrics: dict[str, float] = {}

    def run(self, groups: RolloutGroups) -> RolloutGroups:
        cfg = self.config
        weighted = [g for g in groups.included() if g.rollouts]
        if not weighted:
            return groups
        for g in weighted:
            _check_scored(g)
        bins = [self._bin(g.prompt_id) for g in weighted]
        q = bin_weights(self.scores, sorted(set(bins)), cfg.eta_q, cfg.gamma, cfg.score_clip)
        sizes = np.array([len(g.rollouts) for g in weighted])
        per_group = sample_weights(np.repeat([q[b] for b in bins], sizes), cfg.max_weight)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        for g, b, start in zip(weighted, bins, starts):
            g.sample_weight *= float(per_group[start])
            self._assigned[g.group_id] = b
        self._metrics = self._step_metrics(weighted, bins, per_group[starts])
        return groups

    def _bin(self, prompt_id: str) -> int:
        """The prompt's class: its pass@k bin, or EXCLUDED at pass@k 0 or 1 with exclude_extremes."""
        if self.config.exclude_extremes and self.classifier.passk(prompt_id) in (0.0, 1.0):
            return EXCLUDED
        return self.classifier.assign(prompt_id)

    def _step_metrics(self, groups: list[RolloutGroup], bins: list[int], weights: np.ndarray) -> dict[str, float]:
        metrics: dict[str, float] = {}
        names = [(b, f"bin{b}") for b in range(self.classifier.num_bins)]
        for b, name in names + ([(EXCLUDED, "excluded")] if self.config.exclude_extremes else []):
            mine = [float(w) for w, gb in zip(weights, bins) if gb == b]
            metrics[f"groups_{name}"] = len(mine)
            metrics[f"weight_{name}"] = mine[0] if mine else 0.0
            metrics[f"score_{name}"] = self.scores.get(b, 0.0)
        return metrics

    def step_metrics(self) -> dict[str, float]:
        """Groups, weight and score per bin this step."""
        return dict(self._metrics)

    def observe(self, report: StepReport) -> None:
        losses: dict[int, list[float]] = {}
        for g in report.groups:
            if g.group_id in self._assigned:
                losses.setdefault(self._assigned[g.group_id], []).extend(
                    1.0 - r.reward for r in g.rollouts if r.reward is not None)
        total = sum(len(v) for v in losses.values())
        for b, values in sorted(losses.items()):
            if values:
                share = len(values) / total if self.config.normalize_by_share else 1.0
                self._score(b, float(np.mean(values)) / share)
        self.classifier.observe(report.groups, report.step)
        self._assigned = {}

    def _score(self, b: int, step_mean: float) -> None:
        beta = self.config.ema
        self.scores[b] = step_mean if b not in self.scores else (1.0 - beta) * self.scores[b] + beta * step_mean

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON data: the classifier and the bin scores."""
        return {"classifier": self.classifier.state_dict(), "scores": {str(b): s for b, s in self.scores.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.classifier.load_state_dict(state["classifier"])
        self.scores = {int(b): float(s) for b, s in state["scores"].items()}


def _check_scored(group: RolloutGroup) -> None:
    """The bin scores learn from rewards: a group without them would leave the weights uniform forever."""
    unscored = [r.rollout_id for r in group.rollouts if r.reward is None]
    if unscored:
        raise ValueError(f"group {group.group_id}: rollouts {', '.join(unscored)} have no reward; "
                         "filter.gdro_weights learns its bin scores from rewards: put it after the stage that "
                         "scores them (`from: reward`, where reward is filter.verify)")
