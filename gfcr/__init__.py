"""gfcr: a declarative pipeline language and runtime for the rollout lifecycle of LLM RL.

The package is layered, imports pointing downward only: cli, tracking, runtime, engines, stages,
graph, registry, spec, records, errors (the import-linter contracts in ``pyproject.toml``);
importing ``gfcr`` itself is cheap and pulls in no heavy dependency. ``gfcr.run(pipeline)`` and
``gfcr.resume(run_dir)`` (``gfcr.api``) run a pipeline from Python as ``gfcr run`` and
``gfcr resume`` do, printing a line a step; they import the runtime when called.
``gfcr.testing`` holds the stage conformance checks.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["run", "resume"]


def __getattr__(name: str) -> Any:
    if name in __all__:  # lazily: `import gfcr` stays cheap for `gfcr validate`
        from gfcr import api

        return getattr(api, name)
    raise AttributeError(f"module 'gfcr' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The lazy ``run`` and ``resume`` with the rest, so ``dir(gfcr)`` and completion find them."""
    return sorted({*globals(), *__all__})
