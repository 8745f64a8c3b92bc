"""Pass rate by difficulty bin of the shipped policies on reasoning-gym tasks (issue 42, Build 1).

Which reasoning-gym tasks, at which difficulty, can gfcr's CPU policies partly solve? A
difficulty-driven method (GRESO, DARS, CoBA, MoPPS, ...) needs prompts the policy sometimes
solves and sometimes not. For each policy, task and difficulty bin (a ``reasoning_gym`` source
level), ``--prompts`` prompts each get one greedy answer and ``--samples`` samples at
temperature 1, scored by the ``reasoning_gym`` verifier (the task's ``score_answer``). Columns:

- ``greedy``: greedy accuracy;
- ``pass@1``: the mean accuracy of the temperature-1 samples (what GRPO's groups see);
- ``mixed``: the share of prompts whose samples are neither all right nor all wrong (the groups
  with a learning signal);
- ``question fits``: the share of reasoning-gym's own questions the policy's tokenizer can write
  without ``<unk>`` (and, in brackets, of the prompts as sent).
  The tiny-arith models know about 30 characters (digits, ``+ - * : ?``, the letters of
  ``What is ... Answer``): reasoning-gym's own questions never fit, so they get the arithmetic
  tasks' ``expression`` in their training format (``What is {expression}? Answer:``); SmolLM2
  gets reasoning-gym's question as a chat turn, asked to put the answer after ``Answer:``.

Run (one thread; minutes, SmolLM2 most of it), under the heavy lock on a shared machine::

    flock /tmp/gfcr-heavy.lock nice -n 5 env PYTHONPATH=. HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 \\
        python benchmarks/rg_pass_rates.py

Results go to ``benchmarks/results/rg_pass_rates.json`` and print as the markdown table of
``docs/reasoning-gym.md``. ``--policies tiny-arith-h64`` runs one policy (``--merge`` adds it to the
file's others); ``--prompts 4`` a smoke run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gfcr.engines import TransformersEngine, load_policy
from gfcr.records import PromptPool
from gfcr.spec import PolicySpec
from gfcr.stages.data.reasoning_gym import ReasoningGymSource
from gfcr.stages.engine import GenerationRequest, SamplingParams
from gfcr.stages.resources import prompt_tokens
from gfcr.stages.verifiers.scoring import score_text

REPO = Path(__file__).resolve().parents[1]
TINY_TEMPLATE = "What is {expression}? Answer:"
CHAT_TEMPLATE = "{question}\nPut the final answer after 'Answer:'."


def lv(name: str, **config: Any) -> dict[str, Any]:
    return {"name": name, "config": config}


def terms(n: int, digits: int) -> dict[str, int]:
    return {"min_terms": n, "max_terms": n, "min_digits": digits, "max_digits": digits}


PLAIN = {"operators": ["+", "-", "*"], "allow_parentheses": False, "allow_negation": False}
# the tasks whose items carry an `expression` in the tiny-arith models' alphabet
ARITH_TASKS = [
    {"task": "chain_sum", "levels": [lv("2x1d", **terms(2, 1)), lv("2x2d", **terms(2, 2)),
                                     lv("3x1d", **terms(3, 1)), lv("3x2d", **terms(3, 2))]},
    {"task": "basic_arithmetic", "levels": [lv("2x1d", **terms(2, 1), **PLAIN), lv("2x2d", **terms(2, 2), **PLAIN),
                                            lv("3x1d", **terms(3, 1), **PLAIN)]},
    {"task": "products", "levels": [lv("1d", **terms(2, 1)), lv("1-2d", min_terms=2, max_terms=2, min_digits=1,
                                                                max_digits=2), lv("2d", **terms(2, 2))]},
]
WORD_TASKS = [
    {"task": "leg_counting", "levels": [lv("1animal", min_animals=1, max_animals=1, min_instances=1, max_instances=3),
                                        lv("2animals", min_animals=2, max_animals=2, min_instances=1, max_instances=3),
                                        lv("4animals", min_animals=4, max_animals=4, min_instances=1,
                                           max_instances=5)]},
    {"task": "gcd", "levels": [lv("to20", min_value=1, max_value=20), lv("to100", min_value=1, max_value=100)]},
]
POLICIES = {  # policy -> (template, chat, tasks, max_new_tokens)
    "tiny-arith-h64": (TINY_TEMPLATE, False, ARITH_TASKS, 8),
    "tiny-arith": (TINY_TEMPLATE, False, ARITH_TASKS, 8),
    "tiny-arith-mix": (TINY_TEMPLATE, False, ARITH_TASKS, 8),
    "smollm2-135m-instruct": (CHAT_TEMPLATE, True, ARITH_TASKS + WORD_TASKS, 48),
}


def pool_for(task: dict[str, Any], template: str, chat: bool, prompts: int, seed: int) -> PromptPool:
    config = ReasoningGymSource.Config(n=prompts * len(task["levels"]), seed=seed, template=template, chat=chat,
                                       tasks=[task])
    return ReasoningGymSource(config).load()


def fits(policy: Any, pool: PromptPool) -> float:
    """The share of prompts the tokenizer writes without its unknown token."""
    unk = policy.tokenizer.unk_token_id
    return sum(unk is None or unk not in prompt_tokens(policy, p) for p in pool) / len(pool)


def own_question_fits(policy: Any, task: dict[str, Any], prompts: int, seed: int) -> float:
    """``fits`` for reasoning-gym's own question text, as plain text."""
    return fits(policy, pool_for(task, "{question}", False, prompts, seed))


