"""The golden table of user errors at the command line: a bad checkpoint, model, run directory,
evaluation or data, and a bad `--set` of the update's components. Each runs through `gfcr run`
/ `gfcr resume` / `gfcr validate` and must exit 2 with what happened, where (the file or
folder, ``file:line:`` or the `--set` that brought the value) and the fix, and no traceback.
A bug in a stage still exits 1 with its traceback.

The spec-level golden table (bad YAML, config, wiring) is tests/spec/test_golden_errors.py."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.errors import EvalError
from gfcr.records import RolloutGroups, UpdateReport
from gfcr.runtime.store.checkpoint import MANIFEST
from gfcr.stages.testing import FakeUpdate
from tests.conftest import BASE
from tests.runtime.test_checkpoint import _drop_stage

cli = CliRunner()
CKPT = "checkpoints/step-000002"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A 2-step run of the fake pipeline, checkpointed at step 2: each case damages a copy."""
    root = tmp_path_factory.mktemp("golden-cli")
    (root / "spec.yaml").write_text(BASE)
    result = cli.invoke(app, ["run", str(root / "spec.yaml"), "--run-dir", str(root / "run"), "--executor", "local"])
    assert result.exit_code == 0, result.output
    assert (root / "run" / CKPT / MANIFEST).is_file()
    return root / "run"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _set_format(path: Path, value: int) -> None:
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "format": value, "gfcr": "9.9.9"}))


def _not_a_checkpoint(ckpt: Path) -> None:
    shutil.rmtree(ckpt)
    ckpt.mkdir()
    (ckpt / "notes.txt").write_text("not a checkpoint")


def _only_a_pickle(run: Path) -> None:
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "step-000002.pt").write_bytes(b"\x80\x04K\x01.")


def _torch_save_as_the_rng_state(run: Path) -> None:
    """The RNG state written by torch.save (a pickle), the manifest rewritten to match it."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save({"state": torch.get_rng_state()}, buffer)
    (run / CKPT / "rng" / "torch.safetensors").write_bytes(buffer.getvalue())
    _rehash(run / CKPT)


def _run_dir_is_a_file(run: Path) -> None:
    (run.parent / "run.spec.yaml").write_text(BASE)
    shutil.rmtree(run)
    run.write_text("not a folder")


@dataclass
class Case:
    id: str
    damage: Callable[[Path], None]  # applied to a copy of the finished run
    says: list[str]  # what and where, with {run} for the run directory
    fix: str
    args: list[str] = field(default_factory=lambda: ["resume", "{run}"])


RESUME_CASES = [
    Case("bad checkpoint directory", lambda run: _not_a_checkpoint(run / CKPT),
         [f"{{run}}/{CKPT} is not a complete checkpoint: it has no manifest.json"], f"delete {{run}}/{CKPT}"),
    Case("truncated manifest", lambda run: _truncate(run / CKPT / MANIFEST),
         [f"{{run}}/{CKPT}/manifest.json is truncated or corrupt"], f"delete {{run}}/{CKPT}"),
    Case("a file listed in the manifest is missing", lambda run: (run / CKPT / "rng" / "numpy.json").unlink(),
         [f"{{run}}/{CKPT}/rng/numpy.json is missing"], "to resume from an older checkpoint"),
    Case("corrupt state file", lambda run: _flip_a_byte(run / CKPT / "stages" / "pick" / "state.json"),
         [f"{{run}}/{CKPT}/stages/pick/state.json is corrupt: its sha256 differs"], f"delete {{run}}/{CKPT}"),
    Case("missing stage state", lambda run: _drop_stage(run / CKPT, "pick"),
         [f"{{run}}/{CKPT}: no state for stage `pick`"], "resume with the spec.yaml it was saved with"),
    Case("format mismatch", lambda run: _set_format(run / CKPT / MANIFEST, 3),
         ["checkpoint format 3 (written by gfcr 9.9.9); this gfcr reads format 2"], "resume it with the gfcr version"),
    Case("format-1 pickle checkpoint", _only_a_pickle,
         ["{run}/checkpoints/step-000002.pt is not a gfcr checkpoint this gfcr loads", "a format-1 checkpoint",
          "loading a pickle can run any code"],
         "start the run again with `gfcr run`"),
    Case("a pickle inside a checkpoint", _torch_save_as_the_rng_state,
         [f"{{run}}/{CKPT} is not a gfcr checkpoint: {{run}}/{CKPT}/rng/torch.safetensors is a pickle"],
         f"Resume only run directories you trust: delete {{run}}/{CKPT}"),
    Case("--run-dir names a file", _run_dir_is_a_file, ["run directory {run} is a file"], "pick another --run-dir",
         ["run", "{run}.spec.yaml", "--run-dir", "{run}", "--executor", "local"]),
    # a run directory with no checkpoint at all is not an error: it resumes from step 0
    # (tests/runtime/test_resume_always.py)
    Case("not a run directory", lambda run: (run / "spec.yaml").unlink(),
         ["{run} is not a gfcr run directory (no spec.yaml)"], "pass the folder `gfcr run` printed"),
    Case("run directory does not exist", lambda run: shutil.rmtree(run),
         ["{run} does not exist"], "pass the folder `gfcr run` printed"),
    Case("run directory in use", lambda run: None,
         ["run directory {run} is not empty"], "continue that run with `gfcr resume {run}`",
         ["run", "{run}/spec.yaml", "--run-dir", "{run}", "--executor", "local"]),
]


STORE_BASE = BASE.replace("update: {use: update.fake, from: keep}",
                          "  store:   {use: replay.store, from: keep}\nupdate: {use: update.fake, from: store}")
INDEX = f"{CKPT}/stages/store/files/responses.faiss"


@pytest.fixture(scope="module")
def store_run(tmp_path_factory) -> Path:
    """The fake pipeline with a replay store, checkpointed at step 2: the replay cases damage a copy."""
    root = tmp_path_factory.mktemp("golden-store")
    (root / "spec.yaml").write_text(STORE_BASE)
    result = cli.invoke(app, ["run", str(root / "spec.yaml"), "--run-dir", str(root / "run"), "--executor", "local"])
    assert result.exit_code == 0, result.output
    assert (root / "run" / INDEX).is_file()
    return root / "run"


def _rehash(ckpt: Path) -> None:
    """Rewrite the manifest's sizes and hashes to match the files (a store copied in by hand)."""
    import hashlib

    manifest = json.loads((ckpt / MANIFEST).read_text())
    for entry in manifest["files"]:
        data = (ckpt / entry["path"]).read_bytes()
        entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def _truncate_and_rehash(run: Path) -> None:
    _truncate(run / INDEX)
    _rehash(run / CKPT)


