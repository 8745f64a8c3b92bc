"""Where Ray puts a run's actors: a placement group per actor group (docs/ray.md, "Placement").

A group of actors (the engine replicas; the trainer ranks of a distributed update) reserves
one Ray placement group, a bundle of resources per actor, before any actor starts. The
spec's ``resources`` say what each bundle holds and where the bundles go:

- ``cpus`` and ``gpus``: the bundle's ``CPU`` and ``GPU``;
- ``strategy``: Ray's placement strategy (``pack`` -> ``PACK``, ``spread`` -> ``SPREAD``,
  ``strict_pack`` -> ``STRICT_PACK``, ``strict_spread`` -> ``STRICT_SPREAD``);
- ``node_resource``: a Ray custom resource that the chosen nodes declare (``ray start
  --resources '{"engines": 1}'``; on KubeRay, ``rayStartParams.resources`` of a worker group).
  Each bundle asks for ``NODE_SHARE`` of it, so it marks the node rather than counting
  slots: any amount declared lets the node take up to 1,000 bundles. Custom resources rather
  than Ray's node labels: they are stable in every Ray release gfcr supports, Ray's own
  ``node:<ip>`` resources pin a bundle to one machine the same way, and KubeRay and
  ``ray up`` both set them.

``reserve`` fails at once, before any actor starts, when the cluster cannot hold the group
even empty (``cannot_hold``, from the nodes' total resources), and after ``timeout_s`` when
it could but other work holds the resources now; the error says what is missing and what to
lower. Ray would otherwise leave the group, and every actor in it, pending forever.

Each actor of the group is then started with its bundle's ``scheduling_strategy``; the
bundles' nodes are read back from Ray (``Reservation.nodes``), and each engine replica
records its own node on the completions it generates (the lineage's ``ray_node`` column).
Any group of actors is placed the same way, e.g. two trainer ranks on the ``trainers`` nodes::

    reservation = reserve(bundles(2, cpus=1, node_resource="trainers"), "spread",
                          what="the trainer ranks", lower="`workers` or `cpus` on the update")
    ranks = [TrainerRank.options(num_cpus=1, scheduling_strategy=where).remote(rank)
             for rank, where in enumerate(reservation.strategies)]
    ...
    reservation.release()  # when the ranks have ended: frees the bundles
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from gfcr.errors import GfcrError
from gfcr.spec import Resources as Placement

Bundle = dict[str, float]
RAY_STRATEGY = {"pack": "PACK", "spread": "SPREAD", "strict_pack": "STRICT_PACK", "strict_spread": "STRICT_SPREAD"}
NODE_SHARE = 0.001  # of a node resource each bundle takes: the node is marked, not divided into slots
READY_TIMEOUT_S = 60.0  # a group the cluster can hold is reserved in milliseconds when its resources are free
EPS = 1e-9


def bundles(count: int, cpus: float, gpus: int = 0, node_resource: str | None = None) -> list[Bundle]:
    """``count`` equal bundles of ``cpus`` CPUs and ``gpus`` GPUs, on nodes that declare
    ``node_resource`` (if given); GPUs of 0 are left out (Ray refuses a 0 in a bundle)."""
    bundle: Bundle = {"CPU": float(cpus)}
    if gpus:
        bundle["GPU"] = float(gpus)
    if node_resource is not None:
        bundle[node_resource] = NODE_SHARE
    return [dict(bundle) for _ in range(count)]


def placement_bundles(placement: Placement) -> list[Bundle]:
    """A bundle per replica of a stage's ``resources``."""
    return bundles(placement.replicas, placement.cpus, placement.gpus, placement.node_resource)


# --- can the cluster hold it at all? (no Ray needed: the nodes' totals are passed in) -------

def _fits(bundle: Mapping[str, float], node: Mapping[str, float], times: int = 1) -> bool:
    return all(node.get(key, 0.0) + EPS >= times * amount for key, amount in bundle.items())


def _slots(bundle: Mapping[str, float], node: Mapping[str, float]) -> int:
    """How many copies of ``bundle`` fit on ``node``."""
    return min(math.floor((node.get(key, 0.0) + EPS) / amount) for key, amount in bundle.items())


def _total(group: Sequence[Mapping[str, float]]) -> Bundle:
    out: Bundle = {}
    for bundle in group:
        for key, amount in bundle.items():
            out[key] = out.get(key, 0.0) + amount
    return out


def describe(bundle: Mapping[str, float]) -> str:
    """``1 CPU, 1 GPU on a node with `engines```: a bundle in the words of the spec."""
    parts = [f"{bundle.get('CPU', 0.0):g} CPU", f"{bundle.get('GPU', 0.0):g} GPU"]
    marks = [key for key in bundle if key not in ("CPU", "GPU")]
    return ", ".join(parts) + (f" on a node with `{'`, `'.join(marks)}`" if marks else "")


