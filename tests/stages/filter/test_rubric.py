"""filter.rubric with real criteria: a math-verify correctness criterion (the ``math`` verifier in its
worker processes), a format rule, a length rule, and a judge question (the scripted judge of
test_judge.py: the judge's parsing and fallbacks are what is tested), weighted; the normalisations,
each criterion's score in the components and the reason, the declared fallback of a judge criterion,
the charges, and the Config's refusals."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gfcr.engines import load_policy
from gfcr.records import Prompt, PromptPool, RolloutGroups, VerifierSpec
from gfcr.spec import PolicySpec
from gfcr.stages.filter.rubric import Rubric
from gfcr.stages.resources import Lent
from gfcr.stages.testing import scored_group
from tests.stages.filter.test_judge import ScriptedJudge

POOL = PromptPool([Prompt("m:0", text="What is 1/4 + 1/4? Put the answer in \\boxed{}.",
                          verifier=VerifierSpec("math", "\\frac{1}{2}"))])
TEXTS = ["1/4 + 1/4 = \\boxed{0.5}", "The answer is 1/2", "\\boxed{\\frac{1}{3}}",
         "Let me think. " * 20 + "\\boxed{\\frac{2}{4}}"]
CRITERIA = {"correct": {"kind": "verifier", "verifier": "math", "weight": 0.6},
            "format": {"kind": "regex", "pattern": r"\\boxed\{", "weight": 0.3},
            "short": {"kind": "length", "max_tokens": 40, "weight": 0.1}}


def _groups(texts: list[str]) -> RolloutGroups:
    group = scored_group("m:0", [0] * len(texts))
    for rollout, text in zip(group.rollouts, texts):
        rollout.reward, rollout.correct, rollout.text = None, None, text
        rollout.response_token_ids = list(range(len(text.split())))  # a token a word
    return RolloutGroups([group])


def _run(texts=TEXTS, lent: Lent | None = None, **config):
    stage = Rubric(Rubric.Config(**config))
    stage.setup(lent or Lent())
    return list(stage.run(_groups(texts), POOL).rollouts()), stage


def test_math_verify_format_and_length_weighted():
    rollouts, stage = _run(criteria=CRITERIA)
    correct = [r.reward_components["correct"] for r in rollouts]
    assert correct == [1.0, 1.0, 0.0, 1.0]  # math-verify: 0.5 == 1/2 == 2/4, 1/3 is not
    assert [r.reward_components["format"] for r in rollouts] == [1.0, 0.0, 1.0, 1.0]
    assert [r.reward_components["short"] for r in rollouts] == [1.0, 1.0, 1.0, 0.0]
    assert [r.reward for r in rollouts] == pytest.approx([1.0, 0.7, 0.4, 0.9])
    assert [r.correct for r in rollouts] == [True, True, False, True]
    assert all(r.reward_components["rubric_fallbacks"] == 0 for r in rollouts)
    assert rollouts[3].reward_reason.startswith("rubric 0.9: correct 1 (")
    assert rollouts[3].reward_reason.endswith("; format 1; short 0 (61 tokens > 40)")
    assert stage.step_metrics() == pytest.approx({"correct_mean": 0.75, "format_mean": 0.75, "short_mean": 0.75,
                                                  "fallbacks": 0.0})


def test_sum_normalisation_and_pass_at():
    rollouts, _ = _run(criteria=CRITERIA | {"format": {"kind": "regex", "pattern": r"\\boxed\{", "weight": 3}},
                       normalise="sum", pass_at=3.5)
    assert [r.reward for r in rollouts] == pytest.approx([3.7, 0.7, 3.1, 3.6])
    assert [r.correct for r in rollouts] == [True, False, False, True]


def test_a_judge_criterion_asks_like_filter_judge_and_falls_back_as_declared():
    fake = ScriptedJudge(["yes", "", "no", "maybe"])
    criteria = CRITERIA | {"clear": {"kind": "judge", "weight": 1.0, "template": "Is this clear? {response}",
                                     "fallback": 0.5}}
    lent = Lent(fake, fake)
    rollouts, stage = _run(lent=lent, criteria=criteria)
    assert [r.reward_components["clear"] for r in rollouts] == [1.0, 0.5, 0.0, 0.5]
    assert [r.reward_components["rubric_fallbacks"] for r in rollouts] == [0, 1, 0, 1]
    assert rollouts[1].reward_reason.endswith("; clear fallback 0.5: judge gave an empty answer")
    assert rollouts[3].reward_reason.endswith("; clear fallback 0.5: no yes or no in the judge's answer 'maybe'")
    assert [r.reward for r in rollouts] == pytest.approx([1.0, 0.6, 0.2, 0.7])  # (0.7 + 0.5) / 2 ...
    assert lent.take_tokens_scored() == sum(len(q.prompt_token_ids) for q in fake.requests) > 0
    assert "".join(map(chr, fake.requests[0].prompt_token_ids)) == f"Is this clear? {TEXTS[0]}"
    assert stage.step_metrics()["fallbacks"] == 2


def test_a_judge_criterion_on_a_real_model_scores_every_row():
    policy = load_policy(PolicySpec(model="tiny-arith"))
    from gfcr.engines import TransformersEngine

    criteria = {"judged": {"kind": "judge", "template": "{response} + 1 =", "max_new_tokens": 3,
                           "parse": {"kind": "number", "range": [0, 99]}},
                "short": {"kind": "length", "max_tokens": 40}}
    rollouts, _ = _run(["59", "12"], lent=Lent(policy, TransformersEngine(policy)), criteria=criteria)
    for rollout in rollouts:
        score, fell = rollout.reward_components["judged"], rollout.reward_components["rubric_fallbacks"]
        assert (fell == 1 and "judged fallback 0:" in rollout.reward_reason) or (
            fell == 0 and f"judged {score:g} (judge score" in rollout.reward_reason)
        assert rollout.reward == pytest.approx((score + 1.0) / 2)


@pytest.mark.parametrize("criteria, says", [
    ({"a": {"kind": "length", "max_tokens": 4, "weight": 0}}, "every criterion has weight 0"),
    ({"a": {"kind": "regex", "pattern": "(unclosed"}}, "is not a regular expression"),
    ({"Bad-Name": {"kind": "length", "max_tokens": 4}}, "is not a lower-case identifier"),
    ({"a": {"kind": "verifier", "verifier": "gsm8"}}, "did you mean `gsm8k`?"),
    ({"a": {"kind": "judge", "template": "{prompt} only"}}, "no `{response}` placeholder"),
    ({"a": {"kind": "vibes"}}, "does not match any of the expected tags"),
    ({}, "at least 1 item"),
])
def test_bad_criteria_are_refused(criteria, says):
    with pytest.raises(ValidationError, match=says.replace("(", r"\(").replace("?", r"\?")
                       .replace("{", r"\{").replace("}", r"\}")):
        Rubric.Config(criteria=criteria)


def test_only_a_judge_criterion_makes_it_call_the_engine():
    assert not Rubric.Config(criteria=CRITERIA).steers_engine_calls
    judged = Rubric.Config(criteria={"j": {"kind": "judge", "model": "smollm2-135m-instruct"}})
    assert judged.steers_engine_calls and judged.models_loaded() == (("criteria.j.model", "smollm2-135m-instruct"),)
    assert Rubric.Config(criteria=CRITERIA).models_loaded() == ()
