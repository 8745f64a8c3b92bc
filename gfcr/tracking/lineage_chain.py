"""The chain of one rollout, from its data row to the update: what ``gfcr lineage`` prints.

It joins three things a run directory holds: the rollout's lineage row (``lineage/*.parquet``),
the compiled pipeline of its ``spec.yaml`` (which stage ids are Control stages upstream of the
stage that generated the rollout, and every stage's alias), and the data source (the prompt's
text and source row, loaded again from the spec: sources are deterministic). The step's line
of ``metrics.jsonl`` says what the update did with the batch.

It also reads the step's Control decisions (``lineage/control-*.parquet``): for the rollout's
prompt, what each Control stage decided and why (``decisions``). A run written before they
were recorded has none, and the chain says so.

``prompt_history`` is the same for a prompt id: every decision any Control stage made on the
prompt, step by step, picked or skipped (a skipped prompt has no rollout, so no rollout
chain), with the rollouts each step gave it.

A reused rollout (a replayed group's, a cached correct response; ``replayed_from`` set) is
followed back to the rollout it copies: that one's step, the stage that generated it, its
policy version, reward and whether it reached an update then (``reused_from``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx

from gfcr.errors import GfcrError
from gfcr.graph import CompiledPipeline, load_pipeline
from gfcr.records import Prompt
from gfcr.runtime.store.lineage import read_control_lineage, read_lineage
from gfcr.runtime.store.rundir import RunDir


@dataclass(frozen=True)
class StageRef:
    id: str
    alias: str | None = None  # None when the pipeline could not be compiled again

    def __str__(self) -> str:
        return f"{self.id} ({self.alias})" if self.alias else self.id


@dataclass(frozen=True)
class GroupSummary:
    """The rollout's siblings: same prompt, same step (and loop round)."""

    size: int
    correct: int
    reward_mean: float | None


@dataclass(frozen=True)
class RolloutChain:
    run_dir: Path
    row: dict[str, Any]  # the lineage row (gfcr.runtime.store.lineage.SCHEMA)
    group: GroupSummary
    step_metrics: dict[str, Any] | None  # the step's metrics.jsonl line
    prompt: Prompt | None = None
    data_source: str | None = None  # e.g. `arithmetic` with its validated `with`
    selected_by: tuple[StageRef, ...] = ()
    created_by: StageRef | None = None
    dropped_by: StageRef | None = None
    update: StageRef | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)  # what could not be shown, and why
    # a reused rollout's originals, nearest first: the lineage row of the rollout it copies, then
    # that one's if it was itself reused (``replayed_from``), as far as the run's lineage goes
    reused_from: tuple[dict[str, Any], ...] = ()
    # the Control stages' rows of the control lineage for this prompt at the step that selected it,
    # in the order they ran (gfcr.runtime.store.lineage.CONTROL_SCHEMA); aliases by stage id in ``aliases``
    decisions: tuple[dict[str, Any], ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)
    selected_step: int | None = None  # the step its prompt was selected: an earlier one for a resumed rollout


@dataclass(frozen=True)
class PromptHistory:
    """Every Control decision on one prompt in a run, and the rollouts it got."""

    run_dir: Path
    prompt_id: str
    decisions: tuple[dict[str, Any], ...]  # control lineage rows, in step order
    rollouts: dict[int, tuple[int, int]]  # step -> (rollouts, of them in the update)
    aliases: dict[str, str] = field(default_factory=dict)  # stage id -> alias
    notes: tuple[str, ...] = ()


