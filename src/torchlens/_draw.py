"""The op graph of a trace, drawn: [`Trace.draw`][torchlens.Trace.draw].

One picture of the recorded computation: a node per op (its index, name, output shape, the dtype
where it changes), per model input, per parameter where it enters and for the output; an arrow
per data-flow edge recorded in `OpRecord.inputs`; module calls as nested boxes. Everything comes
from the records (`trace.ops`, `trace.modules`, `trace.structure`), never from tensors, so a
trace loaded with [`torchlens.load`][torchlens.load] or taken with `save="none"` draws the same.

The drawing is built in three steps:

1. **What to draw** (`_Scene`): the ops in view (all, or a `focus=` module's and the ops just
   outside it as stubs), rolled stacks (`_roll`: the layers of a stack whose recorded op
   sequences are the same are drawn once, `×N`; a layer that differs, or a second call of one
   block, is drawn apart with the reason), modules deeper than `depth=` folded into one node,
   and the marks of `highlight=` (each name resolved with
   [`resolve_alias`][torchlens.mechinterp.resolve_alias] to the op whose output it reads).
2. **Layout** (`_layout`): Graphviz's `dot`, run in-process through pygraphviz (whose wheels
   ship Graphviz, so `pip install` is enough). Every node and box label gets a fixed size
   computed here from a monospace character width, so the layout does not depend on the fonts
   of the machine and no label can overflow its node.
3. **SVG** (`_svg`): drawn here from the layout's coordinates, with integer-free but rounded
   coordinates, no timestamps and a fixed order, so the same trace gives the same bytes.
"""

from __future__ import annotations

import contextlib
import html
import io
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torchlens._core.errors import TorchLensError, close_matches
from torchlens._core.persisted import PERSISTED
from torchlens._core.records import ModuleCall, Ref
from torchlens._naming.resolver import GENERATIONS, AliasError, UnknownAlias, UnknownGeneration, resolve_alias

if TYPE_CHECKING:
    from torchlens._trace import Trace

__all__ = ["Drawing", "DrawSpecError", "DrawingTooLarge", "LayoutEngineMissing", "draw", "MAX_NODES"]

#: The most nodes and module boxes `draw` lays out without being asked to (`max_nodes=`).
#: Graphviz's `dot` grows faster than the node count: on the reference machine (one core) an
#: unrolled GPT-2 small (680 nodes) takes 0.2 s, 2,700 nodes 2 s and 5,300 nodes with their
#: 1,100 boxes 10 s (`scripts/bench_draw.py`); a loaded machine takes a few times longer. Past
#: this many, the call refuses before the layout starts and says how to narrow the drawing.
MAX_NODES = 4000


class DrawSpecError(TorchLensError, ValueError):
    """An argument of [`Trace.draw`][torchlens.Trace.draw] is not accepted; the message says what is."""


class DrawingTooLarge(DrawSpecError):
    """The drawing asked for has more nodes than `max_nodes`; the message gives smaller ones.

    Raised before the layout starts, so a call that would take minutes fails at once.
    """


class LayoutEngineMissing(TorchLensError, ImportError):
    """pygraphviz (Graphviz in a wheel, the layout engine) is not installed."""


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
        nodes = sum(v for k, v in self.counts.items() if not k.endswith("edge") and k not in ("flow", "loop"))
        edges = sum(v for k, v in self.counts.items() if k.endswith("edge") or k in ("flow", "loop"))
        return f"Drawing({nodes} nodes, {edges} edges, {len(self)} characters of SVG)"


# -- drawing constants -------------------------------------------------------------------------

FONT = "DejaVu Sans Mono, Menlo, Consolas, Liberation Mono, monospace"
FS = 12  # op names, box titles
FS_SMALL = 11  # shapes, marks, notes: never below 11 px at 100% zoom
CW = 0.62  # character width per px of font size, a little over what monospace fonts use
LH = 15  # line height of 12 px text
LH_SMALL = 14
PAD_X = 7
PAD_Y = 5
MARGIN = 14
NOTE_CHARS = 96  # wrap width of the notes under the graph
BOX_LABEL_CHARS = 58  # wrap width of a box's reason line

#: Status -> (strong colour, pale fill, word shown in the label). Okabe-Ito hues, which stay apart
#: under the common colour-vision deficiencies; the word carries the status too.
STATUS_STYLE = {
    "real": ("#0072b2", "#e3f0fa", "real"),
    "reconstructed_read_only": ("#009e73", "#dff5ee", "read-only"),
    "needs_capture": ("#e69f00", "#fdf1d8", "needs capture"),
    "refused": ("#d55e00", "#fbe6d9", "refused"),
    "structurally_absent": ("#6e7781", "#eef0f2", "absent"),
    "ambiguous": ("#cc79a7", "#f8e8f1", "ambiguous"),
}

COLORS = {
    "bg": "#ffffff", "ink": "#1f2328", "muted": "#57606a", "line": "#8c959f", "edge": "#57606a",
    "op": "#f6f8fa", "input": "#e7f0fb", "input_line": "#0072b2", "param": "#fff8e5", "param_line": "#b08800",
    "module": "#eef1f8", "module_line": "#57606a", "inplace_line": "#d55e00", "loop": "#0072b2",
    "stub": "#ffffff", "box_line": "#a5adb6", "group_line": "#0072b2",
}
BOX_FILLS = ("#fbfbfd", "#f3f5f9")


# -- the scene: what to draw -------------------------------------------------------------------


@dataclass
class _Mark:
    text: str  # "2.x blocks.0.hook_resid_mid"
    status: str
    name: str
    generation: str | None
    site: str  # "transformer.h.0:resid_mid"


@dataclass
class _Node:
    id: str
    kind: str  # op, input, param, output, module, stub, outside
    lines: list[tuple[str, int, bool]]  # (text, font size, bold)
    box: Any = None  # the _Box it sits in, or None (top level)
    op: int | None = None
    title: str = ""
    marks: list[_Mark] = field(default_factory=list)
    inplace: bool = False
    attrs: dict[str, str] = field(default_factory=dict)
    w: float = 0.0
    h: float = 0.0


@dataclass
class _Box:
    id: str
    call: ModuleCall
    parent: Any  # _Box or None
    lines: list[tuple[str, int, bool]] = field(default_factory=list)
    marks: list[_Mark] = field(default_factory=list)
    group: Any = None  # the _Group of a rolled layer's box
    level: int = 1


@dataclass
class _Group:
    stack: str
    layers: list[int]  # layer indices in the stack
    calls: list[ModuleCall]
    reason: str = ""

    @property
    def rep(self) -> ModuleCall:
        return self.calls[0]


