"""``update.with.advantage`` is checked when the pipeline compiles (``gfcr validate``): an unknown
estimator, a bad key of its Config and the old string form each exit 2 with the key path."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app

QUICKSTART = str(Path(__file__).resolve().parents[3] / "pipelines" / "quickstart.yaml")


@pytest.mark.parametrize("overrides, path, message", [
    (["update.with.advantage.use=medain"], "update.with.advantage.use",
     "unknown advantage estimator `medain`\n    fix: did you mean `median`"),
    (["update.with.advantage.use=gapo", "update.with.advantage.with.fracton=0.3"], "update.with.advantage.with",
     "advantage estimator `gapo`: unknown key `fracton`\n    fix: did you mean `fraction`?"),
    (["update.with.advantage.use=gapo", "update.with.advantage.with.fraction=1.5"], "update.with.advantage.with",
     "`fraction`: Input should be less than or equal to 1"),
    (["update.with.advantage=median"], "update.with.advantage", "write `advantage: {use: median}`"),
])
def test_bad_advantage_specs_fail_validation_with_the_key_path(overrides, path, message):
    args = ["validate", QUICKSTART] + [a for o in overrides for a in ("--set", o)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert f"{path}:" in result.output and message in result.output
    assert "Traceback" not in result.output


def test_the_median_ablation_validates():
    result = CliRunner().invoke(app, ["validate", QUICKSTART, "--set", "update.with.advantage.use=median"])
    assert result.exit_code == 0, result.output