def rollout_chain(run_dir: Path, rollout_id: str) -> RolloutChain:
    """Everything the run directory knows about ``rollout_id``; a GfcrError with near ids if it
    has no such rollout."""
    rd = open_run_dir(run_dir)
    table = read_lineage(rd.lineage_dir)
    if table.num_rows == 0:
        raise GfcrError(f"{run_dir} has no lineage yet (lineage/ is empty)\n"
                        "    fix: pass a run that has finished at least one step")
    rows = table.to_pylist()
    row = next((r for r in rows if r["rollout_id"] == rollout_id), None)
    if row is None:
        raise GfcrError(_unknown_rollout(run_dir, rollout_id, rows))
    siblings = [r for r in rows if r["group_id"] == row["group_id"]]
    notes: list[str] = []
    pipeline = _pipeline(rd, notes)
    refs = _stage_refs(pipeline, row)
    prompt, source = _prompt(pipeline, row["prompt_id"], notes)
    originals = _originals(row, rows, notes)
    decided = read_control_lineage(rd.lineage_dir)
    if not decided:
        notes.append("this run's lineage has no Control decisions (lineage/control-*.parquet): it was written "
                     "by a gfcr that did not record them")
    resumed = [r for r in (row, *originals) if r.get("resumed_from")]  # carried by generate.partial
    selected = originals[len(resumed) - 1]["step"] if resumed else row["step"]
    decisions = tuple(d for d in decided if d["step"] == selected and d["prompt_id"] == row["prompt_id"])
    return RolloutChain(run_dir=rd.path, row=row, group=_group(siblings), step_metrics=_step_metrics(rd, row["step"]),
                        prompt=prompt, data_source=source, notes=tuple(notes), reused_from=originals,
                        decisions=decisions, aliases=_aliases(pipeline), selected_step=selected, **refs)


def is_prompt(run_dir: Path, some_id: str) -> bool:
    """Whether ``some_id`` names a prompt (not a rollout) of the run's lineage or Control decisions."""
    rd = open_run_dir(run_dir)
    table = read_lineage(rd.lineage_dir)
    if some_id in set(table.column("rollout_id").to_pylist()):
        return False
    return some_id in set(table.column("prompt_id").to_pylist()) or any(
        d["prompt_id"] == some_id for d in read_control_lineage(rd.lineage_dir))


def prompt_history(run_dir: Path, prompt_id: str) -> PromptHistory:
    """Every Control decision on ``prompt_id`` and the rollouts it got, step by step."""
    rd = open_run_dir(run_dir)
    decisions = tuple(d for d in read_control_lineage(rd.lineage_dir) if d["prompt_id"] == prompt_id)
    rollouts: dict[int, tuple[int, int]] = {}
    for r in (r for r in read_lineage(rd.lineage_dir).to_pylist() if r["prompt_id"] == prompt_id):
        n, used = rollouts.get(r["step"], (0, 0))
        rollouts[r["step"]] = (n + 1, used + bool(r["in_update"]))
    notes: list[str] = []
    if not decisions:
        notes.append("no Control decision on this prompt is recorded (lineage/control-*.parquet): the run was "
                     "written by a gfcr that did not record them, or its control stages list only what they pick")
    return PromptHistory(rd.path, prompt_id, decisions, rollouts, stage_aliases(rd, notes), tuple(notes))


def stage_aliases(rd: RunDir, notes: list[str]) -> dict[str, str]:
    """Each stage id's alias in the run's pipeline; none, with a note, when its spec no longer compiles."""
    return _aliases(_pipeline(rd, notes))


def _aliases(pipeline: CompiledPipeline | None) -> dict[str, str]:
    return {} if pipeline is None else {sid: n.info.alias for sid, n in pipeline.nodes.items()}


def _originals(row: dict[str, Any], rows: list[dict[str, Any]], notes: list[str]) -> tuple[dict[str, Any], ...]:
    """The rows a reused rollout copies, following ``replayed_from`` (or, for a rollout carried over
    by ``generate.partial``, ``resumed_from``) back to the rollout that started it. The original's
    row is the first one with its id (the step that generated it)."""
    first: dict[str, dict[str, Any]] = {}
    for r in rows:
        first.setdefault(r["rollout_id"], r)
    chain, seen, source = [], {row["rollout_id"]}, _source(row)
    while source and source not in seen:
        seen.add(source)
        original = first.get(source)
        if original is None:
            notes.append(f"rollout `{source}` (replayed into this one) is not in this run's lineage: it comes from "
                         "another run or a file (a replay pool seeded from them), or its step's lineage file is gone")
            break
        chain.append(original)
        source = _source(original)
    return tuple(chain)


