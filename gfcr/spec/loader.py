"""Loading specs: YAML file or Python data -> overrides -> schema -> references.

Every problem found is collected and raised together as one ``SpecError``. Stage names
(``use``) and stage configs (``with``) need the registry and are checked one layer up, by
``gfcr.graph.compile_pipeline``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable

from pydantic import ValidationError

from gfcr.errors import Location, Problem, SpecError, did_you_mean, known
from gfcr.spec.models import UPDATE_ID, PipelineSpec, resolve_plugin_path
from gfcr.spec.overrides import ConfigKeys, apply_overrides
from gfcr.spec.problems import dotted, problems_from_validation
from gfcr.spec.yaml_source import SourceMap, parse_yaml


RawChecks = Callable[[Any, SourceMap], list[Problem]]
# (entry kind, name) -> the key paths under its `with` that hold a file or folder path: kind
# "stage" with a stage alias, "data" with a data source name; given by the graph layer
PathKeys = Callable[[str, str], "list[tuple[str, ...]]"]


def load_spec(path: str | Path, overrides: Iterable[str] = (), raw_checks: RawChecks | None = None,
              plugins: Iterable[str] = (), config_keys: ConfigKeys | None = None,
              path_keys: PathKeys | None = None) -> PipelineSpec:
    """Read a pipeline YAML file (a path, or the name of a shipped pipeline: ``quickstart``), apply
    ``--set`` overrides, add the ``--plugin`` modules to its ``plugins`` and validate it."""
    path = pipeline_path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        hint = did_you_mean(str(path), shipped_pipelines())
        raise SpecError([Problem(Location(str(path)), "", f"cannot read the file: {exc.strerror}",
                                 f"{hint + ' (a shipped pipeline); ' if hint else ''}check the path, or name a "
                                 "shipped pipeline (`gfcr run quickstart`; they are the files of `pipelines/`)")]
                        ) from None
    return load_spec_text(text, str(path), overrides, raw_checks, plugins, config_keys, path_keys)


def shipped_pipelines() -> dict[str, Path]:
    """The pipelines of gfcr's ``pipelines/`` folder by name: ``quickstart``, ``examples/fake_dapo``.
    The folder is the checkout's, beside the package (``pip install -e .``, as the Makefile does)."""
    folder = Path(__file__).resolve().parents[2] / "pipelines"
    found = {p.stem: p for p in sorted(folder.glob("*.yaml"))}
    found.update({f"examples/{p.stem}": p for p in sorted(folder.glob("examples/*.yaml"))})
    return found


def pipeline_path(name_or_path: str | Path) -> Path:
    """``name_or_path`` itself when a file is there, else the shipped pipeline of that name (if any)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    return shipped_pipelines().get(str(name_or_path).removesuffix(".yaml"), path)


def load_spec_text(text: str, file: str | None = None, overrides: Iterable[str] = (),
                   raw_checks: RawChecks | None = None, plugins: Iterable[str] = (),
                   config_keys: ConfigKeys | None = None, path_keys: PathKeys | None = None) -> PipelineSpec:
    data, source, problems = parse_yaml(text, file)
    if data is None and not problems:
        problems.append(Problem(Location(file, 1, 1), "", "the file is empty",
                                "a pipeline needs at least `name`, `data`, `stages` and `update`"))
    elif data is not None and not isinstance(data, dict):
        problems.append(Problem(source.locate(()), "", "a pipeline file must be a mapping of keys",
                                "start with `name: ...` at the top level"))
    if problems:
        raise SpecError(problems)
    return build_spec(data, source, overrides, raw_checks, plugins, config_keys, path_keys)


def build_spec(data: dict[str, Any], source: SourceMap | None = None, overrides: Iterable[str] = (),
               raw_checks: RawChecks | None = None, plugins: Iterable[str] = (),
               config_keys: ConfigKeys | None = None, path_keys: PathKeys | None = None) -> PipelineSpec:
    """Validate plain data (from YAML or Python) into a ``PipelineSpec``.

    ``raw_checks`` (given by the graph layer, which knows the registries) adds its problems
    when the schema fails, so that all of a file's problems are reported together;
    ``config_keys`` (likewise) lets a stage swap by ``--set`` drop the old stage's keys
    (``gfcr.spec.overrides``); ``path_keys`` (likewise) names the ``with`` keys that hold paths,
    which ``resolve_paths`` makes absolute.

    >>> spec = build_spec({"name": "demo", "data": {"source": "arithmetic"},
    ...     "stages": {"pick": {"use": "control.uniform", "with": {"batch_size": 4}}},
    ...     "update": {"use": "update.fake", "from": "pick"}})
    >>> spec.stages["pick"].use
    'control.uniform'
    """
    source = source or SourceMap()
    data = _copy(data)
    problems = apply_overrides(PipelineSpec, data, source, list(overrides), config_keys)
    add_plugins(data, source, list(plugins))
    if path_keys is not None:
        resolve_paths(data, source, path_keys)
    try:
        spec = PipelineSpec.model_validate(data)
    except ValidationError as exc:
        spec = None
        problems += problems_from_validation(exc, PipelineSpec, data, source)
    if spec is not None:
        problems += check_references(spec, source)
    if problems:
        raise SpecError(problems + (raw_checks(data, source) if raw_checks else []))
    spec._source = source
    return spec


def _base(source: SourceMap, path: tuple) -> Path:
    """The folder a relative path written at ``path`` is relative to: the pipeline file's, or the
    current directory for a value set by ``--set`` or a spec built in Python."""
    where = source.locate(path)
    return Path(where.file).parent if source.file and where.file == source.file else Path.cwd()


def _absolute(value: Any, base: Path) -> Any:
    if not isinstance(value, str) or not value or value.startswith(("s3://", "http://", "https://")):
        return value
    path = Path(value).expanduser()  # links kept: the folder a user named is the one shown
    return value if path.is_absolute() else os.path.normpath(base.absolute() / path)


def resolve_paths(data: dict[str, Any], source: SourceMap, path_keys: PathKeys) -> None:
    """The one rule for paths in a spec: a relative path is relative to the pipeline file's folder
    (the current directory for ``--set`` values and specs built in Python). Each path a stage or
    data source declares (``FilePath``) and a local ``policy.model`` folder is made absolute in
    ``data``, so the run directory's copy of the spec finds the same files."""
    entries = [("stage", ("stages", sid), e) for sid, e in (data.get("stages") or {}).items()] \
        if isinstance(data.get("stages"), dict) else []
    entries += [("stage", ("update",), data.get("update")), ("data", ("data",), data.get("data")),
                ("data", ("eval",), data.get("eval"))]
    for kind, where, entry in entries:
        name = entry.get("use" if kind == "stage" else "source") if isinstance(entry, dict) else None
        values = entry.get("with") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not isinstance(values, dict):
            continue
        for keys in path_keys(kind, name):
            holder = values
            for key in keys[:-1]:
                holder = holder.get(key) if isinstance(holder, dict) else None
            if isinstance(holder, dict) and keys[-1] in holder:
                holder[keys[-1]] = _absolute(holder[keys[-1]], _base(source, (*where, "with", *keys)))
    policy = data.get("policy")
    model = policy.get("model") if isinstance(policy, dict) else None
    if isinstance(model, str) and (set(model) & {"/", "\\"} or model.startswith((".", "~"))):
        policy["model"] = _absolute(model, _base(source, ("policy", "model")))


