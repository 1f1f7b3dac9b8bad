"""The layout: every label measured from a monospace character width, then Graphviz's `dot`,
run in-process through pygraphviz (its wheels ship Graphviz)."""

from __future__ import annotations

import contextlib
import html
import io
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchlens._drawing.errors import LayoutEngineMissing
from torchlens._drawing.scene import Box, Mark, Node, Scene
from torchlens._drawing.style import (
    BOX_FILLS,
    COLORS,
    CW,
    FS,
    FS_SMALL,
    LH,
    LH_SMALL,
    PAD_X,
    PAD_Y,
    STATUS_STYLE,
)

if TYPE_CHECKING:
    pass


# -- measuring labels --------------------------------------------------------------------------


def text_w(text: str, size: int) -> float:
    return len(text) * CW * size


def mark_text(mark: Mark) -> str:
    return f"{mark.text} · {STATUS_STYLE[mark.status][2]}"


def lines_size(lines, marks) -> tuple[float, float]:
    w = max(
        [text_w(t, s) for t, s, _ in lines]
        + [text_w(mark_text(m), FS_SMALL) + 16 for m in marks]
        + [0]
    )
    h = sum(LH if s == FS else LH_SMALL for _, s, _ in lines) + len(marks) * (LH_SMALL + 4)
    return w, h


def measure(scene: Scene) -> None:
    for node in scene.nodes.values():
        w, h = lines_size(node.lines, node.marks)
        node.w = round(w + 2 * PAD_X + (4 if node.kind in ("input", "output") else 0), 1)
        node.h = round(h + 2 * PAD_Y, 1)


def box_label_size(box: Box) -> tuple[float, float]:
    w, h = lines_size(box.lines, box.marks)
    return round(w + 2 * PAD_X, 1), round(h + PAD_Y + 2, 1)


# -- layout ------------------------------------------------------------------------------------


def pygraphviz_module():
    try:
        import pygraphviz
    except ImportError as exc:
        raise LayoutEngineMissing(
            "Trace.draw lays the graph out with Graphviz through pygraphviz, which is not installed here "
            f"({exc}). In the TorchLens checkout, install the draw extra (pip install -e '.[draw]'), "
            "or install pygraphviz itself: its wheels ship Graphviz, so no system package is needed."
        ) from None
    return pygraphviz


