"""Step time of GRPO on SmolLM2-135M-Instruct: gfcr against the plain hand-written loop and
stock TRL, side by side in one run, on the same machine and the same prompts.

    .venv/bin/python benchmarks/smollm2_step_time.py [--steps 4] [--skip-trl]

Settings are the peer baseline's (../shared/peers/trl_cpu): 8 prompts x 8 rollouts, 48 new
tokens, temperature 1.0, fp32, no reference model, one AdamW update per batch in
micro-batches of 16, lr 5e-6, clip 0.2. All three read the peer's arithmetic prompts
(``arith_task.train_set``, chat template applied) and its reward rule; gfcr reads them
through its ``jsonl`` data source and scores them with its ``arithmetic`` verifier.

- hand loop: ``hand_grpo.py`` with ``SMOLLM2_HF`` pointing at gfcr's cached safetensors copy;
- TRL: ``trl_grpo.py`` in its own environment (``benchmarks/setup_trl_env.sh`` makes
  ``.bench/trl-venv``); skipped with a note when that environment is missing;
- gfcr: ``gfcr run`` of ``pipelines/grpo_arith_smollm2.yaml`` with the data swapped for the
  peer's prompts and evaluation off.

The runs go one after another (two cores cannot host two fairly). Each reports its own step
time; the first step is dropped as warm-up and the median of the rest is compared. Writes
``benchmarks/results/smollm2_step_time.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PEERS = (REPO / ".." / "shared" / "peers" / "trl_cpu").resolve()
WORK = REPO / ".bench" / "smollm2"
TRL_PYTHON = REPO / ".bench" / "trl-venv" / "bin" / "python"


def peer_prompts(path: Path) -> None:
    """The peer's training prompts as a jsonl file gfcr can read."""
    sys.path.insert(0, str(PEERS))
    from arith_task import train_set

    rows = [{"id": i, "prompt": p["question"], "answer": str(p["answer"])} for i, p in enumerate(train_set())]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def gfcr_pipeline(prompts: Path, out: Path) -> None:
    spec = yaml.safe_load((REPO / "pipelines" / "grpo_arith_smollm2.yaml").read_text())
    spec["name"] = "bench-grpo-smollm2"
    spec["policy"]["engine"] = "hf"  # the loops compared here are transformers loops (vLLM: benchmarks/vllm_cpu.py)
    spec["data"] = {"source": "jsonl", "with": {"path": str(prompts), "verifier": "arithmetic", "name": "peer"}}
    spec.pop("eval", None)
    spec["run"] = {"steps": 1, "seed": 42}
    out.write_text(yaml.safe_dump(spec, sort_keys=False))


def run(cmd: list[str], env: dict[str, str], log: Path) -> float:
    start = time.perf_counter()
    with open(log, "w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=WORK)
    return time.perf_counter() - start


def step_times(path: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    values = []
    for r in rows:
        value = r
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            values.append(float(value))
    return values


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--skip-trl", action="store_true")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    from gfcr.engines import resolve_model

    env["SMOLLM2_HF"] = str(resolve_model("smollm2-135m-instruct"))
    prompts, pipeline = WORK / "peer_prompts.jsonl", WORK / "bench_pipeline.yaml"
    peer_prompts(prompts)
    gfcr_pipeline(prompts, pipeline)

    results: dict[str, dict] = {}
    hand_out = WORK / "hand"
    for d in (hand_out, WORK / "trl", WORK / "gfcr"):
        subprocess.run(["rm", "-rf", str(d)], check=True)
    wall = run([sys.executable, str(PEERS / "hand_grpo.py"), "--steps", str(args.steps), "--out", str(hand_out)],
               env, WORK / "hand.log")
    results["hand loop"] = {"steps": step_times(hand_out / "steps.jsonl", "step_s"), "wall_s": wall}

    wall = run([str(REPO / ".venv" / "bin" / "gfcr"), "run", str(pipeline), "--steps", str(args.steps),
                "--run-dir", str(WORK / "gfcr")], env, WORK / "gfcr.log")
    results["gfcr"] = {"steps": step_times(WORK / "gfcr" / "metrics.jsonl", "time.step_s"), "wall_s": wall,
                       "rollouts_in_update": step_times(WORK / "gfcr" / "metrics.jsonl", "rollouts_in_update")}

    if args.skip_trl or not TRL_PYTHON.exists():
        results["TRL GRPOTrainer"] = {"skipped": "no .bench/trl-venv (run benchmarks/setup_trl_env.sh)"}
    else:
        wall = run([str(TRL_PYTHON), str(PEERS / "trl_grpo.py"), "--lr", "5e-6", "--max_steps", str(args.steps),
                    "--eval_every", "100000", "--out", str(WORK / "trl")], env, WORK / "trl.log")
        results["TRL GRPOTrainer"] = {"steps": step_times(WORK / "trl" / "steps.jsonl", "step_s"), "wall_s": wall}

    hand = statistics.median(results["hand loop"]["steps"][1:])
    print(f"| runner | median step (s), steps 2..{args.steps} | ratio to hand loop | all steps (s) |")
    print("|---|---|---|---|")
    for name, r in results.items():
        if "steps" not in r:
            print(f"| {name} | {r['skipped']} | | |")
            continue
        median = statistics.median(r["steps"][1:])
        r["median_s"], r["ratio_to_hand"] = median, median / hand
        print(f"| {name} | {median:.1f} | {median / hand:.2f}x | {', '.join(f'{s:.1f}' for s in r['steps'])} |")
    out = REPO / "benchmarks" / "results" / "smollm2_step_time.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": args.steps, "machine": os.uname().nodename, "cpus": os.cpu_count(),
                               "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