REPLAY_CASES = [
    Case("truncated replay index", lambda run: _truncate(run / INDEX),
         [f"{{run}} has no complete checkpoint to resume from: {{run}}/{INDEX} has"], f"delete {{run}}/{CKPT}"),
    Case("truncated replay index listed in the manifest", _truncate_and_rehash,
         [f"{{run}}/{INDEX} is not a readable FAISS index (truncated or corrupt)"],
         "delete this checkpoint directory to resume from an older one"),
    Case("replay inspect of a truncated index", lambda run: _truncate(run / INDEX),
         [f"{{run}} has no complete checkpoint: {{run}}/{INDEX} has"], "set `run.checkpoint_every`",
         ["replay", "inspect", "{run}"]),
    Case("replay inspect of a truncated index listed in the manifest", _truncate_and_rehash,
         [f"{{run}}/{INDEX} is not a readable FAISS index"], "delete this checkpoint directory",
         ["replay", "inspect", "{run}"]),
]


def _tiny_arith_folder() -> Path:
    """tiny-arith's folder: a causal LM, no classification head."""
    from gfcr.engines.models import resolve_model

    return resolve_model("tiny-arith")


def _spec_with(tmp_path: Path, old: str, new: str) -> Path:
    assert old in BASE
    path = tmp_path / "spec.yaml"
    path.write_text(BASE.replace(old, new, 1))
    return path


