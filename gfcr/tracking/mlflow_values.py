"""What a gfcr run looks like as MLflow params and metrics: flat keys, MLflow's limits respected.

- Params are the resolved spec, flattened with ``.`` (``update.with.lr``), defaults included:
  each stage's ``with`` and the data sources' ``with`` come from their validated Configs, so
  a param exists for every setting a run used, not only those its YAML wrote. Values are
  ``str(value)`` as MLflow writes them (``None``, ``True``, ``[0.2, 0.28]``).
- Metrics are the numeric leaves of a ``metrics.jsonl`` line, flattened the same way
  (``update.grad_norm``, ``time.step_s``, ``control.pick.p_easy``); booleans become 0/1;
  strings, nulls and lists are left out (they are in ``metrics.jsonl``).

MLflow caps a param value at 6000 characters and a key at 250: a longer value is cut and ends
with ``... [truncated: N chars]``, a longer key keeps its head and gets a short hash, so two
long keys stay distinct. Characters MLflow refuses in keys become ``_``.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any, Iterable, Iterator, Mapping

from gfcr.graph import CompiledPipeline

MAX_PARAM_VALUE = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
MAX_KEY = 250  # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH
MAX_TAG_VALUE = 8000  # mlflow.utils.validation.MAX_TAG_VAL_LENGTH
PARAMS_PER_BATCH = 100  # mlflow.utils.validation.MAX_PARAMS_TAGS_PER_BATCH
METRICS_PER_BATCH = 1000  # mlflow.utils.validation.MAX_METRICS_PER_BATCH
_BAD_KEY_CHARS = re.compile(r"[^\w\-. :/]")


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(a.b.c, leaf)`` for every leaf of nested mappings; an empty mapping is a leaf ``{}``."""
    if isinstance(value, Mapping) and value:
        for key, sub in value.items():
            yield from flatten(sub, f"{prefix}{key}.")
    elif prefix:
        yield prefix[:-1], value


def mlflow_key(key: str) -> str:
    """``key`` in the characters and length MLflow accepts."""
    key = _BAD_KEY_CHARS.sub("_", key)
    if len(key) <= MAX_KEY:
        return key
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    return f"{key[:MAX_KEY - 9]}~{digest}"


def fit_value(value: str, limit: int = MAX_PARAM_VALUE) -> str:
    """``value`` cut to ``limit`` characters, saying so when it was cut."""
    if len(value) <= limit:
        return value
    note = f"... [truncated: {len(value)} chars]"
    return value[: limit - len(note)] + note


def resolved_spec(pipeline: CompiledPipeline) -> dict[str, Any]:
    """The spec as plain data with every default filled in, stage and data configs validated."""
    data = pipeline.spec.model_dump(by_alias=True, mode="json")
    for sid, node in pipeline.nodes.items():
        target = data["update"] if sid == "update" else data["stages"][sid]
        target["with"] = node.config.model_dump(mode="json")
    for key, binding in (("data", pipeline.data), ("eval", pipeline.eval)):
        if binding is not None:
            data[key]["with"] = binding.config.model_dump(mode="json")
    return data


def spec_params(pipeline: CompiledPipeline) -> dict[str, str]:
    """The MLflow params of a run: its resolved spec, flattened."""
    return {mlflow_key(k): fit_value("{}" if v == {} else str(v)) for k, v in flatten(resolved_spec(pipeline))}


def metric_values(record: Mapping[str, Any], skip: Iterable[str] = ("step",)) -> dict[str, float]:
    """The numeric leaves of a metrics line, flattened; booleans as 0/1."""
    skipped = set(skip)
    out: dict[str, float] = {}
    for key, value in flatten(record):
        if key in skipped or isinstance(value, (str, list, tuple, dict)) or value is None:
            continue
        number = float(value)  # bool, int, float, numpy scalars
        if math.isfinite(number):
            out[mlflow_key(key)] = number
    return out


def batches(items: list[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]
