"""Per-step lineage: one row per rollout, saying where it came from and where it went
(DESIGN.md section 7). Written as parquet, one file per step (``lineage/step-000007.parquet``),
with a second table per step for the Control stages' decisions
(``lineage/control-000007.parquet``, below).

A row follows a rollout from its prompt to the update:

- who: ``run_id``, ``step``, ``rollout_id``, ``group_id``, ``prompt_id``, and for tree
  rollouts ``tree_id`` / ``node_id`` / ``parent_node_id`` / ``branch_token_idx`` (a branch's fork point);
- how it was made: ``origin`` (fresh, pilot, resumed, replayed, cached_correct, ...),
  ``replayed_from`` (the rollout id a reused rollout copies), ``resumed_from`` and
  ``resumed_tokens`` (a rollout ``generate.partial`` carried over from an earlier step: its id
  there, and the tokens sampled before this step), ``draft_from`` and ``draft_tokens`` (a
  rollout of ``generate.speculative`` that starts with an accepted draft: the draft's rollout id
  and the accepted prefix length), ``forced_tokens`` (the tokens at its end that an in-flight
  controller appended rather than sampled: ``control.truncate_steps``'s answer), ``created_step`` (the step that
  generated it: an earlier one than ``step`` for a reused rollout), ``replayed_policy_version``
  (a reused rollout's original's oldest policy version, null for others), ``policy_version_min`` /
  ``_max`` over its tokens (they differ only for rollouts continued across updates; a reused
  rollout keeps its original versions unless its replay rescored it at the current policy,
  ``replay.rlep`` with ``correction: none``), the engine ``replica`` and the ``ray_node`` id
  it ran on (null for an in-process engine), ``status``,
  ``finish_reason``, ``stop_reason`` (why an in-flight controller ended it, when one said),
  ``n_tokens`` and ``created_by`` (the id of the first stage that output it, or
  of the stage that appended it to a group another stage created: ``replay.rlep``);
- what was decided: ``reward``, ``correct``, ``reward_reason``, ``advantage`` (the mean over
  tokens for per-token estimators), ``dropped_by`` (the id of the stage that dropped its group
  or removed the rollout from it, or null) with ``drop_reason``, ``changed_by`` (the ids of the
  stages that changed its group's rewards, advantages, loss masks, sample weights, rollouts or
  verdict, in order), ``in_update`` (it reached the update stage in its group) and, for those,
  ``staleness``: how many versions older than the update that trained it its oldest token was
  (0 under ``sync`` for fresh rollouts; ``lag`` under ``pipelined``; replayed ones older);
- for a trajectory (``generate.multi_turn``), ``turns``: one entry per turn, in order, with its
  ``role`` (``model`` turns are trained on, ``environment`` turns never), ``n_tokens``, the
  first 200 characters of its ``text``, the environment's ``reward`` for a model turn and the
  parsed ``tool_call`` (JSON); null for a single-turn rollout.

The runtime, not the stages, records ``created_by``, ``dropped_by`` and ``changed_by``.

A filter drops a whole group (every rollout of it shares the verdict) or removes one rollout
from its group (``RolloutGroup.remove``): a removed rollout keeps its row, after its group's
rollouts, with the removing stage and reason, and ``in_update`` false.

The control table has one row per prompt a Control stage decided on in the step, picked or
skipped (a skipped prompt has no rollout, so no row above), in the order the stages ran:

- ``run_id``, ``step``, ``round`` (the loop round, null outside loop blocks), ``stage_id``,
  ``prompt_id``;
- ``decision`` (``picked`` or ``skipped``), ``n_rollouts`` (as that stage set it);
- ``code``, ``value_name``, ``value``, ``quantities`` (the entry's ``ControlReason``: the
  snake_case reason, the decisive number and the other numbers decided on; null when the stage
  gave none) and ``reason`` (the sentence for people).

A stage that passes an upstream entry on unchanged (``control.fixed_n`` setting the group
size) decided nothing about it and has no row (``gfcr.runtime.loop.local.decided``). Join the two
tables on ``(step, prompt_id)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gfcr.errors import RunDirError
from gfcr.records import ControlDecision, Rollout, RolloutGroup, StepReport
from gfcr.runtime.store.rundir import atomic_path

SCHEMA = pa.schema([
    ("run_id", pa.string()), ("step", pa.int64()), ("rollout_id", pa.string()), ("group_id", pa.string()),
    ("prompt_id", pa.string()), ("tree_id", pa.string()), ("node_id", pa.string()),
    ("parent_node_id", pa.string()), ("origin", pa.string()), ("replayed_from", pa.string()),
    ("resumed_from", pa.string()), ("resumed_tokens", pa.int64()), ("draft_from", pa.string()),
    ("draft_tokens", pa.int64()), ("forced_tokens", pa.int64()), ("branch_token_idx", pa.int64()),
    ("created_step", pa.int64()), ("replayed_policy_version", pa.int64()),
    ("policy_version_min", pa.int64()), ("policy_version_max", pa.int64()), ("replica", pa.string()),
    ("ray_node", pa.string()), ("status", pa.string()), ("finish_reason", pa.string()), ("stop_reason", pa.string()),
    ("n_tokens", pa.int64()),
    ("reward", pa.float64()), ("correct", pa.bool_()), ("reward_reason", pa.string()),
    ("advantage", pa.float64()), ("created_by", pa.string()), ("dropped_by", pa.string()),
    ("drop_reason", pa.string()), ("in_update", pa.bool_()), ("changed_by", pa.list_(pa.string())),
    ("turns", pa.list_(pa.struct([("role", pa.string()), ("n_tokens", pa.int64()), ("text", pa.string()),
                                  ("reward", pa.float64()), ("tool_call", pa.string())]))),
    ("staleness", pa.int64()),
])
TURN_TEXT = 200  # characters of a turn's text the lineage keeps


def lineage_rows(report: StepReport) -> list[dict[str, Any]]:
    """The lineage rows of one step, in group order, then rollout order (removed rollouts last)."""
    return [row for g in report.groups for row in _group_rows(report, g)]


def _group_rows(report: StepReport, group: RolloutGroup) -> list[dict[str, Any]]:
    rows = [_row(report, group, r) for r in group.rollouts]
    for removal in group.removed:  # removed before anything later happened to its group
        rows.append({**_row(report, group, removal.rollout), "dropped_by": removal.removed_by,
                     "drop_reason": removal.reason, "in_update": False, "staleness": None})
    return rows


def _row(report: StepReport, group: RolloutGroup, r: Rollout) -> dict[str, Any]:
    versions = r.policy_versions()
    dropped_by = report.dropped_by.get(group.group_id, group.verdict.dropped_by)
    return {
        "run_id": report.run_id, "step": report.step, "rollout_id": r.rollout_id, "group_id": group.group_id,
        "prompt_id": group.prompt_id, "tree_id": r.tree_id, "node_id": r.node_id,
        "parent_node_id": r.parent_node_id, "origin": str(r.origin), "replayed_from": r.replayed_from,
        "resumed_from": r.resumed_from, "resumed_tokens": r.resumed_tokens,
        "draft_from": r.draft_from, "draft_tokens": r.draft_tokens, "forced_tokens": r.forced_tokens,
        "branch_token_idx": r.branch_token_idx, "created_step": r.created_step,
        "replayed_policy_version": r.replayed_policy_version,
        "policy_version_min": int(versions.min()) if len(versions) else None,
        "policy_version_max": int(versions.max()) if len(versions) else None,
        "replica": r.replica, "ray_node": r.ray_node, "status": str(r.status), "finish_reason": r.finish_reason,
        "stop_reason": r.stop_reason or None, "n_tokens": len(r),
        "reward": r.reward, "correct": r.correct, "reward_reason": r.reward_reason,
        "advantage": _scalar_advantage(r.advantage), "created_by": report.created_by_rollout(group.group_id, r.rollout_id),
        "dropped_by": dropped_by, "drop_reason": group.verdict.reason if dropped_by is not None else None,
        "in_update": group.group_id in report.update_group_ids,
        "changed_by": list(report.changed_by.get(group.group_id, ())),
        "turns": None if r.turns is None else [
            {"role": str(t.role), "n_tokens": len(t), "text": t.text[:TURN_TEXT], "reward": t.reward,
             "tool_call": None if t.tool_call is None else json.dumps(t.tool_call, sort_keys=True)}
            for t in r.turns],
        "staleness": _staleness(report, versions) if group.group_id in report.update_group_ids else None,
    }


def _staleness(report: StepReport, versions: np.ndarray) -> int | None:
    """How many versions older than the update that trained it the rollout's oldest token is
    (None for an empty rollout)."""
    return int(report.trained_version - versions.min()) if len(versions) else None


def _scalar_advantage(advantage: float | np.ndarray | None) -> float | None:
    """A per-token advantage ([T]) is summarised by its mean; a scalar passes through."""
    if advantage is None:
        return None
    if isinstance(advantage, np.ndarray):
        return float(advantage.mean()) if advantage.size else None
    return float(advantage)


def write_lineage(path: Path, report: StepReport) -> None:
    table = pa.Table.from_pylist(lineage_rows(report), schema=SCHEMA)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def read_lineage(lineage_dir: Path) -> pa.Table:
    """Every step's rows of a run, in step order (an empty table when there are none)."""
    files = sorted(Path(lineage_dir).glob("step-*.parquet"))
    if not files:
        return SCHEMA.empty_table()
    return pa.concat_tables([_read(f) for f in files])


