"""The ``code`` verifier: HumanEval's canonical solutions pass, ``pass`` bodies fail, and hostile
programs (an endless loop, 10 GB, a fork, a write outside the sandbox, a socket, reading the
run directory) each score 0 with the reason, inside the bubblewrap sandbox and under the guard
alone (``sandbox: guard``, the fallback where bwrap does not work). What the namespace adds to
the guard is in ``test_sandbox.py``."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gfcr.records import VerifierSpec
from gfcr.stages.data.humaneval import HumanEvalSource
from gfcr.stages.verifiers.code import CodeOptions, build_program, extract_code, verify_code
from gfcr.stages.verifiers.sandbox import bwrap_problem
from gfcr.stages.verifiers.scoring import score_text

PROMPT = 'def add(a, b):\n    """The sum of a and b."""\n'
TESTS = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
OPTIONS = {"entry_point": "add", "prompt": PROMPT, "timeout_s": 1.0}


LEVELS = [pytest.param("bwrap", marks=pytest.mark.skipif(bwrap_problem() is not None, reason=str(bwrap_problem()))),
          "guard"]


def score(body: str, **options):
    return verify_code(body, TESTS, {**OPTIONS, **options})


def test_a_completion_continues_the_prompt_and_a_fenced_function_replaces_its_stub():
    assert extract_code("    return a + b\n", "add") == ("    return a + b\n", False)
    fenced = "Sure:\n```python\nimport math\n```\nand\n```python\ndef add(a, b):\n    return a + b\n```\n"
    assert extract_code(fenced, "add") == ("def add(a, b):\n    return a + b\n", True)  # the block defining it
    program = build_program("def add(a, b):\n    return a + b\n", TESTS, CodeOptions(**OPTIONS))
    assert program == PROMPT + "\ndef add(a, b):\n    return a + b\n\n\n" + TESTS + "\n\ncheck(add)\n"
    assert score("    return a + b\n").reason == "all tests passed"
    assert score(fenced).correct and score(fenced).formatted
    assert (score("    return a - b\n").correct, score("    return a - b\n").reason) == (False, "a test failed: AssertionError")
    assert score("   ").reason == "no code found"
    assert score("    return (a +\n").reason.startswith("SyntaxError")


@pytest.mark.parametrize("body, reason", [
    ("    while True:\n        pass\n", "time limit: still running after 1s (killed)"),
    ("    blob = bytearray(10 * 2**30)\n    return a + b\n", "memory limit: MemoryError past 512 MB"),
    ("    import os\n    os.fork()\n    return a + b\n", "sandbox refused os.fork"),
    ("    import os\n    try:\n        os.fork()\n    except OSError:\n        pass\n    return a + b\n",
     "sandbox refused os.fork"),  # caught, and still a failure
    ("    import subprocess\n    subprocess.run(['true'])\n    return a + b\n", "sandbox refused subprocess.Popen"),
    ("    open('/tmp/gfcr-sandbox-escape', 'w').write('x')\n    return a + b\n",
     "sandbox refused writing '/tmp/gfcr-sandbox-escape' outside the sandbox directory"),
    ("    open('../escape', 'w').write('x')\n    return a + b\n", "sandbox refused writing '../escape'"),
    ("    import socket\n    socket.create_connection(('127.0.0.1', 9))\n    return a + b\n",
     "sandbox refused importing socket"),
    ("    import os\n    os._exit(0)\n", "the program ended without finishing its tests (exit status 0)"),
    ("    raise SystemExit(0)\n", "SystemExit: 0"),
    ("    open('big', 'w').write('x' * (2 << 20))\n    return a + b\n", "OSError: [Errno 27] File too large"),
])
@pytest.mark.parametrize("level", LEVELS)
def test_hostile_programs_score_zero_with_the_reason(body, reason, level):
    start = time.monotonic()
    verdict = score(body, sandbox=level)
    assert not verdict.correct and verdict.reason.startswith(reason), verdict.reason
    assert time.monotonic() - start < 1.0 + 1.0
    assert not Path("/tmp/gfcr-sandbox-escape").exists()


@pytest.mark.parametrize("level", LEVELS)
def test_the_run_directory_is_out_of_reach(tmp_path, level):
    secret = tmp_path / "run" / "metrics.jsonl"
    secret.parent.mkdir()
    secret.write_text("{}\n")
    verdict = score(f"    open({str(secret)!r}).read()\n    return a + b\n", sandbox=level)
    assert verdict.reason == f"sandbox refused reading {str(secret)!r} outside the sandbox directory"
    assert score("    open('scratch', 'w').write('ok')\n    return a + b\n", sandbox=level).correct  # its own directory


def test_the_code_verifier_runs_in_filter_verify_s_worker_pool():
    spec = VerifierSpec("code", TESTS, OPTIONS)
    assert score_text("    return a + b\n", spec) == score_text("    return a + b\n", spec, timeout_s=None)
    reward, verdict = score_text("    while True: pass\n", spec, timeout_s=5.0)
    assert (reward, verdict.reason) == (0.0, "time limit: still running after 1s (killed)")


def _sweep(problems, body_of) -> list[tuple[str, bool, str]]:
    def one(prompt):
        verdict = verify_code(body_of(prompt), prompt.verifier.ground_truth, prompt.verifier.options)
        return prompt.metadata["task_id"], verdict.correct, verdict.reason

    with ThreadPoolExecutor(2) as pool:  # each check is its own process
        return list(pool.map(one, problems))


def _check_humaneval(problems):
    passed = _sweep(problems, lambda p: p.metadata["canonical_solution"])
    assert [p for p in passed if not p[1]] == []
    stubbed = _sweep(problems, lambda p: "    pass\n")
    assert [p for p in stubbed if p[1]] == []


def test_humaneval_sample_canonical_solutions_pass_and_pass_bodies_fail():
    problems = HumanEvalSource(HumanEvalSource.Config()).load()
    _check_humaneval(problems[::8][:20])  # 20 problems spread over the 164


@pytest.mark.slow
def test_every_humaneval_canonical_solution_passes_and_every_pass_body_fails():
    problems = HumanEvalSource(HumanEvalSource.Config()).load()
    assert len(problems) == 164
    _check_humaneval(problems)
