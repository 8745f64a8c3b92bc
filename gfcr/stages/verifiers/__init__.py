"""Verifiers: functions ``(response_text, ground_truth, options) -> Score``, by name.

``VERIFIERS`` holds the built-ins (``arithmetic``, ``gsm8k``, ``math``, ``code``,
``reasoning_gym``), imported lazily on
first lookup, and any verifier a package declares in the ``gfcr.verifiers`` entry-point
group::

    [project.entry-points."gfcr.verifiers"]
    my_verifier = "my_package.rewards:verify_mine"

A prompt names its verifier in ``Prompt.verifier`` (a ``VerifierSpec``); the
``filter.verify`` stage runs it, in a pool of killable worker processes
(``gfcr.stages.verifiers.pool``).
"""

from __future__ import annotations

from gfcr.errors import did_you_mean, known
from gfcr.registry import Registry
from gfcr.stages.verifiers.base import Score, Verifier, VerifierOptions, parse_options

BUILTIN_VERIFIERS = {
    "arithmetic": "gfcr.stages.verifiers.arithmetic:verify_arithmetic",
    "gsm8k": "gfcr.stages.verifiers.gsm8k:verify_gsm8k",
    "math": "gfcr.stages.verifiers.math_equiv:verify_math",
    "code": "gfcr.stages.verifiers.code:verify_code",
    "reasoning_gym": "gfcr.stages.verifiers.reasoning_gym:verify_reasoning_gym",
}


def make_verifier_registry(builtins: bool = True, entry_points: bool = True) -> Registry[Verifier]:
    registry: Registry[Verifier] = Registry("verifier", "gfcr.verifiers" if entry_points else None)
    if builtins:
        for name, target in BUILTIN_VERIFIERS.items():
            registry.register_lazy(name, target, origin="gfcr")
    return registry


VERIFIERS = make_verifier_registry()


def check_verifier_name(name: str, registry: Registry[Verifier] = VERIFIERS) -> str:
    """``name`` if it is a registered verifier, else ValueError with a "did you mean" fix
    (for pydantic validators, whose ValueErrors become spec problems)."""
    if name not in registry:
        names = registry.names()
        hint = did_you_mean(name, names) or f"known verifiers: {known(names)}"
        raise ValueError(f"unknown verifier `{name}`; {hint}")
    return name


__all__ = [
    "BUILTIN_VERIFIERS", "Score", "VERIFIERS", "Verifier", "VerifierOptions", "check_verifier_name",
    "make_verifier_registry", "parse_options",
]
