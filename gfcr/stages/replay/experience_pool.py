"""RLEP's experience pool: verified successes per prompt, seeded from a run directory or a JSONL
file, or filled online, and saved as parquet with the stage's checkpoint.

An entry is a ``StoredRollout`` (``gfcr.stages.common.stored``): token ids, segments with their
policy versions and behaviour log-probs, text, reward, the step that generated it. The pool keeps
at most ``max_per_prompt`` entries per prompt (the oldest leave first) and skips an entry whose
token ids equal one of its prompt's stored entries.

Seeds:

- ``seed_run_dir(run_dir, stage)``: the correct entries of the newest checkpoint's replay store
  (``stages/<stage>/files/entries.parquet``, written by ``replay.store`` or by ``replay.rlep``'s own
  pool) of another run. Their rollout ids are prefixed with the run directory's name
  (``<run>::<rollout id>``): ids are derived from prompt and step, so a run on the same data
  names its own rollouts the same way.
- ``seed_jsonl(path, pool, tokenize)``: one JSON object a line, ``{"prompt_id": ...}`` or
  ``{"prompt": <text of a prompt of the data>}``, with ``"response"`` (its text) and optionally
  ``"reward"`` (default 1.0). The text is tokenized with the policy's tokenizer (an end-of-text
  token appended), as the RLEP reference code does; such entries have no behaviour log-probs
  (their one segment is ``replayed_text``, step -1), so they are rescored when replayed.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from gfcr.errors import DataError, GfcrError, Location, Problem
from gfcr.records import Origin, PromptPool, Rollout, RolloutStatus, Segment, SegmentOrigin
from gfcr.stages.common.store_files import ENTRIES, read_entries, write_entries
from gfcr.stages.common.stored import StoredRollout, stored_bytes, stored_from

POOL_FILE = "pool.parquet"
SEED_STEP = -1  # the step of an entry read from a JSONL file: before the run


class ExperiencePool:
    """Verified successes by prompt, oldest first; at most ``max_per_prompt`` each."""

    def __init__(self, max_per_prompt: int | None):
        self.max_per_prompt = max_per_prompt
        self._by_prompt: dict[str, list[StoredRollout]] = {}
        self._tokens: set[tuple[str, bytes]] = set()
        self.next_entry_id = 0

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_prompt.values())

    @property
    def prompt_count(self) -> int:
        return len(self._by_prompt)

    def candidates(self, prompt_id: str) -> list[StoredRollout]:
        return list(self._by_prompt.get(prompt_id, ()))

    def entries(self) -> list[StoredRollout]:
        return [e for entries in self._by_prompt.values() for e in entries]

    def add_rollout(self, rollout: Rollout, step: int) -> bool:
        """Add a verified success of step ``step``; False if its prompt holds the same tokens."""
        text = rollout.text if rollout.text is not None else ""
        entry = stored_from(rollout, self.next_entry_id, step, text, rollout.reward or 0.0, 0)
        return self.add_entry(replace(entry, step=step))

    def add_entry(self, entry: StoredRollout) -> bool:
        key = (entry.prompt_id, entry.response_token_ids.tobytes())
        if key in self._tokens:
            return False
        entry = _with_id(entry, self.next_entry_id)
        self.next_entry_id += 1
        self._tokens.add(key)
        entries = self._by_prompt.setdefault(entry.prompt_id, [])
        entries.append(entry)
        if self.max_per_prompt is not None and len(entries) > self.max_per_prompt:
            gone = entries.pop(0)
            self._tokens.discard((gone.prompt_id, gone.response_token_ids.tobytes()))
        return True

    def save(self, directory: Path) -> None:
        write_entries(self.entries(), directory / POOL_FILE)

    def load(self, directory: Path, next_entry_id: int) -> None:
        self._by_prompt.clear()
        self._tokens.clear()
        for entry in read_entries(directory / POOL_FILE):
            self._by_prompt.setdefault(entry.prompt_id, []).append(entry)
            self._tokens.add((entry.prompt_id, entry.response_token_ids.tobytes()))
        self.next_entry_id = next_entry_id


def _with_id(entry: StoredRollout, entry_id: int) -> StoredRollout:
    return entry if entry.entry_id == entry_id else replace(entry, entry_id=entry_id)


# --- seeds ----------------------------------------------------------------------------------------

def seed_run_dir(run_dir: Path, stage: str | None) -> list[StoredRollout]:
    """The correct entries of the store in ``run_dir``'s newest checkpoint, ids prefixed with the run's name."""
    files = _store_files(Path(run_dir), stage)
    prefix = Path(run_dir).resolve().name.replace(" ", "_")
    return [replace(e, rollout_id=f"{prefix}::{e.rollout_id}", group_id=f"{prefix}::{e.group_id}")
            for e in read_entries(files) if e.correct is True]


def _store_files(run_dir: Path, stage: str | None) -> Path:
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*")) if (run_dir / "checkpoints").is_dir() else []
    fix = ("point `seed_from.run_dir` at a run directory whose pipeline has a `replay.store` (or `replay.rlep`) "
           "stage and at least one checkpoint")
    if not checkpoints:
        raise GfcrError(f"`seed_from.run_dir`: {run_dir} has no checkpoints", fix)
    newest = checkpoints[-1] / "stages"
    names = (ENTRIES, POOL_FILE)
    found = sorted(p for name in names for p in newest.glob(f"*/files/{name}"))
    if stage is not None:
        found = [p for p in found if p.parent.parent.name == stage]
    if len(found) != 1:
        what = "no replay store" if not found else f"{len(found)} replay stores ({', '.join(p.parent.parent.name for p in found)})"
        raise GfcrError(f"`seed_from.run_dir`: the newest checkpoint of {run_dir} ({checkpoints[-1].name}) has "
                        f"{what}" + (f" for the stage `{stage}`" if stage else ""),
                        "name the store's stage id with `seed_from.stage`" if found else fix)
    return found[0]


def seed_jsonl(path: Path, pool: PromptPool, tokenize: Callable[[str], list[int]]) -> list[StoredRollout]:
    """The responses of a JSONL file (see the module docstring), tokenized; a DataError lists every bad line."""
    problems: list[Problem] = []
    by_text = {p.text: p.prompt_id for p in pool if p.text is not None}
    entries: list[StoredRollout] = []
    for lineno, line in _lines(Path(path)):
        row, message = _row(line, pool, by_text)
        if message is not None:
            problems.append(Problem(Location(str(path), lineno), "", message, _JSONL_FIX))
            continue
        if float(row.get("reward", 1.0)) <= 0.0:
            continue  # not a success
        entries.append(_jsonl_entry(row, lineno, tokenize))
    if problems:
        raise DataError(problems)
    return entries


_JSONL_FIX = ('each line: {"prompt_id": "<an id of the data>", "response": "<text>"} (or "prompt": "<its text>"), '
              'optionally "reward": 1.0')


def _lines(path: Path) -> Iterable[tuple[int, str]]:
    if not path.is_file():
        raise DataError([Problem(Location(str(path)), "", "the JSONL file of `seed_from.jsonl` does not exist",
                                 "point `seed_from.jsonl` at a file of responses")])
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            yield lineno, line


def _row(line: str, pool: PromptPool, by_text: dict[str, str]) -> tuple[dict, str | None]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        return {}, f"not JSON: {exc}"
    if not isinstance(row, dict) or not isinstance(row.get("response"), str):
        return {}, 'a line needs a "response" string'
    pid = row.get("prompt_id", by_text.get(row.get("prompt")))
    if pid is None or pid not in pool:
        return {}, f"no prompt of the data matches {row.get('prompt_id', row.get('prompt'))!r}"
    return {**row, "prompt_id": pid}, None


def _jsonl_entry(row: dict, lineno: int, tokenize: Callable[[str], list[int]]) -> StoredRollout:
    tokens = np.asarray(tokenize(row["response"]), dtype=np.int32)
    segment = Segment(0, len(tokens), 0, np.zeros(len(tokens), dtype=np.float32), SegmentOrigin.REPLAYED_TEXT)
    reward = float(row.get("reward", 1.0))
    rid = f"seed-jsonl:{lineno}"
    return StoredRollout(entry_id=0, rollout_id=rid, group_id=rid, prompt_id=row["prompt_id"], step=SEED_STEP,
                         added_step=SEED_STEP, response_token_ids=tokens, segments=(segment,),
                         status=RolloutStatus.COMPLETED, origin=Origin.FRESH, finish_reason="stop",
                         text=row["response"], reward=reward, correct=True, priority=reward,
                         nbytes=stored_bytes(len(tokens), 1, row["response"], 0))