def add_plugins(data: dict[str, Any], source: SourceMap, extra: list[str]) -> None:
    """Append the ``--plugin`` modules to ``data["plugins"]`` (once each, located at the option),
    and make its relative ``.py`` paths absolute: the file's against the pipeline file's folder,
    the option's against the current directory."""
    listed = data.get("plugins")
    if not isinstance(listed, list):
        if extra and listed is None:
            listed = data["plugins"] = []
        else:
            return  # not a list: the schema says so
    base = Path(source.file).parent if source.file else None
    listed[:] = [resolve_plugin_path(p, base) if isinstance(p, str) else p for p in listed]
    for ref in extra:
        ref = resolve_plugin_path(ref, None)
        if ref not in listed:
            source.spans[("plugins", len(listed))] = Location(f"--plugin {ref}")
            listed.append(ref)


def _copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_copy(v) for v in data]
    return data


def check_references(spec: PipelineSpec, source: SourceMap) -> list[Problem]:
    """Every ``from`` names a stage or loop; loops name their members; ids do not collide."""
    problems: list[Problem] = []

    def add(path: tuple, message: str, fix: str | None) -> None:
        problems.append(Problem(source.locate(path), dotted(path), message, fix))

    if UPDATE_ID in spec.stages:
        add(("stages", UPDATE_ID), f"`{UPDATE_ID}` is reserved for the update node",
            "rename this stage; the update goes under the top-level `update:` key")
    readable = set(spec.stages) | set(spec.loops)
    for sid, stage in spec.all_stages().items():
        base = ("stages", sid) if sid != UPDATE_ID else (UPDATE_ID,)
        for key, ref in _refs(stage.from_):
            if ref == UPDATE_ID:
                add(base + ("from",) + key, "no stage may read the update's output",
                    "the update is the sink; stages learn from it through `observe`")
            elif ref == sid:
                add(base + ("from",) + key, f"stage `{sid}` reads its own output",
                    "remove it; to iterate, use a loop block (`loops:`)")
            elif ref not in readable:
                add(base + ("from",) + key, f"`{ref}` is not a stage or loop of this pipeline",
                    did_you_mean(ref, readable) or f"name one of {known(readable)}")
        for i, ref in enumerate(stage.in_flight):
            if ref not in spec.stages or ref == sid:
                others = [s for s in spec.stages if s != sid]
                add(base + ("in_flight", i), f"`{ref}` is not another stage of this pipeline",
                    did_you_mean(ref, others) or f"name an in-flight controller stage, e.g. "
                    f"`stop: {{use: control.stop_at_target, with: {{groups: 8}}}}`")
    seen: dict[str, str] = {}
    for name, loop in spec.loops.items():
        if name in spec.stages:
            add(("loops", name), f"loop `{name}` has the same name as a stage",
                "give the loop a name of its own")
        for i, member in enumerate(loop.stages):
            if member not in spec.stages:
                add(("loops", name, "stages", i), f"`{member}` is not a stage of this pipeline",
                    did_you_mean(member, spec.stages) or f"name one of {known(spec.stages)}")
            elif member in seen:
                add(("loops", name, "stages", i), f"`{member}` is already in loop `{seen[member]}`",
                    "a stage belongs to at most one loop block")
            seen.setdefault(member, name)
        if loop.until not in loop.stages:
            add(("loops", name, "until"), f"the until stage `{loop.until}` is not in this loop's `stages`",
                did_you_mean(loop.until, loop.stages) or f"name one of {known(loop.stages)}")
    return problems


def _refs(value: Any) -> list[tuple[tuple, str]]:
    """(key path below `from`, referenced id) pairs."""
    if value is None:
        return []
    if isinstance(value, str):
        return [((), value)]
    if isinstance(value, list):
        return [((i,), v) for i, v in enumerate(value)]
    return [((k,), v) for k, v in value.items()]
