"""Generate the block diagrams of the site: docs/assets/diagrams/<family>.svg and their page.

For each model family marked `diagram` in `torchlens.testing.FAMILIES` this script builds a
small random-init model ([`torchlens.testing.build`][torchlens.testing.build], eager attention), traces it once with
`save="all"`, and draws what the trace says about it:

* the embeddings, decoder block 0 and what follows the last block, from the traced module
  tree: which norm feeds which sublayer, and which norm follows it, come from the recorded
  data flow, read through the naming tables (the module a table row's target names, as
  `resolve_alias` finds it on the trace), not from the family's name;
* inside each module, every facet the trace holds, with its shape; facets that are the same
  tensor (same op, same values) share one row, written `resid_pre = input`;
* beside each facet, the names that resolve to it in every naming generation, read from
  `alias_report(trace, generation)` on that trace. Nothing on the right is typed by hand.

The output is deterministic: fixed seeds, no timestamps, a fixed ordering, integer
coordinates, and nothing drawn from a tensor's values (only shapes, names and statuses).

The page docs/guides/diagrams.md has a hand-written part (kept as is) and a generated part
between two marker comments: one section per family with the block's data flow in one line,
how many names the diagram shows per generation, and the image.

Usage:
    python scripts/gen_diagrams.py          # write the SVGs and the page's generated part
    python scripts/gen_diagrams.py --check  # exit 1 if a committed SVG or the page is stale
    python scripts/gen_diagrams.py gpt2     # write only some SVGs (not the page)

`tests/test_diagrams.py` runs the check.
"""

from __future__ import annotations

import argparse
import html
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from markdown.extensions.toc import slugify

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import FACETS, testing

sys.path.insert(
    0, str(Path(__file__).resolve().parent)
)  # this script's siblings, also when a test loads it by path
from _outputs import splice, write_or_check

ROOT = Path(__file__).resolve().parent.parent

OUT = ROOT / "docs" / "assets" / "diagrams"
PAGE = ROOT / "docs" / "guides" / "diagrams.md"
BEGIN = "<!-- BEGIN GENERATED: scripts/gen_diagrams.py; do not edit by hand -->"
END = "<!-- END GENERATED -->"

#: file slug -> (title, key of torchlens.testing.FAMILIES), for the families marked `diagram`
FAMILIES: dict[str, tuple[str, str]] = {
    f.slug: (f.title, name) for name, f in testing.FAMILIES.items() if f.diagram
}

GENERATIONS: tuple[str, ...] = tuple(mi.GENERATIONS)
N_TOKENS = 4
READABLE = ("real", "reconstructed_read_only")

# -- what to draw ------------------------------------------------------------------------------


