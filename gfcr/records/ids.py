"""Stable identifiers.

Ids are plain strings that are the same across epochs, restarts and machines: they are
derived from where a thing came from, never from a clock or a random uuid, so a resumed run
names its rollouts exactly as the uninterrupted run did.
"""

from __future__ import annotations

import re

_ID = re.compile(r"^[^\s]+$")


def check_id(value: object, what: str) -> str:
    """Return ``value`` if it is a non-empty string without whitespace, else raise ValueError."""
    if not isinstance(value, str) or not _ID.match(value):
        raise ValueError(f"{what} must be a non-empty string without whitespace, got {value!r}")
    return value


def prompt_id(source: str, split: str, index: int) -> str:
    """``source:split:index``, e.g. ``gsm8k:train:17``."""
    return f"{source}:{split}:{index}"


def group_id(prompt: str, step: int, round: int = 0) -> str:
    """One sampling event of one prompt: ``<prompt>@s<step>`` (``.r<round>`` in loop rounds > 0)."""
    return f"{prompt}@s{step}" + (f".r{round}" if round else "")


def rollout_id(group: str, index: int) -> str:
    """The ``index``-th rollout of a group: ``<group>/<index>``."""
    return f"{group}/{index}"
