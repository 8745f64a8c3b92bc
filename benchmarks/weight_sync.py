"""Seconds per weight sync to 2 Ray engine replicas: Ray's object store against the collective
weight group (gloo), side by side in one invocation, for tiny-arith-h64 and SmolLM2-135M.

    .venv/bin/python benchmarks/weight_sync.py [--syncs 8] [--models tiny-arith-h64 smollm2-135m-instruct]

For each model: a local Ray cluster, the driver's policy (fp32, CPU) and an engine group of 2
transformers replicas (``RayEngineGroup``, as ``executor: {kind: ray}`` starts it). Each round
is an "update" (every weight moves) followed by one sync; the path alternates round by round
(collective, object store, object store, collective, ...) so that the host's load drifts over
both alike. The first collective sync forms the group and is reported apart (``form_s``); the
medians are over the rest. After the last round of each path, each replica's weights are
checked equal to the driver's (a benchmark of a sync that lost weights would be worthless).
What a sync costs beyond the transport (a replica loading into its engine) is the same on both
paths: the transformers replica samples from the policy copy the weights land in.

Writes ``benchmarks/results/weight_sync.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gfcr.engines import load_policy  # noqa: E402
from gfcr.runtime.ray import executor as ray_executor  # noqa: E402
from gfcr.spec import PolicySpec  # noqa: E402
from gfcr.spec import Resources as Placement  # noqa: E402

PATHS = ("collective", "object_store")
TWO = Placement(replicas=2)


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def bench_model(model: str, syncs: int) -> dict[str, Any]:
    spec = PolicySpec(model=model, engine="hf")
    policy = load_policy(spec)
    group = ray_executor.RayEngineGroup.start(policy, spec, TWO)
    try:
        return _rounds(group, policy, syncs)
    finally:
        group.close()


def _rounds(group: Any, policy: Any, syncs: int) -> dict[str, Any]:
    seconds: dict[str, list[float]] = {path: [] for path in PATHS}
    form_s = None
    for i in range(2 * syncs + 1):
        path = PATHS[0] if i == 0 else PATHS[(i + 1) // 2 % 2]  # c, o, o, c, c, o, o, ...
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(1e-3 * torch.randn_like(p))
        policy.version += 1
        group.weight_sync = path
        group.sync_weights(policy.version)
        record = group.syncs[-1]
        assert record.path == path, f"a {path} sync went by {record.path} (see the warning above)"
        if i == 0:
            form_s = record.seconds
        else:
            seconds[path].append(record.seconds)
        print(f"  sync {i} {path}: {record.seconds:.3f}s, {record.bytes / 2**20:.1f} MiB, load {load_average()}",
              file=sys.stderr, flush=True)
        if i >= 2 * syncs - 1:
            _check_equal(group, policy)
    medians = {path: statistics.median(s) for path, s in seconds.items()}
    return {"bytes_per_sync": group.syncs[-1].bytes, "form_s": round(form_s or 0.0, 3),
            "seconds": {path: [round(s, 4) for s in v] for path, v in seconds.items()},
            "median_s": {path: round(m, 4) for path, m in medians.items()},
            "object_store_over_collective": round(medians["object_store"] / medians["collective"], 3)}


def _check_equal(group: Any, policy: Any) -> None:
    import ray

    driver = policy.model.state_dict()
    for weights in ray.get([r.weights.remote() for r in group.replicas]):
        assert all(torch.equal(v, driver[k]) for k, v in weights.items()), "a replica missed the sync"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--syncs", type=int, default=8, help="syncs per path per model (after the group forms)")
    parser.add_argument("--models", nargs="+", default=["tiny-arith-h64", "smollm2-135m-instruct"])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "weight_sync.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results: dict[str, Any] = {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "torch": torch.__version__,
                               "load_before": load_average(), "models": {}}
    release = ray_executor.connect(None, TWO)  # one local cluster for every model
    try:
        for model in args.models:
            print(f"{model}:", file=sys.stderr, flush=True)
            results["models"][model] = bench_model(model, args.syncs)
            args.out.write_text(json.dumps(results, indent=2) + "\n")
    finally:
        release()
    results["load_after"] = load_average()
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print("| model | MiB per sync (2 replicas) | object store s (median) | collective s (median) | "
          "object store / collective | group formation s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for model, r in results["models"].items():
        print(f"| {model} | {r['bytes_per_sync'] / 2**20:.1f} | {r['median_s']['object_store']:.3f} | "
              f"{r['median_s']['collective']:.3f} | {r['object_store_over_collective']:.2f} | {r['form_s']:.3f} |")


if __name__ == "__main__":
    main()
