"""What a stage's docstrings say about it, for ``gfcr stages ALIAS``: read from the module
docstring (and the class's), so a new stage shows up without anyone editing a list.

- ``what``: the module docstring's first paragraph, without its leading ``<alias>:`` (the
  class docstring's, for a module that holds several stages);
- ``paper``: the first sentence that cites an arXiv id, or None;
- ``fidelity``: the first sentence that says how closely it follows its source (one that
  mentions the abstract, a transcription, or what it was checked against), or None;
- ``yaml``: the ``.. code-block:: yaml`` examples, dedented (the conformance tests run them).

Example:

>>> from gfcr.registry import stage_info
>>> doc = stage_doc("control.vade", stage_info("control.vade").cls)
>>> doc.what.startswith("a non-stationary bandit over prompts")
True
>>> "arXiv 2511.18902" in doc.paper, doc.fidelity.startswith("Only the abstract could be read")
(True, True)
>>> "use: control.vade" in doc.yaml[0]
True
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

_YAML_BLOCK = re.compile(r"\.\. code-block:: yaml\n\n((?:(?:    .*)?\n)+)")
_SENTENCE_END = re.compile(r"(?<=[^\s.]{3})\.(?:\s+|$)")  # not after "e.g." or "et al."
_FIDELITY = re.compile(r"abstract|transcription|checked against", re.IGNORECASE)


@dataclass(frozen=True)
class StageDoc:
    what: str
    paper: str | None
    fidelity: str | None
    yaml: tuple[str, ...]


def stage_doc(alias: str, cls: type) -> StageDoc:
    """What the stage ``alias`` (class ``cls``) does, what it cites, and how faithfully."""
    paragraphs = _paragraphs(inspect.getdoc(inspect.getmodule(cls)) or "")
    own = paragraphs and paragraphs[0].startswith(f"{alias}:")
    if not own:  # a module of several stages (the test stages): the class says what it does
        paragraphs = _paragraphs(inspect.getdoc(cls) or "")
    sentences = [_unprefixed(s, alias) for p in paragraphs for s in _sentences(p)]
    paper = _first(sentences, re.compile(r"arXiv"))
    fidelity = _first(sentences, _FIDELITY)
    return StageDoc(what=_unprefixed(paragraphs[0], alias) if paragraphs else "", paper=paper,
                    fidelity=None if fidelity == paper else fidelity, yaml=yaml_examples(cls))


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
