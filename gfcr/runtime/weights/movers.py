"""Weight movers: how a new policy version reaches the engine(s) after an update.

The runtime's trainer (``gfcr.runtime.training``) bumps the version and calls the run's mover,
``move(version) -> bytes``; the report's ``sync_s`` is the call's wall time and ``sync_bytes`` what
it returns. The movers, by name (``WEIGHT_MOVERS``, each a factory ``make(engine) -> mover``):

================  ===================================================================================
``none``          the engine samples from the trained model object itself (the transformers engine)
``reload``        the engine copies the weights in itself: the local vLLM engine's ``sync_weights``
``object_store``  Ray engine replicas, through Ray's object store (``executor.weight_sync``)
``collective``    Ray engine replicas, through a torch.distributed weight group whose source is the
                  driver or trainer rank 0, falling back to the object store (``executor.weight_sync``)
================  ===================================================================================

``mover_name(spec)`` picks the run's: ``executor.weight_sync`` (default ``collective``) under the
Ray executor, ``reload`` for the vLLM engine, else ``none``. Under a stale lifecycle
(``pipelined``, ``async``) the update's mover is ``none`` on either local engine and on Ray:
the engine samples a second copy of the policy, which the schedule loads from its weight history
before each step's generation, and on vLLM or the Ray engine replicas the schedule then makes the
engine's sync call itself (``engine.sync_weights``, in the producer: vLLM reloads, the replicas
take the copy by ``executor.weight_sync``; ``gfcr.runtime.loop.lifecycle``).

Adding a sync path is one module and one registration: a class with ``move(version) -> int``
and ``WEIGHT_MOVERS.register("name", make)`` (or ``register_lazy("name", "pkg.module:make",
origin=...)``); a run uses it with ``build_services(spec, mover="name")``
(``gfcr.runtime.loop.session``). Stage code never imports this package (an import-linter
contract): stages decide, the runtime moves.
"""

from __future__ import annotations

from typing import Any, Callable

from gfcr.registry import Registry
from gfcr.runtime.training import WeightMover
from gfcr.spec import PipelineSpec

MakeMover = Callable[[Any], WeightMover]
WEIGHT_MOVERS: Registry[MakeMover] = Registry("weight mover")


class StayPut:
    """``none``: the engine shares the trained model, so nothing is copied."""

    def __init__(self, engine: Any = None):
        self.engine = engine

    def move(self, version: int) -> int:
        return 0


class EngineReload:
    """``reload``: the engine loads the policy's weights itself (``Engine.sync_weights``: the local
    vLLM engine copies them into its workers)."""

    def __init__(self, engine: Any):
        self.engine = engine

    def move(self, version: int) -> int:
        return self.engine.sync_weights(version)


WEIGHT_MOVERS.register("none", StayPut, origin="gfcr")
WEIGHT_MOVERS.register("reload", EngineReload, origin="gfcr")
WEIGHT_MOVERS.register_lazy("object_store", "gfcr.runtime.ray.movers:ObjectStoreMover", origin="gfcr")
WEIGHT_MOVERS.register_lazy("collective", "gfcr.runtime.ray.movers:CollectiveMover", origin="gfcr")


def mover_name(spec: PipelineSpec) -> str:
    """The mover a run of ``spec`` uses."""
    if spec.executor.kind == "ray" and spec.policy is not None:
        return spec.executor.weight_sync or "collective"
    if spec.policy is not None and spec.policy.engine == "vllm":
        return "reload"
    return "none"


def make_mover(name: str, engine: Any) -> WeightMover:
    """The mover ``name`` over ``engine`` (an unknown name: the registry's error, with a did-you-mean)."""
    return WEIGHT_MOVERS.get(name)(engine)
