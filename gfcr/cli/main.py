"""``gfcr``'s entry point: pyproject's ``gfcr = "gfcr.cli.main:app"`` and ``python -m gfcr.cli.main``.

The app and its commands are in ``gfcr.cli.app``; nothing imports this module back.
"""

from gfcr.cli.app import app

__all__ = ["app"]

if __name__ == "__main__":
    app()
