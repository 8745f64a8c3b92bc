"""The tiny-arith policy, loaded once per test module (it is a few MB and loads in a second)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def policy():
    from gfcr.engines import load_policy
    from gfcr.spec import PolicySpec

    return load_policy(PolicySpec(model="tiny-arith"))
