"""The update's components as ``gfcr stages --components`` and ``docs/update-catalog.md`` list
them, read from the registries (``ADVANTAGE_ESTIMATORS``, ``LOSSES``, ``AGGREGATIONS``,
``CORRECTIONS``, ``LR_RULES``) and from each component's own module docstring and Config, so a new component shows up without
anyone editing a list:

- ``paper``: the first arXiv id in the module docstring, or ``-``;
- ``changes``: the first sentence of the docstring after ``<kind> ``alias``:``, without the
  parentheses that cite arXiv ids (the ``paper`` column has the first of them);
- ``defaults``: every Config field as ``name=value`` (YAML values), or ``name (required)``;
- ``requires``: the class's ``requires`` Requirements, and whether it has a pipeline check
  (``pairing_problems``) that ``gfcr validate`` runs, both read through
  ``gfcr.registry.components``;
- ``fidelity``: every ``checked against <repo>@<commit>: N/M cases`` status of the docstring
  (one per reference-case file, ``docs/fidelity.md``), or its ``from the abstract: ...``
  statement, or ``not stated``;
- ``deviations``: the docstring's ``Deviations:`` paragraph (where the component differs from
  the paper or the reference code, and the setting that gives the reference's behaviour).

Example:

>>> info = next(i for i in component_infos()[0] if i.alias == "gapo")
>>> info.kind, info.paper, info.changes, info.defaults
('advantage', '2510.21830', "GAPO's adaptive-Q advantage", 'fraction=0.5, eps=1e-06')
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass

from pydantic_core import to_jsonable_python

from gfcr.errors import RegistryError
from gfcr.registry import catalog
from gfcr.registry.components import ChecksPairing, declared, provides

KINDS = {"advantage": "ADVANTAGE_ESTIMATORS", "loss": "LOSSES", "aggregation": "AGGREGATIONS",
         "correction": "CORRECTIONS", "lr_rule": "LR_RULES"}
COLUMNS = ("kind", "alias", "paper", "what it changes", "defaults", "requires", "fidelity")

_ARXIV = re.compile(r"arXiv[:\s]+(\d{4}\.\d{4,5})")
_CITATION = re.compile(r"\s*\([^()]*arXiv[^()]*\)")  # a parenthesis that cites an arXiv id
_ALIAS_PREFIX = re.compile(r"^\w+ ``[^`]+``:\s*")  # "advantage ``mean_std``: "
_SENTENCE_END = re.compile(r"(?<=[^\s.]{3})\.(?:\s|$)")  # not after "Dr." or "et al."
_STATUS = re.compile(r"checked against [\w.\-]+/[\w.\-]+@[0-9a-f]{7}: \d+/\d+ cases(?:, \d+ documented deviations?)?")
_ABSTRACT = re.compile(r"from the abstract: [^;.(]*")
_DEVIATIONS = re.compile(r"^Deviations\b.*?(?=\n\s*\n|\Z)", re.S | re.M)  # the paragraph, to its blank line


@dataclass(frozen=True)
class ComponentInfo:
    kind: str  # the update's key: advantage, loss, aggregation, correction or lr_rule
    alias: str
    paper: str
    changes: str
    defaults: str
    requires: str
    origin: str  # the package that registered it ("gfcr" for built-ins)
    fidelity: str = "not stated"
    deviations: str = ""

    def row(self) -> tuple[str, ...]:
        return self.kind, self.alias, self.paper, self.changes, self.defaults, self.requires, self.fidelity


def component_infos() -> tuple[list[ComponentInfo], dict[str, RegistryError]]:
    """Every registered component, by kind then alias, and those that failed to load, with why
    (keyed ``kind alias``): one broken plugin does not hide the others."""
    infos, broken = [], {}
    for kind, name in KINDS.items():
        registry = getattr(catalog, name)
        for alias in registry.names():
            try:
                infos.append(describe(kind, alias, registry.get(alias), registry.origin(alias)))
            except RegistryError as exc:
                broken[f"{kind} {alias}"] = exc
    return infos, broken


def describe(kind: str, alias: str, cls: type, origin: str = "gfcr") -> ComponentInfo:
    doc = inspect.getmodule(cls).__doc__ or cls.__doc__ or ""
    paper = _ARXIV.search(doc)
    return ComponentInfo(kind, alias, paper.group(1) if paper else "-", first_sentence(doc),
                         defaults(cls.Config), requirements(cls), origin, fidelity(doc), deviations(doc))


def fidelity(doc: str) -> str:
    """The docstring's fidelity statuses, ``; ``-joined (one per reference-case file)."""
    flat = " ".join(doc.split())
    found = _STATUS.findall(flat) or [m.strip() for m in _ABSTRACT.findall(flat)[:1]]
    return "; ".join(found) or "not stated"


def deviations(doc: str) -> str:
    """The docstring's ``Deviations:`` paragraph, its bullets kept one a line, in single backticks."""
    found = _DEVIATIONS.search(doc)
    if found is None:
        return ""
    lines, item = [], []
    for line in found.group(0).splitlines():
        if line.lstrip().startswith("- ") and item:
            lines.append(" ".join(item))
            item = []
        item.append(line.strip())
    lines.append(" ".join(item))
    return "\n".join(lines).replace("``", "`")


def first_sentence(doc: str) -> str:
    """The docstring's first sentence after its alias, without arXiv citations, in single backticks."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    text = _CITATION.sub("", _ALIAS_PREFIX.sub("", paragraph))
    return _SENTENCE_END.split(text, maxsplit=1)[0].rstrip(".").replace("``", "`")


def defaults(config: type) -> str:
    fields = [f"{name} (required)" if f.is_required() else
              f"{name}={json.dumps(to_jsonable_python(f.get_default(call_default_factory=True)))}"
              for name, f in config.model_fields.items()]
    return ", ".join(fields) or "-"


def requirements(cls: type) -> str:
    needs = [f"{r.kind} {' or '.join(r.allowed)}" for r in declared(cls, "requires")]
    if provides(cls, ChecksPairing):
        needs.append("pipeline checks (gfcr validate)")
    return "; ".join(needs) or "-"


def markdown_table(infos: list[ComponentInfo]) -> str:
    """The components as a Markdown table, arXiv ids linked, then each one's deviations."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for info in infos:
        paper = info.paper if info.paper == "-" else f"[{info.paper}](https://arxiv.org/abs/{info.paper})"
        cells = (info.kind, f"`{info.alias}`", paper, info.changes, info.defaults, info.requires, info.fidelity)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", "## Deviations", "", "Each component's `Deviations:` paragraph, as its docstring states it: where it "
              "differs from its paper or its reference code, and the setting that gives the reference's behaviour.", ""]
    for info in infos:
        lines.append(f"- **{info.kind} `{info.alias}`**: " + (deviations_markdown(info.deviations) or "not stated."))
    return "\n".join(lines) + "\n"


def deviations_markdown(text: str) -> str:
    """A ``Deviations:`` paragraph as one Markdown list item (its bullets nested under it)."""
    first, *rest = re.sub(r"^Deviations[^:]*:\s*", "", text).splitlines() or [""]
    if first.startswith("- "):  # a list of bullets: all of them nested under the component
        return "\n" + "\n".join("  " + line for line in [first, *rest])
    return "\n".join([first, *("  " + line for line in rest)])
