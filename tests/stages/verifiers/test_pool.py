"""Verifiers that cannot hang the run (issue 16, must-show 7): each hostile response costs at
most the configured timeout of wall time, leaves no process or thread running, and scores 0
with the reason, in the lineage of a real run too."""

from __future__ import annotations

import os
import textwrap
import threading
import time

import pytest

from gfcr.graph import load_pipeline
from gfcr.records import VerifierSpec
from gfcr.runtime.store.lineage import read_lineage
from gfcr.runtime.store.rundir import RunDir
from gfcr.runtime.loop.session import Run
from gfcr.stages.filter.verify import Verify
from gfcr.stages.verifiers import VERIFIERS, Score
from gfcr.stages.verifiers.arithmetic import verify_arithmetic
from gfcr.stages.verifiers.gsm8k import verify_gsm8k
from gfcr.stages.verifiers.math_equiv import verify_math
from gfcr.stages.verifiers.pool import Overran, VerifierPool, WorkerDied
from gfcr.stages.verifiers.scoring import score_text

# 21 characters that send sympy (inside math-verify) into a power tower that holds the GIL for
# minutes: a thread's timeout never fires, and neither does math-verify's own signal.alarm
TOWER = "\\boxed{9^{9^{9^{9}}}}"
DEGENERATE = "The answer is " * 12_000  # 168,000 characters of answer markers with no number after them


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def children() -> set[int]:
    """This process's child processes, from /proc."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    if int(handle.read().rsplit(")", 1)[1].split()[1]) == me:
                        found.add(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


@pytest.fixture
def pool():
    with VerifierPool(workers=1) as p:
        p.call(verify_math, "\\boxed{2}", "2", {}, timeout_s=5.0)  # started, math-verify imported
        yield p


def test_a_sympy_power_tower_costs_the_timeout_and_its_worker_is_killed(pool):
    (pid,) = pool.pids()
    threads = threading.active_count()
    start = time.monotonic()
    with pytest.raises(Overran, match="verifier timeout after 1s"):
        pool.call(verify_math, TOWER, "2", {}, timeout_s=1.0)
    spent = time.monotonic() - start
    assert 1.0 <= spent < 1.0 + 0.5, spent  # the timeout, then SIGKILL and reaping
    assert gone(pid) and threading.active_count() == threads  # killed and reaped; no thread left behind
    assert pool.call(verify_math, "\\boxed{2}", "2", {}, timeout_s=5.0).correct  # a new worker took its place


def test_the_default_timeout_of_filter_verify_bounds_the_tower_at_5_s():
    from gfcr.records import Prompt, PromptPool

    prompts = PromptPool([Prompt("p:0", text="q", verifier=VerifierSpec("math", "2"))])
    stage = Verify(Verify.Config(workers=1))
    stage.run(_groups("p:0", ["\\boxed{2}"]), prompts)  # the worker started, math-verify imported
    g = _groups("p:0", [TOWER])
    start = time.monotonic()
    stage.run(g, prompts)
    spent = time.monotonic() - start
    (rollout,) = g.rollouts()
    assert (rollout.reward, rollout.reward_reason) == (0.0, "verifier timeout after 5s (worker killed)")
    assert 5.0 <= spent < 5.0 + 1.0, spent


def _groups(prompt: str, texts: list[str]):
    from gfcr.records import RolloutGroups
    from tests.stages.filter.test_verify import group

    return RolloutGroups([group(prompt, texts)])


def test_degenerate_repeated_markers_are_scored_in_linear_time():
    start = time.monotonic()
    score = verify_gsm8k(DEGENERATE, "18", {})
    assert time.monotonic() - start < 2.0  # it was 6 minutes for 140k characters (quadratic); ~0.05 s now
    assert score == Score(False, False, None, "no answer found")
    start = time.monotonic()
    assert score_text(DEGENERATE + "so 18", VerifierSpec("gsm8k", "18"), timeout_s=5.0)[0] == 1.0
    assert time.monotonic() - start < 5.0
    boxes = "\\boxed{" * 50_000  # unclosed braces, each read to the end of the text before
    start = time.monotonic()
    assert verify_gsm8k(boxes, "1", {}).reason == "no answer found"
    assert time.monotonic() - start < 2.0  # quadratic, it would be 50,000 scans of up to 350,000 characters


def test_a_verifier_past_its_memory_limit_scores_zero_with_the_reason():
    def hog(text: str, truth: str, options: dict) -> Score:
        blob = bytearray(10 << 30)  # 10 GiB
        return Score(True, True, str(len(blob)))

    with VerifierPool(workers=1, memory_mb=512) as pool:
        with pytest.raises(Exception, match="MemoryError"):
            pool.call(hog, "x", "1", {}, timeout_s=5.0)
        assert pool.call(verify_arithmetic, "Answer: 1", "1", {}, timeout_s=5.0).correct  # the worker lives on


def test_a_worker_that_dies_is_replaced_and_the_call_reports_it():
    def dies(text: str, truth: str, options: dict) -> Score:
        os.kill(os.getpid(), 9)
        raise AssertionError("unreachable")

    with VerifierPool(workers=1) as pool:
        with pytest.raises(WorkerDied, match=r"verifier worker died \(killed by signal 9\)"):
            pool.call(dies, "x", "1", {}, timeout_s=5.0)
        assert pool.call(verify_arithmetic, "Answer: 1", "1", {}, timeout_s=5.0).correct


def test_closing_the_pool_leaves_no_process():
    before = children()
    pool = VerifierPool(workers=2)
    pool.map([], 1.0)
    pool.call(verify_arithmetic, "Answer: 1", "1", {}, timeout_s=5.0)
    pids = pool.pids()
    assert pids and set(pids) <= children()
    pool.close()
    assert all(gone(pid) for pid in pids) and children() <= before


# --- a real run: the run goes on, reward 0, the reason in the lineage -------------------------

def hostile_verifier(pids: str):
    """A verifier that scores every response as if it were the power tower, noting its worker's pid."""
    def hostile(text: str, truth: str, options: dict) -> Score:
        with open(pids, "a") as handle:
            handle.write(f"{os.getpid()}\n")
        return verify_math(TOWER, truth, {})

    return hostile


