"""``gfcr lineage``: a run's lineage summarised, the rollouts that match a query, or one
rollout's chain, from its data row to the update.

    $ gfcr lineage runs/quickstart-20261130-101500

prints a table, one line per step: the rollouts it handled, how many it generated, how many
reached the update, and how many each stage dropped and why (``gfcr.tracking.lineage_query``).
``--dropped``, ``--step N``, ``--stage ID`` and ``--reason TEXT`` list the rollouts that match
them all instead, with their ids:

    $ gfcr lineage runs/dapo-20261130-101500 --dropped --reason "zero variance"

Given a rollout id,

    $ gfcr lineage runs/quickstart-20261130-101500 'arithmetic:train-0:443@s1/0'

prints a table, one line per link: the prompt (id, text, ground truth, source row), the step
and the Control stages that selected it, the stage that generated it (origin, policy
version, replica, tokens, finish reason; for a reused rollout the step and policy version its
original was generated at), for a replayed or cached rollout the rollout it copies ("reused
from": its step, stage, policy version, tokens, reward; back to the generated one, a note where
the chain leaves this run's lineage), its reward and why, its group, whether a filter kept or
dropped it (which stage, why), its advantage, and whether it reached the update. The
"selected" link gives each Control stage's decision on the prompt at that step and why
(``picked: closest_to_target, draw=0.48 (...)``), from the control lineage.

    $ gfcr lineage runs/greso-20261130-101500 'arithmetic:train-0:443'

given a prompt id instead, prints every decision any Control stage made on that prompt, step by
step, picked or skipped and why, with the rollouts each step gave it.
``--json`` prints the same as one JSON object.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from gfcr.cli.common import fail, out
from gfcr.errors import GfcrError


def lineage(run_dir: Annotated[Path, typer.Argument(help="a run directory made by `gfcr run`")],
            rollout_id: Annotated[Optional[str], typer.Argument(help=(
                "a rollout id, e.g. arithmetic:train-0:443@s1/0, or a prompt id for its Control decisions; "
                "without one, a summary of the run, or with the options below the rollouts that match"))] = None,
            dropped: Annotated[bool, typer.Option("--dropped", help="list the rollouts a stage dropped")] = False,
            step: Annotated[Optional[int], typer.Option("--step", metavar="N", help="list the rollouts of step N")]
            = None,
            stage: Annotated[Optional[str], typer.Option("--stage", metavar="ID", help=(
                "list the rollouts this stage dropped (its id, e.g. keep, or alias)"))] = None,
            reason: Annotated[Optional[str], typer.Option("--reason", metavar="TEXT", help=(
                "list the dropped rollouts whose drop reason contains TEXT, e.g. 'zero variance'"))] = None,
            stale: Annotated[bool, typer.Option("--stale", help=(
                "list the rollouts trained on with tokens older than the update's version, and what the "
                "update's correction did with them"))] = False,
            as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False) -> None:
    """Summarise a run's lineage per step (rollouts generated, kept, dropped by stage and why);
    list the rollouts that match --dropped, --step, --stage, --reason; or show where one rollout
    came from and where it went (data row, selection and why, generation, reward, filters,
    advantage, update), or, for a prompt id, why each Control stage picked or skipped it."""
    from gfcr.tracking.lineage_query import RolloutQuery

    query = RolloutQuery(dropped=dropped, step=step, stage=stage, reason=reason, stale=stale)
    try:
        if rollout_id is None:
            _show_run(run_dir, query, as_json)
        else:
            _refuse_query_with_id(query)
            _show_chain(run_dir, rollout_id, as_json)
    except GfcrError as exc:
        fail(exc)
        raise typer.Exit(2) from None


def _refuse_query_with_id(query: Any) -> None:
    if query.given:
        raise GfcrError("--dropped, --stale, --step, --stage and --reason list a run's rollouts; they do not apply to one "
                        "rollout's chain", "drop the rollout id to list the matching rollouts, or the options to "
                        "follow that rollout")


def _show_chain(run_dir: Path, rollout_id: str, as_json: bool) -> None:
    """One rollout's chain, or a prompt's Control decisions."""
    from gfcr.tracking.lineage_chain import RolloutChain, is_prompt, prompt_history, rollout_chain

    chain = prompt_history(run_dir, rollout_id) if is_prompt(run_dir, rollout_id) else \
        rollout_chain(run_dir, rollout_id)
    if as_json:
        out.print_json(json.dumps(asdict(chain), default=str))
        return
    out.print(chain_table(chain) if isinstance(chain, RolloutChain) else history_table(chain))
    _print_notes(chain.notes)


def _print_notes(notes: Any) -> None:
    for note in notes:
        out.print(f"[yellow]note:[/] {escape(note)}", markup=True)


def _show_run(run_dir: Path, query: Any, as_json: bool) -> None:
    """The run's summary per step, or the rollouts that match ``query``."""
    from gfcr.tracking.lineage_query import find_rollouts, summarise_lineage

    found = find_rollouts(run_dir, query) if query.given else summarise_lineage(run_dir)
    if as_json:
        out.print_json(json.dumps(_run_json(found), default=str))
        return
    if query.given and not found.rows:
        out.print(_no_match(found))
    else:
        out.print(matches_table(found) if query.given else summary_table(found))
    _print_follow_hint(run_dir, found)
    _print_notes(found.notes)


