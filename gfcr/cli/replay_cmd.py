"""``gfcr replay inspect RUN_DIR [--query TEXT]``: what a run's replay store holds.

    $ gfcr replay inspect runs/replay-store-arith-20261201-101500 --query "12 + 7 ="

reads the store of the run's ``replay.store`` stage (``--stage ID`` when it has several) from
its newest checkpoint and prints its size, the prompts with the most rollouts, the rollouts by
the step they were added and by staleness (policy versions behind the checkpoint's policy),
their rewards, and with ``--query`` the nearest stored prompts and responses to the text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from gfcr.cli.common import fail, out
from gfcr.errors import GfcrError

replay_app = typer.Typer(no_args_is_help=True, help="Look inside the replay stores of a run.")  # `gfcr replay`


@replay_app.command()
def inspect(run_dir: Annotated[Path, typer.Argument(help="a run directory made by `gfcr run`")],
            query: Annotated[Optional[str], typer.Option("--query", "-q", help="show its nearest neighbours")] = None,
            stage: Annotated[Optional[str], typer.Option(help="the replay.store stage id (when there are several)")]
            = None,
            k: Annotated[int, typer.Option("-k", min=1, help="neighbours shown per search")] = 5,
            top: Annotated[int, typer.Option(min=1, help="prompts shown, most rollouts first")] = 10) -> None:
    """What a run's replay store holds (counts by prompt, age, reward) and its nearest neighbours of a query."""
    from gfcr.runtime.store.replay_inspect import open_replay_store, summarize

    try:
        opened = open_replay_store(run_dir, stage)
        summary = summarize(opened.store, opened.policy_version, top)
        hits = _neighbours(opened.store, query, k) if query is not None else None
    except GfcrError as exc:
        fail(exc)
        raise typer.Exit(2) from None
    _print_summary(opened, summary)
    if hits is not None:
        _print_neighbours(query or "", *hits)


def _neighbours(store: Any, query: str, k: int) -> tuple[list, list]:
    return store.knn_prompts(query, k), store.knn_by_response(query, k)


def _print_summary(opened: Any, s: dict[str, Any]) -> None:
    store = opened.store
    out.print(f"replay store `{escape(opened.stage_id)}` at {escape(str(opened.checkpoint))} "
              f"(step {opened.step}, policy version {opened.policy_version})")
    out.print(f"  {s['entries']} rollouts of {s['prompts']} prompts, {s['bytes']:,} bytes; index "
              f"{store.config.index}, embedder {escape(store.config.embedder)}")
    t = s["totals"]
    out.print(f"  since the start: {t['added']} added, {t['exact_duplicates']} exact and {t['near_duplicates']} "
              f"near duplicates skipped, {t['evicted']} evicted")
    table = Table("prompt", "rollouts", "mean reward", "text", title=f"prompts with the most rollouts (top {len(s['top_prompts'])})",
                  title_justify="left")
    for pid, n, text, mean in s["top_prompts"]:
        table.add_row(escape(pid), str(n), "-" if mean is None else f"{mean:.3f}", escape(_short(text)))
    out.print(table)
    out.print("  added at step:  " + _counts(s["added_step"]))
    out.print("  staleness:      " + _counts(s["staleness"]) + "  (policy versions behind the checkpoint)")
    out.print("  reward:         " + _rewards(s["reward"], s["unscored"]))


def _counts(pairs: list[tuple[Any, int]]) -> str:
    return ", ".join(f"{key}: {n}" for key, n in pairs) or "(empty)"


def _rewards(r: dict[str, Any], unscored: int) -> str:
    if not r:
        return f"none scored ({unscored} unscored)"
    text = f"mean {r['mean']:.3f}, min {r['min']:g}, max {r['max']:g}"
    if "counts" in r:
        text += "; " + ", ".join(f"{value:g}: {n}" for value, n in r["counts"])
    else:
        text += "; quartiles " + ", ".join(f"{q:.3f}" for q in r["quartiles"])
    return text + (f"; {unscored} unscored" if unscored else "")


def _print_neighbours(query: str, prompts: list, responses: list) -> None:
    table = Table("cosine", "prompt", "rollouts", "text", title=f"nearest prompts to {query!r}", title_justify="left")
    for p in prompts:
        table.add_row(f"{p.score:.3f}", escape(p.prompt_id), str(p.entries), escape(_short(p.text)))
    out.print(table)
    table = Table("cosine", "rollout", "prompt", "step", "reward", "response", title=f"nearest responses to {query!r}",
                  title_justify="left")
    for h in responses:
        e = h.entry
        table.add_row(f"{h.score:.3f}", escape(e.rollout_id), escape(e.prompt_id), str(e.step),
                      "-" if e.reward is None else f"{e.reward:g}", escape(_short(e.text)))
    out.print(table)


def _short(text: str, width: int = 60) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"
