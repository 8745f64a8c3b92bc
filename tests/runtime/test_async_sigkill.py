"""SIGKILL at random moments of an *asynchronous* run (``lifecycle: {mode: async,
max_staleness: 2}``, issue 38, Must show 8): every resume finishes, and the run's records
account for every rollout exactly once.

An asynchronous run is not deterministic (which weights a step samples with depends on how far
the producer got), so a resumed run is not compared with an uninterrupted one; what is asserted
is the accounting, after the last resume of each run directory:

- the metrics have steps 0 .. N-1, each once, and the lineage one file per step, each once;
- no rollout id appears twice in the lineage, and each step's lineage rows are exactly its
  generated rollouts (``rollouts_generated``) with exactly its generated tokens
  (``tokens_generated``), the rows in the update with an advantage exactly
  ``rollouts_in_update`` and ``tokens_in_update``, and those in the update's batch exactly the
  tokens of the step's ``staleness`` counts: nothing the
  killed attempt generated after its last checkpoint is counted (it is generated again, once);
- ``summary.json``'s totals are the sums of the metrics lines; the policy version moves once
  per update that ran; no rollout was trained more than ``max_staleness`` versions old.

The pipeline is quickstart made small (6 steps of 4 prompts, a checkpoint and an evaluation every
2 steps) with ``async, max_staleness: 2`` and ``correction: tis``, on the local executor, run
as a user runs it: ``gfcr run`` then ``gfcr resume`` in a subprocess, with the phase log of
``tests/runtime/test_random_sigkill.py``. Where each kill lands is drawn from a seeded RNG over
five kinds of moment: before the first checkpoint, inside the n-th generate call (the producer's
thread), inside the n-th update (the trainer's), inside an evaluation, and inside a checkpoint
write after a random one of its parts. Under ``async`` the producer runs ahead of the trainer, so
a kill in one side's phase usually finds the other side mid-phase too.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO
from tests.killing import describe, kill_marked, left_running
from tests.runtime.test_random_sigkill import Attempt, checkpoint_parts, durations

STEPS, BOUND = 6, 2
SETTINGS = [f"run.steps={STEPS}", "run.checkpoint_every=2", "eval.every=2", "eval.with.n=16",
            "stages.pick.with.batch_size=4", "lifecycle.mode=async", f"lifecycle.max_staleness={BOUND}",
            "update.with.correction.use=tis", "executor.kind=local", "tracking.mlflow=null"]
SETS = [a for s in SETTINGS for a in ("--set", s)]
QUICKSTART = str(REPO / "pipelines" / "quickstart.yaml")


class AsyncAttempt(Attempt):
    def kill(self) -> str:
        """SIGKILL the gfcr process; every phase in progress, both sides' (``generate+update``)."""
        super().kill()
        entered = {(line[1], line[2]) for line in self.lines() if line[0] == "enter"}
        left = {(line[1], line[2]) for line in self.lines() if line[0] == "exit"}
        return "+".join(sorted(name for name, _ in entered - left)) or "between phases"


