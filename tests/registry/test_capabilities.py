"""Stages say what they are; nobody asks which alias another stage has, or probes it by name.

- Every ``getattr``/``hasattr`` with a literal name in the stage, runtime and graph layers reads a
  name some Protocol declares (the lifecycle roles and capabilities of
  ``gfcr/registry/lifecycle.py``, the components' extension points of
  ``gfcr/registry/components.py``, the engine and verifier Protocols), or an attribute of a
  third-party object listed below with the reason.
- A stage's Config with a near miss of a capability name is refused at registration.
- ``PipelineView.having`` finds the stages by what their Configs declare.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gfcr.errors import GraphError, RegistryError
from gfcr.graph import load_pipeline
from gfcr.registry import (STAGES, BuildsTrees, FixesGroupSize, RecordsEntropy, SizesEachGroup, StageConfig,
                           declares, make_stage_registry)
from gfcr.records import Allocation, RolloutGroups

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("gfcr/stages", "gfcr/runtime", "gfcr/graph")

# attributes of objects gfcr does not define, read where they may be missing
NOT_CAPABILITIES = {
    "strerror": "OSError's errno text (runtime/endpoint.py)",
    "pid": "a Prefect server process handle, absent before it starts (runtime/server_guard.py)",
    "_run_uvicorn_command": "Prefect's server launcher, whose private name the guard wraps when present",
    "__name__": "a verifier function's name in an error message",
    "task_runs": "the Prefect runner's count of task runs, absent on the local runner",
    "get_embedding_dimension": "sentence-transformers' newer name (older versions: get_sentence_embedding_dimension)",
    "pidfd_open": "os.pidfd_open, on Linux only",
}


def _protocol_names() -> set[str]:
    """Every member a ``Protocol`` class declares anywhere in gfcr (annotations and methods)."""
    names: set[str] = set()
    for path in (REPO / "gfcr").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(_named(b, "Protocol") for b in node.bases):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(item.target.id)
    return names


def _named(node: ast.expr, name: str) -> bool:
    return (isinstance(node, ast.Name) and node.id == name) or (isinstance(node, ast.Attribute) and node.attr == name)


def _probes() -> list[tuple[str, int, str]]:
    """``(file, line, name)`` of every getattr/hasattr with a literal attribute name."""
    found = []
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                        and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                    found.append((str(path.relative_to(REPO)), node.lineno, node.args[1].value))
    return found


def test_no_capability_is_found_by_a_name_no_protocol_declares():
    declared = _protocol_names()
    stray = [f"{f}:{line}: `{name}`" for f, line, name in _probes()
             if name not in declared and name not in NOT_CAPABILITIES]
    assert not stray, "declare these as a Protocol's members (gfcr/registry/lifecycle.py) and test with isinstance:\n" \
                      + "\n".join(stray)


def test_the_scan_sees_a_probe():
    """The scan is not vacuous: it finds the literal names the layers still probe for."""
    assert {name for _, _, name in _probes()} & set(NOT_CAPABILITIES)


class _Generator:
    """A generate stage for the test."""

    class Config(StageConfig):
        entropy: bool = False

    def run(self, allocation: Allocation) -> RolloutGroups:
        return RolloutGroups([])


def test_a_config_with_a_near_miss_of_a_capability_is_refused_at_registration():
    class Typo(_Generator):
        class Config(StageConfig):
            record_entropy: bool = True  # a near miss of records_entropy: no check would ever read it

    registry = make_stage_registry(builtins=False, entry_points=False)
    with pytest.raises(RegistryError) as err:
        registry.register("generate.typo", Typo)
    assert "its Config defines `record_entropy`, which is not a capability" in err.value.message
    assert "did you mean `records_entropy`?" in err.value.fix

    class Exact(_Generator):
        class Config(StageConfig):
            records_entropy: bool = True

    registry.register("generate.exact", Exact)
    assert declares(registry.get("generate.exact").Config, RecordsEntropy)


@pytest.mark.parametrize(("alias", "capability"), [
    ("control.fixed_n", FixesGroupSize), ("control.mc_grpo", FixesGroupSize), ("control.dars", SizesEachGroup),
    ("control.xrpo", SizesEachGroup), ("generate.sample", RecordsEntropy), ("generate.partial", RecordsEntropy),
    ("generate.tree", BuildsTrees), ("generate.tree", RecordsEntropy),
])
def test_the_builtin_stages_declare_what_they_do(alias, capability):
    assert declares(STAGES.get(alias).Config, capability)


def test_checks_read_capabilities_not_aliases():
    """control.early_exit's check finds the fixed group size through the capability, so it reads
    control.mc_grpo's G + 1 as it reads control.fixed_n's n, and says which key to raise."""
    path = REPO / "pipelines" / "early_exit_arith.yaml"
    load_pipeline(path, ["tracking.mlflow=null"])  # 16 rows a prompt, 8 kept: fine
    with pytest.raises(GraphError) as err:
        load_pipeline(path, ["tracking.mlflow=null", "stages.budget.use=control.mc_grpo", "stages.budget.with={g: 7}"])
    text = str(err.value)
    assert "`budget` (control.mc_grpo) allocates 8 rows a prompt" in text
    assert "oversample: set `budget`'s `g` above 7 (ARRoL's 2x: 15)" in text
