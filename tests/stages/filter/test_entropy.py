"""filter.entropy: the quantile band of mean token entropies, by hand, for each action and scope;
NaN positions left out of the mean; missing entropies and bad bands are loud; a short real run."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.graph import load_pipeline
from gfcr.records import RolloutGroups
from gfcr.runtime.loop.session import Run
from gfcr.stages.filter.entropy import EntropyGate, mean_entropy
from gfcr.stages.testing import scored_group
from tests.conftest import REPO


def batch(a=(0.0, 1.0, 2.0), b=(3.0, 4.0)) -> RolloutGroups:
    groups = []
    for prompt, values in (("p:a", a), ("p:b", b)):
        g = scored_group(prompt, [float(i % 2) for i in range(len(values))])
        for r, h in zip(g.rollouts, values):
            r.token_entropy = np.array([h], dtype=np.float32)
        groups.append(g)
    return RolloutGroups(groups)


def entropies(groups: RolloutGroups) -> list[list[float]]:
    return [[float(r.token_entropy[0]) for r in g.rollouts] for g in groups]


def gate(**config) -> EntropyGate:
    return EntropyGate(EntropyGate.Config(**config))


def test_keep_the_batch_band():
    # 5 values 0..4: quantile 0.25 = 1.0, 0.75 = 3.0 (linear); keep 1, 2, 3
    groups = batch()
    stage = gate(band=(0.25, 0.75))
    out = stage.run(groups)
    assert entropies(out) == [[1.0, 2.0], [3.0]]
    assert [m.reason for m in groups.groups[0].removed] == ["mean token entropy 0 outside the band [1, 3]"]
    assert stage.step_metrics() == {"rollouts_seen": 5.0, "rollouts_removed": 2.0, "rollouts_reweighted": 0.0,
                                    "entropy_mean": 2.0, "entropy_lo": 1.0, "entropy_hi": 3.0}


def test_drop_the_batch_band():
    out = gate(action="drop", band=(0.25, 0.75)).run(batch())
    assert entropies(out) == [[0.0], [4.0]]


def test_reweight_the_band():
    groups = batch()
    gate(action="reweight", band=(0.25, 0.75), weight=0.5).run(groups)
    assert [[r.sample_weight for r in g.rollouts] for g in groups] == [[1.0, 0.5, 0.5], [0.5, 1.0]]
    assert not any(g.removed for g in groups)


def test_group_scope_uses_each_group_s_own_quantiles():
    # group a [0, 1, 2]: band (0, 0.5) is [0, 1]; group b [3, 4]: [3, 3.5]
    out = gate(band=(0.0, 0.5), scope="group").run(batch())
    assert entropies(out) == [[0.0, 1.0], [3.0]]


def test_nan_positions_are_left_out_and_a_missing_entropy_is_loud():
    g = scored_group("p:0", [1.0])
    r = g.rollouts[0]
    r.token_entropy = np.array([np.nan, 1.0, 3.0], dtype=np.float32)
    assert mean_entropy(r) == pytest.approx(2.0)
    r.token_entropy = np.array([np.nan], dtype=np.float32)
    with pytest.raises(ValueError, match="no recorded token entropy.*entropy: true"):
        gate().run(RolloutGroups([g]))
    r.token_entropy = None
    with pytest.raises(ValueError, match="p:0@s0/0"):
        gate().run(RolloutGroups([g]))


def test_a_group_left_empty_is_dropped():
    groups = batch(a=(1.0,), b=(5.0, 6.0))  # batch band (0, 0.5): [1, 5]; drop inside removes 1.0 and 5.0
    out = gate(action="drop", band=(0.0, 0.5)).run(groups)
    assert entropies(out) == [[6.0]]
    assert not groups.groups[0].verdict.included and "entropy gate" in groups.groups[0].verdict.reason


@pytest.mark.parametrize("band", [(0.5, 0.5), (0.6, 0.2), (-0.1, 0.5), (0.2, 1.5)])
def test_a_bad_band_is_refused(band):
    with pytest.raises(ValueError, match="0 <= q_lo < q_hi <= 1"):
        EntropyGate.Config(band=band)


def test_validate_needs_an_upstream_generator_that_records_entropy():
    spec = str(REPO / "pipelines" / "entropy_arith.yaml")
    assert CliRunner().invoke(app, ["validate", spec]).exit_code == 0
    result = CliRunner().invoke(app, ["validate", spec, "--set", "stages.rollout.with.entropy=false"])
    assert result.exit_code == 2 and "does not record them" in result.output
    assert "stages.rollout.with.entropy=true" in result.output


def test_a_short_tiny_arith_run(tmp_path):
    text = (REPO / "pipelines" / "entropy_arith.yaml").read_text()
    text = text.replace("n: 4000", "n: 40").replace("batch_size: 16", "batch_size: 4")
    text = text.replace("steps: 100, seed: 0, checkpoint_every: 50", "steps: 2, seed: 0, checkpoint_every: 2")
    text = text.replace("eval: {source", "# eval: {source")
    spec = tmp_path / "entropy.yaml"
    spec.write_text(text + "tracking: {mlflow: null}\n")
    Run.start(load_pipeline(spec), tmp_path / "run").train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        gate_metrics = r["stages"]["gate"]
        assert gate_metrics["rollouts_seen"] == 4 * 8
        # the band [0.2, 1.0] removes only rollouts below the 20% quantile (linear, at 6.2 of 31): at most 7 of 32 (none when
        # more than a fifth tie at the lowest entropy, as identical confident answers do)
        assert 0 <= gate_metrics["rollouts_removed"] <= 7
        assert gate_metrics["entropy_lo"] <= gate_metrics["entropy_mean"] <= gate_metrics["entropy_hi"]
        assert r["rollouts_in_update"] <= 4 * 8 - gate_metrics["rollouts_removed"]