def summary_table(summary: Any) -> Table:
    """One line per step: rollouts handled, generated, in the update, and the drops with their reasons."""
    table = Table("step", "rollouts", "generated", "in update", "dropped", "dropped by stage: why",
                  title=f"lineage of run {escape(str(summary.run_dir))}", title_justify="left")
    for s in summary.steps:
        table.add_row(str(s.step), str(s.rollouts), str(s.generated), str(s.kept), str(s.dropped),
                      escape(_drops_text(s)))
    steps = summary.steps
    table.add_section()
    table.add_row("all", *(str(sum(getattr(s, k) for s in steps)) for k in ("rollouts", "generated", "kept", "dropped")),
                  "")
    return table


def _drops_text(step: Any) -> str:
    lines = [f"{d.rollouts} by {_stage(d.stage, {d.stage: d.alias} if d.alias else {})}: {d.reason}" for d in step.drops]
    if step.not_handed_on:
        lines.append(f"{step.not_handed_on} neither dropped nor handed to the update")
    return "\n".join(lines) or "-"


def matches_table(found: Any) -> Table:
    """The matching rollouts: id, step, reward, and what became of them."""
    table = Table("rollout id", "step", "reward", "what became of it",
                  title=escape(f"{len(found.rows)} rollouts matching {_query_text(found.query)}  (run {found.run_dir})"),
                  title_justify="left")
    for row in found.rows:
        fate = found.stale.fate(row["staleness"]) if found.query.stale else _fate(row, found.aliases)
        table.add_row(escape(row["rollout_id"]), str(row["step"]), _num(row["reward"]), escape(fate))
    return table


def _fate(row: dict[str, Any], aliases: dict[str, str]) -> str:
    if row["dropped_by"]:
        return f"dropped by {_stage(row['dropped_by'], aliases)}: {row['drop_reason'] or '(no reason given)'}"
    return "reached the update" if row["in_update"] else "not handed to the update"


def _query_text(query: Any) -> str:
    """The options as typed: ``--dropped --reason 'zero variance'``."""
    given = {k: getattr(query, k) for k in ("step", "stage", "reason") if getattr(query, k) is not None}
    parts = ["--dropped"] * query.dropped + ["--stale"] * query.stale + [
        f"--{k} {v!r}" if isinstance(v, str) else f"--{k} {v}" for k, v in given.items()]
    return " ".join(parts)


def _no_match(found: Any) -> str:
    if found.query.stale:
        return escape(f"no rollout of {found.run_dir} matches {_query_text(found.query)}: every rollout trained on "
                      "there was sampled by the version that trained it")
    reasons = "; ".join(f"`{r}`" for r in found.reasons[:8]) or "none: no stage dropped a rollout"
    return escape(f"no rollout of {found.run_dir} matches {_query_text(found.query)}; its drop reasons: {reasons}")


def _print_follow_hint(run_dir: Path, found: Any) -> None:
    rows = getattr(found, "rows", None)
    if rows:
        out.print(escape(f"follow one: gfcr lineage {run_dir} '{rows[0]['rollout_id']}'"))
    elif rows is None:
        out.print(escape(f"list rollouts: gfcr lineage {run_dir} --dropped [--step N] [--stage ID] "
                         "[--reason TEXT]; follow one: gfcr lineage RUN_DIR ROLLOUT_ID"))


_ROW_KEYS = ("rollout_id", "step", "prompt_id", "group_id", "reward", "correct", "dropped_by", "drop_reason",
             "in_update")