def _source(row: dict[str, Any]) -> str | None:
    return row.get("replayed_from") or row.get("resumed_from")


def open_run_dir(path: Path) -> RunDir:
    rd = RunDir(Path(path))
    if not rd.path.is_dir():
        raise GfcrError(f"{path} does not exist\n    fix: pass a run directory that `gfcr run` printed, "
                        "e.g. runs/quickstart-20261130-101500")
    if not rd.spec.is_file():
        raise GfcrError(f"{path} is not a gfcr run directory (no spec.yaml)\n"
                        "    fix: pass the folder `gfcr run` printed, e.g. runs/quickstart-20261130-101500")
    return rd


def _unknown_rollout(run_dir: Path, rollout_id: str, rows: list[dict[str, Any]]) -> str:
    ids = [r["rollout_id"] for r in rows]
    in_group = [i for i in ids if i.startswith(rollout_id + "/")]  # a group id was given
    of_prompt = [r["rollout_id"] for r in rows if r["prompt_id"] == rollout_id]  # a prompt id was given
    near = in_group or of_prompt or difflib.get_close_matches(rollout_id, ids, n=5, cutoff=0.8)
    hint = (f"did you mean {', '.join(f'`{i}`' for i in near[:5])}?" if near
            else f"rollout ids look like `{ids[0]}` (`<prompt id>@s<step>/<index>`)")
    return (f"{run_dir} has no rollout `{rollout_id}` in its lineage ({len(ids)} rollouts, "
            f"steps {rows[0]['step']}-{rows[-1]['step']})\n    fix: {hint}")


def _pipeline(rd: RunDir, notes: list[str]) -> CompiledPipeline | None:
    try:
        return load_pipeline(rd.spec)
    except GfcrError as exc:  # e.g. a plugin stage that is no longer installed
        notes.append(f"stage aliases and the prompt are not shown: {rd.spec} does not compile here "
                     f"({str(exc).splitlines()[0]})")
        return None


def _stage_refs(pipeline: CompiledPipeline | None, row: dict[str, Any]) -> dict[str, Any]:
    def ref(sid: str | None) -> StageRef | None:
        if sid is None:
            return None
        node = pipeline.nodes.get(sid) if pipeline is not None else None
        return StageRef(sid, node.info.alias if node is not None else None)

    created = row["created_by"]
    selected: tuple[StageRef, ...] = ()
    if pipeline is not None and created in pipeline.graph:
        upstream = nx.ancestors(pipeline.graph, created)
        selected = tuple(StageRef(sid, n.info.alias) for sid, n in pipeline.nodes.items()
                         if sid in upstream and n.info.family == "control")
    return {"selected_by": selected, "created_by": ref(created), "dropped_by": ref(row["dropped_by"]),
            "update": ref("update")}


def _prompt(pipeline: CompiledPipeline | None, prompt_id: str, notes: list[str]) -> tuple[Prompt | None, str | None]:
    if pipeline is None:
        return None, None
    binding = pipeline.data
    source = f"{binding.name} {binding.config.model_dump(mode='json')}"
    try:
        pool = binding.load()
    except (GfcrError, OSError) as exc:  # the data file moved, or its rows changed
        notes.append(f"the prompt text is not shown: data source `{binding.name}` cannot be loaded "
                     f"({str(exc).splitlines()[0]})")
        return None, source
    if prompt_id not in pool:
        notes.append(f"the prompt text is not shown: data source `{binding.name}` has no prompt `{prompt_id}` "
                     "any more (did its file change?)")
        return None, source
    return pool.get(prompt_id), source


def _group(rows: list[dict[str, Any]]) -> GroupSummary:
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    return GroupSummary(size=len(rows), correct=sum(bool(r["correct"]) for r in rows),
                        reward_mean=sum(rewards) / len(rewards) if rewards else None)


def _step_metrics(rd: RunDir, step: int) -> dict[str, Any] | None:
    return next((r for r in rd.read_metrics() if r["step"] == step), None)
