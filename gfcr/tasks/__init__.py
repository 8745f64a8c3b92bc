"""Benchmark tasks shipped with gfcr: one YAML file per task (``<name>.yaml``), holding the
``policy``, ``data`` and ``eval`` sections a pipeline spec takes, for ``gfcr compare``."""
