"""The README leads a new user from install to a comparison: its commands run as written (at tiny
sizes) and print what its ``console`` blocks say to expect.

A ``console`` block holds ``$ command`` lines, each followed by the output to expect. An expected
line must appear in the command's output, in order, once both are normalised: table borders
and pipes become spaces, every number becomes ``#``, lists of numbers (``0, 1, 2``) one ``#``,
95% intervals (``[0.566, 0.711]``) vanish, and ``…`` in an expected line matches anything (a line
of just ``…``: any lines). Numbers are normalised because the test runs the commands at tiny
sizes (``TINY``: 4 prompts x 4 rollouts, 8 eval prompts, the local runner; 2 steps, or a
150-token budget for ``gfcr compare``), where the figures differ from the README's full-size ones.

The path's training commands (run, ablate, compare, lineage of what they wrote) are slow-marked:
``pytest -m slow tests/test_readme.py``. The rest (validate, stages, the README's YAML and
Python, its counts and its length) runs in the default suite.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from gfcr.graph import compile_pipeline
from gfcr.spec import load_spec_text
from tests.conftest import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")
PATH, _, REFERENCE = README.partition("\n# Reference\n")

# the tiny sizes every training command of the path runs at
TINY = ["--set", "stages.pick.with.batch_size=4", "--set", "stages.budget.with.n=4", "--set", "eval.with.n=8",
        "--executor", "local"]
TWO_STEPS = ["--set", "run.steps=2"]  # run and ablate; compare stops at its (smaller) budget
SMALLER = {"--seeds 0,1,2": "--seeds 0,1", "--budget tokens=60000": "--budget tokens=150"}
# commands not run as written: `make demo` builds .venv and trains the quickstart, whose run this
# test makes directly (the Makefile's demo recipe ends with it); `gfcr ui` starts two servers
INSTEAD = {"make demo": "gfcr run pipelines/quickstart.yaml --run-dir runs/demo"}
NOT_RUN = {"gfcr ui"}
TRAINS = ("gfcr run", "gfcr ablate", "gfcr compare", "make demo")


@dataclass
class Step:
    command: str
    expected: list[str]


def steps(text: str = PATH) -> list[Step]:
    """Every ``$ command`` of the text's ``console`` blocks, with the lines expected after it."""
    found = []
    for block in re.findall(r"```console\n(.*?)```", text, re.S):
        for line in block.splitlines():
            if line.startswith("$ "):
                found.append(Step(line[2:].strip(), []))
            elif found and line.strip():
                found[-1].expected.append(line)
    return found


_BORDERS = re.compile(r"[│┃|┆║─━┌┐└┘├┤┬┴┼┏┓┗┛┡┩╇┳┻╋╭╮╰╯]")
_NUMBER = re.compile(r"\d(?:[\d,]*\d)?(?:\.\d+)?(?:e[-+]?\d+)?")


def normalise(line: str) -> str:
    line = _BORDERS.sub(" ", line)
    line = re.sub(r"\[[^\]]*\]", " ", line)  # 95% intervals
    line = _NUMBER.sub("#", line)
    line = re.sub(r"#(?:\s*,\s*#)+", "#", line)  # seed lists
    return " ".join(line.split())


def missing_lines(expected: list[str], output: str) -> list[str]:
    """The expected lines not found in ``output``, in order (``…`` matches anything)."""
    actual = [normalise(line) for line in output.splitlines()]
    position, missing = 0, []
    for line in expected:
        if line.strip() == "…":
            continue
        pattern = re.compile(".*?".join(re.escape(part.strip()) for part in normalise(line).split("…")))
        hit = next((i for i in range(position, len(actual)) if pattern.search(actual[i])), None)
        if hit is None:
            missing.append(line)
        else:
            position = hit + 1
    return missing