def _read(path: Path) -> pa.Table:
    """One step's rows; a file written before a column existed gets that column as nulls."""
    table = _read_table(path)
    for name in SCHEMA.names:
        if name not in table.column_names:
            table = table.append_column(name, pa.nulls(len(table), SCHEMA.field(name).type))
    return table.select(SCHEMA.names).cast(SCHEMA)


def _read_table(path: Path) -> pa.Table:
    """A lineage file's table; a RunDirError naming the file if it is not a readable parquet file
    of lineage rows (truncated, corrupt, or another kind of file)."""
    try:  # ParquetFile, not read_table: the latter loads pyarrow.dataset (+60 MB) for one small file
        with pq.ParquetFile(path) as file:
            return file.read()
    except (pa.ArrowException, OSError) as exc:
        raise RunDirError(f"{path} is not a readable lineage file (truncated or corrupt): {exc}",
                          "restore it from a copy (with MLflow tracking on, the run's artifacts hold one under "
                          "lineage/); else move it out of the folder to read the other steps' lineage") from None


# --- the Control stages' decisions ------------------------------------------------------------

CONTROL_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("step", pa.int64()), ("round", pa.int64()), ("stage_id", pa.string()),
    ("prompt_id", pa.string()), ("decision", pa.string()), ("n_rollouts", pa.int64()), ("code", pa.string()),
    ("value_name", pa.string()), ("value", pa.float64()), ("quantities", pa.map_(pa.string(), pa.float64())),
    ("reason", pa.string()),
])


