"""filter.reward_model with a real transformer classifier (a tiny BERT built here, all-MiniLM-L6-v2's
tokenizer): the scores equal the classifier's own forward pass one row at a time (so batching and
padding change nothing), the mappings, the declared fallbacks (oversized, non-finite, timed out), the
charges, and ``check_reward_model``'s refusals, each with the fix."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

from gfcr.engines.models import resolve_model
from gfcr.engines.reward_models import RewardModel as Classifier
from gfcr.engines.reward_models import RewardModels, check_reward_model, encode
from gfcr.errors import ModelError
from gfcr.records import Prompt, PromptPool, RolloutGroups
from gfcr.stages.common.embedding import packaged_model_dir
from gfcr.stages.filter.reward_model import RewardModel
from gfcr.stages.resources import Lent
from gfcr.stages.testing import scored_group

POOL = PromptPool([Prompt("p:0", text="Natalia sold clips to 48 of her friends in April, and then she sold half "
                                       "as many clips in May. How many clips did Natalia sell altogether?")])
TEXTS = ["48 / 2 = 24 in May. 48 + 24 = 72\n#### 72", "48 + 24 = 72\n#### 73", "72", "",
         "She sold 48 in April and 24 in May, so 72 in all. " * 3 + "#### 72"]


def _classifier(folder: Path, labels: int = 2, seed: int = 0, nan: bool = False) -> str:
    AutoTokenizer.from_pretrained(str(packaged_model_dir())).save_pretrained(folder)
    torch.manual_seed(seed)
    model = BertForSequenceClassification(BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                     intermediate_size=32, num_labels=labels, initializer_range=0.3))
    if nan:
        with torch.no_grad():
            model.classifier.bias.fill_(float("nan"))
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return _classifier(tmp_path_factory.mktemp("rm"))


def _groups(texts: list[str] = TEXTS) -> RolloutGroups:
    group = scored_group("p:0", [0] * len(texts))
    for rollout, text in zip(group.rollouts, texts):
        rollout.reward, rollout.correct, rollout.text = None, None, text
    return RolloutGroups([group])


def _run(folder: str, texts: list[str] = TEXTS, **config) -> tuple[RewardModel, RolloutGroups, Lent]:
    stage, lent = RewardModel(RewardModel.Config(model=folder, **config)), Lent(reward_models=RewardModels())
    stage.setup(lent)
    return stage, stage.run(_groups(texts), POOL), lent


def _direct_log_odds(folder: str, text: str) -> float:
    """The classifier's forward on one row, through transformers alone: logit[1] - logit[0]."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = BertForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = model(**tokenizer(POOL.get("p:0").text, text, return_tensors="pt")).logits[0]
    return float(logits[1] - logits[0])


def test_scores_equal_the_classifiers_own_forward_row_by_row(folder):
    stage, groups, lent = _run(folder, mapping="raw", batch_size=3)
    expected = [_direct_log_odds(folder, t) for t in TEXTS]
    got = [r.reward for r in groups.rollouts()]
    assert got == pytest.approx(expected, abs=1e-5)
    assert len(set(round(g, 4) for g in got)) == len(got)  # the rows differ: the text reaches the head
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokens = sum(len(tokenizer(POOL.get("p:0").text, t)["input_ids"]) for t in TEXTS)
    assert stage.step_metrics()["rm_tokens"] == tokens and lent.tokens_scored == tokens
    assert stage.step_metrics()["scored"] == len(TEXTS) and stage.step_metrics()["fallbacks"] == 0
    for rollout in groups.rollouts():
        assert rollout.reward_components == {"reward_model": rollout.reward, "reward_model_fallback": 0.0}
        assert rollout.reward_reason.startswith(f"reward model logit {rollout.reward:.3g} -> ")
        assert rollout.correct == (rollout.reward >= 0.5)


def test_the_mappings_and_the_label(folder):
    raw = [r.reward for r in _run(folder, mapping="raw")[1].rollouts()]
    sigmoid = [r.reward for r in _run(folder)[1].rollouts()]
    assert sigmoid == pytest.approx([1 / (1 + math.exp(-x)) for x in raw])
    cut_at = sorted(raw)[2]
    threshold = [r.reward for r in _run(folder, mapping="threshold", threshold=cut_at)[1].rollouts()]
    assert threshold == [float(x >= cut_at) for x in raw] and sum(threshold) == 3
    label0 = [r.reward for r in _run(folder, mapping="raw", label=0)[1].rollouts()]
    assert label0 == pytest.approx([-x for x in raw], abs=1e-6)


