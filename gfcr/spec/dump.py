"""Writing specs back to YAML, readable and in the author's key order."""

from __future__ import annotations

from typing import Any

import yaml


class _Dumper(yaml.SafeDumper):
    pass


def _short_lists(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = all(not isinstance(x, (dict, list)) for x in data) and len(data) <= 8
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


def _strings(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    # quote strings that the loader's YAML 1.2 rules, or YAML 1.1 readers, would take for other types
    quote = data.lower() in {"yes", "no", "on", "off", "y", "n", "null", "~", "true", "false"}
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="'" if quote else None)


_Dumper.add_representer(list, _short_lists)
_Dumper.add_representer(str, _strings)


def dump_yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True)
