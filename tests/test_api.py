"""``gfcr.run`` from Python (issue 30): listed by ``dir(gfcr)``, printing a line per step (or
nothing with ``progress=False``), and the package docstring citing only files the repo has."""

from __future__ import annotations

import re

import gfcr
from tests.conftest import BASE, REPO


def test_run_and_resume_are_in_dir_and_the_docstring_cites_real_files():
    assert {"run", "resume", "__version__"} <= set(dir(gfcr))
    cited = re.findall(r"``?([\w./-]+\.(?:md|toml|py))``?", gfcr.__doc__)
    assert cited and all((REPO / name).exists() for name in cited), cited
    assert "DESIGN.md" not in gfcr.__doc__


def test_gfcr_run_prints_a_line_a_step_unless_told_not_to(tmp_path, capsys):
    spec = tmp_path / "fake.yaml"
    spec.write_text(BASE)  # generate.fake, update.fake, 2 steps, MLflow off
    summary = gfcr.run(spec, run_dir=tmp_path / "run", overrides=["executor.kind=local"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"golden: run directory {tmp_path / 'run'}"
    assert [re.sub(r"reward \S+, \d+ rollouts, \S+ s", "...", line) for line in lines[1:]] == \
        ["golden: step 1/2: ...", "golden: step 2/2: ..."]
    assert summary["steps"] == 2
    gfcr.resume(tmp_path / "run", steps=3, progress=False)
    assert capsys.readouterr().out == ""