def test_a_one_label_head_gives_its_logit(tmp_path):
    folder = _classifier(tmp_path, labels=1)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = BertForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        logit = float(model(**tokenizer(POOL.get("p:0").text, TEXTS[0], return_tensors="pt")).logits[0, 0])
    assert list(_run(folder, TEXTS[:1], mapping="raw")[1].rollouts())[0].reward == pytest.approx(logit, abs=1e-5)


def test_an_oversized_input_is_cut_keeping_the_response_end_or_falls_back(folder):
    long = "word " * 2000 + "#### 72"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    row = encode(tokenizer, POOL.get("p:0").text, long, format="pair", max_length=64)
    assert row.cut and len(row.ids) == len(row.types) == 64
    assert tokenizer.decode(row.ids[-6:-1]).replace(" ", "") == "####72"  # the response's end, then [SEP]
    assert tokenizer.decode(row.ids[:3]) == "[CLS] natalia sold"  # the shorter prompt kept whole
    stage, groups, _ = _run(folder, [long, TEXTS[0]], max_length=64)
    cut_row, short = list(groups.rollouts())
    assert cut_row.reward_reason.endswith("(input cut to 64 tokens)") and cut_row.reward_components[
        "reward_model_fallback"] == 0.0
    assert stage.step_metrics()["cut"] == 1 and stage.step_metrics()["rm_tokens"] <= 128
    _, groups, _ = _run(folder, [long, TEXTS[0]], max_length=64, oversized="fallback", fallback=0.25)
    cut_row, short = list(groups.rollouts())
    assert (cut_row.reward, cut_row.correct) == (0.25, False)
    assert cut_row.reward_reason == "reward model fallback 0.25: input over max_length 64 tokens"
    assert cut_row.reward_components == {"reward_model": 0.25, "reward_model_fallback": 1.0}
    assert short.reward_components["reward_model_fallback"] == 0.0


def test_a_non_finite_logit_falls_back(tmp_path):
    stage, groups, _ = _run(_classifier(tmp_path, nan=True), TEXTS[:2])
    for rollout in groups.rollouts():
        assert rollout.reward == 0.0 and rollout.correct is False
        assert rollout.reward_reason == "reward model fallback 0: reward model gave a non-finite logit nan"
    assert stage.step_metrics()["fallbacks"] == 2


def test_rows_not_started_by_the_timeout_fall_back(folder):
    stage, groups, lent = _run(folder, timeout_s=1e-9, batch_size=2)
    for rollout in groups.rollouts():
        assert rollout.reward == 0.0 and rollout.reward_components["reward_model_fallback"] == 1.0
        assert "reward model fallback 0: reward model timed out after" in rollout.reward_reason
        assert "(timeout_s 1e-09)" in rollout.reward_reason
    assert stage.step_metrics()["timeouts"] == len(TEXTS) and lent.tokens_scored == 0


def test_rollouts_that_carry_a_reward_are_left_alone(folder):
    groups = _groups(TEXTS[:2])
    first = next(iter(groups.rollouts()))
    first.reward, first.reward_reason = 1.0, "replayed"
    stage = RewardModel(RewardModel.Config(model=folder))
    stage.setup(Lent(reward_models=RewardModels()))
    stage.run(groups, POOL)
    assert first.reward_reason == "replayed" and stage.step_metrics()["scored"] == 1


def test_chat_format_needs_a_chat_template(folder):
    with pytest.raises(ModelError, match="no chat template"):
        _run(folder, TEXTS[:1], format="chat")


def test_check_reward_model_refuses_with_the_fix(tmp_path):
    with pytest.raises(ModelError, match="no folder there") as missing:
        check_reward_model(str(tmp_path / "absent"))
    assert "benchmarks/train_reward_model.py" in missing.value.fix
    with pytest.raises(ModelError, match="no sequence-classification head") as causal:
        check_reward_model(str(resolve_model("tiny-arith")))
    assert "AutoModelForSequenceClassification" in causal.value.fix
    three = _classifier(tmp_path / "three", labels=3)
    with pytest.raises(ModelError, match="has 3 labels"):
        check_reward_model(three)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        check_reward_model(str(tmp_path / "empty"))
    assert json.loads((Path(three) / "config.json").read_text())["architectures"] == ["BertForSequenceClassification"]


def test_the_runtime_lends_one_model_per_folder(folder):
    models = RewardModels()
    assert models(folder) is models(folder) and isinstance(models(folder), Classifier)


def test_without_a_lent_reward_model_setup_says_how(folder):
    with pytest.raises(ModelError, match="serves no reward model"):
        RewardModel(RewardModel.Config(model=folder)).setup(Lent())
