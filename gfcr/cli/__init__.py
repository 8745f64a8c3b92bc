"""The ``gfcr`` command line."""
