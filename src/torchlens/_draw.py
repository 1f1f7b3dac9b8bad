"""The op graph of a trace, drawn: [`Trace.draw`][torchlens.Trace.draw].

One picture of the recorded computation: a node per op (its index, name, output shape, the dtype
where it changes), per model input, per parameter where it enters and for the output; an arrow
per data-flow edge recorded in `OpRecord.inputs`; module calls as nested boxes. Everything comes
from the records (`trace.ops`, `trace.modules`, `trace.structure`), never from tensors, so a
trace loaded with [`torchlens.load`][torchlens.load] or taken with `save="none"` draws the same.

The drawing is built in three steps:

1. **What to draw** (`Scene`): the ops in view (all, or a `focus=` module's and the ops just
   outside it as stubs), rolled stacks (`roll`: the layers of a stack whose recorded op
   sequences are the same are drawn once, `×N`; a layer that differs, or a second call of one
   block, is drawn apart with the reason), modules deeper than `depth=` folded into one node,
   and the marks of `highlight=` (each name resolved with
   [`resolve_alias`][torchlens.mechinterp.resolve_alias] to the op whose output it reads).
2. **Layout** (`layout`): Graphviz's `dot`, run in-process through pygraphviz (whose wheels
   ship Graphviz, so `pip install` is enough). Every node and box label gets a fixed size
   computed here from a monospace character width, so the layout does not depend on the fonts
   of the machine and no label can overflow its node.
3. **SVG** (`render_svg`): drawn here from the layout's coordinates, with integer-free but rounded
   coordinates, no timestamps and a fixed order, so the same trace gives the same bytes.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchlens._core.errors import close_matches, did_you_mean
from torchlens._core.persisted import PERSISTED
from torchlens._core.records import ModuleCall
from torchlens._drawing.errors import DrawingTooLarge, DrawSpecError, LayoutEngineMissing
from torchlens._drawing.layout import dot_graph, layout, measure
from torchlens._drawing.scene import Mark, Scene
from torchlens._drawing.svg import render_svg
from torchlens._naming.resolver import GENERATIONS, resolve_alias
from torchlens._naming.results import AliasError, UnknownAlias, UnknownGeneration

if TYPE_CHECKING:
    from torchlens._trace import Trace

__all__ = [
    "Drawing",
    "DrawSpecError",
    "DrawingTooLarge",
    "LayoutEngineMissing",
    "draw",
    "MAX_NODES",
]

#: The most nodes and module boxes `draw` lays out without being asked to (`max_nodes=`).
#: Graphviz's `dot` grows faster than the node count: on the reference machine (one core) an
#: unrolled GPT-2 small (680 nodes) takes 0.2 s, 2,700 nodes 2 s and 5,300 nodes with their
#: 1,100 boxes 10 s (`scripts/bench_draw.py`); a loaded machine takes a few times longer. Past
#: this many, the call refuses before the layout starts and says how to narrow the drawing.
MAX_NODES = 4000


class Drawing(str):
    """The SVG text of a drawing; a notebook shows it as the picture (`_repr_svg_`).

    It is a `str` (write it to a file, embed it in HTML) with a few facts about the drawing.

    Attributes:
        counts: how many nodes and edges of each kind it draws (`"op"`, `"input"`, `"param"`,
            `"output"`, `"module"` (a module folded into one node), `"stub"` (an op outside a
            focus), `"outside"`; edges `"flow"`, `"param_edge"`, `"loop"` (into the next layer of
            a rolled stack), `"output_edge"`, `"outside_edge"`).
        unplaced: each highlighted name with no mark on the drawing, with the reason.
        groups: for each rolled stack, its groups of layers: `(stack, layer indices, reason)`,
            the reason empty for the group the others are compared with.
        layout_seconds: how long Graphviz took.
    """

    counts: dict[str, int]
    unplaced: dict[str, str]
    groups: list[tuple[str, tuple[int, ...], str]]
    layout_seconds: float

    def __new__(cls, svg: str, counts=None, unplaced=None, groups=None, layout_seconds=0.0):
        self = super().__new__(cls, svg)
        self.counts = dict(counts or {})
        self.unplaced = dict(unplaced or {})
        self.groups = list(groups or [])
        self.layout_seconds = layout_seconds
        return self

    def _repr_svg_(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        nodes = sum(
            v
            for k, v in self.counts.items()
            if not k.endswith("edge") and k not in ("flow", "loop")
        )
        edges = sum(
            v for k, v in self.counts.items() if k.endswith("edge") or k in ("flow", "loop")
        )
        return f"Drawing({nodes} nodes, {edges} edges, {len(self)} characters of SVG)"


# -- highlight ---------------------------------------------------------------------------------


def _generations() -> dict:
    return GENERATIONS


def _check_generation(generation: Any, what: str) -> None:
    gens = _generations()
    if not isinstance(generation, str) or generation not in gens:
        hint = did_you_mean(str(generation), gens)
        raise UnknownGeneration(
            f"{what}: unknown generation {generation!r}.{hint} Generations: "
            f"{', '.join(repr(g) for g in gens)}."
        )


def _highlight_names(
    highlight: Any, generation: str | None
) -> list[tuple[str | None, str]] | str | None:
    """`highlight=` as a list of (generation or None, name), or `"facets"`, or None."""
    if highlight is None:
        return None
    if isinstance(highlight, str):
        if highlight == "facets":
            return "facets"
        if highlight.lower() in ("facet", "facets", "all"):  # a near miss of the one keyword
            raise DrawSpecError(
                f"highlight={highlight!r}: did you mean highlight='facets' (mark every op a facet "
                "is served from)? Otherwise pass hook names, e.g. highlight=['blocks.0.hook_resid_post']."
            )
        return [(generation, highlight)]
    if isinstance(highlight, Mapping):
        if generation is not None:
            raise DrawSpecError(
                f"highlight= is a dict of generation -> names, so it names each name's generation; drop "
                f"generation={generation!r}, or pass highlight= as a list with generation=."
            )
        out = []
        for gen, names in highlight.items():
            _check_generation(gen, "highlight= key")
            if isinstance(names, str) or not isinstance(names, (list, tuple)):
                raise DrawSpecError(
                    f"highlight={{{gen!r}: ...}} takes a list of names of that generation, not "
                    f"{type(names).__name__} {names!r}; e.g. {{{gen!r}: ['blocks.0.hook_resid_post']}}."
                )
            out += [(gen, n) for n in names]
        return _check_names(out)
    if isinstance(highlight, (list, tuple)):
        return _check_names([(generation, n) for n in highlight])
    raise DrawSpecError(
        f'highlight= takes a list of names (with generation=), a dict generation -> names, or "facets"; not '
        f"{type(highlight).__name__} {highlight!r}."
    )


def _check_names(pairs):
    for _, n in pairs:
        if not isinstance(n, str):
            raise DrawSpecError(
                f"highlight= names must be strings (hook names such as 'blocks.0.hook_resid_post'), "
                f"not {type(n).__name__} {n!r}."
            )
    return pairs


def _resolve(trace: Trace, name: str, generation: str | None, what: str):
    try:
        return resolve_alias(trace, name, generation=generation)
    except AliasError as exc:
        cls = type(exc)
        raise cls(f"{what}={name!r}: {str(exc).rstrip('.')}.") from None


def _status_of_site(site) -> str:
    if not site.saved:
        return "needs_capture"
    return "real" if site.kind == "real" else "reconstructed_read_only"


def _place_marks(scene: Scene, names, several_generations: bool) -> None:
    """Resolve each name and put its mark on the node (or box) of the op it reads."""
    trace = scene.trace
    if names == "facets":
        for call in _drawn_calls(scene):
            if call.facets is None:
                continue
            # the pending checks first, as resolve_alias runs the one of its site: a site whose
            # check fails is marked refused, whether or not it was read before the drawing
            call.facets.check()
            for facet, site in call.facets.sites.items():
                if facet in ("input", "output"):
                    continue
                mark = Mark(
                    facet, _status_of_site(site), facet, None, f"{call.address or '<root>'}:{facet}"
                )
                _put(scene, mark, call, site.op, site)
            for facet, why in call.facets.refused.items():
                mark = Mark(facet, "refused", facet, None, f"{call.address or '<root>'}:{facet}")
                _put(scene, mark, call, None)
                scene.notes.append(f"{call.address or '<root>'}:{facet} is refused: {why}")
        return
    for gen, name in names:
        r = _resolve(trace, name, gen, "highlight")
        label = f"{r.generation} {name}" if several_generations else name
        if (
            r.module_address is None
            or r.facet is None
            or r.status in ("structurally_absent", "ambiguous")
        ):
            scene.unplaced[label] = f"{r.status}: {r.reason}"
            continue
        rec = trace.modules[r.module_address]
        if not rec.calls:
            scene.unplaced[label] = f"{r.module_address} did not run"
            continue
        read = rec.calls[r.call or 0]
        hit = read.facets.sites.get(r.facet) if read.facets is not None else None
        mark = Mark(
            label, r.status, name, r.generation, f"{r.module_address or '<root>'}:{r.facet}"
        )
        if not _put(scene, mark, read, hit.op if hit is not None else None, hit):
            where = f"{r.module_address or '<root>'}:{r.facet}"
            scene.unplaced[label] = (
                f"{r.status}: it reads {where}, outside this drawing "
                f"(focus={scene.focus_label!r}); draw without focus= or focus on "
                f"{r.module_address or '<root>'!r}"
            )
        elif r.status == "refused":
            scene.notes.append(f"{label}: refused: {r.reason}")


def _put(scene: Scene, mark: Mark, call: ModuleCall, op: int | None, site: Any = None) -> bool:
    """Put `mark` on the node of op `op` (or the holder of `call`); where the site's tensor is
    not that op's whole output (GPT-NeoX's q, a third of a fused projection viewed per head; one
    output of a chunk), the drawing's notes say so."""
    target = scene.node_of_site_op(op) if op is not None else scene.holder_of_call(call)
    if target is None:
        return False
    target.marks.append(mark)
    if op is not None and site is not None:
        rec = scene.trace.ops[op]
        whole = tuple(rec.shapes[0]) if len(rec.shapes) == 1 else None
        if whole != tuple(site.shape):
            part = "one output" if whole is None else "a part or rearrangement"
            scene.notes.append(
                f"{mark.text} is {part} of #{op} `{rec.name}`'s output "
                f"({'x'.join(map(str, site.shape)) or 'scalar'}), not all of it"
            )
    return True


