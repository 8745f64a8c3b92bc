"""Moving weights: the registry of weight movers (``movers``) and the torch.distributed weight
group that the ``collective`` mover broadcasts through."""

from gfcr.runtime.weights.movers import WEIGHT_MOVERS, EngineReload, StayPut, make_mover, mover_name

__all__ = ["WEIGHT_MOVERS", "EngineReload", "StayPut", "make_mover", "mover_name"]
