"""The environment modules say what they compute, and their examples run."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import gfcr.stages.environments

MODULES = sorted(m.name for m in pkgutil.iter_modules(gfcr.stages.environments.__path__, "gfcr.stages.environments."))


@pytest.mark.parametrize("name", MODULES)
def test_module_docstring_and_examples(name):
    module = importlib.import_module(name)
    assert module.__doc__, f"{name}: say what the module computes"
    assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0
