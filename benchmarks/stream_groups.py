"""Groups streamed to the filters within a step (``lifecycle: {stream_groups: true}``) against the
barrier (the default), step wall time, in this process, cells interleaved round by round:

- ``fake``: the labelled fake engine behind ``generate.sample`` at ``--step-s`` seconds a decode
  step (4 rows at a time, 6 groups of 4), and the labelled slow filter ``filter.fake_slow`` at
  ``--filter-s`` seconds a group: what streaming itself achieves, free of the host. Its limit is
  ``(generation + filtering) / (generation + one group's filtering)``;
- ``quickstart``: ``pipelines/quickstart.yaml`` (tiny-arith on the transformers engine, 16 groups of
  8, ``filter.verify``), where the filter is a few milliseconds against generation's seconds.

Per cell the median over steps 1.. of ``time.wall_s`` (step 0 pays for start-up) and of the
generate and filter stages' seconds (``time.stages_s``). Streamed and barrier runs of one cell
give the same metrics (tests/runtime/test_streaming.py); only the time differs.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/stream_groups.py [--rounds 2] [--steps 5]

Writes ``benchmarks/results/stream_groups.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
FAKE = """\
name: stream-bench-fake
data: {{source: arithmetic, with: {{n: 400, seed: 0}}}}
stages:
  pick:    {{use: control.uniform, with: {{batch_size: 6}}}}
  budget:  {{use: control.fixed_n, from: pick, with: {{n: 4}}}}
  rollout: {{use: generate.sample, from: budget, with: {{max_new_tokens: 8, max_in_flight: 4}}}}
  reward:  {{use: filter.fake_slow, from: rollout, with: {{latency_s: {filter_s}}}}}
update: {{use: update.fake, from: reward}}
executor: {{kind: local}}
tracking: {{mlflow: null}}
"""
COMMON = ["executor.kind=local", "tracking.mlflow=null", "eval=null"]


class FakePolicy:
    """TEST/FAKE: prompt token ids in the fake engine's alphabet (generate.sample reads no more)."""

    name, tokenizer, lora, version = "fake", None, None, 0

    def __init__(self):
        import torch

        self.model = torch.nn.Linear(1, 1, bias=False)  # weights for the run's final checkpoint to write

    def encode(self, prompt):
        from gfcr.engines.fake import FakeEngine

        return list(FakeEngine().encode("".join(c for c in prompt.text.lower() if c in FakeEngine.ALPHABET[1:])))


def run_cell(cell: str, stream: bool, steps: int, args: argparse.Namespace, folder: Path) -> dict:
    from gfcr.engines.fake import FakeEngine
    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop import session
    from gfcr.runtime.services import RuntimeServices
    from gfcr.stages.resources import Lent

    overrides = COMMON + [f"run.steps={steps}", f"lifecycle.stream_groups={str(stream).lower()}"]
    if cell == "fake":
        path = folder / "fake.yaml"
        path.write_text(FAKE.format(filter_s=args.filter_s))
        services = lambda spec, **kw: RuntimeServices(Lent(FakePolicy(), FakeEngine(step_s=args.step_s)))  # noqa: E731
    else:
        path, services = REPO / "pipelines" / "quickstart.yaml", session.build_services
    run_dir = folder / f"{cell}-{stream}-{len(list(folder.iterdir()))}"
    with mock.patch.object(session, "build_services", services):
        session.Run.start(load_pipeline(path, overrides), run_dir).train()
    lines = [json.loads(line)["time"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    generate, filtered = ("rollout", "reward")
    return {"wall_s": statistics.median(t["wall_s"] for t in lines),
            "generate_s": statistics.median(t["stages_s"][generate] for t in lines),
            "filter_s": statistics.median(t["stages_s"][filtered] for t in lines)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--step-s", type=float, default=0.01)
    parser.add_argument("--filter-s", type=float, default=0.1)
    parser.add_argument("--cells", nargs="+", default=["fake", "quickstart"])
    args = parser.parse_args()
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for cell in args.cells:
                for stream in (False, True):
                    key = f"{cell}, {'streamed' if stream else 'barrier'}"
                    results.setdefault(key, []).append(run_cell(cell, stream, args.steps, args, Path(tmp)))
    table = {key: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for key, runs in results.items()}
    out = REPO / "benchmarks" / "results" / "stream_groups.json"
    out.write_text(json.dumps({"args": vars(args), "load": os.getloadavg(), "cells": table}, indent=1))
    print("| cell | step wall s | generate s | filter s (summed) |\n|---|---|---|---|")
    for key, row in table.items():
        print(f"| {key} | {row['wall_s']:.3f} | {row['generate_s']:.3f} | {row['filter_s']:.3f} |")


if __name__ == "__main__":
    main()