def _drawn_calls(scene: Scene) -> list[ModuleCall]:
    calls = [b.call for b in scene.boxes.values()]
    for node in scene.nodes.values():
        if node.kind == "module":
            rec = scene.trace.modules[node.attrs["data-module"]]
            calls.append(rec.calls[int(node.attrs["data-call"])])
    if not scene.focus_calls and scene.root is not None:
        calls.insert(0, scene.root)
    return sorted(calls, key=lambda c: (c.first_op, -c.end_op))


# -- the entry point ---------------------------------------------------------------------------


def _focus(trace: Trace, focus: Any, generation: str | None):
    """(calls to draw, label, names to highlight) for `focus=`."""
    if focus is None:
        return None, None, []
    if not isinstance(focus, str) or not focus.strip():
        raise DrawSpecError(
            f"focus= takes a module address (e.g. {_example_address(trace)!r}) or a hook name "
            f"(e.g. 'blocks.0.hook_resid_post'), not {type(focus).__name__} {focus!r}."
        )
    text = focus.strip()
    address, _, facet_text = text.rpartition(":") if ":" in text else (text, "", "")
    facet = facet_text or None
    if address in trace.modules or address in ("<root>", ""):
        rec = trace.modules[address if address != "<root>" else ""]
        if not rec.calls:
            raise DrawSpecError(
                f"focus={focus!r}: {rec.address} did not run in this forward, so it has no ops to "
                f"draw; pick a module that ran, e.g. {_example_address(trace)!r}."
            )
        extra = []
        if facet:
            sites = rec.calls[0].facets.sites if rec.calls[0].facets is not None else {}
            if facet not in sites:
                hint = did_you_mean(facet, sites)
                raise DrawSpecError(
                    f"focus={focus!r}: {rec.address or '<root>'} has no facet {facet!r}.{hint} "
                    f"Its facets: {', '.join(sites) or '(none)'}."
                )
            extra = [("site", f"{rec.address}:{facet}")]
        if rec.address == "":
            return None, None, extra
        return list(rec.calls), rec.address, extra
    try:
        r = resolve_alias(trace, text, generation=generation)
    except UnknownAlias as exc:
        hits = close_matches(text, [a for a in trace.modules if a])
        hint = f" Modules like it: {', '.join(repr(h) for h in hits)}." if hits else ""
        raise DrawSpecError(
            f"focus={focus!r} names no module of this trace ({len(trace.modules)} addresses, e.g. "
            f"{_example_address(trace)!r}) and no hook name: {str(exc).rstrip('.')}.{hint}"
        ) from None
    except AliasError as exc:
        raise type(exc)(f"focus={focus!r}: {str(exc).rstrip('.')}.") from None
    if r.module_address is None:
        raise DrawSpecError(
            f"focus={focus!r} is a {r.generation} name with no site in this trace ({r.status}: "
            f"{r.reason}); focus on a module address instead, e.g. {_example_address(trace)!r}."
        )
    rec = trace.modules[r.module_address]
    calls = [rec.calls[r.call]] if r.call is not None else list(rec.calls)
    if r.module_address == "":
        return None, None, [(r.generation, text)]
    return calls, r.module_address, [(r.generation, text)]