def _op_signature(trace: Trace, call: ModuleCall) -> tuple:
    """What a layer call computed, with nothing layer-specific in it: per op its name, its module
    (relative to the layer) and class, output shapes and dtypes, whether it wrote in place, and
    where each input came from (an op of the layer by offset, the layer's input, a parameter of
    the layer by relative name, or an op or parameter outside the layer by identity)."""
    lo, hi = call.first_op, call.end_op
    prefix = call.address + "."
    sig = []
    for op in trace.ops[lo:hi]:
        mod = op.module
        rel = mod[len(prefix):] if mod.startswith(prefix) else ("." if mod == call.address else "@" + mod)
        cls = trace.modules[mod].class_name if mod in trace.modules else ""
        ins = []
        for r in op.inputs:
            if type(r) is Ref:
                if lo <= r.op < hi:
                    ins.append(("op", r.op - lo, r.slot))
                elif r == call.input_ref:
                    ins.append(("input",))
                else:
                    ins.append(("outside", r.op, r.slot))
            elif isinstance(r, str):
                ins.append(("param", r[len(prefix):]) if r.startswith(prefix) else ("outside_param", r))
            else:
                ins.append(("none",))
        sig.append((op.name, rel, cls, tuple(tuple(s) for s in op.shapes), tuple(str(d) for d in op.dtypes),
                    bool(op.mutated), tuple(ins)))
    return tuple(sig)


def _describe_op(trace: Trace, i: int) -> str:
    op = trace.ops[i]
    return f"#{i} `{op.name}` in {op.module or '<root>'}"


def _difference(trace: Trace, a: ModuleCall, b: ModuleCall, sa: tuple, sb: tuple, la: int) -> str:
    """Why layer call `b` is not drawn as layer `la` (call `a`): the first thing their op
    sequences disagree on, in words."""
    ra, rb = trace.modules[a.address], trace.modules[b.address]
    if ra.class_name != rb.class_name:
        return f"it is a {rb.class_name}, layer {la} a {ra.class_name}"
    subs_a, subs_b = _sub_calls(trace, a), _sub_calls(trace, b)
    counts = f"; it runs {len(sb)} ops, layer {la} {len(sa)}"
    for rel, cls in subs_b.items():
        if rel in subs_a and subs_a[rel] != cls:
            return f"its {rel} is a {cls} where layer {la}'s is a {subs_a[rel]}{counts}"
    for rel, cls in subs_b.items():
        if rel not in subs_a:
            return f"it runs {rel} ({cls}), which layer {la} does not{counts}"
    for rel, cls in subs_a.items():
        if rel not in subs_b:
            return f"it does not run {rel} ({cls}), which layer {la} runs{counts}"
    for k, (x, y) in enumerate(zip(sa, sb)):
        if x == y:
            continue
        name_x, rel_x, cls_x = x[:3]
        name_y, rel_y, cls_y = y[:3]
        def where(rel, cls):
            return ("the layer itself" if rel == "." else rel.lstrip("@")) + (f" ({cls})" if cls else "")

        if (name_x, rel_x) != (name_y, rel_y):
            return (f"its op {k} is `{name_y}` in {where(rel_y, cls_y)} where layer {la}'s is `{name_x}` in "
                    f"{where(rel_x, cls_x)}; it runs {len(sb)} ops, layer {la} {len(sa)}")
        if x[3] != y[3]:
            def shape(s):
                return "×".join(map(str, s[0])) if s else "-"
            return f"its op {k} (`{name_y}`) returns {shape(y[3])} where layer {la}'s returns {shape(x[3])}"
        if x[4] != y[4]:
            return f"its op {k} (`{name_y}`) returns {y[4][0]} where layer {la}'s returns {x[4][0]}"
        if x[5] != y[5]:
            return f"its op {k} (`{name_y}`) {'writes' if y[5] else 'does not write'} its input in place"
        outside = [(p, q) for p, q in zip(x[6], y[6]) if p != q and (p[0] == "outside" or q[0] == "outside")]
        if outside:
            p, q = outside[0]
            theirs = _describe_op(trace, q[1]) if q[0] == "outside" else "an input of the layer"
            ours = _describe_op(trace, p[1]) if p[0] == "outside" else "an input of the layer"
            return (f"its op {k} (`{name_y}` in {where(rel_y, cls_y)}) reads {theirs} where layer {la}'s reads "
                    f"{ours} (a mask, bias or table computed outside the layers)")
        return f"its op {k} (`{name_y}`) reads its inputs from other places than layer {la}'s"
    return f"it runs {len(sb)} ops, layer {la} {len(sa)}; the first {min(len(sa), len(sb))} are the same"


def _sub_calls(trace: Trace, call: ModuleCall) -> dict[str, str]:
    """Relative address -> class of the module calls made inside a layer call, in run order."""
    out: dict[str, str] = {}
    prefix = call.address + "."
    for op in trace.ops[call.first_op:call.end_op]:
        a = op.module
        while a.startswith(prefix):
            rel = a[len(prefix):]
            if rel not in out:
                out[rel] = trace.modules[a].class_name
            a = a.rsplit(".", 1)[0]
    return out


def _roll(trace: Trace) -> dict[str, list[_Group]]:
    """The groups of each stack's layers: layers with one op signature form a group (drawn once,
    `×N`), in the order their first layer ran. A layer whose block already ran as an earlier layer
    (one module called twice) is a group of its own kind, drawn apart: its weights are the
    earlier layer's."""
    out: dict[str, list[_Group]] = {}
    structure = trace.structure
    if structure is None:
        return out
    for name, stack in structure.stacks.items():
        if len(stack.layers) < 2:
            continue
        seen_address: dict[str, int] = {}
        by_key: dict[tuple, _Group] = {}
        sigs: dict[int, tuple] = {}
        groups: list[_Group] = []
        for i, layer in enumerate(stack.layers):
            call = layer.call
            if call.end_op <= call.first_op:
                continue
            sig = _op_signature(trace, call)
            again = seen_address.get(call.address)
            seen_address.setdefault(call.address, i)
            key = (sig, again is not None)
            g = by_key.get(key)
            if g is None:
                g = by_key[key] = _Group(name, [], [])
                groups.append(g)
                sigs[id(g)] = sig
            g.layers.append(i)
            g.calls.append(call)
        if not groups:
            continue
        firsts = [g for g, key in zip(groups, by_key) if not key[1]]
        main = max(firsts or groups, key=lambda g: (len(g.layers), -g.layers[0]))
        for g, key in zip(groups, by_key):
            if g is main:
                continue
            if key[1]:
                earlier = [(seen_address[c.address], c.address) for c in g.calls]
                j, address = earlier[0]
                more = ", …" if len({a for _, a in earlier}) > 1 else ""
                g.reason = (f"{'each of these layers calls' if len(g.calls) > 1 else 'it calls'} a block that "
                            f"already ran as an earlier layer ({address} as layer {j}{more}), so its weights are "
                            f"that layer's")
            else:
                g.reason = _difference(trace, main.rep, g.rep, sigs[id(main)], sigs[id(g)], main.layers[0])
        out[name] = groups
    return out


def _ranges(ints: list[int]) -> str:
    """`[0, 1, 2, 5, 7, 8]` -> `'0–2, 5, 7–8'`."""
    parts, start, prev = [], None, None
    for i in ints:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            parts.append(f"{start}–{prev}" if prev != start else f"{start}")
            start = prev = i
    if start is not None:
        parts.append(f"{start}–{prev}" if prev != start else f"{start}")
    return ", ".join(parts)


