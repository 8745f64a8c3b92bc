"""The Ray executor, by concern (DESIGN.md section 6; docs/ray.md):

- ``executor``: the wiring of a run on Ray (``ray_services``: the driver's policy, the engine
  group, the map, the trainer ranks' start-up, the weight mover);
- ``connection``: connecting to Ray or starting a local cluster (shared by the runs of a process),
  and the capacity checks made before anything is placed;
- ``engine_group``: the engine replicas (``EngineReplica`` actors) and the Engine protocol over
  them (``RayEngineGroup``: split, gather, catch up, restart);
- ``collective``: the source's side of the weight group with the replicas (``CollectiveSync``);
- ``movers``: the ``object_store`` and ``collective`` weight movers (``gfcr.runtime.weights``);
- ``map``: verification as Ray tasks (``RayMap``);
- ``placement``, ``restarts``, ``trainer_ranks``: placement groups, replica restarts, trainer ranks.
"""

from gfcr.errors import GfcrError

try:
    import ray  # noqa: F401  (every module of this package needs it: fail here, with the fix)
except ImportError as exc:  # the optional extra is missing
    raise GfcrError("`executor: {kind: ray}` needs Ray, which is not installed\n"
                    "    fix: `pip install 'gfcr[ray]'`, or use `executor: {kind: prefect}`") from exc