def accounting(run_dir: Path) -> dict[str, int]:
    """Assert that the run's metrics, lineage and summary count every rollout and token once;
    the totals."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS)), f"{run_dir}: metrics steps {[r['step'] for r in records]}"
    files = sorted(p.name for p in (run_dir / "lineage").glob("step-*.parquet"))
    assert files == [f"step-{s:06d}.parquet" for s in range(STEPS)], f"{run_dir}: lineage files {files}"
    ids: list[str] = []
    version = 0
    for r in records:
        rows = pq.read_table(run_dir / "lineage" / f"step-{r['step']:06d}.parquet").to_pylist()
        assert {row["step"] for row in rows} == {r["step"]}
        fresh = [row for row in rows if row["created_step"] == r["step"]]
        assert len(fresh) == len(rows) == r["rollouts_generated"], (r["step"], len(rows), r["rollouts_generated"])
        assert sum(row["n_tokens"] for row in rows) == r["tokens_generated"], r["step"]
        reached = [row for row in rows if row["in_update"]]  # the update's batch, zero advantages included
        assert sum(r["staleness"].values()) == sum(row["n_tokens"] for row in reached), r["step"]
        assert all(row["staleness"] <= BOUND for row in reached), [row["staleness"] for row in reached]
        trained = [row for row in reached if row["advantage"] not in (0, None)]  # what the update counts
        assert len(trained) == r["rollouts_in_update"], r["step"]
        assert sum(row["n_tokens"] for row in trained) == r["tokens_in_update"], r["step"]
        version += 0 if r["update_skipped"] else 1
        assert r["policy_version"] == version, (r["step"], r["policy_version"], version)
        ids += [row["rollout_id"] for row in rows]
    assert len(ids) == len(set(ids)), f"{run_dir}: a rollout id appears twice in the lineage"
    summary = json.loads((run_dir / "summary.json").read_text())
    totals = {key: sum(r[key] for r in records)
              for key in ("rollouts_generated", "tokens_generated", "rollouts_in_update", "tokens_in_update")}
    assert {key: summary[key] for key in totals} == totals, (summary, totals)
    assert summary["steps"] == STEPS and summary["policy_version"] == version
    return totals


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict[str, float], int]:
    """An uninterrupted asynchronous run through the same wrapper: its accounting holds, and how
    long each phase takes and how many parts a checkpoint write has."""
    work = tmp_path_factory.mktemp("reference")
    attempt = AsyncAttempt(work, 0, ["run", QUICKSTART, "--run-dir", "run", *SETS], {})
    attempt.finish()
    accounting(work / "run")
    return durations(attempt), checkpoint_parts(attempt)


def target_for(kind: str, rng: random.Random, lengths: dict[str, float], parts: int) -> tuple[dict, float]:
    """The wrapper's target for a ``kind`` of moment, and the delay after the phase is entered."""
    if kind == "first":  # before the first checkpoint (after step 1)
        phase = rng.choice(["generate", "update", "eval"])
        nth = 1 if phase == "eval" else rng.choice([1, 2])
    elif kind == "checkpoint":
        return {"phase": "checkpoint", "nth": rng.choice([1, 2]), "point": rng.randint(1, parts)}, 0.0
    else:
        phase, nth = kind, rng.choice([1, 2, 3])
    return {"phase": phase, "nth": nth}, rng.uniform(0.0, 0.8) * lengths[phase]


def kill_and_resume(work: Path, kills: int, seed: int, reference) -> Counter:
    """``kills`` SIGKILLs at seeded random moments over as many run directories as it takes;
    each run directory is resumed to completion and its accounting checked. The hits, by phase."""
    lengths, parts = reference
    rng = random.Random(seed)
    kinds: list[str] = []
    while len(kinds) < kills:  # every kind once in each block, the first of a run directory first
        block = ["checkpoint", "update", "eval", "generate"]
        rng.shuffle(block)
        kinds += ["first", *block]
    kinds = kinds[:kills]
    hits: Counter = Counter()
    index, run_dirs = 0, []
    while kinds:
        run_dir = work / f"run-{len(run_dirs)}"
        run_dirs.append(run_dir)
        first = True
        while kinds and (first or kinds[0] != "first"):
            kind = kinds.pop(0)
            target, delay = target_for(kind, rng, lengths, parts)
            args = ["run", QUICKSTART, "--run-dir", str(run_dir), *SETS] if first else ["resume", str(run_dir)]
            index += 1
            attempt = AsyncAttempt(work, index, args, target)
            try:
                words = (["held", "checkpoint", str(target["nth"]), str(target["point"])]
                         if kind == "checkpoint" else ["enter", target["phase"], str(target["nth"])])
                if not attempt.wait_for(words):  # the attempt finished before that moment came
                    attempt.finish()
                    kinds.insert(0, kind)
                    break
                time.sleep(delay)
                where = attempt.kill()
                first = False
                before_first = not any((run_dir / "checkpoints").glob("step-*"))
                hits[f"{where} (before the first checkpoint)" if before_first else where] += 1
                remaining = left_running(attempt.mark, within=15)
                assert remaining == [], f"left running after kill {index}: {describe(remaining)}"
            finally:
                kill_marked(attempt.mark)
        index += 1
        last = AsyncAttempt(work, index, ["resume", str(run_dir)], {})
        last.finish()
        accounting(run_dir)
    return hits


@pytest.mark.slow
def test_ten_random_sigkills_of_an_async_run(tmp_path, reference):
    started = time.monotonic()
    hits = kill_and_resume(tmp_path, 10, seed=0, reference=reference)
    print(f"\n10 kills in {time.monotonic() - started:.0f} s; hit: {dict(hits)}")
    assert sum(hits.values()) == 10
    phases: Counter = Counter()
    for where, n in hits.items():
        for phase in where.split(" (")[0].split("+"):
            phases[phase] += n
    assert phases["checkpoint"] >= 1  # held inside the write: always hit
    assert any("before the first checkpoint" in where for where in hits)
