"""Hostile tools and environments (issue 41, Must show 4): a tool call that sleeps forever, writes
2 GB, forks, kills its parent or returns 100 MB of text runs out of process under the tool-process
boundary's limits (``gfcr.stages.environments.sandboxed``) and each is bounded, answered with the
reason, and leaves nothing running; in a run, an environment whose ``step`` raises drops its own
trajectories only, and the other trajectories of the run, hostile or not, are intact."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gfcr.engines import TransformersEngine, load_policy
from gfcr.records import Allocation, AllocationEntry, Prompt, PromptPool, RolloutStatus, StepContext, VerifierSpec
from gfcr.spec import PolicySpec
from gfcr.stages.environments import Action, make_environment
from gfcr.stages.generate.multi_turn import MultiTurn
from gfcr.stages.resources import Lent
from gfcr.stages.verifiers import sandbox
from tests.stages.environments.hostile import PROGRAMS, TAG

TIMEOUT_S = 1.0
HOSTILE = "tests.stages.environments.hostile:Hostile"
needs_bwrap = pytest.mark.skipif(sandbox.bwrap_problem() is not None, reason=str(sandbox.bwrap_problem()))
# what the model reads back after each tool call (the observation's first line after "Output:")
EXPECTED = {
    "sleeps_forever": "time limit: still running after 1s (killed)",
    "writes_2gb_to_a_file": "OSError: [Errno 27] File too large",
    "allocates_2gb": "memory limit: MemoryError past 512 MB",
    "returns_100mb_of_text": "output limit: more than 16384 bytes of output (killed)",
    "forks": "sandbox refused os.fork (no network, no new processes, no signals)",
    "kills_its_parent": "sandbox refused os.kill (no network, no new processes, no signals)",
    "forks_past_the_audit_hook": "ran to the end",
    "benign": "ran to the end",
}


def descendants() -> set[int]:
    """The processes below this one (its children, theirs, ...), read from /proc."""
    parent: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent[int(pid)] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


def tagged() -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if TAG.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(int(pid))
        except OSError:
            continue
    return out


def nothing_left(before: set[int], grace_s: float = 5.0) -> bool:
    """No process this one started is left (a PID namespace is torn down within moments: waited for)."""
    deadline = time.monotonic() + grace_s
    while (descendants() - before or tagged()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not (descendants() - before) and not tagged()


def problem(i: int, kind: str, level: str = "auto") -> Prompt:
    options = {"entry_point": "add", "prompt": "def add(a, n):\n    return", "timeout_s": TIMEOUT_S, "sandbox": level}
    return Prompt(f"h:{i}", text="What is 1 + 2? Answer:", metadata={"hostile": kind},
                  verifier=VerifierSpec("code", "def check(candidate):\n    assert candidate(1, 2) == 3\n", options))


LEVELS = [pytest.param("bwrap", marks=needs_bwrap), "guard"]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind", [k for k in PROGRAMS if k != "forks_past_the_audit_hook"])
def test_each_hostile_tool_call_is_bounded_answered_and_leaves_nothing(kind, level):
    before = descendants()
    env = make_environment(HOSTILE, {"feedback_chars": 200})
    env.reset(problem(0, kind, level), seed=0)
    start = time.monotonic()
    obs = env.step(Action(" 3"))
    took = time.monotonic() - start
    assert took < TIMEOUT_S + 2.0, f"{kind} took {took:.1f}s"
    assert not obs.done and obs.text.startswith("Output:\n") and f"Exit: {EXPECTED[kind]}." in obs.text, obs.text
    assert len(obs.text) <= 200
    if kind == "returns_100mb_of_text":
        assert obs.text.startswith("Output:\n" + "x" * 100) and " ...\n\nExit: output limit" in obs.text
    if kind == "benign":
        assert obs.text == "Output:\n42\n\nExit: ran to the end.\n"
    assert nothing_left(before)


@needs_bwrap
def test_a_child_started_past_the_audit_hook_ends_with_the_tool_call_under_bwrap():
    before = descendants()
    env = make_environment(HOSTILE, {})
    env.reset(problem(0, "forks_past_the_audit_hook", "bwrap"), seed=0)
    obs = env.step(Action(" 3"))
    assert obs.text == "Output:\nstarted\n\nExit: ran to the end.\n"  # it did start a child ...
    assert nothing_left(before)  # ... which the PID namespace took with it


def test_under_the_guard_a_child_past_the_hook_holding_the_output_is_killed_with_its_group():
    before = descendants()
    env = make_environment(HOSTILE, {})
    env.reset(problem(0, "forks_past_the_audit_hook", "guard"), seed=0)
    obs = env.step(Action(" 3"))
    # the child keeps the output pipe open, so the call runs to its time limit; the runner's process group dies
    assert obs.text == "Output:\nstarted\n\nExit: time limit: still running after 1s (killed).\n"
    assert nothing_left(before)


@pytest.fixture(scope="module")
def policy():
    return load_policy(PolicySpec(model="tiny-arith"))


def test_in_a_run_hostile_tools_and_a_raising_environment_spoil_only_their_own_trajectories(policy):
    kinds = [k for k in PROGRAMS if k != "forks_past_the_audit_hook"] + ["raises"]
    pool = [problem(i, kind) for i, kind in enumerate(kinds)]
    config = {"environment": {"use": HOSTILE, "with": {"feedback_chars": 200}}, "max_turns": 2,
              "max_turn_tokens": 4, "max_tokens": 600, "env_workers": 8, "on_env_error": "drop"}
    stage = MultiTurn(MultiTurn.Config.model_validate(config))
    stage.setup(Lent(policy, TransformersEngine(policy)))
    before = descendants()
    start = time.monotonic()
    groups = stage.run(Allocation(0, tuple(AllocationEntry(p, 3) for p in pool)), StepContext("run", 0, 0, 0))
    took = time.monotonic() - start
    # two rounds of tool calls, 24 at once each: the slowest (the sleeper, 1 s) bounds each round
    assert took < 2 * (TIMEOUT_S + 2.0) + 5.0, f"the run took {took:.1f}s"
    assert nothing_left(before)
    by_prompt = {g.prompt_id: g for g in groups}
    for p, kind in zip(pool, kinds):
        g = by_prompt[p.prompt_id]
        if kind == "raises":
            assert not g.rollouts and len(g.removed) == 3
            assert all("raised in step (model turn 1)" in m.reason and "the tool server crashed" in m.reason
                       for m in g.removed)
            continue
        assert len(g.rollouts) == 3 and not g.removed, kind
        for r in g.rollouts:  # two model turns, each answered by its tool's outcome; nothing else lost
            assert r.status == RolloutStatus.TRUNCATED and r.stop_reason == "turn budget: 2 model turns"
            assert [str(t.role) for t in r.turns] == ["model", "environment"] * 2
            assert all(f"Exit: {EXPECTED[kind]}." in t.text for t in r.turns[1::2]) and r.reward == 0.0
            # the tool's outcome, on each model turn
            assert all(t.info["tool"] == "python" and t.info["reason"] for t in r.turns[::2])
    assert stage.step_metrics()["environment_errors"] == 3
    PromptPool(pool)  # the pool is well formed (unique ids)
