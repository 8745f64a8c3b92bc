"""Plugins: a user's own modules that register stages (or data sources, or update components)
when imported, named by a pipeline's ``plugins:`` key or the CLI's ``--plugin``.

A plugin is a module name (``my_stages``, ``my_pkg.stages``) or the path of a ``.py`` file
(``stages/max_solve_rate.py``). A module name is imported from the Python path, with the
pipeline file's folder and the current directory added at its end, so a module beside the
pipeline needs no install; a file is imported from its path (a relative one is read from the
pipeline file's folder, from the current directory for ``--plugin``) as a module named after
the file. Importing it runs its ``@STAGES.register(alias)`` decorators, so its stages are
checked by the registry (the near-miss rule, collisions) as they register.

An installed package declares its stages in the ``gfcr.stages`` entry-point group instead, and
needs no plugin entry (docs/writing-a-stage.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from gfcr.errors import RegistryError
from gfcr.spec.models import PLUGIN_FORMS, is_plugin_ref, resolve_plugin_path


def import_plugin(ref: str, base: Path | None = None) -> ModuleType:
    """Import the plugin ``ref`` (see the module docstring); ``base`` is the pipeline file's folder.
    Raises ``RegistryError`` saying what failed and how to fix it."""
    if not is_plugin_ref(ref):
        raise RegistryError(f"plugin `{ref}` is neither a module name nor a `.py` file", f"give {PLUGIN_FORMS}")
    if ref.endswith(".py"):
        return _import_file(Path(resolve_plugin_path(ref, base)), ref)
    for folder in (base, Path.cwd()):
        if folder is not None and str(folder.resolve()) not in sys.path:
            sys.path.append(str(folder.resolve()))  # at the end: an installed module of the same name wins
    try:
        return importlib.import_module(ref)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (ref == exc.name or ref.startswith(exc.name + ".")):
            raise RegistryError(f"plugin `{ref}`: no module named `{exc.name}`",
                                f"put `{ref.replace('.', '/')}.py` beside the pipeline file or in the current "
                                "directory, install its package, or give the path of its `.py` file") from None
        raise _failed(ref, exc) from exc
    except RegistryError:
        raise  # a stage it registers broke a rule: the registry's message says which and how to fix it
    except Exception as exc:  # its code raised while importing: say so, with where
        raise _failed(ref, exc) from exc


def _import_file(path: Path, ref: str) -> ModuleType:
    if not path.is_file():
        raise RegistryError(f"plugin `{ref}`: no such file ({path})",
                            "check the path: a relative one is read from the pipeline file's folder "
                            "(from the current directory for --plugin)")
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded  # imported before (another pipeline of this process, a resumed run)
    if loaded is not None:
        raise RegistryError(f"plugin `{ref}`: a module named `{name}` is already imported "
                            f"({getattr(loaded, '__file__', None) or 'built in'})",
                            "rename the file, so that its module name is its own")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: doctests and pickles find the module by name
    try:
        spec.loader.exec_module(module)
    except RegistryError:
        del sys.modules[name]
        raise
    except Exception as exc:
        del sys.modules[name]
        raise _failed(ref, exc) from exc
    return module


def _failed(ref: str, exc: BaseException) -> RegistryError:
    where = ""
    tb = exc.__traceback__
    while tb is not None:  # the innermost frame: the plugin's line (or the library it called)
        where = f" ({tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})"
        tb = tb.tb_next
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f" ({exc.filename}:{exc.lineno})"
    shows = f"`python {ref}`" if ref.endswith(".py") else f"`python -c 'import {ref}'`"
    return RegistryError(f"plugin `{ref}` failed to import: {type(exc).__name__}: {exc}{where}",
                         f"fix the error in the plugin module; {shows} shows its traceback")


def import_plugins(refs: list[str] | tuple[str, ...], base: Path | None = None) -> list[ModuleType]:
    """Import every plugin of ``refs`` in order (the CLI's ``--plugin`` for commands without a pipeline)."""
    return [import_plugin(ref, base) for ref in refs]
