"""What stages are lent and what only the runtime keeps (``RuntimeServices``): a stage gets the
policy, the metered engine, the map, the charge counters and the stores of ``OwnsStore`` stages;
never another stage, the clean-up, the trainer start-up, the mover or the runtime's metrics."""

from __future__ import annotations

from dataclasses import fields

import pytest

from gfcr.errors import ModelError
from gfcr.runtime import LocalTrainer, RankTrainer, RuntimeServices
from gfcr.runtime.weights import EngineReload, StayPut
from gfcr.stages.resources import Lent
from gfcr.stages.testing import FakeUpdate


class Owner:
    """Owns a store (the ``OwnsStore`` role), as ``replay.store`` does."""

    def __init__(self):
        self.store = object()

    def owned_store(self):
        return self.store


class Bystander:
    """Any other stage: it has no store to lend."""


def test_stages_are_lent_only_what_they_may_use():
    lent_fields = {f.name for f in fields(Lent)}
    assert lent_fields == {"policy", "engine", "map", "tokens_scored", "rollouts_charged", "tokens_charged", "stores",
                           "steps_optimizer", "judges", "reward_models"}
    runtime_only = {f.name for f in fields(RuntimeServices)} - {"lent"}
    assert runtime_only == {"mover", "start_trainers", "closers", "runtime_metrics"}
    assert not lent_fields & runtime_only


def test_only_the_stores_of_stages_that_own_one_are_lent_and_never_the_stage():
    services, owner = RuntimeServices(), Owner()
    services.lend_stores({"store": owner, "other": Bystander()})
    assert set(services.lent.stores) == {"store"}
    assert services.lent.require_store("store", by="replay.rlep")() is owner.store
    with pytest.raises(ModelError, match="reads the store of the stage `other`"):
        services.lent.require_store("other", by="replay.rlep")


def test_the_default_mover_and_trainer():
    assert isinstance(RuntimeServices().mover, StayPut)  # no engine: nothing to move
    assert isinstance(RuntimeServices(Lent(engine=object())).mover, EngineReload)  # the engine's own sync
    trainer = RuntimeServices().trainer_for(FakeUpdate(FakeUpdate.Config()))
    assert type(trainer) is LocalTrainer and not isinstance(trainer, RankTrainer)
