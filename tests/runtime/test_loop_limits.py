"""A loop block that cannot reach its target (issue 16): every round that does not end it is
reported (the progress bar shows it), and it stops at max_rounds or at its wall-clock limit
(`max_seconds`) with a warning that says which limit and what happens next."""

from __future__ import annotations

import time

from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.graph import compile_pipeline
from gfcr.runtime import LocalRunner
from gfcr.spec import load_spec_text
from tests.conftest import DAPO

UNREACHABLE = DAPO.replace("target_groups: 4", "target_groups: 100000")  # 4 prompts a round: never enough


class Heard:
    def __init__(self):
        self.rounds, self.stops = [], []

    def loop_round(self, event):
        self.rounds.append((event.loop.name, event.step, event.rounds))

    def loop_stopped(self, event):
        self.stops.append((event.loop.name, event.step, event.rounds, event.limit))


def test_each_round_is_heard_and_max_rounds_stops_the_loop_with_a_reason():
    heard = Heard()
    runner = LocalRunner(compile_pipeline(load_spec_text(UNREACHABLE)), hooks=(heard,))
    runner.run_step()
    assert heard.rounds == [("collect", 0, 1), ("collect", 0, 2), ("collect", 0, 3)]
    assert heard.stops == [("collect", 0, 3, "max_rounds=3")]


def test_a_reachable_target_ends_the_loop_without_a_stop():
    heard = Heard()
    runner = LocalRunner(compile_pipeline(load_spec_text(DAPO.replace("target_groups: 4", "target_groups: 1"))),
                         hooks=(heard,))
    runner.run_step()
    assert heard.stops == []


def test_max_seconds_stops_a_loop_whose_max_rounds_is_huge():
    spec = UNREACHABLE.replace("max_rounds: 3", "max_rounds: 1000000000, max_seconds: 0.3")
    heard = Heard()
    runner = LocalRunner(compile_pipeline(load_spec_text(spec)), hooks=(heard,))
    start = time.monotonic()
    runner.run_step()
    assert time.monotonic() - start < 5
    [(name, step, rounds, limit)] = heard.stops
    assert (name, step, limit) == ("collect", 0, "max_seconds=0.3") and rounds == len(heard.rounds) >= 1


def test_gfcr_run_warns_once_per_loop_at_max_rounds_and_at_every_wall_clock_stop(write_spec, tmp_path):
    cli = CliRunner()
    result = cli.invoke(app, ["run", str(write_spec(UNREACHABLE + "run: {steps: 2}\n")), "--run-dir",
                              str(tmp_path / "a"), "--executor", "local"])
    assert result.exit_code == 0, result.output
    said = ("warning: step 0: loop `collect` stopped at its limit max_rounds=3 after 3 round(s), before `enough` "
            "was done; the step goes on with what the rounds collected (said once for this loop)")
    assert said in result.output and result.output.count("warning:") == 1
    spec = UNREACHABLE.replace("max_rounds: 3", "max_rounds: 1000000000, max_seconds: 0.2") + "run: {steps: 2}\n"
    result = cli.invoke(app, ["run", str(write_spec(spec, "timed.yaml")), "--run-dir", str(tmp_path / "b"),
                              "--executor", "local"])
    assert result.exit_code == 0, result.output
    assert result.output.count("loop `collect` stopped at its limit max_seconds=0.2 after") == 2
