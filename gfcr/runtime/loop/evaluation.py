"""Evaluation: greedy accuracy of the current policy on the eval set.

Every eval prompt gets one greedy completion from the engine; its prompt's verifier scores
it. Accuracy is the fraction judged correct (not the shaped reward).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gfcr.errors import EvalError
from gfcr.records import Prompt, PromptPool
from gfcr.stages.resources import Engine, GenerationRequest, Policy, SamplingParams, prompt_tokens
from gfcr.stages.verifiers import Score
from gfcr.stages.verifiers.scoring import score_text


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    n: int
    mean_tokens: float
    seconds: float


def evaluate(policy: Policy, engine: Engine, pool: PromptPool, max_new_tokens: int,
             batch_size: int = 64) -> EvalResult:
    start = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    correct = tokens = 0
    prompts = list(pool)
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        requests = [GenerationRequest(p.prompt_id, tuple(prompt_tokens(policy, p)), 1, params) for p in chunk]
        for prompt, (completion,) in zip(chunk, engine.generate(requests)):
            score = _score(prompt, completion.text, pool.name)
            correct += score.correct
            tokens += len(completion.token_ids)
    n = len(prompts)
    return EvalResult(correct / n if n else 0.0, n, tokens / n if n else 0.0, time.perf_counter() - start)


def _score(prompt: Prompt, text: str, source: str) -> Score:
    if prompt.verifier is None:
        raise EvalError(f"eval prompt {prompt.prompt_id} of `{source}` has no verifier (no ground truth)",
                        "give every eval row an answer, or point `eval` at a source with answers")
    try:
        return score_text(text, prompt.verifier)[1]
    except ValueError as exc:  # the verifiers' way of saying a ground truth is unusable
        raise EvalError(f"eval prompt {prompt.prompt_id} of `{source}` cannot be scored: {exc}",
                        "fix that row's answer in the eval data") from None
