"""What several stage families share: one concept per module, imported by the families, which
never import each other (the import-linter independence contract in ``pyproject.toml``)."""