def _shape(shape) -> str:
    return "×".join(map(str, shape)) if len(shape) else "scalar"


def _dtype(d) -> str:
    return str(d).replace("torch.", "")


def _wrap(text: str, width: int) -> list[str]:
    lines: list[str] = []
    for word in text.split():
        while len(word) > width:  # a long address: cut it (rare)
            if lines and not lines[-1]:
                lines.pop()
            lines.append(word[:width])
            word = word[width:]
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines or [""]


def _relative(address: str, parent: str) -> str:
    if parent and address.startswith(parent + "."):
        return address[len(parent) + 1:]
    return address or "<root>"


class _Scene:
    """Everything one drawing shows, before layout."""

    def __init__(self, trace: Trace, *, rolled: bool, depth: int | None, focus_calls: list[ModuleCall] | None,
                 focus_label: str | None):
        self.trace = trace
        self.depth = depth
        self.nodes: dict[str, _Node] = {}
        self.edges: dict[tuple[str, str], str] = {}  # (src, dst) -> kind, in insertion order
        self.boxes: dict[int, _Box] = {}  # id(call) -> box
        self.notes: list[str] = []
        self.unplaced: dict[str, str] = {}
        self.focus_calls = focus_calls
        self.focus_label = focus_label
        ops = trace.ops
        root = trace.modules[""].calls[0] if trace.modules[""].calls else None
        self.root = root
        tops = focus_calls or ([root] if root is not None else [])
        self._top_ids = {id(c) for c in tops}
        if focus_calls:
            self.visible = sorted({i for c in focus_calls for i in range(c.first_op, c.end_op)})
        else:
            self.visible = list(range(len(ops)))
        visible_set = set(self.visible)
        self.visible_set = visible_set
        # rolled stacks: the ops of every layer but a group's first map to that layer's ops
        self.canon: dict[int, int] = {}
        self.member: dict[int, tuple[int, int]] = {}  # op -> (group id, position of its layer in the group)
        self.groups: list[_Group] = []
        self.group_of_rep: dict[int, _Group] = {}  # id(rep call) -> group
        self.call_canon: dict[int, ModuleCall] = {}  # id(hidden call) -> the rep's call it stands for
        if rolled:
            for stack_groups in _roll(trace).values():
                inside = all(all(i in visible_set for i in (c.first_op, c.end_op - 1)) for g in stack_groups
                             for c in g.calls)
                if not inside or (focus_calls and any(id(c) in self._top_ids for g in stack_groups for c in g.calls)):
                    continue
                for g in stack_groups:
                    self.groups.append(g)
                    self.group_of_rep[id(g.rep)] = g
                    rep = g.rep
                    for pos, c in enumerate(g.calls):
                        for i in range(c.first_op, c.end_op):
                            self.member[i] = (id(g), pos)
                            if pos:
                                self.canon[i] = rep.first_op + (i - c.first_op)
                        if pos:
                            self._map_calls(c, rep)
        self._folded: dict[int, str] = {}
        self._build()

    # -- calls ------------------------------------------------------------------------------

    def _map_calls(self, hidden: ModuleCall, rep: ModuleCall) -> None:
        """Map each call under a hidden layer to the call at the same place under its group's first layer."""
        reps: dict[tuple[str, int], ModuleCall] = {}
        for c in self._calls_within(rep):
            reps[(_relative(c.address, rep.address) if c is not rep else ".", c.first_op - rep.first_op)] = c
        for c in self._calls_within(hidden):
            key = (_relative(c.address, hidden.address) if c is not hidden else ".", c.first_op - hidden.first_op)
            if key in reps:
                self.call_canon[id(c)] = reps[key]

    def _calls_within(self, call: ModuleCall) -> list[ModuleCall]:
        """`call` and every call made inside it (by op range and parent links)."""
        out = [call]
        for rec in self.trace.modules.values():
            for c in rec.calls:
                if c is not call and call.first_op <= c.first_op and c.end_op <= call.end_op and self._under(c, call):
                    out.append(c)
        return out

    @staticmethod
    def _under(c: ModuleCall, ancestor: ModuleCall) -> bool:
        p = c.parent
        while p is not None:
            if p is ancestor:
                return True
            p = p.parent
        return False

    def _chain(self, op_index: int) -> list[ModuleCall]:
        """The calls an op ran in, from just below the drawing's top down to its innermost one."""
        op = self.trace.ops[op_index]
        rec = self.trace.modules[op.module] if op.module and op.module in self.trace.modules else None
        call = rec.calls[op.call] if rec is not None and op.call < len(rec.calls) else None
        chain: list[ModuleCall] = []
        while call is not None and id(call) not in self._top_ids and call is not self.root:
            chain.append(call)
            call = call.parent
        chain.reverse()
        return chain

    # -- nodes ------------------------------------------------------------------------------

    def _box(self, call: ModuleCall, parent: _Box | None, level: int) -> _Box:
        box = self.boxes.get(id(call))
        if box is None:
            box = _Box(f"c{len(self.boxes)}", call, parent, level=level)
            box.group = self.group_of_rep.get(id(call))
            box.lines = self._call_lines(call, parent.call.address if parent else self._top_address(), box.group,
                                         as_box=True)
            self.boxes[id(call)] = box
        return box

    def _top_address(self) -> str:
        return self.focus_calls[0].address if self.focus_calls else ""

    def _call_lines(self, call: ModuleCall, parent_address: str, group: _Group | None, as_box: bool):
        rec = self.trace.modules[call.address]
        name = _relative(call.address, parent_address)
        if len(rec.calls) > 1:
            name += f" (call {call.index})"
        lines = []
        if group is not None:
            addresses = [c.address for c in group.calls]
            stack = group.stack.split("#")[0]
            n = len(group.layers)
            title = f"{name} · {rec.class_name}" + (f" ×{n}" if n > 1 else "")
            lines.append((title, FS, True))
            if n > 1:
                drawn = _relative(call.address, parent_address)
                lines.append((f"layers {_ranges(group.layers)} of {stack or '<root>'}, drawn once as {drawn}", FS_SMALL,
                              False))
                last = _relative(addresses[-1], parent_address)
                if len(set(addresses)) == n:
                    lines.append((f"({drawn} … {last}: {n} modules, one op sequence)", FS_SMALL, False))
                else:
                    lines.append((f"({len(set(addresses))} modules run {n} times, one op sequence)", FS_SMALL, False))
            else:
                lines.append((f"layer {group.layers[0]} of {stack or '<root>'}", FS_SMALL, False))
            if group.reason:
                for i, text in enumerate(_wrap("drawn apart: " + group.reason, BOX_LABEL_CHARS)):
                    lines.append((text, FS_SMALL, False))
        else:
            lines.append((f"{name} · {rec.class_name}", FS, True))
        if not as_box:
            n_ops = call.end_op - call.first_op
            out = call.output_ref
            shape = ""
            if type(out) is Ref:
                shape = " → " + _shape(self.trace.ops[out.op].shapes[out.slot])
            lines.append((f"{n_ops} op{'s' if n_ops != 1 else ''}{shape}", FS_SMALL, False))
        return lines

    def _node_for_op(self, i: int) -> _Node:
        """The node op `i` is drawn as (its own, or the folded module it ran in); made on first use."""
        chain = self._chain(i)
        depth = self.depth
        parent: _Box | None = None
        if self.focus_calls:
            top = next((c for c in self.focus_calls if c.first_op <= i < c.end_op), self.focus_calls[0])
            parent = self._box(top, None, 0)
        folded = depth is not None and len(chain) > depth
        for level, call in enumerate(chain[: depth if folded else len(chain)], start=1):
            parent = self._box(call, parent, level)
        if folded:
            call = chain[depth]
            nid = self._folded_id(call)
            node = self.nodes.get(nid)
            if node is None:
                group = self.group_of_rep.get(id(call))
                lines = self._call_lines(call, parent.call.address if parent else self._top_address(), group,
                                         as_box=False)
                rec = self.trace.modules[call.address]
                node = _Node(nid, "module", lines, parent, title=f"{call.address} ({rec.class_name}), call "
                             f"{call.index}: ops #{call.first_op}–#{call.end_op - 1}")
                node.attrs["data-module"] = call.address
                node.attrs["data-call"] = str(call.index)
                node.attrs["data-first-op"] = str(call.first_op)
                self.nodes[nid] = node
            return node
        nid = f"o{i}"
        node = self.nodes.get(nid)
        if node is None:
            node = self._op_node(i, parent)
            self.nodes[nid] = node
        return node

    def _folded_id(self, call: ModuleCall) -> str:
        """The node id of a module drawn as one node: numbered in the order calls are first met
        (never an object's `id`, which changes from one process to the next)."""
        key = self._folded.get(id(call))
        if key is None:
            key = self._folded[id(call)] = f"m{len(self._folded)}"
        return key

    def _op_node(self, i: int, parent: _Box | None) -> _Node:
        op = self.trace.ops[i]
        if op.name == "input":
            lines = [(f"input #{i}", FS, True), (f"{_shape(op.shape)} {_dtype(op.dtype)}", FS_SMALL, False)]
            node = _Node(f"o{i}", "input", lines, parent, op=i, title=f"op #{i}: a model input")
            node.attrs["data-op"] = str(i)
            return node
        head = f"#{i} {op.name}"
        if op.name == "written_in_place":
            head = f"#{i} written in place"
        shape = _shape(op.shape)
        if len(op.shapes) > 1:
            shape += f" (+{len(op.shapes) - 1} outputs)"
        first = next((r for r in op.inputs if type(r) is Ref), None)
        before = self.trace.ops[first.op].dtypes[first.slot] if first is not None else None
        if before is None or op.dtype != before:
            shape += f" {_dtype(op.dtype)}"
        lines = [(head, FS, True), (shape, FS_SMALL, False)]
        inplace = bool(op.mutated) or op.name == "written_in_place"
        if op.mutated:
            lines.append(("writes its input in place", FS_SMALL, False))
        elif op.name == "written_in_place":
            lines.append(("a tensor after an in-place write", FS_SMALL, False))
        title = repr(op)
        node = _Node(f"o{i}", "op", lines, parent, op=i, title=title, inplace=inplace)
        node.attrs["data-op"] = str(i)
        return node

    def _build(self) -> None:
        ops = self.trace.ops
        params: dict[str, list[str]] = {}  # parameter -> the nodes that read it
        consumers_outside: dict[int, list[int]] = {}
        if self.focus_calls:
            for op in ops:
                if op.index in self.visible_set:
                    continue
                for r in op.inputs:
                    if type(r) is Ref and r.op in self.visible_set:
                        consumers_outside.setdefault(op.index, []).append(r.op)
        for i in self.visible:
            hidden = i in self.canon
            dst = self._node_for_op(self.canon.get(i, i))
            for r in ops[i].inputs:
                if type(r) is Ref:
                    if r.op in self.visible_set:
                        src = self._node_for_op(self.canon.get(r.op, r.op))
                        kind = "flow"
                        a, b = self.member.get(r.op), self.member.get(i)
                        if a is not None and b is not None and a[0] == b[0] and a[1] != b[1]:
                            kind = "loop"
                    else:
                        src = self._stub(r.op, into=True)
                        kind = "flow"
                    if src is not dst:
                        self.edges.setdefault((src.id, dst.id), kind)
                elif isinstance(r, str):
                    if hidden or dst.kind == "module":
                        continue
                    params.setdefault(r, [])
                    if dst.id not in params[r]:
                        params[r].append(dst.id)
                elif not hidden and dst.kind != "module":
                    nid = f"n{i}"
                    if nid not in self.nodes:
                        self.nodes[nid] = _Node(nid, "outside", [("from outside", FS_SMALL, True),
                                                                 ("the forward", FS_SMALL, False)], dst.box,
                                                title="a tensor that no recorded op produced (not a model input)")
                    self.edges.setdefault((nid, dst.id), "outside_edge")
        for j, srcs in consumers_outside.items():
            stub = self._stub(j, into=False)
            for s in srcs:
                src = self._node_for_op(self.canon.get(s, s))
                self.edges.setdefault((src.id, stub.id), "flow")
        # parameters, each in the innermost box holding every node that reads it
        for k, (name, readers) in enumerate(params.items()):
            boxes = [self.nodes[r].box for r in readers]
            box = boxes[0]
            for other in boxes[1:]:
                box = self._common(box, other)
            parent_address = box.call.address if box is not None else self._top_address()
            nid = f"p{k}"
            node = _Node(nid, "param", [(_relative(name, parent_address), FS_SMALL, False)], box,
                         title=f"parameter {name}")
            node.attrs["data-param"] = name
            self.nodes[nid] = node
            for r in readers:
                self.edges.setdefault((nid, r), "param_edge")
        # the output
        root = self.root
        if not self.focus_calls and root is not None and type(root.output_ref) is Ref:
            ref = root.output_ref
            src = self._node_for_op(self.canon.get(ref.op, ref.op))
            shape = ops[ref.op].shapes[ref.slot]
            self.nodes["out"] = _Node("out", "output", [("output", FS, True), (_shape(shape), FS_SMALL, False)],
                                      None, title="the model's output (its first tensor)")
            self.edges.setdefault((src.id, "out"), "output_edge")

    def _stub(self, i: int, into: bool) -> _Node:
        nid = f"{'i' if into else 'x'}{i}"
        node = self.nodes.get(nid)
        if node is None:
            op = self.trace.ops[i]
            word = "from" if into else "to"
            lines = [(f"{word} #{i} {op.name}", FS_SMALL, True),
                     (f"in {op.module or '<root>'}", FS_SMALL, False),
                     (_shape(op.shape), FS_SMALL, False)]
            node = _Node(nid, "stub", lines, None, op=i, title=repr(op))
            node.attrs["data-op"] = str(i)
            self.nodes[nid] = node
        return node

    @staticmethod
    def _common(a: _Box | None, b: _Box | None) -> _Box | None:
        seen = set()
        x = a
        while x is not None:
            seen.add(id(x))
            x = x.parent
        y = b
        while y is not None and id(y) not in seen:
            y = y.parent
        return y

    # -- marks ------------------------------------------------------------------------------

    def node_of_site_op(self, i: int) -> _Node | None:
        """The node a mark on op `i`'s output sits on: its own (or its folded module's, or its
        rolled layer's), or a stub just outside a focus; None when the op is not in view."""
        if i in self.visible_set:
            return self._node_for_op(self.canon.get(i, i))
        for prefix in ("i", "x"):
            node = self.nodes.get(f"{prefix}{i}")
            if node is not None:
                return node
        return None

    def holder_of_call(self, call: ModuleCall) -> _Box | _Node | None:
        """The box (or folded node) a call is drawn as; None when it is not in view."""
        call = self.call_canon.get(id(call), call)
        if call.end_op <= call.first_op or call.first_op not in self.visible_set:
            return None
        self._node_for_op(self.canon.get(call.first_op, call.first_op))  # makes its boxes
        box = self.boxes.get(id(call))
        if box is not None:
            return box
        node = self.nodes.get(self._folded.get(id(call), ""))
        if node is not None:
            return node
        if self.focus_calls and any(call is c for c in self.focus_calls):
            return self.boxes.get(id(call))
        # a call folded into an outer module's node: mark that node
        return self._node_for_op(self.canon.get(call.first_op, call.first_op))