def run_command(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """``command`` as the README writes it, at the tiny sizes if it trains, in ``cwd``."""
    command = INSTEAD.get(command, command)
    for full, small in SMALLER.items():
        command = command.replace(full, small)
    args = shlex.split(command)
    assert args[0] == "gfcr", command
    extra = TINY if command.startswith(TRAINS) else []
    extra = extra + (TWO_STEPS if command.startswith(("gfcr run", "gfcr ablate")) else [])
    env = {**os.environ, "COLUMNS": "400", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
           "MLFLOW_TRACKING_URI": f"sqlite:///{cwd}/mlflow.db"}
    return subprocess.run([sys.executable, "-m", "gfcr.cli.main", *args[1:], *extra], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1800)


def check_step(step: Step, cwd: Path) -> None:
    result = run_command(step.command, cwd)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"`{step.command}` failed:\n{output[-3000:]}"
    missing = missing_lines(step.expected, output)
    assert not missing, f"`{step.command}` did not print, as the README says:\n" + "\n".join(missing) + (
        f"\n--- it printed:\n{output[-6000:]}")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A working directory with the shipped pipelines and the README's ``my_grpo.yaml``."""
    (tmp_path / "pipelines").symlink_to(REPO / "pipelines")
    for name, text in re.findall(r"Save this as `([\w.]+)`[^\n]*\n(?:[^\n]+\n)*\n```yaml\n(.*?)```", PATH, re.S):
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_path_is_short_and_keeps_its_two_make_commands():
    assert len(PATH.splitlines()) <= 150, "the README's path (before `# Reference`) should stay within 150 lines"
    assert all(f"$ {c}" in PATH or c in PATH for c in ("make demo", "make test"))
    recipe = (REPO / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert recipe.rstrip().endswith("gfcr run pipelines/quickstart.yaml"), "INSTEAD['make demo'] runs what make demo runs"


def test_the_path_has_every_step_a_new_user_needs():
    commands = [s.command for s in steps()]
    for start in ("make demo", "gfcr validate", "gfcr run", "gfcr stages", "gfcr ablate", "gfcr compare",
                  "gfcr lineage", "gfcr ui"):
        assert any(c.startswith(start) for c in commands), start
    assert all(s.expected for s in steps()), "every command is followed by the output to expect"


QUICK = [s for s in steps() if not s.command.startswith(TRAINS) and "runs/" not in s.command
         and s.command not in NOT_RUN]


@pytest.mark.parametrize("step", QUICK, ids=[s.command for s in QUICK])
def test_a_command_that_does_not_train_prints_what_the_readme_says(step, checkout):
    check_step(step, checkout)


@pytest.mark.slow
def test_the_path_runs_as_written_and_prints_what_the_readme_says(checkout):
    """Every command of the path in order (each may read what the one before wrote), at tiny sizes."""
    for step in steps():
        if step.command not in NOT_RUN:
            check_step(step, checkout)


def test_normalising_keeps_words_and_forgets_figures():
    assert normalise("│ eval accuracy before           │ 37.5%   │") == normalise("eval accuracy before │ 33.0%")
    assert normalise("| greso-arith | 0, 1 | 2 | 0.5 |") == normalise("| greso-arith | 0, 1, 2 | 108 [106, 109] | 0.640 [0.603, 0.677] |")
    assert missing_lines(["a …", "…", "c # d"], "a b\nx\nc 12 d") == []
    assert missing_lines(["c 1 d", "a"], "a\nc 2 d") == ["a"]  # in order


def test_readme_pipelines_compile():
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", README, re.S) if b.startswith("name:")]
    assert len(blocks) >= 2  # the path's my_grpo.yaml and the reference's language example
    for block in blocks:
        compile_pipeline(load_spec_text(block, "README.md"))


def test_readme_python_runs():
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_run_files_table_lists_every_file_a_run_directory_holds():
    from gfcr.runtime.store import rundir

    files = re.findall(r"^      ([\w./-]+?)(?:/step-\d+\.parquet|/step-\d+/|/control-\d+\.parquet)?\s", rundir.__doc__, re.M)
    assert "run.json" in files
    for name in files:
        assert f"| `{name.split('/')[0]}" in REFERENCE, f"the README's table of run files should list `{name}`"


_COUNTED = re.compile(r"\b(\d+) (stages|labelled test stages|data sources|verifiers|advantage estimators|losses|"
                      r"aggregations|off-policy corrections)\b")


@pytest.mark.parametrize("page", ["README.md", "docs/roadmap.md"])
def test_counts_in_prose_are_the_registry_s(page):
    spec = importlib.util.spec_from_file_location("stages_doc", REPO / "scripts" / "stages_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    counts = {**module.counts(), "labelled test stages": module.counts()["test stages"]}
    prose = re.sub(r"```.*?```", " ", (REPO / page).read_text(encoding="utf-8"), flags=re.S)  # not printed outputs
    text = " ".join(prose.split())
    for number, noun in _COUNTED.findall(text):
        assert int(number) == counts[noun], f"{page} says {number} {noun}; the registry has {counts[noun]}"
