"""Judge agreement (issue 43, Must show 5): SmolLM2-135M-Instruct as a judge (``filter.judge``, the
template of pipelines/examples/judge_gsm8k_smollm2.yaml: yes/no against the reference) against the
rule verifier (``gsm8k``) on a fixed set of responses to the shipped GSM8K test problems:

- ``reference``: the reference solution itself (its ``#### <number>`` line): the rule says correct;
- ``perturbed``: the same solution with its final number moved by 1-9 (seeded): the rule says
  incorrect (the worked steps above it still hold the true number);
- ``own``: SmolLM2's own greedy answer to the problem (at most ``--max-new-tokens`` tokens), which
  the rule scores as it comes.

The judge runs through the stage itself (``Judge.run``) on the policy's transformers engine, greedy;
the rule verifier through ``score_text``. Per kind and in all: the confusion table (judge yes / no /
fallback against rule correct / incorrect), the agreement and Cohen's kappa (fallbacks count as
``no``). Results go to ``benchmarks/results/judge_agreement.json``; no threshold: the numbers are
the point.

Full run (a few CPU-minutes; under the heavy lock on a shared machine):
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/judge_agreement.py
Smoke run:
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/judge_agreement.py --n 3 --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from gfcr.engines import TransformersEngine, load_policy
from gfcr.records import PromptPool, RolloutGroups, VerifierSpec
from gfcr.spec import PolicySpec
from gfcr.stages.data.gsm8k import Gsm8kSource
from gfcr.stages.engine import GenerationRequest, SamplingParams
from gfcr.stages.filter.judge import Judge
from gfcr.stages.resources import Lent
from gfcr.stages.testing import scored_group
from gfcr.stages.verifiers.scoring import score_text

REPO = Path(__file__).resolve().parents[1]
PIPELINE = REPO / "pipelines" / "examples" / "judge_gsm8k_smollm2.yaml"
KINDS = ("reference", "perturbed", "own")
FINAL = re.compile(r"(####\s*)(-?[\d,]+(?:\.\d+)?)\s*$")


def judge_config() -> dict[str, Any]:
    """The shipped pipeline's judge: its ``with`` block, unchanged."""
    return yaml.safe_load(PIPELINE.read_text())["stages"]["judge"]["with"]


def perturbed(solution: str, rng: np.random.Generator) -> str:
    """The solution with the number of its ``####`` line moved by 1-9 (up or down)."""
    found = FINAL.search(solution)
    assert found, solution[-80:]
    value = float(found[2].replace(",", "")) + int(rng.integers(1, 10)) * (1 if rng.random() < 0.5 else -1)
    shown = f"{value:g}" if value != int(value) else str(int(value))
    return solution[:found.start(2)] + shown


def responses(pool: PromptPool, policy: Any, engine: TransformersEngine, max_new_tokens: int,
              seed: int) -> dict[str, list[str]]:
    rng = np.random.default_rng(seed)
    out = {"reference": [p.metadata["solution"] for p in pool], "perturbed": []}
    out["perturbed"] = [perturbed(p.metadata["solution"], rng) for p in pool]
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    requests = [GenerationRequest(f"own:{p.prompt_id}", tuple(policy.encode(p)), 1, params) for p in pool]
    out["own"] = [c.text for (c,) in engine.generate(requests)]
    return out


def judge_all(pool: PromptPool, texts: list[str], lent: Lent) -> list[tuple[float, str]]:
    groups = []
    for prompt, text in zip(pool, texts):
        group = scored_group(prompt.prompt_id, [0])
        group.rollouts[0].reward, group.rollouts[0].correct, group.rollouts[0].text = None, None, text
        groups.append(group)
    stage = Judge(Judge.Config(**judge_config()))
    stage.setup(lent)
    stage.run(RolloutGroups(groups), pool)
    return [(g.rollouts[0].reward, g.rollouts[0].reward_reason) for g in groups]


def confusion(rule: list[bool], judged: list[tuple[float, str]]) -> dict[str, Any]:
    table = {f"rule_{r}": {"judge_yes": 0, "judge_no": 0, "judge_fallback": 0} for r in ("correct", "incorrect")}
    for correct, (reward, reason) in zip(rule, judged):
        verdict = "judge_fallback" if "fallback" in reason else ("judge_yes" if reward == 1.0 else "judge_no")
        table["rule_correct" if correct else "rule_incorrect"][verdict] += 1
    judge_yes = [reward == 1.0 and "fallback" not in reason for reward, reason in judged]
    n = len(rule)
    agree = sum(a == b for a, b in zip(rule, judge_yes)) / n if n else float("nan")
    p_rule, p_judge = sum(rule) / n, sum(judge_yes) / n
    chance = p_rule * p_judge + (1 - p_rule) * (1 - p_judge)
    kappa = (agree - chance) / (1 - chance) if chance < 1 else float("nan")
    return {"n": n, "table": table, "agreement": agree, "kappa": kappa}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=50, help="GSM8K test problems (the file's first n)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="SmolLM2's own answers' length limit")
    parser.add_argument("--seed", type=int, default=0, help="the perturbations' seed")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "judge_agreement.json")
    args = parser.parse_args()
    pool = Gsm8kSource(Gsm8kSource.Config(split="test", limit=args.n)).load()
    policy = load_policy(PolicySpec(model="smollm2-135m-instruct"))
    engine = TransformersEngine(policy)
    lent = Lent(policy, engine)
    start = time.perf_counter()
    texts = responses(pool, policy, engine, args.max_new_tokens, args.seed)
    generated_s = time.perf_counter() - start
    result: dict[str, Any] = {"kinds": {}, "config": judge_config(), "n": args.n, "seed": args.seed,
                              "max_new_tokens": args.max_new_tokens}
    rule_all, judged_all = [], []
    for kind in KINDS:
        rule = [score_text(t, p.verifier or VerifierSpec("gsm8k", ""), timeout_s=None)[1].correct
                for t, p in zip(texts[kind], pool)]
        judged = judge_all(pool, texts[kind], lent)
        result["kinds"][kind] = confusion(rule, judged) | {"examples": [
            {"prompt_id": p.prompt_id, "response_tail": t[-120:], "rule": r, "judge": j[1]}
            for p, t, r, j in list(zip(pool, texts[kind], rule, judged))[:3]]}
        rule_all += rule
        judged_all += judged
    result["all"] = confusion(rule_all, judged_all)
    result["time"] = {"own_answers_s": generated_s, "total_s": time.perf_counter() - start,
                      "load": os.getloadavg(), "python": platform.python_version(), "argv": sys.argv}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for kind in (*KINDS, "all"):
        c = result["all"] if kind == "all" else result["kinds"][kind]
        t = c["table"]
        print(f"{kind:9s} n={c['n']:3d} rule-correct: yes {t['rule_correct']['judge_yes']:3d} no "
              f"{t['rule_correct']['judge_no']:3d} fb {t['rule_correct']['judge_fallback']:3d} | rule-incorrect: yes "
              f"{t['rule_incorrect']['judge_yes']:3d} no {t['rule_incorrect']['judge_no']:3d} fb "
              f"{t['rule_incorrect']['judge_fallback']:3d} | agreement {c['agreement']:.3f} kappa {c['kappa']:.3f}")


if __name__ == "__main__":
    main()