def dot_graph(scene: Scene, with_text: bool):
    """The pygraphviz graph of the scene: fixed-size nodes and box labels (and, for PNG and PDF,
    their text, which Graphviz then renders itself)."""
    pgv = pygraphviz_module()
    g = pgv.AGraph(directed=True, strict=False)
    g.graph_attr.update(
        rankdir="TB",
        nodesep="0.14",
        ranksep="0.26",
        newrank="true",
        outputorder="edgesfirst",
        fontname="Courier",
        pad="0",
    )
    g.node_attr.update(
        shape="box", fixedsize="true", fontname="Courier", fontsize=str(FS_SMALL), margin="0"
    )
    g.edge_attr.update(arrowsize="0.6", color=COLORS["edge"])
    subgraphs: dict[str, Any] = {}

    def holder(box):
        if box is None:
            return g
        sg = subgraphs.get(box.id)
        if sg is None:
            parent = holder(box.parent)
            w, h = box_label_size(box)
            text = (
                f'<FONT POINT-SIZE="{FS_SMALL}">'
                + "<BR/>".join(html.escape(t) for t, _, _ in box.lines)
                + "</FONT>"
                if with_text
                else " "
            )
            label = (
                f'<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="0"><TR>'
                f'<TD FIXEDSIZE="TRUE" WIDTH="{w:g}" HEIGHT="{h:g}" ALIGN="LEFT" BALIGN="LEFT">{text}</TD>'
                f"</TR></TABLE>>"
            )
            sg = parent.add_subgraph(
                name=f"cluster_{box.id}",
                label=label,
                labeljust="l",
                labelloc="t",
                margin="8",
                style="rounded,filled" if with_text else "rounded",
                fillcolor=BOX_FILLS[box.level % 2],
                color=COLORS["box_line"],
            )
            subgraphs[box.id] = sg
        return sg

    for node in scene.nodes.values():
        attrs = {"width": f"{node.w / 72:.4f}", "height": f"{node.h / 72:.4f}", "label": ""}
        if with_text:
            text = [t for t, _, _ in node.lines] + [mark_text(m) for m in node.marks]
            attrs.update(
                label="\\n".join(t.replace("\\", "\\\\") for t in text),
                style="filled,rounded",
                fillcolor=COLORS.get(node.kind, COLORS["op"]),
            )
        holder(node.box).add_node(node.id, **attrs)
    # An op that reads nothing computed in view (an `arange`, a constant, an op fed only from outside a
    # focus) would be ranked at the top, and the module box it runs in with it, beside the boxes that
    # ran before it: an invisible edge from the node drawn for the op before it keeps run order.
    fed = {
        b
        for (a, b), kind in scene.edges.items()
        if kind in ("flow", "loop") and scene.nodes[a].kind != "stub"
    }
    order: dict[int, Node] = {}
    for node in scene.nodes.values():
        first = node.op if node.op is not None else node.attrs.get("data-first-op")
        if node.kind in ("op", "module", "input") and first is not None:
            order.setdefault(int(first), node)
    ranked = sorted(order)
    for k, i in enumerate(ranked):
        node = order[i]
        if k and node.id not in fed and node.kind != "input":
            prev = order[ranked[k - 1]]
            if prev is not node:
                g.add_edge(prev.id, node.id, style="invis", weight="0", id=f"r{i}")
    for k, ((a, b), kind) in enumerate(scene.edges.items()):
        attrs = {"id": f"e{k}"}
        if kind == "loop":
            attrs.update(constraint="false", style="dashed", color=COLORS["loop"])
        elif kind == "param_edge":
            attrs.update(style="dashed", color=COLORS["param_line"])
        g.add_edge(a, b, **attrs)
    return g


@dataclass
class Layout:
    width: float
    height: float
    nodes: dict[str, tuple[float, float]]  # center, in SVG coordinates (y down)
    boxes: dict[str, tuple[float, float, float, float]]  # x, y, w, h
    edges: list[tuple[str, str, str, list[tuple[float, float]], tuple[float, float] | None]]
    version: str
    seconds: float


def layout(scene: Scene) -> Layout:
    import json

    g = dot_graph(scene, with_text=False)
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()):  # pygraphviz's own "may take a long time" line
        data = json.loads(g.draw(format="json0", prog="dot").decode("utf-8"))
    seconds = time.perf_counter() - t0
    bb = [float(v) for v in data["bb"].split(",")]
    height = bb[3]

    def pt(s: str) -> tuple[float, float]:
        x, y = s.split(",")[-2:]
        return round(float(x), 1), round(height - float(y), 1)

    nodes, boxes, ids = {}, {}, {}
    for obj in data.get("objects", []):
        ids[obj["_gvid"]] = obj["name"]
        if obj["name"].startswith("cluster_"):
            x0, y0, x1, y1 = (float(v) for v in obj["bb"].split(","))
            boxes[obj["name"][len("cluster_") :]] = (
                round(x0, 1),
                round(height - y1, 1),
                round(x1 - x0, 1),
                round(y1 - y0, 1),
            )
        elif "pos" in obj:
            nodes[obj["name"]] = pt(obj["pos"])
    edges = []
    kinds = list(scene.edges.values())
    for e in data.get("edges", []):
        if not e["id"].startswith("e"):
            continue  # an invisible ordering edge
        k = int(e["id"][1:])
        spline = e.get("pos", "")
        end = None
        points = []
        for part in spline.split():
            if part.startswith("e,"):
                end = pt(part[2:])
            elif part.startswith("s,"):
                continue
            else:
                points.append(pt(part))
        edges.append((ids[e["tail"]], ids[e["head"]], kinds[k], points, end))
    version = getattr(pygraphviz_module(), "__version__", "")
    return Layout(round(bb[2], 1), round(height, 1), nodes, boxes, edges, version, seconds)
