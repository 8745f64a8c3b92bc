"""Step time of GRPO on SmolLM2-135M-Instruct: gfcr against the plain hand-written loop and
stock TRL, side by side in one run, on the same machine and the same prompts.

    .venv/bin/python benchmarks/smollm2_step_time.py [--steps 5] [--skip-trl] [--only NAME ...]

Settings are the peer baseline's (../shared/peers/trl_cpu): 8 prompts x 8 rollouts, 48 new
tokens, temperature 1.0, fp32, no reference model, one AdamW update per batch in
micro-batches of 16, lr 5e-6, clip 0.2. All three read the peer's arithmetic prompts
(``arith_task.train_set``, chat template applied) and its reward rule; gfcr reads them
through its ``jsonl`` data source and scores them with its ``arithmetic`` verifier.

- hand loop: ``hand_grpo.py`` with ``SMOLLM2_HF`` pointing at gfcr's cached safetensors copy;
- TRL: ``trl_grpo.py`` in its own environment (``benchmarks/setup_trl_env.sh`` makes
  ``.bench/trl-venv``); skipped with a note when that environment is missing;
- gfcr: ``gfcr run`` of ``pipelines/grpo_arith_smollm2.yaml`` with the data swapped for the
  peer's prompts and evaluation off, in four columns (``GFCR_CELLS``): the transformers engine
  and the vLLM-CPU engine, each under ``lifecycle: sync`` and under ``lifecycle: {mode: async,
  max_staleness: 2}`` (generation overlapped with the update, ``tis`` as the declared
  correction; on vLLM the engine core in a process of its own, reloaded with the scheduled
  version's weights).

The runs go one after another (two cores cannot host two fairly). Each reports its own step
time; the first step is dropped as warm-up and the median of the rest is compared. For gfcr the
step is ``time.wall_s``, the seconds between two metrics lines: under ``async`` the update of
step t and the generation of later steps overlap, so a step's own stage clocks would count the
overlapped seconds twice; the wall between records counts every second of the run once (under
``sync`` it is ``time.step_s`` plus the records' milliseconds). Writes
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


# gfcr's columns: name -> (engine, lifecycle); a stale lifecycle must declare its correction
GFCR_CELLS = {
    "gfcr, transformers, sync": ("hf", None),
    "gfcr, vLLM-CPU, sync": ("vllm", None),
    "gfcr, transformers, async K=2": ("hf", {"mode": "async", "max_staleness": 2}),
    "gfcr, vLLM-CPU, async K=2": ("vllm", {"mode": "async", "max_staleness": 2}),
}


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def gfcr_pipeline(prompts: Path, out: Path, engine: str, lifecycle: dict | None) -> None:
    spec = yaml.safe_load((REPO / "pipelines" / "grpo_arith_smollm2.yaml").read_text())
    spec["name"] = "bench-grpo-smollm2"
    spec["policy"]["engine"] = engine
    if lifecycle is not None:
        spec["lifecycle"] = lifecycle
        spec["update"]["with"]["correction"] = {"use": "tis"}
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
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--only", nargs="+", help="run only these columns (by name), e.g. to check the script; "
                        "the results then go to .bench/smollm2/results.json, not benchmarks/results/")
    args = parser.parse_args()
    wanted = set(args.only or ["hand loop", *GFCR_CELLS, "TRL GRPOTrainer"])
    WORK.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    from gfcr.engines import resolve_model

    env["SMOLLM2_HF"] = str(resolve_model("smollm2-135m-instruct"))
    prompts = WORK / "peer_prompts.jsonl"
    peer_prompts(prompts)

    results: dict[str, dict] = {}
    load_before = load_average()
    if "hand loop" in wanted:
        hand_out = WORK / "hand"
        subprocess.run(["rm", "-rf", str(hand_out)], check=True)
        wall = run([sys.executable, str(PEERS / "hand_grpo.py"), "--steps", str(args.steps), "--out", str(hand_out)],
                   env, WORK / "hand.log")
        results["hand loop"] = {"steps": step_times(hand_out / "steps.jsonl", "step_s"), "wall_s": wall,
                                "load_after": load_average()}

    for name, (engine, lifecycle) in GFCR_CELLS.items():
        if name not in wanted:
            continue
        slug = name.replace("gfcr, ", "").replace(", ", "-").replace(" ", "_").replace("=", "")
        pipeline, run_dir = WORK / f"{slug}.yaml", WORK / slug
        gfcr_pipeline(prompts, pipeline, engine, lifecycle)
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        wall = run([str(REPO / ".venv" / "bin" / "gfcr"), "run", str(pipeline), "--steps", str(args.steps),
                    "--run-dir", str(run_dir)], env, WORK / f"{slug}.log")
        metrics = run_dir / "metrics.jsonl"
        results[name] = {"steps": step_times(metrics, "time.wall_s"), "step_s": step_times(metrics, "time.step_s"),
                         "wall_s": wall, "rollouts_in_update": step_times(metrics, "rollouts_in_update"),
                         "weight_move_s": step_times(metrics, "time.weight_move_s"),
                         "trainer_wait_s": step_times(metrics, "time.trainer_wait_s"),
                         "load_after": load_average()}

    if "TRL GRPOTrainer" in wanted and (args.skip_trl or not TRL_PYTHON.exists()):
        results["TRL GRPOTrainer"] = {"skipped": "no .bench/trl-venv (run benchmarks/setup_trl_env.sh)"}
    elif "TRL GRPOTrainer" in wanted:
        subprocess.run(["rm", "-rf", str(WORK / "trl")], check=True)
        wall = run([str(TRL_PYTHON), str(PEERS / "trl_grpo.py"), "--lr", "5e-6", "--max_steps", str(args.steps),
                    "--eval_every", "100000", "--out", str(WORK / "trl")], env, WORK / "trl.log")
        results["TRL GRPOTrainer"] = {"steps": step_times(WORK / "trl" / "steps.jsonl", "step_s"), "wall_s": wall,
                                      "load_after": load_average()}

    print(table(results, args.steps))
    out = WORK / "results.json" if args.only else REPO / "benchmarks" / "results" / "smollm2_step_time.json"
    out.write_text(json.dumps({"steps": args.steps, "machine": os.uname().nodename, "cpus": os.cpu_count(),
                               "load_before": load_before, "results": results}, indent=2) + "\n")


def table(results: dict[str, dict], steps: int) -> str:
    """Median of steps 2..N per runner, as a ratio to the hand loop's and to TRL's where they ran."""
    medians = {name: statistics.median(r["steps"][1:]) for name, r in results.items() if r.get("steps")}
    for name, median in medians.items():
        results[name]["median_s"] = median
    hand, trl = medians.get("hand loop"), medians.get("TRL GRPOTrainer")
    lines = [f"| runner | median step (s), steps 2..{steps} | ratio to hand loop | ratio to TRL | all steps (s) |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        if name not in medians:
            lines.append(f"| {name} | {r.get('skipped', 'no steps')} | | | |")
            continue
        m = medians[name]
        to_hand = f"{m / hand:.2f}x" if hand else ""
        to_trl = f"{m / trl:.2f}x" if trl else ""
        lines.append(f"| {name} | {m:.1f} | {to_hand} | {to_trl} | {', '.join(f'{s:.1f}' for s in r['steps'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
