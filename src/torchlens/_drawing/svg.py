"""The SVG, drawn from the layout's coordinates in a fixed order, so the same trace gives the
same bytes."""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING

from torchlens._drawing.layout import Layout, box_label_size, text_w
from torchlens._drawing.scene import Scene
from torchlens._drawing.style import (
    BOX_FILLS,
    COLORS,
    FONT,
    FS,
    FS_SMALL,
    LH,
    LH_SMALL,
    MARGIN,
    NOTE_CHARS,
    PAD_X,
    PAD_Y,
    STATUS_STYLE,
    ranges,
    wrap,
)

if TYPE_CHECKING:
    pass


# -- SVG ---------------------------------------------------------------------------------------


def esc(text: str) -> str:
    return html.escape(text, quote=True)


def num(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


class Svg:
    def __init__(self):
        self.parts: list[str] = []

    def add(self, s: str) -> None:
        self.parts.append(s)

    def text(self, x, y, s, size=FS_SMALL, color="ink", bold=False):
        w = ' font-weight="bold"' if bold else ""
        self.add(
            f'<text x="{num(x)}" y="{num(y)}" font-size="{size}" fill="{COLORS.get(color, color)}"{w}>'
            f"{esc(s)}</text>"
        )

    def rect(self, x, y, w, h, fill, stroke="none", rx=0, dash=False, width=1.0):
        d = ' stroke-dasharray="4 3"' if dash else ""
        self.add(
            f'<rect x="{num(x)}" y="{num(y)}" width="{num(w)}" height="{num(h)}" rx="{rx}" '
            f'fill="{COLORS.get(fill, fill)}" stroke="{COLORS.get(stroke, stroke)}" stroke-width="{width}"{d}/>'
        )


def draw_lines(svg: Svg, x: float, y: float, lines, marks, width: float) -> None:
    """Text lines then mark chips, top-left at (x, y)."""
    for text, size, bold in lines:
        lh = LH if size == FS else LH_SMALL
        svg.text(
            x,
            y + lh - 4,
            text,
            size=size,
            color="ink" if bold or size == FS else "muted",
            bold=bold,
        )
        y += lh
    for m in marks:
        strong, pale, word = STATUS_STYLE[m.status]
        svg.add(
            f'<g class="mark" data-name="{esc(m.name)}" data-generation="{esc(m.generation or "")}" '
            f'data-status="{m.status}" data-site="{esc(m.site)}">'
        )
        svg.rect(x - 3, y + 2, width + 6, LH_SMALL + 2, pale, strong, rx=3)
        svg.rect(x, y + 6, 8, 8, strong)
        svg.text(x + 14, y + LH_SMALL - 1, f"{m.text} · {word}", size=FS_SMALL)
        svg.add("</g>")
        y += LH_SMALL + 4


def legend_rows(scene: Scene, width: float) -> tuple[list[tuple[str, str]], float]:
    """Legend entries (kind, words) and the height they take, wrapped to `width`."""
    kinds = {n.kind for n in scene.nodes.values()}
    entries = [("op", "an op: #index name, output shape (dtype where it changes)")]
    if "input" in kinds or "output" in kinds:
        entries.append(("input", "model input / output"))
    if "param" in kinds:
        entries.append(("param", "parameter, where it enters"))
    if "module" in kinds:
        entries.append(("module", "a module drawn as one node (depth=)"))
    if "stub" in kinds:
        entries.append(("stub", "an op outside the focus"))
    if any(n.inplace for n in scene.nodes.values()):
        entries.append(("inplace", "writes in place"))
    if "loop" in scene.edges.values():
        entries.append(("loop", "into the next layer of a ×N box"))
    statuses = []
    for holder in list(scene.nodes.values()) + list(scene.boxes.values()):
        for m in holder.marks:
            if m.status not in statuses:
                statuses.append(m.status)
    for s in STATUS_STYLE:
        if s in statuses:
            entries.append(("status:" + s, STATUS_STYLE[s][2]))
    x, rows = 0.0, 1
    for _, words in entries:
        w = 30 + text_w(words, FS_SMALL) + 18
        if x and x + w > width:
            rows += 1
            x = 0
        x += w
    return entries, rows * 22


def render_svg(scene: Scene, lay: Layout, title: str, desc: str) -> str:
    notes = list(scene.notes)
    for name, why in scene.unplaced.items():
        notes.append(f"{name}: no mark: {why}")
    min_width = 560
    graph_w = lay.width + 2 * MARGIN
    width = max(graph_w, min_width)
    legend, legend_h = legend_rows(scene, width - 2 * MARGIN)
    top = MARGIN + legend_h + 8
    note_lines: list[str] = []
    for k, note in enumerate(notes, 1):
        wrapped = wrap(note, NOTE_CHARS)
        note_lines += [f"{k}. {wrapped[0]}"] + ["   " + w for w in wrapped[1:]]
    if note_lines:
        width = max(width, 2 * MARGIN + text_w("   " + "x" * NOTE_CHARS, FS_SMALL))
    notes_h = (LH_SMALL * len(note_lines) + LH + 10) if note_lines else 0
    height = math.ceil(top + lay.height + MARGIN + notes_h)
    width = math.ceil(width)  # whole pixels: a browser reports an image's own size rounded
    ox = MARGIN + (width - graph_w) / 2
    svg = Svg()
    svg.add(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{num(width)}" height="{num(height)}" '
        f'viewBox="0 0 {num(width)} {num(height)}" font-family="{FONT}" role="img" aria-labelledby="title desc">'
    )
    svg.add(f'<title id="title">{esc(title)}</title>')
    svg.add(f'<desc id="desc">{esc(desc)}</desc>')
    svg.add(
        f"<!-- Drawn by torchlens Trace.draw; layout: Graphviz dot through pygraphviz {lay.version}. -->"
    )
    svg.add(
        '<defs><marker id="tl-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{COLORS["edge"]}"/></marker>'
        '<marker id="tl-arrow-loop" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{COLORS["loop"]}"/></marker>'
        '<marker id="tl-arrow-param" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{COLORS["param_line"]}"/></marker>'
        "</defs>"
    )
    svg.add(
        f'<rect x="0" y="0" width="{num(width)}" height="{num(height)}" fill="{COLORS["bg"]}"/>'
    )
    # legend
    svg.add('<g class="legend">')
    x, y = float(MARGIN), float(MARGIN)
    for kind, words in legend:
        w = 30 + text_w(words, FS_SMALL) + 18
        if x > MARGIN and x + w > width - MARGIN:
            x, y = float(MARGIN), y + 22
        if kind.startswith("status:"):
            strong, pale, _ = STATUS_STYLE[kind[len("status:") :]]
            svg.rect(x, y + 1, 24, 14, pale, strong, rx=3)
            svg.rect(x + 3, y + 4, 8, 8, strong)
        elif kind == "loop":
            svg.add(
                f'<path d="M{num(x)},{num(y + 8)} L{num(x + 24)},{num(y + 8)}" stroke="{COLORS["loop"]}" '
                f'stroke-dasharray="4 3" fill="none" marker-end="url(#tl-arrow-loop)"/>'
            )
        else:
            style = node_style(kind if kind != "inplace" else "op", kind == "inplace")
            svg.rect(
                x, y + 1, 24, 14, style[0], style[1], rx=style[2], dash=style[3], width=style[4]
            )
        svg.text(x + 30, y + 12, words, size=FS_SMALL, color="muted")
        x += w
    svg.add("</g>")
    # boxes, outermost first
    labels = Svg()
    svg.add('<g class="boxes">')
    for box in sorted(scene.boxes.values(), key=lambda b: b.level):
        if box.id not in lay.boxes:
            continue
        bx, by, bw, bh = lay.boxes[box.id]
        bx, by = bx + ox, by + top
        grouped = box.group is not None
        attrs = f'data-module="{esc(box.call.address)}" data-call="{box.call.index}"'
        if grouped:
            attrs += f' data-layers="{esc(ranges(box.group.layers))}"'
        svg.add(f'<g class="box{" group" if grouped else ""}" id="{box.id}" {attrs}>')
        svg.add(
            f"<title>{esc(box.call.address)} ({esc(scene.trace.modules[box.call.address].class_name)})</title>"
        )
        stroke = COLORS["group_line"] if grouped else COLORS["box_line"]
        svg.rect(
            bx,
            by,
            bw,
            bh,
            BOX_FILLS[box.level % 2],
            stroke,
            rx=6,
            dash=bool(grouped and box.group.reason),
            width=1.6 if grouped else 1.0,
        )
        svg.add("</g>")
        # the title goes over the edges (an edge entering a box may cross its title's band)
        lw, lh = box_label_size(box)
        labels.add(f'<g class="box-label" data-box="{box.id}">')
        labels.rect(bx + 1.5, by + 1.5, min(lw, bw - 3), lh, BOX_FILLS[box.level % 2], rx=5)
        draw_lines(labels, bx + PAD_X, by + PAD_Y - 1, box.lines, box.marks, lw - 2 * PAD_X)
        labels.add("</g>")
    svg.add("</g>")
    # edges
    svg.add('<g class="edges">')
    for a, b, kind, points, end in lay.edges:
        if not points:
            continue
        d = f"M{num(points[0][0] + ox)},{num(points[0][1] + top)}"
        for k in range(1, len(points) - 2, 3):
            (x1, y1), (x2, y2), (x3, y3) = points[k], points[k + 1], points[k + 2]
            d += f" C{num(x1 + ox)},{num(y1 + top)} {num(x2 + ox)},{num(y2 + top)} {num(x3 + ox)},{num(y3 + top)}"
        if end is not None:
            d += f" L{num(end[0] + ox)},{num(end[1] + top)}"
        color, marker, dash = COLORS["edge"], "tl-arrow", ""
        if kind == "loop":
            color, marker, dash = COLORS["loop"], "tl-arrow-loop", ' stroke-dasharray="5 3"'
        elif kind == "param_edge":
            color, marker, dash = COLORS["param_line"], "tl-arrow-param", ' stroke-dasharray="3 3"'
        svg.add(
            f'<path class="edge {kind}" data-src="{a}" data-dst="{b}" d="{d}" fill="none" stroke="{color}" '
            f'stroke-width="1.2"{dash} marker-end="url(#{marker})"/>'
        )
    svg.add("</g>")
    svg.add('<g class="box-labels">')
    svg.parts += labels.parts
    svg.add("</g>")
    # nodes
    svg.add('<g class="nodes">')
    for node in scene.nodes.values():
        if node.id not in lay.nodes:
            continue
        cx, cy = lay.nodes[node.id]
        x, y = cx + ox - node.w / 2, cy + top - node.h / 2
        attrs = "".join(f' {k}="{esc(v)}"' for k, v in node.attrs.items())
        svg.add(f'<g class="node {node.kind}" id="{node.id}"{attrs}>')
        svg.add(f"<title>{esc(node.title)}</title>")
        fill, stroke, rx, dashed, sw = node_style(node.kind, node.inplace)
        if node.marks:
            stroke, sw = STATUS_STYLE[node.marks[0].status][0], 2.0
        svg.rect(x, y, node.w, node.h, fill, stroke, rx=rx, dash=dashed, width=sw)
        if node.kind == "module":
            svg.rect(x + 3, y + 3, node.w - 6, node.h - 6, "none", "module_line", rx=3, width=0.8)
        draw_lines(svg, x + PAD_X, y + PAD_Y, node.lines, node.marks, node.w - 2 * PAD_X)
        svg.add("</g>")
    svg.add("</g>")
    if note_lines:
        svg.add('<g class="notes">')
        y = float(top + lay.height + MARGIN + 4)
        svg.text(MARGIN, y + LH - 4, "Notes", size=FS, bold=True)
        y += LH
        for line in note_lines:
            svg.text(MARGIN, y + LH_SMALL - 3, line, size=FS_SMALL)
            y += LH_SMALL
        svg.add("</g>")
    svg.add("</svg>")
    return "\n".join(svg.parts) + "\n"


def node_style(kind: str, inplace: bool) -> tuple[str, str, int, bool, float]:
    """(fill, stroke, corner radius, dashed, stroke width) of a node kind."""
    fill, stroke, rx, dash, width = COLORS["op"], COLORS["line"], 3, False, 1.0
    if kind in ("input", "output"):
        fill, stroke, rx = COLORS["input"], COLORS["input_line"], 9
    elif kind == "param":
        fill, stroke, rx = COLORS["param"], COLORS["param_line"], 9
    elif kind == "module":
        fill, stroke, rx, width = COLORS["module"], COLORS["module_line"], 5, 1.2
    elif kind in ("stub", "outside"):
        fill, stroke, dash = COLORS["stub"], COLORS["line"], True
    if inplace:
        stroke, dash, width = COLORS["inplace_line"], True, 1.6
    return fill, stroke, rx, dash, width
