"""The error taxonomy: a fix on every GfcrError, rendered on its own line, and errors that pickle
(Prefect and Ray carry them between processes) whatever their constructor takes."""

from __future__ import annotations

import pickle

from gfcr.errors import (
    CheckpointError, DataError, EvalError, GfcrError, Location, ModelError, Problem, RegistryError, RunDirError,
    StageError,
)


def test_message_and_fix_are_fields_and_render_on_two_lines():
    exc = CheckpointError("runs/x/checkpoints/step-000002/manifest.json is truncated", "delete it")
    assert (exc.message, exc.fix) == ("runs/x/checkpoints/step-000002/manifest.json is truncated", "delete it")
    assert str(exc) == "runs/x/checkpoints/step-000002/manifest.json is truncated\n    fix: delete it"
    assert str(GfcrError("no fix")) == "no fix" and GfcrError("no fix").fix is None


def test_an_inline_fix_is_split_into_the_field():
    exc = GfcrError("a run directory is busy\n    fix: pick another --run-dir")
    assert (exc.message, exc.fix) == ("a run directory is busy", "pick another --run-dir")


def test_every_new_class_is_a_gfcr_error():
    for cls in (ModelError, RunDirError, CheckpointError, EvalError, RegistryError):
        assert issubclass(cls, GfcrError)


def test_errors_pickle_with_their_fields():
    problem = Problem(Location("rows.jsonl", 3), "", "missing field `answer`", "add it")
    for exc in (ModelError("no model", "install it"), DataError([problem]),
                StageError("pick", 2, "run-1", ModelError("no model", "install it"), round=1)):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc) and back.fix == exc.fix
    back = pickle.loads(pickle.dumps(StageError("pick", 2, "run-1", ValueError("x"))))
    assert (back.stage_id, back.step, back.round, str(back.cause), back.user_error) == ("pick", 2, None, "x", False)
    assert pickle.loads(pickle.dumps(DataError([problem]))).problems == [problem]