def control_rows(report: StepReport) -> list[dict[str, Any]]:
    """One row per prompt each Control stage decided on in the step, in the order they ran."""
    return [_control_row(report, d) for d in report.control_decisions]


def _control_row(report: StepReport, decision: ControlDecision) -> dict[str, Any]:
    entry, why = decision.entry, decision.entry.why
    return {
        "run_id": report.run_id, "step": report.step, "round": decision.round, "stage_id": decision.stage_id,
        "prompt_id": entry.prompt_id, "decision": entry.decision, "n_rollouts": entry.n_rollouts,
        "code": why.code if why else None, "value_name": why.name if why else None,
        "value": why.value if why else None, "quantities": dict(why.quantities) if why else None,
        "reason": entry.reason or None,
    }


def write_control_lineage(path: Path, report: StepReport) -> None:
    table = pa.Table.from_pylist(control_rows(report), schema=CONTROL_SCHEMA)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def read_control_lineage(lineage_dir: Path) -> list[dict[str, Any]]:
    """Every step's Control decisions, in step order, ``quantities`` as dicts (an empty list for
    a run without them: one written before they were recorded)."""
    files = sorted(Path(lineage_dir).glob("control-*.parquet"))
    rows = [row for f in files for row in _read_table(f).cast(CONTROL_SCHEMA).to_pylist()]
    for row in rows:
        row["quantities"] = dict(row["quantities"]) if row["quantities"] is not None else None
    return rows
