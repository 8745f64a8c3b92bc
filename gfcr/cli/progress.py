"""The progress bar of ``gfcr run`` and its closing summary table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from gfcr.runtime.loop.events import RunEvent


class ProgressHook:
    """A run hook (``gfcr.runtime.loop.events``): one bar over the steps, with reward, eval
    accuracy and rollouts/s, and the loop blocks' rounds and limits."""

    def __init__(self, console: Console, total: int, start: int = 0, title: str = "steps"):
        self.console, self.total, self.start = console, total, start
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]}  acc {task.fields[acc]}  {task.fields[rate]} rollouts/s"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False,
        )
        self.title = title
        self.task = self.progress.add_task(title, total=total, completed=start, reward="-", acc="-", rate="-")
        self._said: set[str] = set()  # loops whose max_rounds stop was reported

    def before_run(self, event: RunEvent) -> None:
        self.progress.start()

    def before_eval(self, event: RunEvent) -> None:
        self.progress.update(self.task, acc="(evaluating)")

    def after_eval(self, event: RunEvent) -> None:
        self.progress.update(self.task, acc=f"{event.result.accuracy:.1%}")

    def step_recorded(self, event: RunEvent) -> None:
        record = event.record
        reward = record.get("reward_mean")
        rate = record["time"].get("rollouts_per_s")
        self.progress.update(self.task, completed=record["step"] + 1, description=self.title,
                             reward="-" if reward is None else f"{reward:.3f}",
                             rate="-" if rate is None else f"{rate:.0f}")

    def after_run(self, event: RunEvent) -> None:
        self.progress.stop()

    # --- loop blocks (the runner's events) ----------------------------------------------------

    def loop_round(self, event: RunEvent) -> None:
        """The bar says which round a loop is in, so a long loop is never silent."""
        loop, step, rounds = event.loop, event.step, event.rounds
        self.progress.update(self.task, description=f"{self.title} · step {step} loop {loop.name} "
                                                    f"round {rounds}/{loop.max_rounds}")

    def loop_stopped(self, event: RunEvent) -> None:
        """A loop stopped at a limit before its until stage was done: said every time for the
        wall clock, once per loop for max_rounds (some pipelines meet it by design)."""
        loop, step, rounds, limit = event.loop, event.step, event.rounds, event.limit
        if limit.startswith("max_rounds"):
            if loop.name in self._said:
                return
            self._said.add(loop.name)
        self.console.print(f"[yellow]warning:[/] step {step}: loop `{loop.name}` stopped at its limit {limit} "
                           f"after {rounds} round(s), before `{loop.until}` was done; the step goes on with what "
                           "the rounds collected" + (" (said once for this loop)" if limit.startswith("max_rounds")
                                                     else ""), markup=True, highlight=False)

    def stop(self) -> None:
        self.progress.stop()


def summary_table(summary: dict[str, Any]) -> Table:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    table = Table(title=f"{summary['pipeline']}: {summary['steps']} steps", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("eval accuracy before", pct(summary["eval_accuracy_before"]))
    table.add_row("eval accuracy after", pct(summary["eval_accuracy_after"]))
    table.add_row("policy version", str(summary["policy_version"]))
    table.add_row("rollouts generated / in update", f"{summary['rollouts_generated']} / {summary['rollouts_in_update']}")
    table.add_row("tokens generated / in update", f"{summary['tokens_generated']} / {summary['tokens_in_update']}")
    table.add_row("wall time (this session)", f"{summary['seconds_this_session']:.1f} s")
    table.add_row("run directory", summary["run_dir"])
    table.add_row("metrics", summary["metrics"])
    table.add_row("lineage", summary["lineage"])
    table.add_row("checkpoint", str(summary["checkpoint"]))
    if summary.get("log"):  # the engine's own output (vLLM's log and warnings), kept off the terminal
        table.add_row("engine log", summary["log"])
    return table
