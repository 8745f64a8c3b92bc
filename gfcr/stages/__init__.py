"""Stage implementations, one module per stage, grouped by GFCR family.

Stage modules import heavy dependencies (torch, engines) inside methods, never at module
level: ``gfcr validate`` imports stage modules to read their Configs and ports.
"""