def cannot_hold(group: Sequence[Mapping[str, float]], strategy: str,
                nodes: Sequence[Mapping[str, float]]) -> str | None:
    """Why a cluster whose alive nodes have these total resources can never hold the placement
    group (``strategy`` as the spec spells it), or None when it could. A necessary check: for
    equal bundles it is exact; unequal ones may still wait for ``reserve``'s timeout."""
    for bundle in group:
        hosts = [node for node in nodes if _fits(bundle, node)]
        if not hosts:
            return _no_host(bundle, nodes)
    hosts = [node for node in nodes if any(_fits(bundle, node) for bundle in group)]
    if strategy == "strict_pack":
        if not any(_fits(_total(group), node) for node in hosts):
            best = max(hosts, key=lambda node: node.get("CPU", 0.0))
            return (f"`strict_pack` puts all {len(group)} on one node, which needs {describe(_total(group))}; "
                    f"the largest node that qualifies has {best.get('CPU', 0.0):g} CPU, {best.get('GPU', 0.0):g} GPU")
        return None
    if strategy == "strict_spread":
        if len(hosts) < len(group):
            return (f"`strict_spread` puts each of the {len(group)} on its own node, and {len(hosts)} node(s) "
                    f"can hold one ({describe(group[0])})")
        return None
    if all(bundle == group[0] for bundle in group):
        room = sum(_slots(group[0], node) for node in hosts)
        if room < len(group):
            return f"the nodes that qualify have room for {room} of the {len(group)} ({describe(group[0])} each)"
        return None
    need, have = _total(group), _total(hosts)
    short = [key for key, amount in need.items() if have.get(key, 0.0) + EPS < amount]
    if short:
        return f"they need {describe(need)} in all; the nodes that qualify have {have.get(short[0], 0.0):g} {short[0]}"
    return None


def _no_host(bundle: Mapping[str, float], nodes: Sequence[Mapping[str, float]]) -> str:
    missing = [key for key in bundle if not any(node.get(key, 0.0) > 0 for node in nodes)]
    if missing and missing[0] in ("CPU", "GPU"):
        return f"no node of the cluster has a {missing[0]}"
    if missing:
        return (f"no node of the cluster declares the resource `{missing[0]}` (the nodes declare "
                f"{', '.join(sorted({k for node in nodes for k in node if not k.startswith('node:')}))})")
    return f"no node has room for one ({describe(bundle)})"


# --- reserving it ----------------------------------------------------------------------------

@dataclass
class Reservation:
    """A placement group that Ray has reserved, and the scheduling strategy of each bundle: start
    the i-th actor with ``.options(scheduling_strategy=reservation.strategies[i])``."""

    group: PlacementGroup
    strategies: list[PlacementGroupSchedulingStrategy]

    def nodes(self) -> list[str]:
        """The Ray node id that holds each bundle, as Ray's placement-group table says."""
        table = placement_group_table(self.group)["bundles_to_node_id"]
        return [table[i] for i in range(len(self.strategies))]

    def release(self) -> None:
        remove_placement_group(self.group)


def reserve(group: Sequence[Bundle], strategy: str, *, what: str, lower: str,
            timeout_s: float = READY_TIMEOUT_S) -> Reservation:
    """Reserve a placement group of ``group``'s bundles with ``strategy`` (``pack``, ``spread``,
    ``strict_pack``, ``strict_spread``), or fail with a GfcrError naming ``what`` is placed and
    what to ``lower`` (e.g. "`resources.replicas` or `resources.cpus` on the generate stage").
    The caller starts one actor per bundle with ``strategies[i]`` and releases the reservation
    when they end."""
    shape = f"{what} ({len(group)} x {describe(group[0])}, strategy `{strategy}`)"
    alive = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    reason = cannot_hold(group, strategy, alive)
    if reason is not None:
        raise GfcrError(f"{shape} cannot be placed on this Ray cluster: {reason}\n    fix: lower {lower}, "
                        f"{_relax(strategy)}or add nodes that have the resources (`ray start --resources ...`)")
    reserved = placement_group(list(group), strategy=RAY_STRATEGY[strategy])
    if not reserved.wait(timeout_s):
        remove_placement_group(reserved)
        free = ray.available_resources()
        raise GfcrError(f"{shape} could not be reserved within {timeout_s:g}s: the cluster could hold them, but "
                        f"other work holds its resources now ({free.get('CPU', 0.0):g} CPU, {free.get('GPU', 0.0):g}"
                        f" GPU free)\n    fix: stop what holds them (`ray status` lists it), or lower {lower}")
    strategies = [PlacementGroupSchedulingStrategy(reserved, placement_group_bundle_index=i)
                  for i in range(len(group))]
    return Reservation(reserved, strategies)


def _relax(strategy: str) -> str:
    return {"strict_pack": "use `strategy: pack`, ", "strict_spread": "use `strategy: spread`, "}.get(strategy, "")
