"""The run's prompts as MLflow dataset inputs, and the tags that say what a run is.

A ``PromptPool`` becomes a pandas frame with one row per prompt (``prompt_id``, ``text``
(messages as JSON when the prompt is a chat), ``verifier``, ``ground_truth``, ``metadata`` as
JSON), logged with MLflow's ``from_pandas``: MLflow stores its schema, row count and a digest
of the rows, not the rows. The source is a ``CodeDatasetSource`` whose tags hold the spec's
data source and its validated ``with``, since gfcr's sources are code (``arithmetic``) or files
read through code (``jsonl``).
"""

from __future__ import annotations

import getpass
import json
import subprocess
from pathlib import Path
from typing import Any

from gfcr.graph.model import DataBinding
from gfcr.records import PromptPool
from gfcr.runtime.store.rundir import gfcr_version
from gfcr.tracking.mlflow_values import MAX_TAG_VALUE, fit_value, mlflow_key

CONTEXT_TAG = "mlflow.data.context"  # mlflow.utils.mlflow_tags.MLFLOW_DATASET_CONTEXT


def prompt_frame(pool: PromptPool) -> Any:
    """One row per prompt, in pool order."""
    import pandas as pd

    rows = [{
        "prompt_id": p.prompt_id,
        "text": p.text if p.text is not None else json.dumps(p.messages, ensure_ascii=False),
        "verifier": p.verifier.name if p.verifier else None,
        "ground_truth": p.verifier.ground_truth if p.verifier else None,
        "metadata": json.dumps(p.metadata, ensure_ascii=False, sort_keys=True, default=str),
    } for p in pool]
    return pd.DataFrame(rows, columns=["prompt_id", "text", "verifier", "ground_truth", "metadata"])


def dataset_input(pool: PromptPool, binding: DataBinding, context: str) -> Any:
    """An MLflow ``DatasetInput`` of ``pool`` for ``context`` (``training`` or ``eval``)."""
    import mlflow.data
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.entities import DatasetInput, InputTag

    source = CodeDatasetSource({"gfcr.data.source": binding.name,
                                "gfcr.data.with": json.dumps(binding.config.model_dump(mode="json"), sort_keys=True)})
    dataset = mlflow.data.from_pandas(prompt_frame(pool), source=source, name=pool.name)
    return DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag(CONTEXT_TAG, context)])


def run_tags(run: Any) -> dict[str, str]:
    """What a run is: pipeline, stage aliases, gfcr version, git commit, run directory, seed."""
    spec = run.spec
    tags = {
        "mlflow.runName": run.dir.path.name, "mlflow.source.type": "LOCAL", "mlflow.source.name": "gfcr",
        "gfcr.pipeline": spec.name, "gfcr.version": gfcr_version(),  # as run.json records it
        "gfcr.run_dir": str(run.dir.path.resolve()), "gfcr.seed": str(spec.run.seed),
    }
    tags.update({mlflow_key(f"gfcr.stage.{sid}"): node.info.alias for sid, node in run.pipeline.nodes.items()})
    if spec.description:
        tags["mlflow.note.content"] = spec.description  # the run's description in the MLflow UI
    user, commit = _user(), git_commit(Path.cwd())
    if user:
        tags["mlflow.user"] = user
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return {k: fit_value(v, MAX_TAG_VALUE) for k, v in tags.items()}


def git_commit(where: Path) -> str | None:
    """The commit checked out at ``where``, or None outside a git work tree (or without git)."""
    try:
        out = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and len(commit) == 40 else None


def _user() -> str | None:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container user with no passwd entry
        return None