# -- highlight ---------------------------------------------------------------------------------


def _generations() -> dict:
    return GENERATIONS


def _check_generation(generation: Any, what: str) -> None:
    gens = _generations()
    if not isinstance(generation, str) or generation not in gens:
        hits = close_matches(str(generation), gens)
        hint = f" Did you mean {', '.join(repr(h) for h in hits)}?" if hits else ""
        raise UnknownGeneration(f"{what}: unknown generation {generation!r}.{hint} Generations: "
                                f"{', '.join(repr(g) for g in gens)}.")


def _highlight_names(highlight: Any, generation: str | None) -> list[tuple[str | None, str]] | str | None:
    """`highlight=` as a list of (generation or None, name), or `"facets"`, or None."""
    if highlight is None:
        return None
    if isinstance(highlight, str):
        return "facets" if highlight == "facets" else [(generation, highlight)]
    if isinstance(highlight, Mapping):
        if generation is not None:
            raise DrawSpecError(
                f"highlight= is a dict of generation -> names, so it names each name's generation; drop "
                f"generation={generation!r}, or pass highlight= as a list with generation=.")
        out = []
        for gen, names in highlight.items():
            _check_generation(gen, "highlight= key")
            if isinstance(names, str) or not isinstance(names, (list, tuple)):
                raise DrawSpecError(f"highlight={{{gen!r}: ...}} takes a list of names of that generation, not "
                                    f"{type(names).__name__} {names!r}; e.g. {{{gen!r}: ['blocks.0.hook_resid_post']}}.")
            out += [(gen, n) for n in names]
        return _check_names(out)
    if isinstance(highlight, (list, tuple)):
        return _check_names([(generation, n) for n in highlight])
    raise DrawSpecError(
        f"highlight= takes a list of names (with generation=), a dict generation -> names, or \"facets\"; not "
        f"{type(highlight).__name__} {highlight!r}.")


