"""Trainer ranks for an update that cannot run split: every registered update plays the ``Trains``
role now (``update.grpo``, ``update.fake``), so the golden table has no case for it; a plugin's
update without it is refused, with the fix."""

from __future__ import annotations

from gfcr.graph.placement import trainer_problems
from gfcr.spec import load_spec_text
from tests.conftest import BASE


class WholeBatchOnly:
    """An update with ``run`` alone: it cannot be split across trainer ranks."""

    def run(self, groups):  # pragma: no cover - never called
        raise AssertionError


def test_an_update_without_the_trains_role_cannot_run_on_trainer_ranks():
    spec = load_spec_text(BASE.replace("run: {steps: 2}", "run: {steps: 2}\nexecutor: {kind: ray}").replace(
        "update: {use: update.fake, from: keep}", "update: {use: update.fake, from: keep, resources: {replicas: 2}}"))
    found = list(trainer_problems(spec, WholeBatchOnly))
    assert [(path, fix) for path, _, fix in found] == [
        (("update", "resources"), "remove `resources` from the update; it then steps in the driver")]
    assert "cannot run split across trainer ranks" in found[0][1]
