"""Score-path benchmark (issue 10, Must show 1): the transformers engine's two ways of scoring
sampled responses, side by side in one run, SmolLM2 on GSM8K prompts.

- ``forward`` (the default ``policy.score_path``): one forward pass per batch of (prompt,
  response) pairs;
- ``decode``: the responses teacher-forced through the decode loop, one KV-cached step per
  token, in the order they were sampled (bit-for-bit their sampling log-probs), and once more
  in a shuffled order (another batch arrangement: close, not equal).

For each: wall (median of ``--repeats``, the paths alternating), scored tokens/s, and the
largest gap between the scored log-probs (and entropies) and the sampling ones. The responses
come from one ``generate`` call on the same engine, timed too for scale. Results go to
``benchmarks/results/score_paths.json``.

Full run (minutes on CPU):
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/score_paths.py
Smoke run:
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/score_paths.py --prompts 2 --samples 2 --max-new-tokens 16 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.generation import load_questions, timed
from gfcr.engines import TransformersEngine, load_policy
from gfcr.records import Prompt
from gfcr.spec import PolicySpec
from gfcr.stages.engine import Completion, GenerationRequest, SamplingParams, Scored, ScoreRequest

REPO = Path(__file__).resolve().parents[1]


def gaps(completions: list[Completion], scored: list[Scored]) -> dict[str, float]:
    """The largest |scored - sampled| over every token, for log-probs and entropies."""
    lp = max(float(np.abs(s.logprobs - c.logprobs).max(initial=0.0)) for c, s in zip(completions, scored))
    ent = max(float(np.abs(s.entropy - c.entropy).max(initial=0.0)) for c, s in zip(completions, scored))
    return dict(max_logprob_gap=lp, max_entropy_gap=ent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "score_paths.json")
    args = ap.parse_args()

    policy = load_policy(PolicySpec(model=args.model))
    questions = load_questions(args.prompts)
    prompts = [tuple(policy.encode(Prompt(f"gsm8k:{i}", messages=[{"role": "user", "content": q}])))
               for i, q in enumerate(questions)]
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed,
                            entropy=True)
    requests = [GenerationRequest(f"g{i}", p, args.samples, params) for i, p in enumerate(prompts)]
    engines = {path: TransformersEngine(policy, score_path=path) for path in ("forward", "decode")}
    groups, gen_wall = timed("generate", lambda: engines["forward"].generate(requests))
    pairs = [(r, c) for r, g in zip(requests, groups) for c in g]
    completions = [c for _, c in pairs]
    to_score = [ScoreRequest(r.prompt_token_ids, c.token_ids, args.temperature) for r, c in pairs]
    tokens = sum(len(c.token_ids) for c in completions)
    results: dict[str, Any] = dict(model=args.model, prompts=args.prompts, samples=args.samples,
                                   max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                   repeats=args.repeats, threads=torch.get_num_threads(),
                                   machine=platform.processor() or platform.machine(), scored_tokens=tokens,
                                   generate=dict(wall_s=round(gen_wall, 3), tokens_per_s=round(tokens / gen_wall, 2)))
    walls: dict[str, list[float]] = {"forward": [], "decode": []}
    for _ in range(args.repeats):
        for path, engine in engines.items():
            scored, wall = timed(f"score {path}", lambda: engine.score(to_score))
            walls[path].append(wall)
            results[path] = gaps(completions, scored)
    for path, w in walls.items():
        median = statistics.median(w)
        results[path].update(wall_s=round(median, 3), walls_s=[round(x, 3) for x in w],
                             tokens_per_s=round(tokens / median, 2))
    order = list(range(len(to_score)))
    random.Random(args.seed).shuffle(order)
    shuffled, wall = timed("score decode, shuffled", lambda: engines["decode"].score([to_score[i] for i in order]))
    back = [None] * len(order)
    for k, i in enumerate(order):
        back[i] = shuffled[k]
    results["decode_shuffled"] = dict(gaps(completions, back), wall_s=round(wall, 3))  # type: ignore[arg-type]
    results["decode_over_forward_wall"] = round(results["decode"]["wall_s"] / results["forward"]["wall_s"], 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(main())