def measure(policy: Any, engine: TransformersEngine, pool: PromptPool, samples: int, max_new: int,
            seed: int) -> dict[str, dict[str, Any]]:
    """Per level: greedy accuracy, pass@1 at temperature 1, the share of mixed groups, tokens."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=seed)
    ids = [tuple(prompt_tokens(policy, p)) for p in pool]
    first = engine.generate([GenerationRequest(f"g{i}", t, 1, greedy) for i, t in enumerate(ids)])
    groups = engine.generate([GenerationRequest(f"s{i}", t, samples, sampled) for i, t in enumerate(ids)])
    out: dict[str, dict[str, Any]] = {}
    for prompt, (g,), group in zip(pool, first, groups):
        row = out.setdefault(prompt.metadata["level"], {"n": 0, "greedy": 0, "right": 0, "mixed": 0, "tokens": 0})
        right = [score_text(c.text, prompt.verifier, timeout_s=None)[1].correct for c in group]
        row["n"] += 1
        row["greedy"] += score_text(g.text, prompt.verifier, timeout_s=None)[1].correct
        row["right"] += sum(right)
        row["mixed"] += 0 < sum(right) < len(right)
        row["tokens"] += sum(len(c.token_ids) for c in group)
        row.setdefault("example", {"prompt": (prompt.text or prompt.messages[0]["content"])[-80:],
                                   "reference": prompt.verifier.ground_truth, "greedy": g.text[:80]})
    return {level: {"prompts": r["n"], "greedy": r["greedy"] / r["n"], "pass@1": r["right"] / (r["n"] * samples),
                    "mixed": r["mixed"] / r["n"], "mean_tokens": r["tokens"] / (r["n"] * samples),
                    "example": r["example"]} for level, r in out.items()}


def run_policy(name: str, args: argparse.Namespace) -> dict[str, Any]:
    template, chat, tasks, max_new = POLICIES[name]
    start = time.perf_counter()
    policy = load_policy(PolicySpec(model=name))
    policy.model.eval()
    engine = TransformersEngine(policy)
    result: dict[str, Any] = {"template": template, "chat": chat, "max_new_tokens": max_new, "tasks": {}}
    for task in tasks:
        pool = pool_for(task, template, chat, args.prompts, args.seed)
        levels = measure(policy, engine, pool, args.samples, max_new, args.seed)
        result["tasks"][task["task"]] = {
            "fits": fits(policy, pool), "own_question_fits": own_question_fits(policy, task, args.prompts, args.seed),
            "levels": {lvl["name"]: {**levels[lvl["name"]], "config": lvl["config"]} for lvl in task["levels"]}}
        print(f"{name} {task['task']}: " + ", ".join(f"{k} {v['pass@1']:.2f}" for k, v in levels.items()),
              file=sys.stderr, flush=True)
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def table(results: dict[str, Any]) -> str:
    lines = ["| policy | task | level | question fits | greedy | pass@1 (T=1) | mixed groups | prompts |",
             "|---|---|---|---|---|---|---|---|"]
    for name, res in results["policies"].items():
        for task, t in res["tasks"].items():
            for level, r in t["levels"].items():
                fit = f"{t['own_question_fits']:.0%} (as sent: {t['fits']:.0%})"
                lines.append(f"| {name} | {task} | {level} | {fit} | {r['greedy']:.2f} | {r['pass@1']:.2f} "
                             f"| {r['mixed']:.2f} | {r['prompts']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--prompts", type=int, default=32, help="prompts per difficulty bin")
    ap.add_argument("--samples", type=int, default=8, help="temperature-1 samples per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "rg_pass_rates.json")
    ap.add_argument("--merge", action="store_true", help="add these policies to --out's, keeping the others")
    args = ap.parse_args()
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.merge and args.out.is_file() else {
        "machine": platform.processor() or platform.machine(), "policies": {}}
    results["reasoning_gym"] = importlib.metadata.version("reasoning-gym")
    for name in args.policies:
        load_before = os.getloadavg()[0]
        results["policies"][name] = {**run_policy(name, args), "prompts_per_bin": args.prompts,
                                     "samples": args.samples, "seed": args.seed, "threads": torch.get_num_threads(),
                                     "load_before": load_before, "load_after": os.getloadavg()[0]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
