"""Checks made before a run depends on something outside it: its inputs (``inputs``: data files,
the policy model) and servers (``endpoint``: a bounded probe of an http(s) endpoint)."""