def _check_names(pairs):
    for gen, n in pairs:
        if not isinstance(n, str):
            raise DrawSpecError(f"highlight= names must be strings (hook names such as 'blocks.0.hook_resid_post'), "
                                f"not {type(n).__name__} {n!r}.")
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


def _place_marks(scene: _Scene, names, several_generations: bool) -> None:
    """Resolve each name and put its mark on the node (or box) of the op it reads."""
    trace = scene.trace
    if names == "facets":
        for call in _drawn_calls(scene):
            if call.facets is None:
                continue
            for facet, site in call.facets.sites.items():
                if facet in ("input", "output"):
                    continue
                mark = _Mark(facet, _status_of_site(site), facet, None,
                             f"{call.address or '<root>'}:{facet}")
                _put(scene, mark, call, site.op)
            for facet, why in call.facets.refused.items():
                mark = _Mark(facet, "refused", facet, None, f"{call.address or '<root>'}:{facet}")
                _put(scene, mark, call, None)
                scene.notes.append(f"{call.address or '<root>'}:{facet} is refused: {why}")
        return
    for gen, name in names:
        r = _resolve(trace, name, gen, "highlight")
        label = f"{r.generation} {name}" if several_generations else name
        if r.module_address is None or r.facet is None or r.status in ("structurally_absent", "ambiguous"):
            scene.unplaced[label] = f"{r.status}: {r.reason}"
            continue
        rec = trace.modules[r.module_address]
        call = rec.calls[r.call or 0] if rec.calls else None
        if call is None:
            scene.unplaced[label] = f"{r.module_address} did not run"
            continue
        site = call.facets.sites.get(r.facet) if call.facets is not None else None
        mark = _Mark(label, r.status, name, r.generation, f"{r.module_address or '<root>'}:{r.facet}")
        if not _put(scene, mark, call, site.op if site is not None else None):
            where = f"{r.module_address or '<root>'}:{r.facet}"
            scene.unplaced[label] = (f"{r.status}: it reads {where}, outside this drawing "
                                     f"(focus={scene.focus_label!r}); draw without focus= or focus on "
                                     f"{r.module_address or '<root>'!r}")
        elif r.status == "refused":
            scene.notes.append(f"{label}: refused: {r.reason}")


def _put(scene: _Scene, mark: _Mark, call: ModuleCall, op: int | None) -> bool:
    target = scene.node_of_site_op(op) if op is not None else scene.holder_of_call(call)
    if target is None:
        return False
    target.marks.append(mark)
    return True


def _drawn_calls(scene: _Scene) -> list[ModuleCall]:
    calls = [b.call for b in scene.boxes.values()]
    for node in scene.nodes.values():
        if node.kind == "module":
            rec = scene.trace.modules[node.attrs["data-module"]]
            calls.append(rec.calls[int(node.attrs["data-call"])])
    if not scene.focus_calls and scene.root is not None:
        calls.insert(0, scene.root)
    return sorted(calls, key=lambda c: (c.first_op, -c.end_op))


# -- measuring labels --------------------------------------------------------------------------


def _text_w(text: str, size: int) -> float:
    return len(text) * CW * size


def _mark_text(mark: _Mark) -> str:
    return f"{mark.text} · {STATUS_STYLE[mark.status][2]}"


def _lines_size(lines, marks) -> tuple[float, float]:
    w = max([_text_w(t, s) for t, s, _ in lines] + [_text_w(_mark_text(m), FS_SMALL) + 16 for m in marks] + [0])
    h = sum(LH if s == FS else LH_SMALL for _, s, _ in lines) + len(marks) * (LH_SMALL + 4)
    return w, h


def _measure(scene: _Scene) -> None:
    for node in scene.nodes.values():
        w, h = _lines_size(node.lines, node.marks)
        node.w = round(w + 2 * PAD_X + (4 if node.kind in ("input", "output") else 0), 1)
        node.h = round(h + 2 * PAD_Y, 1)


