"""What does losing an engine replica cost? The same seeded Ray run of quickstart.yaml (2 tiny-arith
replicas) undisturbed and with replica ray-1 SIGKILLed in the middle of step 1's generation, side
by side in one invocation, on one local Ray cluster (sized as gfcr sizes one for 2 replicas).

    .venv/bin/python benchmarks/replica_restart.py [--steps 4] [--repeats 1] [--set KEY=VALUE]...

The kill is the tests' (``tests/runtime/replica_kill.py``, test-only): the replica's pid comes from
the actor, and the process is killed as soon as step 1's call has started on it (the replicas'
test-only hook marks it), while the call runs (checked). Per run it prints each step's ``time.step_s`` (the step itself, from metrics.jsonl),
the restart's wait as the engine group measured it (from the failed call to the restarted
replica holding the current weights, ``ReplicaRestarts.seconds``) and whether the two runs agree:
lineage rows (rollout ids, groups, replicas, token counts, rewards), every rollout's tokens, and
the metrics apart from ``time`` and ``ray``. Results: benchmarks/results/replica_restart.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def one_run(run_dir: Path, overrides: list[str], kill: bool, started: Path) -> dict:
    import pyarrow.parquet as pq

    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import Run
    from tests.runtime.replica_kill import KillsInFlight, Tokens

    run = Run.start(load_pipeline(REPO / "pipelines" / "quickstart.yaml", overrides), run_dir)
    tokens = Tokens()
    run.runner.hooks = (*run.runner.hooks, tokens)
    group = run.services.lent.engine
    killer = KillsInFlight(group, 1, 3, started) if kill else None  # call 1: step 0's eval; 3: step 1's generation
    start = time.perf_counter()
    run.train()
    wall = time.perf_counter() - start
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lineage = [(r["step"], r["rollout_id"], r["group_id"], r["replica"], r["n_tokens"], r["reward"])
               for path in sorted((run_dir / "lineage").glob("step-*.parquet")) for r in pq.read_table(path).to_pylist()]
    return {"killed": kill, "killed_in_flight": None if killer is None else killer.killed_in_flight,
            "wall_s": wall, "step_s": [line["time"]["step_s"] for line in lines],
            "replica_restarts": [line["ray"]["replica_restarts"] for line in lines],
            "restart_wait_s": list(group.faults.seconds), "lineage": lineage, "tokens": tokens.by_id,
            "metrics": [{k: v for k, v in line.items() if k not in ("time", "ray")} for line in lines]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    from gfcr.runtime.ray.executor import connect
    from gfcr.spec import Resources as Placement

    overrides = [f"run.steps={args.steps}", "eval.every=1000", "eval.with.n=16", "executor.kind=ray",
                 "stages.rollout.resources.replicas=2", "tracking.mlflow=null", *args.overrides]
    from tests.runtime.replica_kill import started_dir

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        with started_dir(Path(tmp)) as started:
            release = connect(None, Placement(replicas=2))
        try:
            for repeat in range(args.repeats):
                for kill in (False, True):
                    runs.append(one_run(Path(tmp) / f"{repeat}-{kill}", overrides, kill, started))
        finally:
            release()
    base = runs[0]
    rows = []
    for run in runs:
        same = {"lineage": run["lineage"] == base["lineage"], "tokens": run["tokens"] == base["tokens"],
                "metrics": _close(run["metrics"], base["metrics"])}
        rows.append({k: v for k, v in run.items() if k not in ("lineage", "tokens", "metrics")} | {"same_as_first": same})
        steps = " ".join(f"{s:.1f}" for s in run["step_s"])
        print(f"{'killed' if run['killed'] else 'undisturbed':>11}: step_s {steps} | restarts {run['replica_restarts']} "
              f"| restart wait {[round(s, 1) for s in run['restart_wait_s']]} s | wall {run['wall_s']:.1f} s "
              f"| in flight {run['killed_in_flight']} | same as the first run: {same}")
    out = REPO / "benchmarks" / "results" / "replica_restart.json"
    out.write_text(json.dumps({"command": " ".join(sys.argv), "overrides": overrides, "runs": rows}, indent=2) + "\n")
    print(f"results: {out}")


def _close(got: list[dict], expected: list[dict]) -> bool:
    """Equal up to float rounding (as tests/runtime/test_metric_fixtures.assert_same_run)."""
    from tests.runtime.test_metric_fixtures import assert_same_run

    try:
        assert_same_run(got, expected)
    except AssertionError:
        return False
    return True


if __name__ == "__main__":
    main()
