"""The update's components: advantage estimators, losses, aggregations and off-policy
corrections, each a registry of its own (``docs/update-catalog.md``).

They are a library beside the stage families, not part of one: ``update.grpo`` is assembled
from them, and ``filter.d3s`` measures Var(A) with the very estimator the update uses. Like
``gfcr.stages.common``, this package imports no stage family.
"""