def _box_label_size(box: _Box) -> tuple[float, float]:
    w, h = _lines_size(box.lines, box.marks)
    return round(w + 2 * PAD_X, 1), round(h + PAD_Y + 2, 1)


# -- layout ------------------------------------------------------------------------------------


def _pygraphviz():
    try:
        import pygraphviz
    except ImportError as exc:
        raise LayoutEngineMissing(
            "Trace.draw lays the graph out with Graphviz through pygraphviz, which is not installed here "
            f"({exc}). Install it with pip install 'torchlens[draw]' (pygraphviz's wheels ship Graphviz, so no "
            "system package is needed).") from None
    return pygraphviz


def _graph(scene: _Scene, with_text: bool):
    """The pygraphviz graph of the scene: fixed-size nodes and box labels (and, for PNG and PDF,
    their text, which Graphviz then renders itself)."""
    pgv = _pygraphviz()
    g = pgv.AGraph(directed=True, strict=False)
    g.graph_attr.update(rankdir="TB", nodesep="0.14", ranksep="0.26", newrank="true", outputorder="edgesfirst",
                        fontname="Courier", pad="0")
    g.node_attr.update(shape="box", fixedsize="true", fontname="Courier", fontsize=str(FS_SMALL), margin="0")
    g.edge_attr.update(arrowsize="0.6", color=COLORS["edge"])
    subgraphs: dict[str, Any] = {}

    def holder(box):
        if box is None:
            return g
        sg = subgraphs.get(box.id)
        if sg is None:
            parent = holder(box.parent)
            w, h = _box_label_size(box)
            text = (f'<FONT POINT-SIZE="{FS_SMALL}">' + "<BR/>".join(html.escape(t) for t, _, _ in box.lines) + "</FONT>"
                    if with_text else " ")
            label = (f'<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="0"><TR>'
                     f'<TD FIXEDSIZE="TRUE" WIDTH="{w:g}" HEIGHT="{h:g}" ALIGN="LEFT" BALIGN="LEFT">{text}</TD>'
                     f'</TR></TABLE>>')
            sg = parent.add_subgraph(name=f"cluster_{box.id}", label=label, labeljust="l", labelloc="t",
                                     margin="8", style="rounded,filled" if with_text else "rounded",
                                     fillcolor=BOX_FILLS[box.level % 2], color=COLORS["box_line"])
            subgraphs[box.id] = sg
        return sg

    for node in scene.nodes.values():
        attrs = {"width": f"{node.w / 72:.4f}", "height": f"{node.h / 72:.4f}", "label": ""}
        if with_text:
            text = [t for t, _, _ in node.lines] + [_mark_text(m) for m in node.marks]
            attrs.update(label="\\n".join(t.replace("\\", "\\\\") for t in text), style="filled,rounded",
                         fillcolor=COLORS.get(node.kind, COLORS["op"]))
        holder(node.box).add_node(node.id, **attrs)
    # An op that reads nothing computed in view (an `arange`, a constant, an op fed only from outside a
    # focus) would be ranked at the top, and the module box it runs in with it, beside the boxes that
    # ran before it: an invisible edge from the node drawn for the op before it keeps run order.
    fed = {b for (a, b), kind in scene.edges.items() if kind in ("flow", "loop") and scene.nodes[a].kind != "stub"}
    order = {}
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
class _Layout:
    width: float
    height: float
    nodes: dict[str, tuple[float, float]]  # center, in SVG coordinates (y down)
    boxes: dict[str, tuple[float, float, float, float]]  # x, y, w, h
    edges: list[tuple[str, str, str, list[tuple[float, float]], tuple[float, float] | None]]
    version: str
    seconds: float


def _layout(scene: _Scene) -> _Layout:
    import json

    g = _graph(scene, with_text=False)
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
            boxes[obj["name"][len("cluster_"):]] = (round(x0, 1), round(height - y1, 1), round(x1 - x0, 1),
                                                    round(y1 - y0, 1))
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
    version = getattr(_pygraphviz(), "__version__", "")
    return _Layout(round(bb[2], 1), round(height, 1), nodes, boxes, edges, version, seconds)


