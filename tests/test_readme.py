"""The README's examples run: its pipeline YAML validates, its Python block executes."""

from __future__ import annotations

import re

from gfcr.graph import compile_pipeline
from gfcr.spec import load_spec_text
from tests.conftest import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")


def test_readme_pipeline_compiles():
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", README, re.S) if b.startswith("name:")]
    assert blocks
    for block in blocks:
        compile_pipeline(load_spec_text(block, "README.md"))


def test_readme_python_runs():
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