def _example_address(trace: Trace) -> str:
    return trace.blocks[0] if trace.blocks else next((a for a in trace.modules if a), "")


def draw(
    trace: Trace,
    path: str | os.PathLike | None = None,
    *,
    rolled: bool = True,
    depth: int | None = None,
    focus: str | None = None,
    highlight: Any = None,
    generation: str | None = None,
    max_nodes: int | None = MAX_NODES,
) -> Drawing:
    """Draw `trace`'s op graph; see [`Trace.draw`][torchlens.Trace.draw]."""
    if not isinstance(trace, PERSISTED["Trace"]):
        raise DrawSpecError(f"draw() takes a torchlens Trace, not {type(trace).__name__}.")
    if not isinstance(rolled, bool):
        raise DrawSpecError(
            f"rolled= takes True (each stack's repeated layers drawn once, ×N) or False (every op), "
            f"not {rolled!r}."
        )
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise DrawSpecError(
            f"depth= takes None (every module a box) or a whole number >= 0 (how many levels of "
            f"module boxes to draw; deeper modules are drawn as one node each, depth=0 draws no box), "
            f"not {depth!r}."
        )
    if max_nodes is not None and (
        isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1
    ):
        raise DrawSpecError(
            f"max_nodes= takes a positive whole number or None (no limit), not {max_nodes!r}."
        )
    if generation is not None:
        _check_generation(generation, "generation=")
        if highlight is None and focus is None:
            raise DrawSpecError(
                f"generation={generation!r} names the naming generation of highlight= and focus= "
                "names, and neither is given; pass highlight=[...] or focus='...' with it, or "
                "leave it out."
            )
    fmt = None
    if path is not None:
        if not isinstance(os.fspath(path) if isinstance(path, os.PathLike) else path, str):
            raise DrawSpecError(
                f"path= takes a str or a pathlib.Path ending in .svg, .png or .pdf, not "
                f"{type(path).__name__}."
            )
        fmt = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
        if fmt not in ("svg", "png", "pdf"):
            raise DrawSpecError(
                f"path={os.fspath(path)!r}: draw writes .svg, .png or .pdf files; end the path with "
                f"one of those."
            )
    if not trace.modules or "" not in trace.modules or not trace.modules[""].calls:
        raise DrawSpecError(
            "this trace has no root module call to draw (its records are incomplete)."
        )
    names = _highlight_names(highlight, generation)
    focus_calls, focus_label, focus_names = _focus(trace, focus, generation)
    scene = Scene(
        trace, rolled=rolled, depth=depth, focus_calls=focus_calls, focus_label=focus_label
    )
    count = len(scene.nodes) + len(scene.boxes)
    if max_nodes is not None and count > max_nodes:
        raise DrawingTooLarge(_too_large(trace, scene, count, max_nodes, rolled, depth, focus))
    several = isinstance(highlight, Mapping) and len(highlight) > 1
    site_names = [n for g, n in focus_names if g == "site"]
    alias_names = [(g, n) for g, n in focus_names if g != "site"]
    if names == "facets":
        _place_marks(scene, "facets", False)
        names = []
    if alias_names or names:
        pairs = list(names or [])
        pairs += [p for p in alias_names if p not in pairs]
        if not several and len({g for g, _ in pairs if g is not None}) > 1:
            several = True
        _place_marks(scene, pairs, several)
    for site in site_names:
        address, facet = site.rsplit(":", 1)
        call = trace.modules[address].calls[0]
        assert call.facets is not None  # site_names come from calls with facets
        s = call.facets.sites[facet]
        _put(scene, Mark(site, _status_of_site(s), site, None, site), call, s.op)
    measure(scene)
    lay = layout(scene)
    title = (
        f"{trace.model_class}: op graph"
        + (f" of {focus_label}" if focus_label else "")
        + (", rolled" if scene.groups else "")
    )
    desc = (
        f"The recorded ops of one forward of {trace.model_class} as TorchLens traced it: "
        f"{sum(n.kind == 'op' for n in scene.nodes.values())} ops drawn"
        + (
            f", layers of {', '.join(sorted({g.stack for g in scene.groups}))} rolled"
            if scene.groups
            else ""
        )
        + "."
    )
    text = render_svg(scene, lay, title, desc)
    counts: dict[str, int] = {}
    for n in scene.nodes.values():
        counts[n.kind] = counts.get(n.kind, 0) + 1
    for kind in scene.edges.values():
        counts[kind] = counts.get(kind, 0) + 1
    groups = [(g.stack, tuple(g.layers), g.reason) for g in scene.groups]
    drawing = Drawing(text, counts, scene.unplaced, groups, lay.seconds)
    if path is not None and fmt == "svg":
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    elif path is not None and fmt in ("png", "pdf"):
        with contextlib.redirect_stderr(io.StringIO()):
            dot_graph(scene, with_text=True).draw(os.fspath(path), format=fmt, prog="dot")
    return drawing