def _run_json(found: Any) -> dict[str, Any]:
    """The summary (steps with their counts and drops), or the query and its matching rollouts."""
    if hasattr(found, "steps"):
        steps = [{**asdict(s), "dropped": s.dropped, "not_handed_on": s.not_handed_on} for s in found.steps]
        return {"run_dir": found.run_dir, "steps": steps, "notes": found.notes}
    rows = [{k: row[k] for k in _ROW_KEYS} | {"dropped_by_alias": found.aliases.get(row["dropped_by"])}
            | ({"staleness": row["staleness"], "stale_fate": found.stale.fate(row["staleness"])} if found.query.stale
               else {}) for row in found.rows]
    return {"run_dir": found.run_dir, "query": asdict(found.query), "rollouts": rows, "notes": found.notes}


def chain_table(chain: Any) -> Table:
    """The chain as a two-column table: the link, and what happened there."""
    row = chain.row
    table = Table(title=f"rollout {escape(row['rollout_id'])}  (run {escape(str(chain.run_dir))}, step {row['step']})",
                  show_header=False, title_justify="left")
    table.add_column("link", style="bold", no_wrap=True)
    table.add_column("what happened")
    for link, text in _links(chain):
        table.add_row(link, escape(text))
    return table


def history_table(history: Any) -> Table:
    """A prompt's Control decisions, one line per step and stage."""
    table = Table(title=f"prompt {escape(history.prompt_id)}  (run {escape(str(history.run_dir))})",
                  title_justify="left")
    for column in ("step", "stage", "decision and why", "rollouts (in update)"):
        table.add_column(column)
    shown: set[int] = set()
    for d in history.decisions:
        got = history.rollouts.get(d["step"]) if d["step"] not in shown else None
        shown.add(d["step"])
        step = str(d["step"]) + (f" round {d['round']}" if d["round"] is not None else "")
        table.add_row(step, escape(_stage(d["stage_id"], history.aliases)), escape(decision_text(d)),
                      "-" if got is None else f"{got[0]} ({got[1]})")
    return table


def decision_text(d: dict[str, Any]) -> str:
    """One control lineage row: ``picked: no_streak, p_skip=0 (greso: keep (no streak))``."""
    why = d["code"] or "(no reason code)"
    if d["value_name"] is not None:
        why += f", {d['value_name']}={d['value']:.4g}"
    if d["quantities"]:
        why += " (" + ", ".join(f"{k}={v:.4g}" for k, v in d["quantities"].items()) + ")"
    return f"{d['decision']}: {why}" + (f"; {d['reason']}" if d["reason"] else "")


def _stage(sid: str, aliases: dict[str, str]) -> str:
    return f"{sid} ({aliases[sid]})" if sid in aliases else sid


def _selected(chain: Any) -> str:
    row = chain.row
    step = row["step"] if chain.selected_step is None else chain.selected_step
    text = f"step {step}, by " + (" -> ".join(map(str, chain.selected_by)) or "(no control stage)")
    for d in chain.decisions:
        where = f" round {d['round']}" if d["round"] is not None else ""
        text += f"\n{_stage(d['stage_id'], chain.aliases)}{where}: {decision_text(d)}"
    return text


def _links(chain: Any) -> list[tuple[str, str]]:
    row = chain.row
    return [
        ("data row", _data_row(chain)),
        ("selected", _selected(chain)),
        ("generated", _generated(chain)),
        *[("resumed from" if prev.get("resumed_from") else "reused from", _original(row))
          for prev, row in zip((row, *chain.reused_from), chain.reused_from)],
        *([("turns", _turns(row["turns"]))] if row.get("turns") else []),
        ("scored", _scored(row)),
        ("group", f"{row['group_id']}: {chain.group.size} rollouts, {chain.group.correct} correct, mean reward "
                  + _num(chain.group.reward_mean)),
        ("verdict", f"dropped by {chain.dropped_by}: {row['drop_reason'] or '(no reason given)'}"
         if chain.dropped_by else "kept by every filter"),
        ("advantage", _num(row["advantage"]) if row["advantage"] is not None else "none (not computed)"),
        ("update", _update(chain)),
    ]


def _turns(turns: list[dict[str, Any]]) -> str:
    """A trajectory turn by turn: who said what, which tokens trained, the reward of each turn."""
    lines, k = [], 0
    for t in turns:
        if t["role"] == "model":
            k += 1
            head = f"model turn {k}: {t['n_tokens']} tokens, trained"
        else:
            head = f"environment: {t['n_tokens']} tokens, not trained"
        call = f", calls {t['tool_call']}" if t.get("tool_call") else ""
        reward = f", reward {_num(t['reward'])}" if t.get("reward") is not None else ""
        lines.append(f"{head}{call}{reward}: {t['text']!r}")
    return "\n".join(lines)


