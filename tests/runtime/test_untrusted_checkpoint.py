"""A run directory from someone else cannot run code: a checkpoint carrying a pickled object whose
unpickling has a side effect (it creates a marker file) is refused unread by `gfcr resume`, which
exits 2 saying the checkpoint is not a gfcr checkpoint, with its path and the fix.

Each payload is first shown live (unpickling it the unsafe way does create the marker), so the
test proves gfcr never unpickles it, not merely that the payload was inert."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.runtime.store.checkpoint import MANIFEST
from tests.conftest import BASE

cli = CliRunner()
CKPT = "checkpoints/step-000002"


class Payload:
    """Unpickling this creates ``marker``: a stand-in for any code a hostile pickle runs."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return io.open, (self.marker, "w")


def _torch_pickle(marker: Path, **tensors) -> bytes:
    buffer = io.BytesIO()
    torch.save({**tensors, "payload": Payload(marker)}, buffer)
    return buffer.getvalue()


def _assert_live(data: bytes, marker: Path, torch_format: bool) -> None:
    """Loading ``data`` the unsafe way runs the payload (then the marker is removed again)."""
    assert not marker.exists()
    torch.load(io.BytesIO(data), weights_only=False) if torch_format else pickle.loads(data)  # noqa: S301
    assert marker.exists(), "the payload is not live: the test would prove nothing"
    marker.unlink()


def _rehash(ckpt: Path) -> None:
    """Make the manifest agree with the files, as a hostile author would."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    for entry in manifest["files"]:
        data = (ckpt / entry["path"]).read_bytes()
        entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("untrusted")
    (root / "spec.yaml").write_text(BASE)
    result = cli.invoke(app, ["run", str(root / "spec.yaml"), "--run-dir", str(root / "run"), "--executor", "local"])
    assert result.exit_code == 0, result.output
    return root / "run"


def _plant(run: Path, file: str, data: bytes, rehash: bool) -> None:
    (run / CKPT / file).write_bytes(data)
    if rehash:
        _rehash(run / CKPT)


# (id, the file replaced, torch.save format or a bare pickle, manifest rewritten to match)
PLANTED = [
    ("torch.save as the RNG tensors, manifest rewritten", "rng/torch.safetensors", True, True),
    ("torch.save as the RNG tensors, manifest left", "rng/torch.safetensors", True, False),
    ("bare pickle as a stage's state.json, manifest rewritten", "stages/pick/state.json", False, True),
    ("bare pickle as the runner position, manifest rewritten", "runner.json", False, True),
]


def _resume_refuses(run: Path, marker: Path, checkpoint: Path, file: Path):
    result = cli.invoke(app, ["resume", str(run), "--executor", "local"])
    assert not marker.exists(), "gfcr ran the pickle's code"
    output = result.output
    assert result.exit_code == 2, output
    assert f"{checkpoint} is not a gfcr checkpoint" in output and str(file) in output, output
    assert "is a pickle" in output and "fix: " in output and "Resume only run directories you trust" in output
    assert "Traceback" not in output, output
    return result


@pytest.mark.parametrize("file, torch_format, rehash", [c[1:] for c in PLANTED], ids=[c[0] for c in PLANTED])
def test_a_checkpoint_carrying_a_pickle_is_refused_and_its_code_never_runs(file, torch_format, rehash,
                                                                          finished_run, tmp_path):
    run, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(finished_run, run)
    data = _torch_pickle(marker, state=torch.get_rng_state()) if torch_format else pickle.dumps(Payload(marker))
    _assert_live(data, marker, torch_format)
    _plant(run, file, data, rehash)
    result = _resume_refuses(run, marker, run / CKPT, run / CKPT / file)
    assert "has no complete checkpoint to resume from" in result.output  # skipped as unusable, nothing loaded
    assert json.loads((run / CKPT / MANIFEST).read_text())["step"] == 2  # nothing rewritten


def test_a_pickle_beside_a_good_checkpoint_is_never_read(finished_run, tmp_path):
    """An unlisted pickle in a checkpoint (or a format-1 `.pt` beside it) is ignored: resume works."""
    run, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(finished_run, run)
    (run / CKPT / "extra.pt").write_bytes(_torch_pickle(marker))
    (run / "checkpoints" / "step-000001.pt").write_bytes(_torch_pickle(marker))
    result = cli.invoke(app, ["resume", str(run), "--steps", "3", "--executor", "local"])
    assert result.exit_code == 0, result.output
    assert not marker.exists()


def test_a_format_1_pickle_checkpoint_is_refused_unread(finished_run, tmp_path):
    run, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(finished_run, run)
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").mkdir()
    data = _torch_pickle(marker)
    _assert_live(data, marker, torch_format=True)
    (run / "checkpoints" / "step-000002.pt").write_bytes(data)
    result = cli.invoke(app, ["resume", str(run), "--executor", "local"])
    assert not marker.exists()
    assert result.exit_code == 2, result.output
    assert f"{run}/checkpoints/step-000002.pt is not a gfcr checkpoint this gfcr loads" in result.output
    assert "start the run again with `gfcr run`" in result.output and "Traceback" not in result.output


POLICY_RUN = textwrap.dedent("""\
    name: untrusted-policy
    policy: {model: tiny-arith}
    data: {source: arithmetic, with: {n: 16, seed: 0}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 2}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 2}}
      rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 4}}
      reward:  {use: filter.verify, from: rollout}
    update: {use: update.grpo, from: reward, with: {lr: 1.0e-4}}
    run: {steps: 1, seed: 0, checkpoint_every: 1}
    tracking: {mlflow: null}
    """)


def test_policy_weights_saved_with_torch_save_are_refused_and_never_unpickled(tmp_path):
    """The policy's weights as `torch.save` would write them (the state dict, plus the payload),
    under the safetensors name and with the manifest rewritten to match: refused unread."""
    (tmp_path / "spec.yaml").write_text(POLICY_RUN)
    run, marker = tmp_path / "run", tmp_path / "pwned"
    result = cli.invoke(app, ["run", str(tmp_path / "spec.yaml"), "--run-dir", str(run), "--executor", "local"])
    assert result.exit_code == 0, result.output
    ckpt = run / "checkpoints" / "step-000001"
    from safetensors.torch import load_file

    data = _torch_pickle(marker, **load_file(str(ckpt / "policy.safetensors")))
    _assert_live(data, marker, torch_format=True)
    (ckpt / "policy.safetensors").write_bytes(data)
    _rehash(ckpt)
    _resume_refuses(run, marker, ckpt, ckpt / "policy.safetensors")