SPEC = textwrap.dedent("""\
    name: hostile
    policy: {model: tiny-arith}
    data: {source: arithmetic, with: {n: 4, seed: 0, digits: 2, operators: ["+"]}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 1}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 2}}
      rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 8}}
      reward:  {use: filter.verify, from: rollout, with: {verifier: hostile, timeout_s: 1.0, workers: 2}}
    update: {use: update.grpo, from: reward, with: {lr: 3.0e-4, loss: {use: ppo_clip, with: {clip: [0.2, 0.28]}}}}
    run: {steps: 1, seed: 0}
    executor: {kind: local}
    tracking: {mlflow: null}
    """)


def test_a_run_goes_on_with_reward_zero_and_the_timeout_in_the_lineage(tmp_path, monkeypatch):
    from gfcr.registry.core import _Entry

    monkeypatch.setitem(VERIFIERS._entries, "hostile", _Entry(None, hostile_verifier(str(tmp_path / "pids")), "tests"))
    spec = tmp_path / "hostile.yaml"
    spec.write_text(SPEC, encoding="utf-8")
    start = time.monotonic()
    Run.start(load_pipeline(spec), tmp_path / "run").train()
    spent = time.monotonic() - start
    rows = read_lineage(RunDir(tmp_path / "run").lineage_dir).to_pylist()
    assert len(rows) == 2
    assert {(r["reward"], r["correct"], r["reward_reason"]) for r in rows} == {
        (0.0, False, "verifier timeout after 1s (worker killed)")}, rows
    assert len(RunDir(tmp_path / "run").read_metrics()) == 1  # the step finished
    pids = {int(p) for p in (tmp_path / "pids").read_text().split()}
    assert len(pids) == 2 and all(gone(pid) for pid in pids)  # every worker that ran the tower was killed
    print(f"hostile run: {spent:.1f}s")
    assert spent < 60
