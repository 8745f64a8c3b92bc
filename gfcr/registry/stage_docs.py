"""What a stage's docstrings say about it, for ``gfcr stages`` and ``docs/stages.md``: read from
the module docstring (and the class's), so a new stage shows up without anyone editing a list.

- ``what``: the module docstring's first paragraph, without its leading ``<alias>:`` (the
  class docstring's, for a module that holds several stages);
- ``paper``: the first sentence that cites an arXiv id, or None (the ``Deviations`` and
  ``Fidelity:`` paragraphs left out: an id there says how the stage relates to a paper, not
  which one it implements; ``fidelity`` shows the latter);
- ``fidelity``: the stage's ``Fidelity:`` paragraph, parsed (``parse_fidelity``), or None when
  it has none (every built-in states it; the conformance kit's ``check_fidelity`` holds a
  plugin's stage to it too);
- ``yaml``: the ``.. code-block:: yaml`` examples, dedented (the conformance tests run them).

The ``Fidelity:`` paragraph (in the module docstring, or the class's) starts with one of four
fixed forms, then may say more (what is and is not compared, what was chosen)::

    Fidelity: checked against <owner>/<repo>@<commit>: N/M cases[, K documented deviation(s)]
    Fidelity: public code at <owner>/<repo>@<commit>; reference cases pending
    Fidelity: from the abstract: no public code
    Fidelity: gfcr's own: <what it is>

``checked against`` is exactly the line ``tests.fidelity.cases.status`` writes for a case file
(``tests/fidelity/<method>.json``, ``"stage": "<alias>"``), and a test holds the two equal; a
stage checked against several references lists one ``checked against`` claim per case file.

Example:

>>> from gfcr.registry import stage_info
>>> doc = stage_doc("control.vade", stage_info("control.vade").cls)
>>> doc.what.startswith("a non-stationary bandit over prompts")
True
>>> "arXiv 2511.18902" in doc.paper, doc.fidelity.kind, doc.fidelity.label
(True, 'abstract', 'from the abstract')
>>> "use: control.vade" in doc.yaml[0]
True
>>> f = parse_fidelity("checked against Infini-AI-Lab/GRESO@b277843: 34/36 cases, 2 documented deviations "
...                    "(the skip rule).")
>>> f.kind, f.label, f.checks[0].repository, f.checks[0].deviations
('checked', 'checked 34/36', 'Infini-AI-Lab/GRESO', 2)
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

_YAML_BLOCK = re.compile(r"\.\. code-block:: yaml\n\n((?:(?:    .*)?\n)+)")
_SENTENCE_END = re.compile(r"(?<=[^\s.]{3})\.(?:\s+|$)")  # not after "e.g." or "et al."

_REPO = r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+"
_CHECK = re.compile(rf"checked against (?P<repo>{_REPO})@(?P<commit>[0-9a-f]{{7,40}}): (?P<passing>\d+)/(?P<total>\d+) "
                    r"cases(?:, (?P<dev>\d+) documented deviations?)?")
_PENDING = re.compile(rf"public code at (?P<repo>{_REPO})(?:@(?P<commit>[0-9a-f]{{7,40}}))?; reference cases pending")

# kind -> the fixed form its statement starts with, and the short label of the `gfcr stages` column
FORMS = {
    "checked": ("checked against <owner>/<repo>@<commit>: N/M cases[, K documented deviation(s)]", "checked"),
    "pending": ("public code at <owner>/<repo>@<commit>; reference cases pending", "code public, cases pending"),
    "abstract": ("from the abstract: no public code", "from the abstract"),
    "own": ("gfcr's own: <what it is>", "gfcr's own"),
}
_STARTS = {"checked": "checked against ", "pending": "public code at ", "abstract": "from the abstract: no public code",
           "own": "gfcr's own: "}


class FidelityError(ValueError):
    """A ``Fidelity:`` paragraph that does not start with one of the fixed forms."""


@dataclass(frozen=True)
class Check:
    """One ``checked against`` claim: the reference and how many of its cases gfcr passes."""

    repository: str
    commit: str
    passing: int
    total: int
    deviations: int

    @property
    def line(self) -> str:
        """The claim as written, the line ``tests.fidelity.cases.status`` makes from a case file."""
        plural = "s" if self.deviations != 1 else ""
        return (f"checked against {self.repository}@{self.commit}: {self.passing}/{self.total} cases"
                + (f", {self.deviations} documented deviation{plural}" if self.deviations else ""))


@dataclass(frozen=True)
class Fidelity:
    """Where a stage stands against its source: ``kind`` (``checked``, ``pending``, ``abstract``,
    ``own``), the whole statement (``text``), and each ``checked against`` claim in it."""

    kind: str
    text: str
    checks: tuple[Check, ...] = ()

    @property
    def label(self) -> str:
        """The short form of the ``gfcr stages`` column: ``checked 34/36``, ``from the abstract``."""
        if self.kind == "checked":
            return "checked " + ", ".join(f"{c.passing}/{c.total}" for c in self.checks)
        return FORMS[self.kind][1]

    @property
    def head(self) -> str:
        """The statement's fixed-form claims without the prose after them: ``checked against
        Infini-AI-Lab/GRESO@b277843: 34/36 cases, 2 documented deviations``."""
        if self.kind in ("checked", "pending"):
            claims = sorted([(m.start(), m.group(0)) for m in _CHECK.finditer(self.text)]
                            + [(m.start(), m.group(0)) for m in _PENDING.finditer(self.text)])
            return "; ".join(claim for _, claim in claims)
        return self.text if self.kind == "own" else _STARTS["abstract"]


@dataclass(frozen=True)
class StageDoc:
    what: str
    paper: str | None
    fidelity: Fidelity | None
    yaml: tuple[str, ...]
    fidelity_problem: str | None = None  # with ``strict=False``: why the statement was not parsed


def stage_doc(alias: str, cls: type, strict: bool = True) -> StageDoc:
    """What the stage ``alias`` (class ``cls``) does, what it cites, and how faithfully
    (FidelityError if its ``Fidelity:`` paragraph is not in a fixed form; with ``strict=False``,
    for a plugin's stage, its ``fidelity`` is None and ``fidelity_problem`` says why)."""
    module_doc, class_doc = inspect.getdoc(inspect.getmodule(cls)) or "", inspect.getdoc(cls) or ""
    paragraphs = _paragraphs(module_doc)
    own = paragraphs and paragraphs[0].startswith(f"{alias}:")
    if not own:  # a module of several stages (the test stages): the class says what it does
        paragraphs = _paragraphs(class_doc)
    cited = [p for p in paragraphs if not p.startswith(("Deviations", "Fidelity:"))]  # how it differs: no citation
    sentences = [_unprefixed(s, alias) for p in cited for s in _sentences(p)]
    paper = _first(sentences, re.compile(r"arXiv"))
    statement = fidelity_statement(class_doc) or fidelity_statement(module_doc)
    fidelity, problem = None, None
    try:
        fidelity = None if statement is None else parse_fidelity(statement, where=alias)
    except FidelityError as exc:
        if strict:
            raise
        problem = str(exc)
    return StageDoc(what=_unprefixed(paragraphs[0], alias) if paragraphs else "", paper=paper,
                    fidelity=fidelity, yaml=yaml_examples(cls), fidelity_problem=problem)


def fidelity_statement(doc: str) -> str | None:
    """The text of ``doc``'s ``Fidelity:`` paragraph, on one line, or None."""
    for block in doc.split("\n\n"):
        text = " ".join(block.split())
        if text.startswith("Fidelity:"):
            return text.removeprefix("Fidelity:").strip()
    return None


def parse_fidelity(statement: str, where: str = "the docstring") -> Fidelity:
    """The structured form of a ``Fidelity:`` statement (the text after ``Fidelity:``)."""
    kind = next((k for k, start in _STARTS.items() if statement.startswith(start)), None)
    checks = tuple(Check(m["repo"], m["commit"], int(m["passing"]), int(m["total"]), int(m["dev"] or 0))
                   for m in _CHECK.finditer(statement))
    forms = "; ".join(f"`Fidelity: {form}`" for form, _ in FORMS.values())
    if kind is None or (kind == "checked" and not _CHECK.match(statement)) or (
            kind == "pending" and not _PENDING.match(statement)):
        raise FidelityError(f"{where}: `Fidelity: {statement[:80]}` is not in a fixed form; start it with one of {forms}")
    for c in checks:
        if c.passing + c.deviations != c.total:
            raise FidelityError(f"{where}: `checked against {c.repository}`: {c.passing} passing and {c.deviations} "
                                f"documented deviations do not add up to {c.total} cases; copy the line "
                                "`python scripts/fidelity_doc.py` checks (tests.fidelity.cases.status)")
    return Fidelity(kind, statement, checks)


def yaml_examples(cls: type) -> tuple[str, ...]:
    """The YAML examples of the module's and the class's docstrings, dedented."""
    docs = (inspect.getmodule(cls).__doc__ or "") + (cls.__doc__ or "")
    return tuple(inspect.cleandoc("\n" + block) for block in _YAML_BLOCK.findall(docs))


def _paragraphs(doc: str) -> list[str]:
    """The prose paragraphs, each on one line (doctest and YAML blocks left out)."""
    blocks = [" ".join(b.split()) for b in doc.split("\n\n")]
    return [b for b in blocks if b and not b.startswith((">>>", ".. ", "Example", "YAML"))]


def _sentences(paragraph: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(paragraph) if s.strip()]


def _unprefixed(text: str, alias: str) -> str:
    """``text`` without a leading ``<alias>:`` or list dash."""
    return text.removeprefix(f"{alias}:").removeprefix("- ").strip()


def _first(sentences: list[str], pattern: re.Pattern[str]) -> str | None:
    found = next((s for s in sentences if pattern.search(s)), None)
    return None if found is None else found.rstrip(".:") + "."
