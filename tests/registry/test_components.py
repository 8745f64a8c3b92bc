"""The extension points of the update's components, declared in ``gfcr.registry.components``:
roles read with ``provides``, flags with ``declared``, and a component whose public name is a
near miss of an extension point refused at registration (eager, or lazy at first lookup) with
a did-you-mean."""

from __future__ import annotations

import sys
import types

import pytest

from gfcr.errors import RegistryError
from gfcr.registry import Stateful
from gfcr.registry.catalog import (ADVANTAGE_ESTIMATORS, AGGREGATIONS, CORRECTIONS, LOSSES, make_component_registry)
from gfcr.registry.components import (AddsBatchTerm, ChecksPairing, CorrectsTokens, EstimatesBatch, LimitsStaleness,
                                      check_component_names, declared, provides)
from gfcr.stages.components.base import ComponentConfig


class Loss:
    """TEST COMPONENT: a loss with every loss extension point and a helper."""

    requires = ()
    token_corrections = False
    needs_logprobs = True

    class Config(ComponentConfig):
        pass

    def __init__(self, config):
        self.config = config

    def terms(self, log_ratio, advantages, weight, logprobs=None): ...
    def clipped(self): ...  # a helper, not a near miss

    @staticmethod
    def pairing_problems(config, ctx):
        return []


def with_name(name: str, value=None) -> type:
    return type("Bad", (Loss,), {name: value if value is not None else (lambda self: None)})


@pytest.mark.parametrize("name, value, meant", [
    ("token_correction", False, "token_corrections"), ("need_logprobs", True, "needs_logprobs"),
    ("requieres", (), "requires"), ("pairing_problem", None, "pairing_problems"),
    ("estimate_batches", None, "estimate_batch"), ("batch_terms", None, "batch_term"),
    ("parameter", None, "parameters"), ("metric", None, "metrics"), ("correction", None, "correct"),
    ("keep", None, "keeps"), ("term", None, "terms"), ("state_dicts", None, "state_dict"),
])
def test_a_near_miss_of_an_extension_point_is_refused_with_a_did_you_mean(name, value, meant):
    with pytest.raises(RegistryError) as info:
        check_component_names("loss", "bad", with_name(name, value))
    assert f"loss `bad` (Bad) defines `{name}`" in info.value.message and "never read it" in info.value.message
    assert f"did you mean `{meant}`?" in info.value.fix


def test_registering_a_misspelt_component_fails_at_once():
    registry = make_component_registry("loss", "gfcr.test_losses", {})
    with pytest.raises(RegistryError, match="did you mean `token_corrections`"):
        registry.register("bad", with_name("token_correction", False))
    assert "bad" not in registry
    assert registry.register("good", Loss) is Loss


def test_a_lazily_registered_misspelt_component_is_refused_at_its_first_lookup(monkeypatch):
    module = types.ModuleType("gfcr_test_misspelt")
    module.Bad = with_name("needs_logprob", True)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    registry = make_component_registry("loss", "gfcr.test_losses", {"bad": "gfcr_test_misspelt:Bad"})
    with pytest.raises(RegistryError, match="did you mean `needs_logprobs`"):
        registry.get("bad")


def test_every_builtin_component_passes_the_check():
    for registry in (ADVANTAGE_ESTIMATORS, LOSSES, AGGREGATIONS, CORRECTIONS):
        for alias in registry.names():
            check_component_names(registry.kind, alias, registry.get(alias))


def test_flags_are_read_with_their_declared_defaults():
    assert declared(Loss, "token_corrections") is False and declared(Loss, "needs_logprobs") is True
    assert declared(LOSSES.get("ppo_clip"), "token_corrections") is True
    assert declared(LOSSES.get("ppo_clip"), "needs_logprobs") is False and declared(object(), "requires") == ()
    with pytest.raises(KeyError):
        declared(Loss, "token_correction")  # only a declared flag can be read


def test_roles_are_read_from_the_declared_protocols():
    assert provides(Loss, ChecksPairing) and not provides(Loss, EstimatesBatch)
    assert provides(ADVANTAGE_ESTIMATORS.get("reinforce_pp"), EstimatesBatch)
    daro = AGGREGATIONS.get("daro")
    assert provides(daro, AddsBatchTerm) and provides(daro, Stateful)
    assert not provides(AGGREGATIONS.get("token_mean"), AddsBatchTerm)
    tis, none = CORRECTIONS.get("tis"), CORRECTIONS.get("none")
    assert provides(tis, CorrectsTokens) and provides(tis, LimitsStaleness)
    assert not provides(none, CorrectsTokens) and not provides(none, LimitsStaleness)
