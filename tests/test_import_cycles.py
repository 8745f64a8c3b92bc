"""No import cycle in gfcr/ (``scripts/import_cycles.py``), and the check finds the cycles it is for."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "import_cycles.py"


def _script():
    spec = importlib.util.spec_from_file_location("import_cycles", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def test_gfcr_has_no_import_cycle():
    """Checked everywhere, gfcr.stages and its families included (the script's EXCLUDED is empty)."""
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("no import cycle in gfcr/ ("), out.stdout


def test_the_check_lists_module_and_package_cycles(tmp_path, monkeypatch):
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from loopy import b\n",  # an import inside a function counts
        "b.py": "import loopy.a\n",
        "p/__init__.py": "", "p/x/__init__.py": "", "p/y/__init__.py": "",
        "p/x/one.py": "from loopy.p.y import two\n",
        "p/y/two.py": "", "p/y/three.py": "from loopy.p.x import four\n",
        "p/x/four.py": "",
    }
    for name, text in files.items():
        (tmp_path / "loopy" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "loopy" / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    script = _script()

    cycles, count = script.find_cycles("loopy")
    assert count == 10
    assert [(c.kind, c.members) for c in cycles] == [("module cycle", ["loopy.a", "loopy.b"]),
                                                     ("package cycle in loopy.p", ["loopy.p.x", "loopy.p.y"])]
    assert cycles[0].imports == ["loopy.a:2 imports loopy.b", "loopy.b:1 imports loopy.a"]
    assert cycles[1].describe() == ("package cycle in loopy.p (2 members): loopy.p.x -> loopy.p.y -> loopy.p.x\n"
                                    "    loopy.p.x.one:1 imports loopy.p.y.two\n"
                                    "    loopy.p.y.three:1 imports loopy.p.x.four")
    excluded, _ = script.find_cycles("loopy", excluded=("loopy.p",))  # not checked inside loopy.p
    assert [c.members for c in excluded] == [["loopy.a", "loopy.b"]]
