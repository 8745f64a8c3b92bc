"""Drawing a compiled pipeline with Graphviz: stages coloured by family, loop blocks as boxes,
feedback edges dashed, edges labelled with their port type; an in-flight controller is drawn
beside its generate stage with a dashed edge labelled ``in flight``.

DOT needs only the ``graphviz`` Python package; PNG and SVG also need Graphviz's ``dot``
program (Debian/Ubuntu: ``apt-get install graphviz``; macOS: ``brew install graphviz``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import graphviz

from gfcr.errors import GfcrError
from gfcr.graph.model import CompiledPipeline, LoopBlock
from gfcr.records import PromptPool

FAMILY_COLOURS = {
    "control": "#cfe2ff",
    "generate": "#d1f0d1",
    "filter": "#ffe5b4",
    "replay": "#e6d6f5",
    "update": "#f8c8c8",
}
FORMATS = ("dot", "svg", "png")


def to_dot(pipeline: CompiledPipeline) -> graphviz.Digraph:
    dot = graphviz.Digraph(pipeline.spec.name, graph_attr={"rankdir": "LR", "label": pipeline.spec.name,
                                                           "labelloc": "t", "fontname": "Helvetica"},
                           node_attr={"shape": "box", "style": "rounded,filled", "fontname": "Helvetica"},
                           edge_attr={"fontname": "Helvetica", "fontsize": "10"})

    def add_node(graph: graphviz.Digraph, sid: str) -> None:
        node = pipeline.nodes[sid]
        label = f"{sid}\n{node.info.alias}" + ("\n(test stage)" if node.info.testing else "")
        style = "rounded,filled,dashed" if node.info.testing else "rounded,filled"
        graph.node(sid, label, fillcolor=FAMILY_COLOURS[node.info.family], style=style)

    if any(p.type is PromptPool for n in pipeline.nodes.values() for p in n.info.inputs):
        dot.node("__data__", f"data: {pipeline.data.name}", shape="cylinder", style="filled", fillcolor="#eeeeee")
    for item in pipeline.plan:
        if isinstance(item, LoopBlock):
            with dot.subgraph(name=f"cluster_{item.name}") as box:
                box.attr(label=f"loop {item.name}: until {item.until}, at most {item.max_rounds} rounds",
                         style="rounded,dashed", color="#555555")
                for sid in item.body:
                    add_node(box, sid)
        else:
            add_node(dot, item)
    for sid, node in pipeline.nodes.items():
        if not node.runs:
            add_node(dot, sid)
    for sid, node in pipeline.nodes.items():
        if any(p.type is PromptPool for p in node.runtime_inputs):
            dot.edge("__data__", sid, label="PromptPool", style="dotted")
        for ctrl in node.in_flight:
            dot.edge(ctrl, sid, label="in flight", style="dashed", arrowhead="odot")
        for b in node.bindings:
            dot.edge(b.source, sid, label=b.type.__name__ + (" (previous round)" if b.feedback else ""),
                     style="dashed" if b.feedback else "solid", constraint="false" if b.feedback else "true")
    return dot


def render(pipeline: CompiledPipeline, out: str | Path) -> Path:
    """Write the pipeline's drawing to ``out``; the format is the file's suffix (dot, svg, png)."""
    out = Path(out)
    fmt = out.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise GfcrError(f"cannot draw to `{out}`: unknown format `{fmt}`; use a .dot, .svg or .png file name")
    source = to_dot(pipeline).source
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "dot":
        out.write_text(source, encoding="utf-8")
        return out
    exe = shutil.which("dot")
    if exe is None:
        raise GfcrError(f"drawing {fmt.upper()} needs Graphviz's `dot` program, which is not installed; "
                        "install it (apt-get install graphviz, or brew install graphviz), or write a .dot file")
    subprocess.run([exe, f"-T{fmt}", "-o", str(out)], input=source.encode(), check=True)
    return out
