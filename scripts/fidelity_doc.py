"""Write ``docs/fidelity.md``: per method, the reference it was checked against, its cases,
how many pass and how many are documented deviations (read from ``tests/fidelity/*.json``).

Command (from the repo root, after adding or regenerating a case file)::

    python scripts/fidelity_doc.py

``tests/fidelity/test_doc.py`` fails while the committed page differs from what this writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's gfcr and tests, even where another one is installed

from tests.fidelity.cases import fidelity_markdown  # noqa: E402

DOC = ROOT / "docs" / "fidelity.md"

if __name__ == "__main__":
    DOC.write_text(fidelity_markdown())
    print(f"wrote {DOC.relative_to(ROOT)}")
