"""Environments for ``generate.multi_turn``, by name (``environment: {use: <name>, with: {...}}``).

``ENVIRONMENTS`` holds the built-ins (``calculator``, ``code``, ``reasoning_gym``; the labelled
``testing.echo`` and ``testing.raising``) and those other packages register under the ``gfcr.environments`` entry
point group; a name of the form ``package.module:Class`` imports that class directly. Each
trajectory gets a fresh object, ``cls(**with)`` (``make_environment``).
"""

from __future__ import annotations

from typing import Any

from gfcr.registry import Registry
from gfcr.stages.environments.base import (
    Action, ChecksOptions, ClosesEnvironment, Environment, EnvironmentFactory, EnvironmentFailed, Observation, ToolCall,
)
from gfcr.stages.environments.tools import TOOL_PARSERS, Parser

BUILTIN_ENVIRONMENTS = {
    "calculator": "gfcr.stages.environments.calculator:Calculator",
    "code": "gfcr.stages.environments.code:Code",
    "reasoning_gym": "gfcr.stages.environments.procedural:ReasoningGym",
    "testing.echo": "gfcr.stages.environments.testing:Echo",
    "testing.raising": "gfcr.stages.environments.testing:Raising",
}

ENVIRONMENTS: Registry[EnvironmentFactory] = Registry(
    "environment", "gfcr.environments",
    unknown_fix=lambda name: "name a class as `package.module:Class`, or register it under the "
                             "`gfcr.environments` entry point group")
for _name, _target in BUILTIN_ENVIRONMENTS.items():
    ENVIRONMENTS.register_lazy(_name, _target, origin="gfcr")


def environment_factory(name: str) -> EnvironmentFactory:
    """The class (or factory) ``name`` names: a registered name or ``package.module:Class``."""
    if ":" in name and name not in ENVIRONMENTS:
        ENVIRONMENTS.register_lazy(name, name, origin="pipeline")
    return ENVIRONMENTS.get(name)


def make_environment(name: str, options: dict[str, Any]) -> Environment:
    """A fresh environment for one trajectory."""
    return environment_factory(name)(**options)


__all__ = ["Action", "BUILTIN_ENVIRONMENTS", "ChecksOptions", "ClosesEnvironment", "ENVIRONMENTS", "Environment", "EnvironmentFailed", "Observation",
           "Parser", "TOOL_PARSERS", "ToolCall", "environment_factory", "make_environment"]