# -- SVG ---------------------------------------------------------------------------------------


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def _f(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


class _Svg:
    def __init__(self):
        self.parts: list[str] = []

    def add(self, s: str) -> None:
        self.parts.append(s)

    def text(self, x, y, s, size=FS_SMALL, color="ink", bold=False):
        w = ' font-weight="bold"' if bold else ""
        self.add(f'<text x="{_f(x)}" y="{_f(y)}" font-size="{size}" fill="{COLORS.get(color, color)}"{w}>'
                 f'{_esc(s)}</text>')

    def rect(self, x, y, w, h, fill, stroke="none", rx=0, dash=False, width=1.0):
        d = ' stroke-dasharray="4 3"' if dash else ""
        self.add(f'<rect x="{_f(x)}" y="{_f(y)}" width="{_f(w)}" height="{_f(h)}" rx="{rx}" '
                 f'fill="{COLORS.get(fill, fill)}" stroke="{COLORS.get(stroke, stroke)}" stroke-width="{width}"{d}/>')


def _draw_lines(svg: _Svg, x: float, y: float, lines, marks, width: float) -> None:
    """Text lines then mark chips, top-left at (x, y)."""
    for text, size, bold in lines:
        lh = LH if size == FS else LH_SMALL
        svg.text(x, y + lh - 4, text, size=size, color="ink" if bold or size == FS else "muted", bold=bold)
        y += lh
    for m in marks:
        strong, pale, word = STATUS_STYLE[m.status]
        svg.add(f'<g class="mark" data-name="{_esc(m.name)}" data-generation="{_esc(m.generation or "")}" '
                f'data-status="{m.status}" data-site="{_esc(m.site)}">')
        svg.rect(x - 3, y + 2, width + 6, LH_SMALL + 2, pale, strong, rx=3)
        svg.rect(x, y + 6, 8, 8, strong)
        svg.text(x + 14, y + LH_SMALL - 1, f"{m.text} · {word}", size=FS_SMALL)
        svg.add("</g>")
        y += LH_SMALL + 4


def _legend(scene: _Scene, width: float) -> tuple[list[tuple[str, str]], float]:
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
        w = 30 + _text_w(words, FS_SMALL) + 18
        if x and x + w > width:
            rows += 1
            x = 0
        x += w
    return entries, rows * 22


def _svg(scene: _Scene, lay: _Layout, title: str, desc: str) -> str:
    notes = list(scene.notes)
    for name, why in scene.unplaced.items():
        notes.append(f"{name}: no mark: {why}")
    min_width = 560
    graph_w = lay.width + 2 * MARGIN
    width = max(graph_w, min_width)
    legend, legend_h = _legend(scene, width - 2 * MARGIN)
    top = MARGIN + legend_h + 8
    note_lines: list[str] = []
    for k, note in enumerate(notes, 1):
        wrapped = _wrap(note, NOTE_CHARS)
        note_lines += [f"{k}. {wrapped[0]}"] + ["   " + w for w in wrapped[1:]]
    if note_lines:
        width = max(width, 2 * MARGIN + _text_w("   " + "x" * NOTE_CHARS, FS_SMALL))
    notes_h = (LH_SMALL * len(note_lines) + LH + 10) if note_lines else 0
    height = math.ceil(top + lay.height + MARGIN + notes_h)
    width = math.ceil(width)  # whole pixels: a browser reports an image's own size rounded
    ox = MARGIN + (width - graph_w) / 2
    svg = _Svg()
    svg.add(f'<svg xmlns="http://www.w3.org/2000/svg" width="{_f(width)}" height="{_f(height)}" '
            f'viewBox="0 0 {_f(width)} {_f(height)}" font-family="{FONT}" role="img" aria-labelledby="title desc">')
    svg.add(f'<title id="title">{_esc(title)}</title>')
    svg.add(f'<desc id="desc">{_esc(desc)}</desc>')
    svg.add(f"<!-- Drawn by torchlens Trace.draw; layout: Graphviz dot through pygraphviz {lay.version}. -->")
    svg.add('<defs><marker id="tl-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{COLORS["edge"]}"/></marker>'
            '<marker id="tl-arrow-loop" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{COLORS["loop"]}"/></marker>'
            '<marker id="tl-arrow-param" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{COLORS["param_line"]}"/></marker>'
            '</defs>')
    svg.add(f'<rect x="0" y="0" width="{_f(width)}" height="{_f(height)}" fill="{COLORS["bg"]}"/>')
    # legend
    svg.add('<g class="legend">')
    x, y = MARGIN, MARGIN
    for kind, words in legend:
        w = 30 + _text_w(words, FS_SMALL) + 18
        if x > MARGIN and x + w > width - MARGIN:
            x, y = MARGIN, y + 22
        if kind.startswith("status:"):
            strong, pale, _ = STATUS_STYLE[kind[len("status:"):]]
            svg.rect(x, y + 1, 24, 14, pale, strong, rx=3)
            svg.rect(x + 3, y + 4, 8, 8, strong)
        elif kind == "loop":
            svg.add(f'<path d="M{_f(x)},{_f(y + 8)} L{_f(x + 24)},{_f(y + 8)}" stroke="{COLORS["loop"]}" '
                    f'stroke-dasharray="4 3" fill="none" marker-end="url(#tl-arrow-loop)"/>')
        else:
            style = _node_style(kind if kind != "inplace" else "op", kind == "inplace")
            svg.rect(x, y + 1, 24, 14, style[0], style[1], rx=style[2], dash=style[3], width=style[4])
        svg.text(x + 30, y + 12, words, size=FS_SMALL, color="muted")
        x += w
    svg.add("</g>")
    # boxes, outermost first
    labels = _Svg()
    svg.add('<g class="boxes">')
    for box in sorted(scene.boxes.values(), key=lambda b: b.level):
        if box.id not in lay.boxes:
            continue
        bx, by, bw, bh = lay.boxes[box.id]
        bx, by = bx + ox, by + top
        grouped = box.group is not None
        attrs = f'data-module="{_esc(box.call.address)}" data-call="{box.call.index}"'
        if grouped:
            attrs += f' data-layers="{_esc(_ranges(box.group.layers))}"'
        svg.add(f'<g class="box{" group" if grouped else ""}" id="{box.id}" {attrs}>')
        svg.add(f"<title>{_esc(box.call.address)} ({_esc(scene.trace.modules[box.call.address].class_name)})</title>")
        stroke = COLORS["group_line"] if grouped else COLORS["box_line"]
        svg.rect(bx, by, bw, bh, BOX_FILLS[box.level % 2], stroke, rx=6, dash=bool(grouped and box.group.reason),
                 width=1.6 if grouped else 1.0)
        svg.add("</g>")
        # the title goes over the edges (an edge entering a box may cross its title's band)
        lw, lh = _box_label_size(box)
        labels.add(f'<g class="box-label" data-box="{box.id}">')
        labels.rect(bx + 1.5, by + 1.5, min(lw, bw - 3), lh, BOX_FILLS[box.level % 2], rx=5)
        _draw_lines(labels, bx + PAD_X, by + PAD_Y - 1, box.lines, box.marks, lw - 2 * PAD_X)
        labels.add("</g>")
    svg.add("</g>")
    # edges
    svg.add('<g class="edges">')
    for a, b, kind, points, end in lay.edges:
        if not points:
            continue
        d = f"M{_f(points[0][0] + ox)},{_f(points[0][1] + top)}"
        for k in range(1, len(points) - 2, 3):
            (x1, y1), (x2, y2), (x3, y3) = points[k], points[k + 1], points[k + 2]
            d += f" C{_f(x1 + ox)},{_f(y1 + top)} {_f(x2 + ox)},{_f(y2 + top)} {_f(x3 + ox)},{_f(y3 + top)}"
        if end is not None:
            d += f" L{_f(end[0] + ox)},{_f(end[1] + top)}"
        color, marker, dash = COLORS["edge"], "tl-arrow", ""
        if kind == "loop":
            color, marker, dash = COLORS["loop"], "tl-arrow-loop", ' stroke-dasharray="5 3"'
        elif kind == "param_edge":
            color, marker, dash = COLORS["param_line"], "tl-arrow-param", ' stroke-dasharray="3 3"'
        svg.add(f'<path class="edge {kind}" data-src="{a}" data-dst="{b}" d="{d}" fill="none" stroke="{color}" '
                f'stroke-width="1.2"{dash} marker-end="url(#{marker})"/>')
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
        attrs = "".join(f' {k}="{_esc(v)}"' for k, v in node.attrs.items())
        svg.add(f'<g class="node {node.kind}" id="{node.id}"{attrs}>')
        svg.add(f"<title>{_esc(node.title)}</title>")
        fill, stroke, rx, dash, sw = _node_style(node.kind, node.inplace)
        if node.marks:
            stroke, sw = STATUS_STYLE[node.marks[0].status][0], 2.0
        svg.rect(x, y, node.w, node.h, fill, stroke, rx=rx, dash=dash, width=sw)
        if node.kind == "module":
            svg.rect(x + 3, y + 3, node.w - 6, node.h - 6, "none", "module_line", rx=3, width=0.8)
        _draw_lines(svg, x + PAD_X, y + PAD_Y, node.lines, node.marks, node.w - 2 * PAD_X)
        svg.add("</g>")
    svg.add("</g>")
    if note_lines:
        svg.add('<g class="notes">')
        y = top + lay.height + MARGIN + 4
        svg.text(MARGIN, y + LH - 4, "Notes", size=FS, bold=True)
        y += LH
        for line in note_lines:
            svg.text(MARGIN, y + LH_SMALL - 3, line, size=FS_SMALL)
            y += LH_SMALL
        svg.add("</g>")
    svg.add("</svg>")
    return "\n".join(svg.parts) + "\n"


def _node_style(kind: str, inplace: bool):
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


# -- the entry point ---------------------------------------------------------------------------


def _focus(trace: Trace, focus: Any, generation: str | None):
    """(calls to draw, label, names to highlight) for `focus=`."""
    if focus is None:
        return None, None, []
    if not isinstance(focus, str) or not focus.strip():
        raise DrawSpecError(f"focus= takes a module address (e.g. {_example_address(trace)!r}) or a hook name "
                            f"(e.g. 'blocks.0.hook_resid_post'), not {type(focus).__name__} {focus!r}.")
    text = focus.strip()
    address, facet = (text.rsplit(":", 1) + [None])[:2] if ":" in text else (text, None)
    if address in trace.modules or address in ("<root>", ""):
        rec = trace.modules[address if address != "<root>" else ""]
        if not rec.calls:
            raise DrawSpecError(f"focus={focus!r}: {rec.address} did not run in this forward, so it has no ops to "
                                f"draw; pick a module that ran, e.g. {_example_address(trace)!r}.")
        extra = []
        if facet:
            sites = rec.calls[0].facets.sites if rec.calls[0].facets is not None else {}
            if facet not in sites:
                hits = close_matches(facet, sites)
                hint = f" Did you mean {', '.join(repr(h) for h in hits)}?" if hits else ""
                raise DrawSpecError(f"focus={focus!r}: {rec.address or '<root>'} has no facet {facet!r}.{hint} "
                                    f"Its facets: {', '.join(sites) or '(none)'}.")
            extra = [("site", f"{rec.address}:{facet}")]
        if rec.address == "":
            return None, None, extra
        return list(rec.calls), rec.address, extra
    try:
        r = resolve_alias(trace, text, generation=generation)
    except UnknownAlias as exc:
        hits = close_matches(text, [a for a in trace.modules if a])
        hint = f" Modules like it: {', '.join(repr(h) for h in hits)}." if hits else ""
        raise DrawSpecError(f"focus={focus!r} names no module of this trace ({len(trace.modules)} addresses, e.g. "
                            f"{_example_address(trace)!r}) and no hook name: {str(exc).rstrip('.')}.{hint}") from None
    except AliasError as exc:
        raise type(exc)(f"focus={focus!r}: {str(exc).rstrip('.')}.") from None
    if r.module_address is None:
        raise DrawSpecError(f"focus={focus!r} is a {r.generation} name with no site in this trace ({r.status}: "
                            f"{r.reason}); focus on a module address instead, e.g. {_example_address(trace)!r}.")
    rec = trace.modules[r.module_address]
    calls = [rec.calls[r.call]] if r.call is not None else list(rec.calls)
    if r.module_address == "":
        return None, None, [(r.generation, text)]
    return calls, r.module_address, [(r.generation, text)]


def _example_address(trace: Trace) -> str:
    return trace.blocks[0] if trace.blocks else next((a for a in trace.modules if a), "")


def draw(trace: Trace, path: str | os.PathLike | None = None, *, rolled: bool = True, depth: int | None = None,
         focus: str | None = None, highlight: Any = None, generation: str | None = None,
         max_nodes: int | None = MAX_NODES) -> Drawing:
    """Draw `trace`'s op graph; see [`Trace.draw`][torchlens.Trace.draw]."""
    if not isinstance(trace, PERSISTED["Trace"]):
        raise DrawSpecError(f"draw() takes a torchlens Trace, not {type(trace).__name__}.")
    if not isinstance(rolled, bool):
        raise DrawSpecError(f"rolled= takes True (each stack's repeated layers drawn once, ×N) or False (every op), "
                            f"not {rolled!r}.")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise DrawSpecError(f"depth= takes None (every module a box) or a whole number >= 0 (how many levels of "
                            f"module boxes to draw; deeper modules are drawn as one node each, depth=0 draws no box), "
                            f"not {depth!r}.")
    if max_nodes is not None and (isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1):
        raise DrawSpecError(f"max_nodes= takes a positive whole number or None (no limit), not {max_nodes!r}.")
    if generation is not None:
        _check_generation(generation, "generation=")
    fmt = None
    if path is not None:
        fmt = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
        if fmt not in ("svg", "png", "pdf"):
            raise DrawSpecError(f"path={os.fspath(path)!r}: draw writes .svg, .png or .pdf files; end the path with "
                                f"one of those.")
    if not trace.modules or "" not in trace.modules or not trace.modules[""].calls:
        raise DrawSpecError("this trace has no root module call to draw (its records are incomplete).")
    names = _highlight_names(highlight, generation)
    focus_calls, focus_label, focus_names = _focus(trace, focus, generation)
    scene = _Scene(trace, rolled=rolled, depth=depth, focus_calls=focus_calls, focus_label=focus_label)
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
        s = call.facets.sites[facet]
        _put(scene, _Mark(site, _status_of_site(s), site, None, site), call, s.op)
    _measure(scene)
    lay = _layout(scene)
    title = f"{trace.model_class}: op graph" + (f" of {focus_label}" if focus_label else "") + (
        ", rolled" if scene.groups else "")
    desc = (f"The recorded ops of one forward of {trace.model_class} as TorchLens traced it: "
            f"{sum(n.kind == 'op' for n in scene.nodes.values())} ops drawn"
            + (f", layers of {', '.join(sorted({g.stack for g in scene.groups}))} rolled" if scene.groups else "")
            + ".")
    text = _svg(scene, lay, title, desc)
    counts: dict[str, int] = {}
    for n in scene.nodes.values():
        counts[n.kind] = counts.get(n.kind, 0) + 1
    for kind in scene.edges.values():
        counts[kind] = counts.get(kind, 0) + 1
    groups = [(g.stack, tuple(g.layers), g.reason) for g in scene.groups]
    drawing = Drawing(text, counts, scene.unplaced, groups, lay.seconds)
    if fmt == "svg":
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    elif fmt in ("png", "pdf"):
        with contextlib.redirect_stderr(io.StringIO()):
            _graph(scene, with_text=True).draw(os.fspath(path), format=fmt, prog="dot")
    return drawing


def _too_large(trace, scene, count, max_nodes, rolled, depth, focus) -> str:
    """The refusal's message: how big the drawing is and smaller ones, with their sizes."""
    options = []

    def size(**kw):
        args = dict(rolled=rolled, depth=depth, focus_calls=scene.focus_calls, focus_label=scene.focus_label)
        args.update(kw)
        s = _Scene(trace, **args)
        return len(s.nodes) + len(s.boxes)

    if not rolled and trace.structure is not None and trace.structure.stacks:
        options.append(f"rolled=True ({size(rolled=True)} nodes: each stack's repeated layers drawn once)")
    for d in (2, 1):
        if depth is None or depth > d:
            options.append(f"depth={d} ({size(depth=d)} nodes: modules below {d} levels drawn as one node each)")
            break
    if trace.blocks:
        block = trace.blocks[0]
        calls = list(trace.modules[block].calls)
        options.append(f"focus={block!r} ({size(focus_calls=calls, focus_label=block)} nodes; any module address "
                       f"or hook name)")
    return (f"this drawing has {count} nodes and boxes ({len(scene.visible)} ops"
            f"{', unrolled' if not rolled else ''}{', focus=' + repr(focus) if focus else ''}); more than "
            f"max_nodes={max_nodes}, past which Graphviz's layout takes too long to wait for. Narrow it: "
            f"{'; '.join(options) or 'focus= a module address'}; or pass max_nodes=None to lay it out anyway.")
