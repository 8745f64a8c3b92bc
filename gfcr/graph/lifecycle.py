"""What ``gfcr validate`` refuses about a pipeline's declared lifecycle (``lifecycle:``,
docs/async.md), so that staleness is never left to chance:

- a lifecycle whose staleness can be above 0 (``pipelined``, or ``async`` with
  ``max_staleness`` above 0) with an update that declares no off-policy correction: the update
  would take the stale tokens' ratio as if they were on-policy. The fix names the corrections
  that take stale tokens, and the explicit opt-out ``correction: {use: none}``;
- a stage whose Config says it needs the synchronous lifecycle (``sync_only``,
  ``gfcr.registry.NeedsSyncLifecycle``) under ``pipelined`` or ``async``, with the stage's reason.
"""

from __future__ import annotations

from typing import Any, Iterator

from gfcr.registry import DeclaresCorrection, NeedsSyncLifecycle
from gfcr.spec import UPDATE_ID, PipelineSpec

# the corrections a fix suggests, in the order a user of AReaL or verl would reach for them
CORRECTIONS_FOR_STALENESS = ("tis", "decoupled_clip")


def lifecycle_problems(spec: PipelineSpec, aliases: dict[str, str],
                       configs: dict[str, Any]) -> Iterator[tuple[tuple, str, str]]:
    """``(path, message, fix)`` for each problem of the lifecycle with the pipeline's stages
    (``aliases`` and ``configs`` by stage id; a stage whose config did not validate is absent)."""
    lifecycle = spec.lifecycle
    if lifecycle.mode == "sync":
        return
    yield from _barrier_problems(lifecycle.describe(), aliases, configs)
    bound = lifecycle.staleness_bound()
    update = configs.get(UPDATE_ID)
    if bound > 0 and update is not None:
        yield from _correction_problems(lifecycle.describe(), bound, aliases[UPDATE_ID], update)


def _barrier_problems(described: str, aliases: dict[str, str],
                      configs: dict[str, Any]) -> Iterator[tuple[tuple, str, str]]:
    for sid, config in configs.items():
        if isinstance(config, NeedsSyncLifecycle):
            path = ("update",) if sid == UPDATE_ID else ("stages", sid)
            yield (path + ("use",), f"`{sid}` ({aliases[sid]}) needs the synchronous lifecycle, and the pipeline "
                                    f"declares `lifecycle: {{{_written(described)}}}`: it {config.sync_only}",
                   "remove `lifecycle` (the default is `{mode: sync}`), or use another stage in its place "
                   "(`gfcr stages`; docs/async.md lists what each stage does under each lifecycle)")


def _correction_problems(described: str, bound: int, alias: str, config: Any) -> Iterator[tuple[tuple, str, str]]:
    if isinstance(config, DeclaresCorrection) and config.declared_correction() is not None:
        return
    first = CORRECTIONS_FOR_STALENESS[0]
    if not isinstance(config, DeclaresCorrection):
        yield (("lifecycle", "mode"), f"`lifecycle: {{{_written(described)}}}` trains on tokens up to {bound} policy "
                                      f"version(s) old, and the update `{alias}` cannot say how it takes them",
               "use an update with an off-policy correction (`update.grpo` with `correction: {use: tis}`), or "
               "remove `lifecycle`")
        return
    yield (("lifecycle", "mode"), f"`lifecycle: {{{_written(described)}}}` trains on tokens up to {bound} policy "
                                  "version(s) old, and the update declares no off-policy correction: it would "
                                  "take their ratio as on-policy",
           f"declare one in the update's `with`: `correction: {{use: {first}}}` (--set update.with.correction.use="
           f"{first}; or `decoupled_clip`, `recompute_old`, `staleness`), or `correction: {{use: none}}` to train "
           "on stale tokens with no correction, knowingly")


def _written(described: str) -> str:
    """``pipelined, lag 1`` as YAML: ``mode: pipelined, lag: 1``."""
    mode, _, rest = described.partition(", ")
    key, _, value = rest.partition(" ")
    return f"mode: {mode}" + (f", {key}: {value}" if rest else "")


# --- what each stage does under each lifecycle (docs/async.md's table) -------------------------------

REFUSED = "refused by `gfcr validate`: it {why}"


def under_lifecycles(info: Any) -> tuple[str, str]:
    """What the registered stage ``info`` (a ``StageInfo``) does under ``pipelined`` and under
    ``async``, from what it declares: ``sync_only`` on its Config, its family and its roles."""
    from gfcr.registry import declares

    if declares(info.config, NeedsSyncLifecycle):
        refused = REFUSED.format(why=_short(info.config.sync_only))
        return refused, refused
    if info.family == "update":
        return ("trains step t's batch (sampled by version t - lag); stale tokens go to its declared correction",
                "trains the steps in order as they are produced; tokens up to max_staleness versions old go to its "
                "declared correction")
    if info.family == "generate":
        return ("samples step t with version t - lag's weights; each token's segment records that version",
                "starts step t once the trainer has finished step t - max_staleness - 1, on the newest weights; "
                "each token keeps the version it was sampled under")
    if info.in_flight:
        return ("steers the rows of one step's generation, as under sync", "steers the rows of the call it is "
                "attached to, as under sync")
    if info.observes:
        return ("observes each step before its update (the report without it), in step order",
                "observes each step before its update (the report without it), in step order")
    if info.family == "replay":
        return ("ingests and replays per step; a replayed rollout keeps its segments' versions",
                "ingests and replays per step; a replayed rollout keeps its segments' versions")
    return ("unchanged: acts on its step's inputs alone", "unchanged: acts on its step's inputs alone")


def _short(reason: str) -> str:
    """The first clause of a ``sync_only`` reason, for a table cell."""
    return reason.split(", and ")[0]


def lifecycle_table(infos: Any) -> str:
    """The markdown table of docs/async.md: every stage of ``infos`` (``StageInfo``s) under each lifecycle."""
    lines = ["| stage | `pipelined` | `async` |", "|---|---|---|"]
    for info in sorted(infos, key=lambda i: i.alias):
        pipelined, asynchronous = under_lifecycles(info)
        lines.append(f"| `{info.alias}` | {pipelined} | {asynchronous} |")
    return "\n".join(lines) + "\n"
