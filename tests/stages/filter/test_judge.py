"""filter.judge: the parsers on hostile answers, the stage's declared fallbacks (empty, 10 MB, out of
range, unparseable, a hang), the verifier contract it writes, its charges, its seeds, and a frozen judge
model of its own. The scripted answers come from a labelled fake judge (``ScriptedJudge``); the hang,
the seeds and the frozen judge run real decode loops (the fake engine's, tiny-arith's)."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import pytest

from gfcr.engines import FakeEngine, TransformersEngine, load_policy
from gfcr.engines.fake import HashBatch
from gfcr.engines.decode import decode_requests
from gfcr.engines.judges import JudgeModels
from gfcr.errors import ModelError
from gfcr.records import Prompt, PromptPool, RolloutGroups, VerifierSpec
from gfcr.spec import PolicySpec
from gfcr.stages.engine import Completion, GenerationRequest
from gfcr.stages.filter.judge import Judge
from gfcr.stages.filter.judge_prompts import NumberParse, YesNoParse, check_template
from gfcr.stages.resources import Lent
from gfcr.stages.testing import scored_group

TEN_MB = "7" * 10_000_000
POOL = PromptPool([Prompt("p:0", text="What is 12 + 47? Answer:", verifier=VerifierSpec("arithmetic", "59")),
                   Prompt("p:1", text="Say hi.")])


def groups_of(texts: list[str], prompt: str = "p:0") -> RolloutGroups:
    group = scored_group(prompt, [0] * len(texts))
    for rollout, text in zip(group.rollouts, texts):
        rollout.reward, rollout.correct, rollout.text = None, None, text
    return RolloutGroups([group])


# --- the parsers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer, value, reason", [
    ("8", 0.8, "judge score 8 in [0, 10]"),
    ("Score: 7.5/10", 0.75, "judge score 7.5 in [0, 10]"),
    ("", None, "judge gave an empty answer"),
    ("   \n", None, "judge gave an empty answer"),
    ("great answer!", None, "no number in the judge's answer 'great answer!'"),
    ("11", None, "judge score 11 outside [0, 10]"),
    ("-3", None, "judge score -3 outside [0, 10]"),
    ("9" * 400, None, "is not finite"),
])
def test_number_parse(answer, value, reason):
    judged = NumberParse(range=(0, 10)).read(answer)
    assert judged.value == value and reason in judged.reason


def test_number_parse_clips_when_told():
    assert NumberParse(range=(1, 5), out_of_range="clip").read("9").value == 1.0
    assert NumberParse(range=(1, 5), out_of_range="clip").read("0").value == 0.0


@pytest.mark.parametrize("answer, value", [("Yes.", 1.0), ("no", 0.0), ("NO, it is wrong; yes?", 0.0),
                                           ("nothing", None), ("eyes only", None), ("", None)])
def test_yes_no_parse(answer, value):
    assert YesNoParse().read(answer).value == value


def test_a_10_mb_answer_is_read_from_its_head_only_and_fast():
    for parse, answer in ((NumberParse(range=(0, 10)), "x" * 10_000_000), (YesNoParse(), "x" * 10_000_000),
                          (NumberParse(range=(0, 10)), TEN_MB)):
        start = time.perf_counter()
        judged = parse.read(answer)
        assert time.perf_counter() - start < 0.05
        assert judged.value is None and len(judged.reason) < 200
    assert NumberParse(range=(0, 10)).read("5" + "x" * 10_000_000).value == 0.5


def test_template_placeholders():
    assert check_template("{prompt} / {response} / {reference} {{literal}}") == ("prompt", "reference", "response")
    for bad, says in (("{prompt} only", "no `{response}`"), ("{response} {answer}", "`{answer}`"),
                      ("{response} {}", "`{}`"), ("{response!r}", "formats `{response!r}`"),
                      ("{response} {", "does not parse")):
        with pytest.raises(Exception) as info:  # pydantic's error carrying the fix
            check_template(bad)
        assert says in str(info.value), (bad, str(info.value))


# --- the stage, on scripted answers -----------------------------------------------------------------


class ScriptedJudge:
    """TEST/FAKE judge engine and tokenizer: answers each request with the next scripted text (the
    stage's parsing, fallbacks, contract and charges are what is tested, not a model)."""

    policy_version = 0

    def __init__(self, answers: list[str]):
        self.answers, self.requests = list(answers), []

    def encode(self, prompt: Prompt) -> list[int]:
        return [ord(c) % 256 for c in prompt.text]

    def generate(self, requests: Sequence[GenerationRequest], controller=None, max_in_flight=None):
        self.requests += list(requests)
        out = []
        for _ in requests:
            text = self.answers.pop(0)
            ids = tuple(range(min(len(text), 16)))
            out.append([Completion(ids, np.zeros(len(ids), np.float32), "stop", text)])
        return out


def judged(answers: list[str], texts: list[str] | None = None, **config):
    fake = ScriptedJudge(answers)
    lent = Lent(fake, fake)
    stage = Judge(Judge.Config(**config))
    stage.setup(lent)
    out = stage.run(groups_of(texts or ["59"] * len(answers)), POOL)
    return list(out.rollouts()), stage, lent, fake


def test_hostile_answers_get_the_declared_fallback():
    answers = ["8", "", TEN_MB, "12", "no idea", "10"]
    rollouts, stage, lent, _ = judged(answers, parse={"kind": "number", "range": [0, 10]}, fallback=0.25,
                                      pass_at=0.7)
    assert [r.reward for r in rollouts] == [0.8, 0.25, 0.25, 0.25, 0.25, 1.0]
    assert [r.correct for r in rollouts] == [True, False, False, False, False, True]
    assert [r.reward_components["judge_fallback"] for r in rollouts] == [0, 1, 1, 1, 1, 0]
    reasons = [r.reward_reason for r in rollouts]
    assert reasons[0] == "judge score 8 in [0, 10]"
    assert reasons[1] == "judge fallback 0.25: judge gave an empty answer"
    assert reasons[2] == "judge fallback 0.25: the judge's number 77777777777777777777 is not finite"
    assert reasons[3] == "judge fallback 0.25: judge score 12 outside [0, 10]"
    assert reasons[4] == "judge fallback 0.25: no number in the judge's answer 'no idea'"
    assert stage.step_metrics()["fallbacks"] == 4 and stage.step_metrics()["judged"] == 6


def test_judge_tokens_are_charged_to_the_step():
    rollouts, stage, lent, fake = judged(["yes", "no"])
    prompt_tokens = sum(len(r.prompt_token_ids) for r in fake.requests)
    assert lent.take_tokens_scored() == prompt_tokens > 0
    assert lent.take_generation_charge() == (0, 5)  # "yes" and "no": 3 + 2 answer tokens, no rollouts
    assert stage.step_metrics()["judge_tokens"] == 5
    assert [r.reward for r in rollouts] == [1.0, 0.0] and [r.correct for r in rollouts] == [True, False]


def test_the_template_gets_prompt_response_and_reference():
    fake = ScriptedJudge(["yes"])
    stage = Judge(Judge.Config(template="Q={prompt}|A={response}|R={reference}"))
    stage.setup(Lent(fake, fake))
    stage.run(groups_of(["Answer: 59"]), POOL)
    assert "".join(map(chr, fake.requests[0].prompt_token_ids)) == "Q=What is 12 + 47? Answer:|A=Answer: 59|R=59"


def test_a_10_mb_response_is_cut_before_the_judge_reads_it():
    rollouts, _, _, fake = judged(["yes"], texts=[TEN_MB], template="{response}", max_response_chars=100)
    assert len(fake.requests[0].prompt_token_ids) == 100
    assert rollouts[0].reward_reason == "judge said yes (response cut to 100 chars)"


def test_a_reference_the_prompt_lacks_is_an_error():
    stage = Judge(Judge.Config(template="{response} vs {reference}"))
    fake = ScriptedJudge(["yes"])
    stage.setup(Lent(fake, fake))
    with pytest.raises(ValueError, match="prompt p:1 has no ground truth"):
        stage.run(groups_of(["hi"], prompt="p:1"), POOL)


def test_scored_rollouts_are_left_alone():
    groups = groups_of(["59", "58"])
    groups.groups[0].rollouts[0].reward = 0.5
    fake = ScriptedJudge(["yes"])
    stage = Judge(Judge.Config())
    stage.setup(Lent(fake, fake))
    stage.run(groups, POOL)
    assert [r.reward for r in groups.rollouts()] == [0.5, 1.0] and len(fake.requests) == 1


# --- a hang: the deadline stops the judge's decode loop ------------------------------------------


class EndlessBatch(HashBatch):
    """TEST/FAKE: the fake model, slowed to 20 ms a decode step and never ending a row (a hung judge)."""

    def add(self, contexts):
        return self._endless(super().add(contexts))

    def step(self, tokens):
        time.sleep(0.02)
        return self._endless(super().step(tokens))

    @staticmethod
    def _endless(logits):
        logits[:, FakeEngine.eos_token_id] = -float("inf")
        return logits


class HangingJudge(FakeEngine):
    """TEST/FAKE: the fake engine over ``EndlessBatch``; it would decode 100,000 tokens a row."""

    def encode(self, prompt: Prompt) -> list[int]:  # the judge's prompt, as the fake alphabet
        return [1 + (ord(c) % 26) for c in prompt.text]

    def generate(self, requests, controller=None, max_in_flight=None):
        return decode_requests(requests, EndlessBatch(len(self.ALPHABET)), eos=self.eos_token_id, decode=self.decode,
                               controller=controller, max_in_flight=256, replica=self.replica)


def test_a_hung_judge_is_stopped_at_the_timeout_and_falls_back():
    judge = HangingJudge()
    stage = Judge(Judge.Config(max_new_tokens=4096, timeout_s=0.5, fallback=0.0))
    stage.setup(Lent(judge, judge))
    start = time.perf_counter()
    rollouts = list(stage.run(groups_of(["59", "58"]), POOL).rollouts())
    assert time.perf_counter() - start < 5.0  # 4096 steps x 20 ms = 82 s without the deadline
    assert all(r.reward == 0.0 and r.correct is False for r in rollouts)
    assert all(r.reward_reason.startswith("judge fallback 0: judge timed out after") for r in rollouts)
    assert stage.step_metrics()["timeouts"] == 2


# --- real models: seeds and a frozen judge of its own ------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    policy = load_policy(PolicySpec(model="tiny-arith"))
    return policy, TransformersEngine(policy)


def answers(tiny, **config) -> list[str]:
    stage = Judge(Judge.Config(template="What is {response} + 1? Answer:", parse={"kind": "number", "range": [0, 999]},
                               max_new_tokens=4, **config))
    stage.setup(Lent(*tiny))
    return [r.reward_reason for r in stage.run(groups_of(["12", "23", "34", "45", "56", "67"]), POOL).rollouts()]


def test_a_sampling_judge_is_reproducible_from_its_seed(tiny):
    first = answers(tiny, temperature=1.0, seed=3)
    assert answers(tiny, temperature=1.0, seed=3) == first
    assert answers(tiny, temperature=1.0, seed=4) != first


def test_a_judge_model_of_its_own_is_loaded_once_and_frozen(tiny):
    judges = JudgeModels()
    stage = Judge(Judge.Config(model="tiny-arith", template="What is {response} + 1? Answer:",
                               parse={"kind": "number", "range": [0, 999]}, max_new_tokens=4))
    stage.setup(Lent(*tiny, judges=judges))
    judge_policy, _ = judges("tiny-arith")
    assert judge_policy is not tiny[0] and judges("tiny-arith")[0] is judge_policy  # loaded once
    assert not any(p.requires_grad for p in judge_policy.model.parameters())
    own = [r.reward_reason for r in stage.run(groups_of(["12", "23", "34", "45", "56", "67"]), POOL).rollouts()]
    assert own == answers(tiny)  # same weights (untrained policy), same greedy answers


def test_a_judge_model_without_a_runtime_to_serve_it_is_refused():
    stage = Judge(Judge.Config(model="tiny-arith"))
    with pytest.raises(ModelError, match="serves no judge model"):
        stage.setup(Lent())