@dataclass
class FacetRow:
    """One row of the diagram: one facet (or several facets that are the same tensor)."""

    address: str
    facets: list[str]
    shape: tuple[int, ...]
    kind: str
    names: dict[str, list[str]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        generic = [f for f in self.facets if f in ("input", "output")]
        return " = ".join([f for f in self.facets if f not in generic] + generic)


@dataclass
class Box:
    """A module drawn as a box: its facet rows and the modules drawn inside it, in flow order."""

    address: str
    class_name: str
    role: str
    entries: list = field(default_factory=list)  # FacetRow | Box

    def rows(self):
        for e in self.entries:
            if isinstance(e, Box):
                yield from e.rows()
            else:
                yield e

    def output_row(self) -> FacetRow:
        rows = [e for e in self.entries if isinstance(e, FacetRow)]
        return next((r for r in rows if "output" in r.facets), rows[-1])


@dataclass
class Diagram:
    slug: str
    title: str
    trace: tl.Trace
    embeddings: list[Box]
    block: Box
    attn_branch: list[Box]
    mlp_branch: list[Box]
    parallel: bool
    after: list[Box]
    root: Box
    stream_rows: dict[str, FacetRow]
    three_x_adds_to_four_x: bool
    absent: dict[str, int]


def _same_tensor(a, b) -> bool:
    return (
        a.kind == "real"
        and b.kind == "real"
        and a.op is not None
        and a.op == b.op
        and tuple(a.shape) == tuple(b.shape)
        and a.tensor is not None
        and b.tensor is not None
        and a.tensor.dtype == b.tensor.dtype
        and torch.equal(a.tensor, b.tensor)
    )


def _facet_rows(trace: tl.Trace, address: str) -> list[FacetRow]:
    """The facets of `address`'s only call in flow order, facets of one tensor merged."""
    rec = trace.modules[address]
    sites = rec.calls[0].facets.sites
    order = ["input", *FACETS.get(rec.role, {}), "output"]
    order += sorted(n for n in sites if n not in order)
    rows: list[tuple[FacetRow, object]] = []
    for name in order:
        site = sites.get(name)
        if site is None:
            continue
        for row, lead in rows:
            if _same_tensor(lead, site):
                row.facets.append(name)
                break
        else:
            rows.append((FacetRow(address, [name], tuple(site.shape), site.kind), site))
    # A merged row sits where its first facet sits (`down_out = output` before a dropout).
    return [r for r, _ in rows]


def _box(trace: tl.Trace, address: str, inner: list[str] = ()) -> Box:
    """A module box; `inner` are addresses of modules drawn inside it, placed by when they ran."""
    rec = trace.modules[address]
    rows = _facet_rows(trace, address)
    sites = rec.calls[0].facets.sites
    entries: list = list(rows)
    for child in sorted(inner, key=lambda a: trace.modules[a].calls[0].first_op):
        start = trace.modules[child].calls[0].first_op
        # after the last row whose op ran before the child (computed facets have no op)
        at = 0
        for i, row in enumerate(entries):
            if isinstance(row, Box):
                if trace.modules[row.address].calls[0].first_op < start:
                    at = i + 1
                continue
            op = sites[row.facets[0]].op
            if op is not None and op < start and "output" not in row.facets:
                at = i + 1
        entries.insert(at, _box(trace, child))
    return Box(address, rec.class_name, rec.role, entries)


def _inner_modules(trace: tl.Trace, address: str, also: set[str]) -> list[str]:
    """Modules inside `address` worth drawing: norms (QK-norm) and modules a name reads."""
    prefix = address + "."
    return [
        a
        for a, r in trace.modules.items()
        if a.startswith(prefix) and r.calls and (r.role == "norm" or a in also)
    ]


def _names_by_site(trace: tl.Trace) -> tuple[dict, dict, bool]:
    """{(address, facet): {generation: [names]}} for block 0 and global names, and counts of
    names with no site on this trace, per generation."""
    by_site: dict[tuple[str, str], dict[str, list[str]]] = {}
    absent: dict[str, int] = {}
    pairs: dict[str, set] = {}
    for generation in GENERATIONS:
        report = mi.alias_report(trace, generation=generation)
        pairs[generation] = {(r.query, r.module_address, r.facet, r.status) for r in report}
        for r in report:
            if r.layer not in (None, 0):
                continue
            if r.status not in READABLE:
                absent[generation] = absent.get(generation, 0) + 1
                continue
            by_site.setdefault((r.module_address, r.facet), {}).setdefault(generation, []).append(
                r.query
            )
    three_x_adds = pairs["4.x"] <= pairs["3.x"]
    return by_site, absent, three_x_adds


def module_of(trace: tl.Trace, target: str, layer: int = 0) -> str | None:
    """The module a naming-table target (`"ln1"`, `"attention"`, `"mlp_post_norm"`, ...) is on
    `trace` at `layer`, or None when the model has none.

    Read through the public resolver: the first row of any generation whose target is `target`
    (a language-model row, not an encoder one, and none with a second site that it may resolve
    to instead), resolved on the trace, names the module. Every such row of a target points at
    the same module; only the facet read there differs.
    """
    for generation in GENERATIONS:
        for row in mi.table(generation):
            if row.target != target or row.stack is not None or row.or_else is not None:
                continue
            res = mi.resolve_alias(
                trace, row.name.replace("{L}", str(layer)), generation=generation
            )
            return res.module_address
    raise LookupError(f"no naming table has a row with target {target!r}")


def build(slug: str) -> Diagram:
    title, key = FAMILIES[slug]
    model = testing.build(key, "eager")
    trace = tl.trace(model, testing.token_ids(length=N_TOKENS), save="all")
    trace.check()  # checks run on first read: run them all, so only facets that hold are drawn
    by_site, absent, three_x_adds = _names_by_site(trace)

    def find(target: str) -> str | None:
        return module_of(trace, target)

    named_modules = {a for a, _ in by_site}
    block_addr = trace.blocks[0]
    token = find("token_embed")
    embeds = [token] + [a for a in [find("pos_embed")] if a]
    embeddings = [_box(trace, a) for a in embeds]

    def branch(*target_names: str) -> list[Box]:
        out = []
        for t in target_names:
            a = find(t)
            if a is not None and a not in [b.address for b in out]:
                out.append(_box(trace, a, _inner_modules(trace, a, named_modules)))
        return out

    attn_branch = branch("ln1", "attention", "attn_post_norm")
    mlp_branch = branch("ln2", "mlp", "mlp_post_norm")
    block = _box(trace, block_addr)
    stream_rows = {}
    for row in block.entries:
        for f in ("resid_pre", "resid_mid", "resid_post"):
            if f in row.facets:
                stream_rows[f] = row
    parallel = "resid_mid" not in stream_rows

    after = []
    final_norm, unembed = find("final_norm"), find("unembed")
    after += [_box(trace, a) for a in (final_norm, unembed) if a]
    root = _box(trace, "")

    diagram = Diagram(
        slug,
        title,
        trace,
        embeddings,
        block,
        attn_branch,
        mlp_branch,
        parallel,
        after,
        root,
        stream_rows,
        three_x_adds,
        absent,
    )

    # Every drawn row gets its names; every name with a site on this trace must be drawn.
    drawn = {}
    for box in _all_boxes(diagram):
        for row in box.rows():
            for f in row.facets:
                drawn[(row.address, f)] = row
    for site, names in by_site.items():
        if site not in drawn:
            raise SystemExit(
                f"{slug}: names {names} resolve to {site}, which the diagram does not draw"
            )
        row = drawn[site]
        for generation, ns in names.items():
            row.names.setdefault(generation, []).extend(
                n for n in ns if n not in row.names.get(generation, [])
            )
    # Modules of block 0 that play a role must all be placed.
    placed = {b.address for box in _all_boxes(diagram) for b in _walk(box)}
    missing = [
        a
        for a, r in trace.modules.items()
        if a.startswith(block_addr + ".") and r.calls and r.role != "other" and a not in placed
    ]
    if missing:
        raise SystemExit(f"{slug}: block 0 modules the diagram does not place: {missing}")
    return diagram


def _walk(box: Box):
    yield box
    for e in box.entries:
        if isinstance(e, Box):
            yield from _walk(e)


def _all_boxes(d: Diagram) -> list[Box]:
    return [*d.embeddings, d.block, *d.attn_branch, *d.mlp_branch, *d.after, d.root]


# -- drawing -----------------------------------------------------------------------------------

FONT = "DejaVu Sans Mono, Menlo, Consolas, Liberation Mono, monospace"
FS = 12  # names and facets
FS_SMALL = 11  # shapes, class names, notes
#: The SVG's own size is the drawing's size times this, so a browser with the room shows its
#: 12 px names at 15 px (a narrower window still scales the whole image down to fit).
SCALE = 1.25
#: The widest a drawing may be: the site's content column is 998 px wide in a 1280 px window, so a
#: drawing at most this wide, scaled to the column, shows its 11 px text at 11 px or more
#: (tests/test_browser.py measures it there).
MAX_WIDTH = 990
CW = 0.62 * FS  # width of one character, a little over what monospace fonts use
CW_SMALL = 0.62 * FS_SMALL
LH = 15  # line height of a name cell
PAD = 5  # vertical padding of a row
HEAD = 22  # module box header
GAP = 16  # between boxes of one branch (room for an arrow)
STREAM_X = 26
BOX_X = 60
INDENT = 12
NAME_GAP = 16  # between a name and its generation marks
SLOT_PAD = 10  # between two generation marks

COLORS = {
    "ink": "#1f2328",
    "muted": "#57606a",
    "faint": "#d0d7de",
    "band": "#eef1f8",
    "zebra": "#f6f8fa",
    "stream": "#3949ab",
    "box": "#ffffff",
    "box_line": "#8c959f",
    "attention": "#e3f2fd",
    "mlp": "#e8f5e9",
    "norm": "#fff8e1",
    "embedding": "#f3e5f5",
    "unembed": "#f3e5f5",
    "root": "#f6f8fa",
    "block": "#fafbff",
    "other": "#ffffff",
    "real": "#dbe4ff",
    "real_line": "#3949ab",
    "derived": "#fff4d6",
    "derived_line": "#b7791f",
    # the generation marks beside a name: TransformerLens, nnterp, interp-engine
    "2.x": "#3949ab",
    "3.x": "#3949ab",
    "4.x": "#3949ab",
    "nnterp": "#2e7d32",
    "interp-engine": "#8e24aa",
}


def _tw(text: str, cw: float = CW) -> int:
    return int(round(len(text) * cw))


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _wrap(text: str, width: int) -> list[str]:
    """Split `text` into lines of at most `width` characters, at spaces."""
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def _name_lines(row: FacetRow) -> list[tuple[str, list[str]]]:
    """The names that resolve to `row`'s facets, each once, with the generations it is a name in;
    in the order of `GENERATIONS`, then of each generation's report."""
    lines: dict[str, list[str]] = {}
    for g in GENERATIONS:
        for name in row.names.get(g, []):
            lines.setdefault(name, []).append(g)
    return list(lines.items())


def _relative(address: str, parent: str) -> str:
    if address == "":
        return "<root>"
    if parent and address.startswith(parent + "."):
        return "." + address[len(parent) + 1 :]
    return address


class Canvas:
    def __init__(self):
        self.back: list[str] = []  # drawn first (bands, frames)
        self.mid: list[str] = []  # boxes, lines
        self.front: list[str] = []  # text, chips

    def text(self, x, y, s, size=FS, color="ink", weight="normal", layer="front"):
        w = ' font-weight="bold"' if weight == "bold" else ""
        getattr(self, layer).append(
            f'<text x="{x}" y="{y}" font-size="{size}" fill="{COLORS.get(color, color)}"{w}>{_esc(s)}</text>'
        )

    def rect(self, x, y, w, h, fill, stroke="none", rx=0, dash=False, layer="mid", width=1):
        d = ' stroke-dasharray="4 3"' if dash else ""
        getattr(self, layer).append(
            f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="{rx}" fill="{COLORS.get(fill, fill)}" '
            f'stroke="{COLORS.get(stroke, stroke)}" stroke-width="{width}"{d}/>'
        )

    def line(self, points, color="stream", width=2, arrow=False, dash=False, layer="mid"):
        pts = " ".join(f"{x},{y}" for x, y in points)
        extra = ' marker-end="url(#arrow)"' if arrow else ""
        extra += ' stroke-dasharray="5 4"' if dash else ""
        getattr(self, layer).append(
            f'<polyline points="{pts}" fill="none" stroke="{COLORS.get(color, color)}" stroke-width="{width}"{extra}/>'
        )

    def circle(self, x, y, r, fill, stroke, layer="front"):
        getattr(self, layer).append(
            f'<circle cx="{x}" cy="{y}" r="{r}" fill="{COLORS.get(fill, fill)}" stroke="{COLORS.get(stroke, stroke)}" '
            'stroke-width="2"/>'
        )


class Layout:
    """Places the diagram top to bottom. Beside each facet row, one line per name that resolves to
    the facet, each followed by the generations it is a name in, each generation in its own slot
    (a column one can read down); the names column is as wide as the longest name."""

    #: The names column's heading, under each band.
    NAME_HEADING = ("name", "in the generations marked")

    def __init__(self, d: Diagram):
        self.d = d
        self.c = Canvas()
        self.cols = list(GENERATIONS)
        rows = [r for b in _all_boxes(d) for r in b.rows()]
        self.diag_w = self._diagram_width()
        self.name_x = self.diag_w + 24
        heading = _tw(self.NAME_HEADING[1], CW_SMALL)
        widest = max([heading] + [_tw(n) for r in rows for n, _ in _name_lines(r)])
        x = self.name_x + widest + NAME_GAP
        self.col_x: dict[str, int] = {}
        for g in self.cols:
            self.col_x[g] = x
            x += _tw(g, CW) + SLOT_PAD
        self.width = x - SLOT_PAD + 10
        if self.width > MAX_WIDTH:
            raise SystemExit(
                f"{d.slug}: the diagram is {self.width} wide, more than MAX_WIDTH = {MAX_WIDTH}"
            )
        self.y = 0
        self.row_y: dict[int, tuple[int, int]] = {}  # id(row) -> (top, bottom)
        self.box_y: dict[int, tuple[int, int]] = {}  # id(box) -> (top, bottom)
        self.zebra = 0

    def _key(self, g: str) -> str:
        """What generation `g`'s mark stands for, in the drawing's key."""
        table = mi.GENERATIONS[g]
        if g == "3.x" and self.d.three_x_adds_to_four_x:
            return (
                f"{table.heading}: its legacy names and every 4.x name (a bridge cache holds both)"
            )
        return f"{table.heading}: {table.names}" if table.names else table.heading

    def _diagram_width(self) -> int:
        widest = 0

        def visit(box: Box, depth: int, parent: str):
            nonlocal widest
            x = BOX_X + depth * INDENT
            head = _relative(box.address, parent) + "  " + box.class_name
            widest = max(widest, x + 10 + _tw(head) + 10 + depth * INDENT)
            for e in box.entries:
                if isinstance(e, Box):
                    visit(e, depth + 1, box.address)
                else:
                    widest = max(
                        widest, x + 12 + _tw(e.label) + 14 + 8 + _tw(_shape(e.shape), CW_SMALL) + 24
                    )

        d = self.d
        for b in d.embeddings + d.after + [d.root]:
            visit(b, 0, "")
        for b in d.attn_branch + d.mlp_branch:
            visit(b, 0, d.block.address)
        return max(widest, 420)

    # -- pieces

    def band(self, title: str, subtitle: str = ""):
        """A section heading across the whole width, with the column headings."""
        c = self.c
        x = STREAM_X + 16
        lines = _wrap(subtitle, int((self.name_x - x - 12) / CW_SMALL)) if subtitle else []
        title_lines = _wrap(title, int((self.name_x - x - 12) / (0.62 * 13)))
        h = 13 + 16 * len(title_lines) + 13 * max(1, len(lines)) + 1
        c.rect(0, self.y, self.width, h, "band", layer="back")
        for i, line in enumerate(title_lines):
            c.text(x, self.y + 17 + 16 * i, line, size=13, weight="bold")
        below = self.y + 17 + 16 * (len(title_lines) - 1)
        for i, line in enumerate(lines):
            c.text(x, below + 16 + 13 * i, line, size=FS_SMALL, color="muted")
        c.text(self.name_x, self.y + 17, self.NAME_HEADING[0], weight="bold")
        c.text(self.name_x, self.y + 33, self.NAME_HEADING[1], size=FS_SMALL, color="muted")
        for g in self.cols:
            c.text(self.col_x[g], self.y + 17, g, weight="bold", color=g)
        self.y += h + 8
        self.zebra = 0

    def facet_row(self, row: FacetRow, x: int, stream: bool = False):
        c = self.c
        lines = _name_lines(row)
        h = max(1, len(lines)) * LH + 2 * PAD
        top = self.y
        if self.zebra % 2:
            c.rect(0, top, self.width, h, "zebra", layer="back")
        self.zebra += 1
        mid = top + PAD + LH // 2 + 1
        label = row.label
        derived = row.kind != "real"
        chip_w = _tw(label) + 14
        chip_x = x + 12 if not stream else STREAM_X + 16
        c.rect(
            chip_x,
            mid - 9,
            chip_w,
            18,
            "derived" if derived else "real",
            "derived_line" if derived else "real_line",
            rx=9,
            dash=derived,
            layer="front",
        )
        c.text(chip_x + 7, mid + 4, label)
        sx = chip_x + chip_w + 8
        c.text(sx, mid + 4, _shape(row.shape), size=FS_SMALL, color="muted")
        lead_from = sx + _tw(_shape(row.shape), CW_SMALL) + 6
        lead_to = self.name_x - 8
        if lead_to > lead_from:
            c.line([(lead_from, mid), (lead_to, mid)], color="faint", width=1, dash=True)
        if not lines:
            c.text(self.name_x, mid + 4, "–", color="faint")
        for i, (name, generations) in enumerate(lines):
            y = top + PAD + LH * i + LH // 2 + 5
            c.text(self.name_x, y, name)
            for g in generations:
                c.text(self.col_x[g], y, g, size=FS_SMALL, color=g)
        self.row_y[id(row)] = (top, top + h)
        self.y += h

    def box(self, box: Box, depth: int = 0, parent: str = ""):
        c = self.c
        x = BOX_X + depth * INDENT
        right = self.diag_w - 14 - depth * INDENT
        top = self.y
        self.y += HEAD
        c.text(x + 8, top + 15, _relative(box.address, parent), weight="bold")
        c.text(
            x + 8 + _tw(_relative(box.address, parent)) + 10,
            top + 15,
            box.class_name,
            size=FS_SMALL,
            color="muted",
        )
        for e in box.entries:
            if isinstance(e, Box):
                self.y += 2
                self.box(e, depth + 1, box.address)
                self.y += 4
            else:
                self.facet_row(e, x)
        self.y += 6
        fill = box.role if box.role in COLORS else "other"
        c.rect(
            x,
            top,
            right - x,
            self.y - top,
            fill,
            "box_line",
            rx=6,
            layer="back" if depth == 0 else "mid",
        )
        self.box_y[id(box)] = (top, self.y)

    def arrow_down(self, a: Box, b: Box):
        """From the bottom of box a to the top of box b."""
        x = BOX_X + 40
        self.c.line(
            [(x, self.box_y[id(a)][1]), (x, self.box_y[id(b)][0] - 1)],
            color="box_line",
            width=2,
            arrow=True,
            layer="front",
        )

    def stream_node(self, row: FacetRow, add: bool):
        """A residual-stream facet of the block, drawn on the stream; `add` draws the ⊕."""
        self.facet_row(row, 0, stream=True)
        top, bottom = self.row_y[id(row)]
        mid = top + PAD + LH // 2 + 1
        if add:
            self.c.circle(STREAM_X, mid, 8, "#ffffff", "stream")
            self.c.line([(STREAM_X - 5, mid), (STREAM_X + 5, mid)], width=2, layer="front")
            self.c.line([(STREAM_X, mid - 5), (STREAM_X, mid + 5)], width=2, layer="front")
        else:
            self.c.circle(STREAM_X, mid, 4, "stream", "stream")
        return mid

    def read_arrow(self, box: Box):
        top = self.box_y[id(box)][0]
        y = top + HEAD // 2
        self.c.line([(STREAM_X, y), (BOX_X - 2, y)], arrow=True)

    def write_line(self, box: Box, to_y: int, rail: bool = False):
        """From the box's output row back to the stream at `to_y` (the ⊕)."""
        row = box.output_row()
        top, _ = self.row_y[id(row)]
        y = top + PAD + LH // 2 + 1
        if rail:  # parallel blocks: down the right-hand rail, then into the ⊕ from the right
            rx = self.diag_w - 4
            right = self.diag_w - 14
            self.c.line(
                [(right, y), (rx, y), (rx, to_y + 4), (STREAM_X + 10, to_y + 4)], arrow=True
            )
        else:
            self.c.line(
                [(BOX_X, y), (STREAM_X + 18, y), (STREAM_X + 18, to_y), (STREAM_X + 10, to_y)],
                arrow=True,
            )

    # -- the whole picture

    def render(self) -> str:
        d, c = self.d, self.c
        t = d.trace
        n_layers = len(t.blocks)
        block_rec = t.modules[d.block.address]
        self.y = 0
        title = f"{d.title}: decoder block 0 and the names that read each facet"
        c.text(10, 22, title, size=16, weight="bold")
        about = (
            f"{t.model_class}, {n_layers} layers, random weights, eager attention, "
            f"{N_TOKENS} tokens; names from alias_report on this trace (layer 0 and global names)"
        )
        self.y = 42
        for line in _wrap(about, int((self.width - 20) / CW_SMALL)):
            c.text(10, self.y, line, size=FS_SMALL, color="muted")
            self.y += 14
        self.legend(self.y + 4)
        self.y += 26
        self.key()
        self.y += 10

        # embeddings
        self.band("Embedding", "the residual stream starts here")
        emb_mid = []
        for box in d.embeddings:
            self.box(box)
            self.y += 10
            row = box.output_row()
            top, _ = self.row_y[id(row)]
            emb_mid.append(top + PAD + LH // 2 + 1)
        stream_top = emb_mid[0]
        for i, y in enumerate(emb_mid):
            c.line([(BOX_X, y), (STREAM_X + (10 if i else 0), y)], arrow=bool(i))
        if len(emb_mid) > 1:
            c.circle(STREAM_X, emb_mid[-1], 8, "#ffffff", "stream")
            c.line(
                [(STREAM_X - 5, emb_mid[-1]), (STREAM_X + 5, emb_mid[-1])], width=2, layer="front"
            )
            c.line(
                [(STREAM_X, emb_mid[-1] - 5), (STREAM_X, emb_mid[-1] + 5)], width=2, layer="front"
            )

        # block 0
        kind = (
            "parallel attention and MLP: both read resid_pre, one add writes both"
            if d.parallel
            else "attention, then MLP"
        )
        self.band(
            f"Block 0: {d.block.address}  {block_rec.class_name}",
            f"one of {n_layers} blocks; {kind}",
        )
        block_top = self.y - 4
        self.stream_node(d.stream_rows["resid_pre"], add=False)
        self.y += 8
        for i, box in enumerate(d.attn_branch):
            if i:
                self.y += GAP
            self.box(box, 0, d.block.address)
        for a, b in zip(d.attn_branch, d.attn_branch[1:]):
            self.arrow_down(a, b)
        self.read_arrow(d.attn_branch[0])
        self.y += 8
        if not d.parallel:
            mid_y = self.stream_node(d.stream_rows["resid_mid"], add=True)
            self.write_line(d.attn_branch[-1], mid_y)
            self.y += 8
        else:
            self.y += 4
        for i, box in enumerate(d.mlp_branch):
            if i:
                self.y += GAP
            self.box(box, 0, d.block.address)
        for a, b in zip(d.mlp_branch, d.mlp_branch[1:]):
            self.arrow_down(a, b)
        self.read_arrow(d.mlp_branch[0])
        self.y += 8
        post_y = self.stream_node(d.stream_rows["resid_post"], add=True)
        self.write_line(d.mlp_branch[-1], post_y)
        if d.parallel:
            self.write_line(d.attn_branch[-1], post_y, rail=True)
        leftover = [r for r in d.block.entries if r not in d.stream_rows.values()]
        for row in leftover:
            self.facet_row(row, BOX_X)
        self.y += 6
        c.rect(
            4,
            block_top,
            self.diag_w - 2,
            self.y - block_top,
            "none",
            "stream",
            rx=8,
            dash=True,
            layer="back",
            width=1,
        )
        block_bottom = self.y

        # after the last block
        rest = f"blocks 1 to {n_layers - 1}" if n_layers > 2 else "block 1" if n_layers == 2 else ""
        self.y += 8
        self.band(
            "After the last block",
            f"{rest}, then the final norm and the unembedding"
            if rest
            else "the final norm and the unembedding",
        )
        after_mid = []
        for i, box in enumerate(d.after):
            if i:
                self.y += GAP
            self.box(box)
        for a, b in zip(d.after, d.after[1:]):
            self.arrow_down(a, b)
        if d.after:
            self.read_arrow(d.after[0])
            after_mid.append(self.box_y[id(d.after[0])][0] + HEAD // 2)
        self.y += 12
        self.box(d.root)
        self.y += 10

        # the stream
        c.line([(STREAM_X, stream_top), (STREAM_X, block_bottom)], width=3)
        if after_mid:
            c.line([(STREAM_X, block_bottom), (STREAM_X, after_mid[0])], width=3, dash=True)

        # footer: names with no site here
        absent = ", ".join(f"{g} {d.absent.get(g, 0)}" for g in GENERATIONS)
        footer = (
            f"Names of layer 0 and global names with no site on this model (not drawn): {absent}. "
            "The alias-table pages list them with the reason."
        )
        for line in _wrap(footer, int((self.width - 20) / CW_SMALL)):
            c.text(10, self.y + 14, line, size=FS_SMALL, color="muted")
            self.y += 14
        self.y += 12
        return self.svg()

    def legend(self, y: int):
        """The drawing's symbols, left to right, on as many lines as the width needs (each line
        26 high; `self.y` ends below the last)."""
        c = self.c
        items = [
            ("chip", "real", "a tensor an op produced"),
            ("chip", "derived", "computed or reconstructed, read-only"),
            ("text", None, "a = b: two facets of one tensor"),
            ("arrow", None, "residual stream"),
        ]
        x = 10
        for kind, fill, note in items:
            lead = 54 if kind == "chip" else 38 if kind == "arrow" else 0
            w = lead + _tw(note, CW_SMALL)
            if x > 10 and x + w > self.width - 10:
                x, y = 10, y + 26
                self.y += 26
            if kind == "chip":
                line = f"{fill}_line"
                c.rect(x, y - 9, 46, 18, fill, line, rx=9, dash=fill == "derived", layer="front")
                c.text(x + 7, y + 4, "facet")
            elif kind == "arrow":
                c.line([(x, y), (x + 30, y)], arrow=True)
            c.text(x + lead, y + 4, note, size=FS_SMALL, color="muted")
            x += w + 24

    def key(self):
        """What each generation mark beside a name stands for, one line each."""
        c = self.c
        for g in self.cols:
            self.y += 15
            c.text(10, self.y, g, size=FS_SMALL, color=g, weight="bold")
            c.text(
                10 + _tw("interp-engine", CW_SMALL) + 10,
                self.y,
                self._key(g),
                size=FS_SMALL,
                color="muted",
            )

    def svg(self) -> str:
        w, h = self.width, self.y
        d = self.d
        desc = (
            f"Decoder block 0 of a small random-init {d.title} model as traced by TorchLens, with every facet "
            "and the names that resolve to it in TransformerLens 2.x, 3.x, 4.x, nnterp and interp-engine."
        )
        head = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{round(w * SCALE)}" height="{round(h * SCALE)}" '
            f'viewBox="0 0 {w} {h}" '
            f'font-family="{FONT}" role="img" aria-labelledby="title desc">',
            f'<title id="title">{_esc(d.title)}: block 0, facets and their names</title>',
            f'<desc id="desc">{_esc(desc)}</desc>',
            "<!-- Generated by scripts/gen_diagrams.py from a TorchLens trace; do not edit. -->",
            '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{COLORS["stream"]}"/></marker></defs>',
            f'<rect x="0" y="0" width="{w}" height="{h}" fill="#ffffff"/>',
        ]
        return "\n".join(head + self.c.back + self.c.mid + self.c.front + ["</svg>", ""])


def _flow(d: Diagram) -> str:
    """Block 0's data flow in one line, from the diagram's own boxes."""

    def names(branch: list[Box]) -> str:
        return " → ".join(f"`{_relative(b.address, d.block.address)[1:]}`" for b in branch)

    if d.parallel:
        return f"{names(d.attn_branch)}, and in parallel {names(d.mlp_branch)}, both added to `resid_pre` → `resid_post`"
    return f"{names(d.attn_branch)} → ⊕ `resid_mid` → {names(d.mlp_branch)} → ⊕ `resid_post`"


def page_section(diagrams: list[Diagram]) -> str:
    """The generated part of docs/guides/diagrams.md: one section per family."""
    lines = [
        BEGIN,
        "",
        f"Jump to a diagram ({len(diagrams)} of the {len(testing.FAMILIES)} families of "
        "`torchlens.testing.FAMILIES`; the [coverage page](coverage.md) lists every model the test "
        "suite traces): "
        + " · ".join(f"[{d.title}](#{slugify(d.title, '-')})" for d in diagrams)
        + ".",
        "",
    ]
    for d in diagrams:
        block = d.trace.modules[d.block.address]
        counts = {g: 0 for g in GENERATIONS}
        for box in _all_boxes(d):
            for row in box.rows():
                for g in GENERATIONS:
                    counts[g] += len(row.names.get(g, []))
        drawn = ", ".join(f"{g} {counts[g]}" for g in GENERATIONS)
        lines += [
            f"## {d.title}",
            "",
            f"`{d.trace.model_class}`; block 0 is `{d.block.address}` (`{block.class_name}`): {_flow(d)}. "
            f"Names drawn: {drawn}.",
            "",
            '<div class="tl-diagram" markdown>',
            "",
            f"![{d.title}: decoder block 0, its facets and their names](../assets/diagrams/{d.slug}.svg)",
            "",
            "</div>",
            "",
            f"[Open the {d.title} diagram on its own](../assets/diagrams/{d.slug}.svg) · "
            f"[{d.title}'s block 0 as an op graph](op-graph.md#{d.slug}-block)",
            "",
        ]
    lines.append(END)
    return "\n".join(lines)


def render_page(diagrams: list[Diagram]) -> str:
    text = (
        PAGE.read_text(encoding="utf-8")
        if PAGE.exists()
        else f"# Block diagrams\n\n{BEGIN}\n{END}\n"
    )
    return splice(PAGE, text, BEGIN, END, page_section(diagrams))


def render(slug: str) -> str:
    """The SVG of one family."""
    return Layout(build(slug)).render()


def outputs(slugs: list[str] | None = None) -> dict[Path, str]:
    """Every file this script writes, with its content: the SVGs, then the page."""
    diagrams = [build(slug) for slug in (slugs or FAMILIES)]
    out = {OUT / f"{d.slug}.svg": Layout(d).render() for d in diagrams}
    if slugs is None or list(slugs) == list(FAMILIES):
        out[PAGE] = render_page(diagrams)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="report stale files instead of writing them"
    )
    parser.add_argument(
        "families",
        nargs="*",
        help=f"slugs to draw (default: all of {', '.join(FAMILIES)}, and the page)",
    )
    args = parser.parse_args(argv)
    unknown = [s for s in args.families if s not in FAMILIES]
    if unknown:
        parser.error(f"unknown family {unknown}; known: {', '.join(FAMILIES)}")
    return write_or_check(
        outputs(args.families or None), args.check, ROOT, "python scripts/gen_diagrams.py"
    )


if __name__ == "__main__":
    sys.exit(main())
