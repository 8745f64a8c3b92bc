"""Running compiled pipelines: the local runner (the Prefect and Ray runners build on it), the
services it holds (``RuntimeServices``: what it lends stages, and what only it uses) and the
trainer it runs the update with."""

from gfcr.runtime.loop.local import LocalRunner, RunnerHooks, build_stages
from gfcr.runtime.services import RuntimeServices
from gfcr.runtime.training import LocalTrainer, RankTrainer

__all__ = ["LocalRunner", "LocalTrainer", "RankTrainer", "RunnerHooks", "RuntimeServices", "build_stages"]