def _data_row(chain: Any) -> str:
    row, prompt = chain.row, chain.prompt
    head = f"prompt {row['prompt_id']}" + (f" from {chain.data_source}" if chain.data_source else "")
    if prompt is None:
        return head
    text = prompt.text if prompt.text is not None else json.dumps(prompt.messages, ensure_ascii=False)
    lines = [head, f"text: {text!r}"]
    if prompt.verifier is not None:
        lines.append(f"ground truth: {prompt.verifier.ground_truth!r} (verifier {prompt.verifier.name})")
    if prompt.metadata:
        lines.append("source row: " + json.dumps(prompt.metadata, ensure_ascii=False, default=str)[:300])
    return "\n".join(lines)


def _generated(chain: Any) -> str:
    row = chain.row
    lo, hi = row["policy_version_min"], row["policy_version_max"]
    version = f"policy version {lo}" if lo == hi else f"policy versions {lo}-{hi}"
    parts = [f"by {chain.created_by or '(unknown stage)'}", f"origin {row['origin']}", version,
             f"replica {row['replica'] or '-'}" + (f" on Ray node {row['ray_node']}" if row.get("ray_node") else ""),
             f"{row['n_tokens']} tokens",
             f"{row['status']} (finish reason: {row['finish_reason'] or '-'})"]
    if row["replayed_from"]:
        parts.append(f"replayed from {row['replayed_from']}" + _made(row))
    if row.get("stop_reason"):
        parts.append(f"ended in flight: {row['stop_reason']}")
    if row.get("resumed_from"):
        parts.append(f"resumed from {row['resumed_from']} ({row['resumed_tokens']} tokens sampled before this "
                     f"step, from step {row['created_step']})")
    if row.get("draft_from"):
        parts.append(f"draft of {row['draft_from']}: its first {row['draft_tokens']} tokens accepted")
    if row.get("forced_tokens"):
        parts.append(f"its last {row['forced_tokens']} tokens appended by the controller, not sampled")
    if row["tree_id"]:
        branched = row.get("branch_token_idx")
        parts.append(f"tree {row['tree_id']} node {row['node_id']} (parent {row['parent_node_id'] or '-'})"
                     + ("" if branched is None else f", branched at token {branched} (tokens before it copied)"))
    return ", ".join(parts)


def _original(row: dict[str, Any]) -> str:
    """One link back of a reused rollout: the rollout it copies, where and how that was made."""
    lo, hi = row["policy_version_min"], row["policy_version_max"]
    version = f"policy version {lo}" if lo == hi else f"policy versions {lo}-{hi}"
    fate = "reached the update" if row["in_update"] else f"did not reach the update ({row['dropped_by'] or 'not handed to it'})"
    return (f"{row['rollout_id']}: step {row['step']}, by {row['created_by'] or '(unknown stage)'}, origin "
            f"{row['origin']}, {version}, {_scored(row)}, {row['n_tokens']} tokens, {fate}")


def _made(row: dict[str, Any]) -> str:
    """When a reused rollout's original was generated: its step, and its policy version where the
    copy's tokens no longer say it (the replay rescored them at the current policy)."""
    known = [f"step {row['created_step']}" if row.get("created_step") is not None else ""]
    original = row.get("replayed_policy_version")
    if original is not None and (original, original) != (row["policy_version_min"], row["policy_version_max"]):
        known.append(f"policy version {original}")
    known = [k for k in known if k]
    return f" (generated at {', '.join(known)})" if known else ""


def _scored(row: dict[str, Any]) -> str:
    if row["reward"] is None:
        return "not scored"
    verdict = {True: "correct", False: "wrong", None: "no correctness"}[row["correct"]]
    return f"reward {_num(row['reward'])}, {verdict}" + (f": {row['reward_reason']}" if row["reward_reason"] else "")


def _update(chain: Any) -> str:
    row, metrics = chain.row, chain.step_metrics or {}
    if not row["in_update"]:
        why = f"dropped by {chain.dropped_by}" if chain.dropped_by else "its group was not handed to the update"
        return f"did not reach {chain.update or 'the update'}: {why}"
    text = f"reached {chain.update}"
    if metrics.get("update_skipped"):
        return text + f", but the update was skipped ({metrics.get('skip_reason') or 'no reason given'})"
    if metrics:
        after = metrics["policy_version"]  # one update a step: it trained version after - 1 (a reused rollout's own is older)
        text += f": policy version {after - 1} -> {after}, loss {_num(metrics['loss'])}"
    if row["advantage"] == 0.0:
        text += " (advantage 0: no gradient from this rollout)"
    return text


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