def _bad_model_folder(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return _spec_with(tmp_path, "data:", f"policy: {{model: {tmp_path / 'model'}}}\ndata:")


def _eval_without_policy(tmp_path: Path) -> Path:
    return _spec_with(tmp_path, "stages:", "eval: {source: arithmetic, with: {n: 4, split: eval}}\nstages:")


def _bad_rows(tmp_path: Path) -> Path:
    (tmp_path / "rows.jsonl").write_text('{"prompt": "What is 1 + 1? Answer:"}\n')
    return _spec_with(tmp_path, "source: arithmetic, with: {n: 50}",
                      f"source: jsonl, with: {{path: {tmp_path / 'rows.jsonl'}, verifier: arithmetic}}")


def _failing_environment(tmp_path: Path) -> Path:
    """The multi-turn calculator pipeline, one step, on an environment that raises, declared to fail."""
    text = (Path(__file__).resolve().parents[2] / "pipelines" / "examples" / "multi_turn_calc_arith.yaml").read_text()
    text = text.replace("environment: {use: calculator, with: {max_tool_calls: 2}}, tool_parser: calc",
                        "environment: {use: testing.raising, with: {at: 1, every: 1}}, on_env_error: fail")
    text = text.replace("run: {steps: 100, seed: 0, checkpoint_every: 50}", "run: {steps: 1, seed: 0}\ntracking: {mlflow: null}")
    (tmp_path / "spec.yaml").write_text(text.replace("batch_size: 8", "batch_size: 1"))
    return tmp_path / "spec.yaml"


RUN_CASES = [
    ("missing model", lambda tmp: _spec_with(tmp, "data:", "policy: {model: tiny-arithmetic}\ndata:"),
     ["policy.model `tiny-arithmetic` is neither a model alias nor a local Hugging Face folder",
      "did you mean `tiny-arith-mix` or `tiny-arith`?"], "use one of `tiny-arith`"),
    ("missing judge model", lambda tmp: _spec_with(
        tmp, "  keep:    {use: filter.nonzero_variance, from: rollout}",
        "  reward:  {use: filter.judge, from: rollout, with: {model: smollm2-135m}}\n"
        "  keep:    {use: filter.nonzero_variance, from: reward}"),
     ["stages.reward.with.model", "`reward`'s model `smollm2-135m` is neither a model alias nor a local Hugging Face "
      "folder"], "use one of `tiny-arith`"),
    ("missing reward model folder", lambda tmp: _spec_with(
        tmp, "  keep:    {use: filter.nonzero_variance, from: rollout}",
        "  reward:  {use: filter.reward_model, from: rollout, with: {model: no-such-rm}}\n"
        "  keep:    {use: filter.nonzero_variance, from: reward}"),
     ["stages.reward.with.model", "reward model `{tmp}/no-such-rm`: no folder there"],
     "`python benchmarks/train_reward_model.py` fine-tunes one offline"),
    ("reward model without a classification head", lambda tmp: _spec_with(
        tmp, "  keep:    {use: filter.nonzero_variance, from: rollout}",
        f"  reward:  {{use: filter.reward_model, from: rollout, with: {{model: {_tiny_arith_folder()}}}}}\n"
        "  keep:    {use: filter.nonzero_variance, from: reward}"),
     ["stages.reward.with.model", "has no sequence-classification head (architectures: "],
     "fine-tune a classifier from it (AutoModelForSequenceClassification)"),
    ("model folder without config.json", lambda tmp: _spec_with(tmp, "data:", f"policy: {{model: {tmp}}}\ndata:"),
     ["is a folder without config.json"], "save_pretrained"),
    ("bad model folder", _bad_model_folder,
     ["cannot load the tokenizer of policy", "/model"], "a folder written by save_pretrained"),
    ("eval without a policy", _eval_without_policy, ["`eval` needs a policy to evaluate"], "remove `eval`"),

    ("bad data rows", _bad_rows, ["rows.jsonl:1: missing field `answer`"], ""),
    ("an environment that raises, declared to fail the step", _failing_environment,
     ["stage `rollout` failed at step 0", "environment `testing.raising` raised in step (model turn 1) of trajectory",
      "RuntimeError: tool server unreachable at turn 1"], "set `on_env_error: drop` on the stage"),
]


QUICKSTART = str(Path(__file__).resolve().parents[2] / "pipelines" / "quickstart.yaml")
UPDATE_LINE = f"{QUICKSTART}:13:"  # the quickstart's `update:` line

# (id, --set, where, what, fix) through `gfcr validate` of the quickstart (update.grpo)
SET_CASES = [
    ("clip moved to the loss", "update.with.clip=[0.2,0.28]", "--set update.with.clip=[0.2,0.28]:",
     "update.with.clip: `clip` is no longer a key here",
     "write `loss: {use: ppo_clip, with: {clip: [0.2, 0.28]}}` (--set update.with.loss.with.clip=[0.2,0.28])"),
    ("loss_agg is now a component", "update.with.loss_agg=seq_mean", "--set update.with.loss_agg=seq_mean:",
     "update.with.loss_agg: `loss_agg` is no longer a key here",
     "`seq_mean` is now `seq_mean_token_mean`; --set update.with.aggregation.use=seq_mean_token_mean"),
    ("tis_cap is now a correction", "update.with.tis_cap=2.0", "--set update.with.tis_cap=2.0:",
     "update.with.tis_cap: `tis_cap` is no longer a key here",
     "write `correction: {use: tis, with: {cap: 2.0}}` (--set update.with.correction.use=tis --set "
     "update.with.correction.with.cap=2.0)"),
    ("decoupled_clip is now a correction", "update.with.decoupled_clip=true", "--set update.with.decoupled_clip=true:",
     "update.with.decoupled_clip: `decoupled_clip` is no longer a key here",
     "write `correction: {use: decoupled_clip}` (--set update.with.correction.use=decoupled_clip)"),
    ("recompute_old is now a correction", "update.with.recompute_old=true", "--set update.with.recompute_old=true:",
     "update.with.recompute_old: `recompute_old` is no longer a key here",
     "write `correction: {use: recompute_old}` (--set update.with.correction.use=recompute_old)"),
    ("max_staleness belongs to the correction", "update.with.max_staleness=4", "--set update.with.max_staleness=4:",
     "update.with.max_staleness: `max_staleness` is no longer a key here",
     "--set update.with.correction.use=staleness --set update.with.correction.with.max_staleness=4"),
    ("near-miss correction alias", "update.with.correction.use=tsi", "--set update.with.correction.use=tsi:",
     "update.with.correction.use: unknown off-policy correction `tsi`", "did you mean `tis`?"),
    ("near-miss loss alias", "update.with.loss.use=ppo_clpi", "--set update.with.loss.use=ppo_clpi:",
     "update.with.loss.use: unknown loss `ppo_clpi`", "did you mean `ppo_clip`?"),
    ("aggregation without its required constant", "update.with.aggregation.use=seq_mean_token_sum",
     "--set update.with.aggregation.use=seq_mean_token_sum:",  # the --set made the `aggregation` block
     "update.with.aggregation.with: aggregation `seq_mean_token_sum`: `constant` is required",
     "write `aggregation: {use: seq_mean_token_sum, with: {constant: ...}}` "
     "(--set update.with.aggregation.with.constant=...)"),
    ("dual clip not above 1", "update.with.loss.with.dual_clip=0.5", UPDATE_LINE,
     "update.with.loss.with: loss `ppo_clip`: `dual_clip`: Input should be greater than 1, got `0.5`",
     "change `dual_clip` to satisfy the bound"),
]


def _assert_user_error(result, says: list[str], fix: str) -> None:
    output = result.output
    assert result.exit_code == 2, output
    for text in says:
        assert text in output, f"{text!r} not in:\n{output}"
    assert "fix: " in output and fix in output.split("fix: ", 1)[1], output
    assert "Traceback" not in output, output


def test_the_table_covers_every_user_error_class():
    assert len(RESUME_CASES) + len(RUN_CASES) + len(SET_CASES) + len(REPLAY_CASES) >= 24


@pytest.mark.parametrize("case", RESUME_CASES, ids=[c.id for c in RESUME_CASES])
def test_a_bad_checkpoint_or_run_dir_exits_2_with_what_where_and_the_fix(case, finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    case.damage(run)
    result = cli.invoke(app, [a.format(run=run) for a in case.args])
    _assert_user_error(result, [s.format(run=run) for s in case.says], case.fix.format(run=run))


@pytest.mark.parametrize("case", REPLAY_CASES, ids=[c.id for c in REPLAY_CASES])
def test_a_damaged_replay_store_exits_2_with_what_where_and_the_fix(case, store_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(store_run, run)
    case.damage(run)
    result = cli.invoke(app, [a.format(run=run) for a in case.args])
    _assert_user_error(result, [s.format(run=run) for s in case.says], case.fix.format(run=run))


@pytest.mark.parametrize("make, says, fix", [c[1:] for c in RUN_CASES], ids=[c[0] for c in RUN_CASES])
def test_a_bad_model_eval_or_data_exits_2_with_what_where_and_the_fix(make, says, fix, tmp_path):
    spec = make(tmp_path)
    result = cli.invoke(app, ["run", str(spec), "--run-dir", str(tmp_path / "run"), "--executor", "local"])
    _assert_user_error(result, [s.format(tmp=tmp_path) for s in says], fix)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA GPU is here")
def test_a_policy_on_a_gpu_torch_cannot_see_exits_2_with_the_fix(tmp_path):
    spec = _spec_with(tmp_path, "data:", "policy: {model: tiny-arith, device: cuda}\ndata:")
    result = cli.invoke(app, ["run", str(spec), "--run-dir", str(tmp_path / "run"), "--executor", "local"])
    _assert_user_error(result, ["policy `tiny-arith` is to run on `cuda`, but torch", "sees no CUDA GPU"],
                       "or set `policy.device: cpu`")


@pytest.mark.parametrize("override, where, says, fix", [c[1:] for c in SET_CASES], ids=[c[0] for c in SET_CASES])
def test_a_bad_component_set_exits_2_with_what_where_and_the_fix(override, where, says, fix):
    result = cli.invoke(app, ["validate", QUICKSTART, "--set", override])
    _assert_user_error(result, [where, says], fix)
    assert result.output.startswith(where), result.output  # where comes first, as `file:line:` or `--set ...:`


def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    newer = run / "checkpoints" / "step-000003"
    shutil.copytree(run / CKPT, newer)
    _truncate(newer / MANIFEST)
    result = cli.invoke(app, ["resume", str(run), "--steps", "3", "--executor", "local"])
    assert result.exit_code == 0, result.output
    assert f"warning: skipped a damaged checkpoint: {newer}/manifest.json is truncated" in result.output
    assert (newer / MANIFEST).is_file() and json.loads((newer / MANIFEST).read_text())["step"] == 3  # rewritten


def test_a_bug_in_a_stage_exits_1_with_its_traceback(tmp_path, monkeypatch):
    def broken(self, groups):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(FakeUpdate, "prepare", broken)  # the runtime's trainer calls prepare, not run
    spec = tmp_path / "spec.yaml"
    spec.write_text(BASE)
    result = cli.invoke(app, ["run", str(spec), "--run-dir", str(tmp_path / "run"), "--executor", "local"])
    assert result.exit_code == 1, result.output
    assert "stage `update` failed at step 0" in result.output
    assert "Traceback" in result.output and "ZeroDivisionError: a bug" in result.output


@pytest.mark.parametrize("run_dir", ["given", "default"])
def test_a_run_failing_before_its_first_step_leaves_no_run_directory(tmp_path, monkeypatch, run_dir):
    """Nothing but the spec and run.json was written: the folder `gfcr run` made goes again (issue 40)."""
    def refuses(self, groups: RolloutGroups) -> UpdateReport:
        raise EvalError("the eval set `x` has no answers", "give every eval row an answer")

    monkeypatch.setattr(FakeUpdate, "prepare", refuses)  # the runtime's trainer calls prepare, not run
    monkeypatch.chdir(tmp_path)
    (tmp_path / "spec.yaml").write_text(BASE)
    args = ["--run-dir", str(tmp_path / "run")] if run_dir == "given" else []
    result = cli.invoke(app, ["run", "spec.yaml", "--executor", "local", *args])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    left = [p.relative_to(tmp_path) for p in tmp_path.rglob("*")]
    assert sorted(map(str, left)) == (["runs", "spec.yaml"] if run_dir == "default" else ["spec.yaml"])


def test_a_run_failing_after_its_first_step_keeps_its_run_directory(tmp_path, monkeypatch):
    calls = []

    def refuses_the_second(self, groups: RolloutGroups, _prepare=FakeUpdate.prepare) -> Any:
        calls.append(1)
        if len(calls) > 1:
            raise EvalError("the eval set `x` has no answers", "give every eval row an answer")
        return _prepare(self, groups)

    monkeypatch.setattr(FakeUpdate, "prepare", refuses_the_second)
    (tmp_path / "spec.yaml").write_text(BASE)
    result = cli.invoke(app, ["run", str(tmp_path / "spec.yaml"), "--run-dir", str(tmp_path / "run"),
                              "--executor", "local"])
    assert result.exit_code == 2, result.output
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1


def test_a_user_error_met_inside_a_stage_exits_2_naming_the_stage(tmp_path, monkeypatch):
    def refuses(self, groups):
        raise EvalError("the eval set `x` has no answers", "give every eval row an answer")

    monkeypatch.setattr(FakeUpdate, "prepare", refuses)
    spec = tmp_path / "spec.yaml"
    spec.write_text(BASE)
    result = cli.invoke(app, ["run", str(spec), "--run-dir", str(tmp_path / "run"), "--executor", "local"])
    _assert_user_error(result, ["stage `update` failed at step 0 of run run:", "the eval set `x` has no answers"],
                       "give every eval row an answer")
