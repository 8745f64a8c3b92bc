"""Running compiled pipelines: the local runner (the Prefect and Ray runners build on it)."""

from gfcr.runtime.local import LocalRunner, RunnerHooks, build_stages

__all__ = ["LocalRunner", "RunnerHooks", "build_stages"]
