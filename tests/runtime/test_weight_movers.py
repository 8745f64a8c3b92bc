"""Weight movers (``gfcr.runtime.weights``): adding a sync path is one class and one registration,
and a real run (tiny-arith, quickstart made small) hands every new version to the mover it was
given; the run's metrics are those of the run with the default mover, apart from the clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from gfcr.errors import RegistryError
from gfcr.graph import load_pipeline
from gfcr.runtime import LocalRunner
from gfcr.runtime.loop.session import build_services, step_record
from gfcr.runtime.weights import WEIGHT_MOVERS, EngineReload, StayPut, make_mover, mover_name

REPO = Path(__file__).resolve().parents[2]
SMALL = ["stages.pick.with.batch_size=4", "eval.every=1000", "tracking.mlflow=null", "executor.kind=local"]


class CountingMover:
    """A toy sync path (labelled TEST mover): records each version it is handed, and copies nothing
    (the transformers engine shares the trained model, as with ``none``)."""

    def __init__(self, engine):
        self.engine, self.versions = engine, []

    def move(self, version: int) -> int:
        self.versions.append(version)
        return 0


WEIGHT_MOVERS.register("test_counting", CountingMover, origin="tests")  # the one registration


def _records(mover: str | None) -> tuple[list[dict], object]:
    pipeline = load_pipeline(REPO / "pipelines" / "quickstart.yaml", SMALL)
    services = build_services(pipeline.spec, mover=mover)
    reports = LocalRunner(pipeline, services=services).run(3)
    return [step_record(r, None, 0.0) for r in reports], services


def test_a_registered_mover_is_handed_every_new_version_by_a_real_run():
    records, services = _records("test_counting")
    assert isinstance(services.mover, CountingMover)
    updated = [r["policy_version"] for r in records if not r["update_skipped"]]
    assert updated and services.mover.versions == updated  # one call per update, with its new version
    assert services.lent.policy.version == records[-1]["policy_version"]
    baseline, _ = _records(None)  # `none`, the transformers engine's
    strip = lambda rs: [{k: v for k, v in r.items() if k != "time"} for r in rs]  # noqa: E731
    assert strip(records) == strip(baseline)


def test_the_spec_picks_the_shipped_movers():
    quick = load_pipeline(REPO / "pipelines" / "quickstart.yaml", SMALL).spec
    assert mover_name(quick) == "none"
    on_vllm = quick.model_copy(update={"policy": quick.policy.model_copy(update={"engine": "vllm"})})
    assert mover_name(on_vllm) == "reload"
    ray = load_pipeline(REPO / "pipelines" / "quickstart.yaml", SMALL + ["executor.kind=ray"]).spec
    assert mover_name(ray) == "collective"
    object_store = SMALL + ["executor.kind=ray", "executor.weight_sync=object_store"]
    assert mover_name(load_pipeline(REPO / "pipelines" / "quickstart.yaml", object_store).spec) == "object_store"
    assert {"none", "reload", "object_store", "collective"} <= set(WEIGHT_MOVERS.names())
    assert isinstance(make_mover("none", None), StayPut) and isinstance(make_mover("reload", object()), EngineReload)


def test_an_unknown_mover_says_which_it_knows():
    with pytest.raises(RegistryError, match="(?s)unknown weight mover `colective`.*did you mean `collective`"):
        make_mover("colective", None)
