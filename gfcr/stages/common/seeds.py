"""Seeds derived from named parts: ``step_seed`` turns any parts (the stage's seed, the step,
the round, a purpose such as ``"dots-reference"``) into a 31-bit seed.

crc32 of the parts joined by ``:``, so the seed is the same in every process and after a
restart (Python's ``hash`` of a string is salted per process). The engines seed each row from
it with ``gfcr.stages.engine.row_seed``, the same hash of ``(seed, request id, row)``.

Example:

>>> step_seed(0, 1, 0) == step_seed("0", "1", "0")  # parts are read as text
True
>>> 0 <= step_seed(7, "sgpo-profile") < 2 ** 31
True
"""

from __future__ import annotations

import zlib


def step_seed(*parts: object) -> int:
    """A 31-bit seed from any parts (stable across processes, unlike ``hash``)."""
    return zlib.crc32(":".join(map(str, parts)).encode()) & 0x7FFFFFFF