def _too_large(trace, scene, count, max_nodes, rolled, depth, focus) -> str:
    """The refusal's message: how big the drawing is and smaller ones, with their sizes."""
    options = []

    def size(**kw):
        args = dict(
            rolled=rolled, depth=depth, focus_calls=scene.focus_calls, focus_label=scene.focus_label
        )
        args.update(kw)
        s = Scene(trace, **args)
        return len(s.nodes) + len(s.boxes)

    # only drawings smaller than this one are offered
    if not rolled and trace.structure is not None and trace.structure.stacks:
        n = size(rolled=True)
        if n < count:
            options.append(f"rolled=True ({n} nodes: each stack's repeated layers drawn once)")
    for d in (2, 1, 0):
        if depth is None or depth > d:
            n = size(depth=d)
            if n < count:
                options.append(
                    f"depth={d} ({n} nodes: modules below {d} levels drawn as one node each)"
                )
                break
    if trace.blocks:
        block = trace.blocks[0]
        calls = list(trace.modules[block].calls)
        n = size(focus_calls=calls, focus_label=block)
        if n < count:
            options.append(f"focus={block!r} ({n} nodes; any module address or hook name)")
    return (
        f"this drawing has {count} nodes and boxes ({len(scene.visible)} ops"
        f"{', unrolled' if not rolled else ''}{', focus=' + repr(focus) if focus else ''}); more than "
        f"max_nodes={max_nodes}, past which Graphviz's layout takes too long to wait for. Narrow it: "
        f"{'; '.join(options) or 'focus= a module address'}; or pass max_nodes=None to lay it out anyway."
    )
