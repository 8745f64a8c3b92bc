"""Every module of ``gfcr.stages.common`` has a docstring, and its examples run."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import gfcr.stages.common

MODULES = sorted(m.name for m in pkgutil.iter_modules(gfcr.stages.common.__path__, "gfcr.stages.common."))


@pytest.mark.parametrize("name", MODULES)
def test_module_docstring_and_examples(name):
    module = importlib.import_module(name)
    assert module.__doc__, f"{name}: say what the module computes and which stages share it"
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
