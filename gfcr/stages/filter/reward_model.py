"""filter.reward_model: score every unscored rollout with a discriminative reward model, a local
sequence classifier (``AutoModelForSequenceClassification``) that reads the prompt and the response
and gives one logit, on the CPU.

For each rollout whose ``reward`` is None, the stage builds the classifier's input from the prompt
(its text, or its messages' contents) and the response (``format``: ``pair``, the tokenizer's text
pair, or ``chat``, its chat template over a user and an assistant turn; ``gfcr.engines.reward_models``),
runs the rows in batches of ``batch_size``, and maps each logit to the reward (``mapping``):

- ``sigmoid`` (the default): ``sigmoid(logit)``, in [0, 1] (with a two-label head, the softmax
  probability of ``label``);
- ``raw``: the logit itself, unbounded (Bradley-Terry reward models' scale);
- ``threshold``: 1 when the logit is at least ``threshold``, else 0.

It writes what ``filter.verify`` and ``filter.judge`` write, so the filters and the update downstream
read it unchanged: ``reward``; ``correct = reward >= pass_at``; ``reward_components =
{"reward_model": reward, "reward_model_fallback": 0 | 1}``; ``reward_reason`` (``reward model
logit 2.31 -> 0.91``), which the lineage records.

The model: ``model`` is a local folder saved with ``save_pretrained`` (nothing is downloaded), loaded
once by the runtime, frozen (``Lent.reward_models``). ``gfcr validate`` reads its config.json and refuses
a missing folder, a model with no sequence-classification head, or one with more than two labels, at
``stages.<id>.with.model``, with how to make one (``benchmarks/train_reward_model.py`` fine-tunes
all-MiniLM-L6-v2 on the shipped GSM8K data).

Declared fallbacks (reward ``fallback``, ``correct`` False, ``reward_model_fallback`` 1, the reason in
the lineage; the rule is ``gfcr.stages.filter.model_scores``, the judge's):

- an input over ``max_length`` tokens with ``oversized: fallback``; with ``oversized: cut`` (the
  default) it is cut from the left, the response's end kept, and scored (the reason says so);
- a non-finite logit (a broken checkpoint);
- a timeout: the rows of batches not started ``timeout_s`` after the step's scoring began (checked
  between batches; a batch that has started runs to its end).

Budget: every token the classifier reads is charged to the step's ``tokens_scored``
(``Lent.charge_scoring``), so a comparison pays for the reward model; ``stages.<id>`` in
metrics.jsonl has ``scored``, ``fallbacks``, ``timeouts``, ``cut``, ``rm_tokens`` and ``rm_s``.

Deviations: TRL's and OpenRLHF's reward models read the chat template (``format: chat``) and, in
OpenRLHF, the last token's value head; here the head is the classifier's own (its pooled token), and
``pair`` serves encoders fine-tuned as cross-encoders. No normalisation of the reward across the batch
(OpenRLHF's ``normalize_reward``): the advantage estimator downstream normalises.

Fidelity: gfcr's own: no paper; the discriminative reward model of RLHF (a scalar head on a sequence
classifier), no reference code followed.

Example (a tiny two-label BERT classifier, random weights, built here, with all-MiniLM-L6-v2's tokenizer):

>>> import tempfile, torch
>>> from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification
>>> from gfcr.engines.reward_models import RewardModels
>>> from gfcr.records import Prompt, PromptPool, RolloutGroups
>>> from gfcr.stages.common.embedding import packaged_model_dir
>>> from gfcr.stages.resources import Lent
>>> from gfcr.stages.testing import scored_group
>>> folder = tempfile.mkdtemp()
>>> AutoTokenizer.from_pretrained(str(packaged_model_dir())).save_pretrained(folder)[:0]
()
>>> _ = torch.manual_seed(0)
>>> BertForSequenceClassification(BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
...     intermediate_size=16, num_labels=2, initializer_range=0.5)).save_pretrained(folder)
>>> pool = PromptPool([Prompt("p:0", text="what is 2 2")])
>>> group = scored_group("p:0", [0, 0])
>>> for rollout, text in zip(group.rollouts, ["4", "5"]):
...     rollout.reward, rollout.text = None, text
>>> stage = RewardModel(RewardModel.Config(model=folder))
>>> stage.setup(Lent(reward_models=RewardModels()))
>>> scored = stage.run(RolloutGroups([group]), pool)
>>> [0 < r.reward < 1 and r.reward_reason.startswith("reward model logit ") for r in scored.rollouts()]
[True, True]
>>> stage.step_metrics()["rm_tokens"], stage.step_metrics()["fallbacks"]
(16.0, 0.0)

YAML:

.. code-block:: yaml

    score: {use: filter.reward_model, from: rollout, with: {model: ../../runs/reward-model-gsm8k, mapping: sigmoid}}
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from gfcr.records import PromptPool, Rollout, RolloutGroups
from gfcr.registry import FilePath, StageConfig
from gfcr.stages.filter.judge import prompt_text
from gfcr.stages.filter.judge_prompts import Judged
from gfcr.stages.filter.model_scores import write_model_score
from gfcr.stages.resources import Classifier, Lent

ALIAS = "filter.reward_model"


class RewardModel:
    """Score unscored rollouts with a local sequence classifier; declared mapping and fallbacks."""

    class Config(StageConfig):
        marks_correct: ClassVar[bool] = True  # a capability (gfcr.registry.MarksCorrect)
        model: Annotated[FilePath, Field(description=(
            "a local folder saved with save_pretrained from a sequence classifier (relative: to the pipeline file)"))]
        format: Literal["pair", "chat"] = Field("pair", description=(
            "the classifier's input: `pair` (the tokenizer's text pair, prompt then response) or `chat` "
            "(its chat template, a user and an assistant turn)"))
        label: Annotated[int, Field(ge=0, le=1, description=(
            "with a two-label head, the label whose log-odds is the score"))] = 1
        mapping: Literal["sigmoid", "raw", "threshold"] = Field("sigmoid", description=(
            "logit -> reward: `sigmoid` (in [0, 1]), `raw` (the logit), `threshold` (1 at or above `threshold`)"))
        threshold: float = Field(0.0, description="the logit at or above which `mapping: threshold` gives 1")
        pass_at: float = Field(0.5, description="`correct` is `reward >= pass_at`")
        fallback: float = Field(0.0, description=(
            "the reward of a rollout the model cannot score (oversized with `oversized: fallback`, "
            "a non-finite logit, timed out)"))
        max_length: Annotated[int, Field(ge=8, le=1 << 20, description="tokens the classifier reads a row")] = 512
        oversized: Literal["cut", "fallback"] = Field("cut", description=(
            "an input over `max_length`: `cut` (from the left, the response's end kept) or `fallback`"))
        batch_size: Annotated[int, Field(ge=1, le=4096, description="rows a forward pass")] = 16
        timeout_s: Annotated[float, Field(gt=0.0, le=86400.0, description=(
            "wall-clock seconds for one step's scoring; rows of batches not started by then get the fallback"
        ))] = 300.0

        def reward_models_loaded(self) -> tuple[tuple[str, str, int], ...]:
            """The folder ``gfcr validate`` checks (gfcr.registry.LoadsRewardModels)."""
            return (("model", self.model, self.label),)

    def __init__(self, config: Config):
        self.config = config
        self.classifier: Classifier | None = None
        self.lent = Lent()
        self._metrics: dict[str, float] = {}

    def setup(self, lent: Lent) -> None:
        self.lent = lent
        self.classifier = lent.require_reward_model(self.config.model, ALIAS)

    def step_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def run(self, groups: RolloutGroups, pool: PromptPool) -> RolloutGroups:
        cfg = self.config
        todo = [r for r in groups.rollouts() if r.reward is None]
        for rollout, (judged, note) in zip(todo, self.score_rollouts(todo, pool), strict=True):
            write_model_score(rollout, judged, name="reward_model", fallback=cfg.fallback, pass_at=cfg.pass_at,
                              note=note)
        return groups

    def score_rollouts(self, todo: list[Rollout], pool: PromptPool) -> list[tuple[Judged, str]]:
        """What the model read for each rollout, with a note for the reason; charges the step."""
        if self.classifier is None:
            raise RuntimeError(f"{ALIAS} ran before setup: the runtime calls `setup(lent)` first")
        cfg = self.config
        started = time.monotonic()
        rows = self.classifier.score([prompt_text(pool.get(r.prompt_id)) for r in todo], [r.text or "" for r in todo],
                                     format=cfg.format, max_length=cfg.max_length, batch_size=cfg.batch_size,
                                     label=cfg.label, deadline=started + cfg.timeout_s)
        seconds = time.monotonic() - started
        read = [self._read(row, seconds) for row in rows]
        tokens = sum(row.tokens for row in rows if row is not None)
        self.lent.charge_scoring(tokens)
        self._metrics = {"scored": float(len(todo)), "rm_tokens": float(tokens), "rm_s": seconds,
                         "fallbacks": float(sum(1 for judged, _ in read if judged.value is None)),
                         "timeouts": float(sum(1 for row in rows if row is None)),
                         "cut": float(sum(1 for row in rows if row is not None and row.cut))}
        return read

    def _read(self, row: Any, seconds: float) -> tuple[Judged, str]:  # row: a RowScore, or None (timed out)
        cfg = self.config
        if row is None:
            return Judged(None, f"reward model timed out after {seconds:.1f}s (timeout_s {cfg.timeout_s:g})"), ""
        if row.cut and cfg.oversized == "fallback":
            return Judged(None, f"input over max_length {cfg.max_length} tokens"), ""
        if not math.isfinite(row.logit):
            return Judged(None, f"reward model gave a non-finite logit {row.logit}"), ""
        note = f" (input cut to {cfg.max_length} tokens)" if row.cut else ""
        return Judged(self._map(row.logit), f"reward model logit {row.logit:.3g} -> {self._map(row.logit):.3g}"), note

    def _map(self, logit: float) -> float:
        cfg = self.config
        if cfg.mapping == "raw":
            return logit
        if cfg.mapping == "threshold":
            return float(logit >= cfg.threshold)
        return 1.0 / (1.0 + math.exp(-logit)) if logit >= 0 else math.exp(logit) / (1.0 + math.exp(logit))
