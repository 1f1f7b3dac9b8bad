"""What a drawing shows: the nodes (ops, inputs, parameters, folded modules), the module boxes,
the edges and the marks, for the ops in view (all, or a `focus=` module and its stubs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torchlens._core.records import ModuleCall, Ref
from torchlens._drawing.rolled import Group, roll
from torchlens._drawing.style import (
    BOX_LABEL_CHARS,
    FS,
    FS_SMALL,
    fmt_dtype,
    fmt_shape,
    ranges,
    relative,
    wrap,
)

if TYPE_CHECKING:
    from torchlens._trace import Trace


# -- the scene: what to draw -------------------------------------------------------------------


@dataclass
class Mark:
    text: str  # "2.x blocks.0.hook_resid_mid"
    status: str
    name: str
    generation: str | None
    site: str  # "transformer.h.0:resid_mid"


@dataclass
class Node:
    id: str
    kind: str  # op, input, param, output, module, stub, outside
    lines: list[tuple[str, int, bool]]  # (text, font size, bold)
    box: Any = None  # the Box it sits in, or None (top level)
    op: int | None = None
    title: str = ""
    marks: list[Mark] = field(default_factory=list)
    inplace: bool = False
    attrs: dict[str, str] = field(default_factory=dict)
    w: float = 0.0
    h: float = 0.0


@dataclass
class Box:
    id: str
    call: ModuleCall
    parent: Any  # Box or None
    lines: list[tuple[str, int, bool]] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    group: Any = None  # the Group of a rolled layer's box
    level: int = 1


class Scene:
    """Everything one drawing shows, before layout."""

    def __init__(
        self,
        trace: Trace,
        *,
        rolled: bool,
        depth: int | None,
        focus_calls: list[ModuleCall] | None,
        focus_label: str | None,
    ):
        self.trace = trace
        self.depth = depth
        self.nodes: dict[str, Node] = {}
        self.edges: dict[tuple[str, str], str] = {}  # (src, dst) -> kind, in insertion order
        self.boxes: dict[int, Box] = {}  # id(call) -> box
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
        self.member: dict[
            int, tuple[int, int]
        ] = {}  # op -> (group id, position of its layer in the group)
        self.groups: list[Group] = []
        self.group_of_rep: dict[int, Group] = {}  # id(rep call) -> group
        self.call_canon: dict[
            int, ModuleCall
        ] = {}  # id(hidden call) -> the rep's call it stands for
        if rolled:
            for stack_groups in roll(trace).values():
                inside = all(
                    all(i in visible_set for i in (c.first_op, c.end_op - 1))
                    for g in stack_groups
                    for c in g.calls
                )
                if not inside or (
                    focus_calls
                    and any(id(c) in self._top_ids for g in stack_groups for c in g.calls)
                ):
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
            reps[
                (
                    relative(c.address, rep.address) if c is not rep else ".",
                    c.first_op - rep.first_op,
                )
            ] = c
        for c in self._calls_within(hidden):
            key = (
                relative(c.address, hidden.address) if c is not hidden else ".",
                c.first_op - hidden.first_op,
            )
            if key in reps:
                self.call_canon[id(c)] = reps[key]

    def _calls_within(self, call: ModuleCall) -> list[ModuleCall]:
        """`call` and every call made inside it (by op range and parent links)."""
        out = [call]
        for rec in self.trace.modules.values():
            for c in rec.calls:
                if (
                    c is not call
                    and call.first_op <= c.first_op
                    and c.end_op <= call.end_op
                    and self._under(c, call)
                ):
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
        rec = (
            self.trace.modules[op.module] if op.module and op.module in self.trace.modules else None
        )
        call = rec.calls[op.call] if rec is not None and op.call < len(rec.calls) else None
        chain: list[ModuleCall] = []
        while call is not None and id(call) not in self._top_ids and call is not self.root:
            chain.append(call)
            call = call.parent
        chain.reverse()
        return chain

    # -- nodes ------------------------------------------------------------------------------

    def _box(self, call: ModuleCall, parent: Box | None, level: int) -> Box:
        box = self.boxes.get(id(call))
        if box is None:
            box = Box(f"c{len(self.boxes)}", call, parent, level=level)
            box.group = self.group_of_rep.get(id(call))
            box.lines = self._call_lines(
                call, parent.call.address if parent else self._top_address(), box.group, as_box=True
            )
            self.boxes[id(call)] = box
        return box

    def _top_address(self) -> str:
        return self.focus_calls[0].address if self.focus_calls else ""

    def _call_lines(self, call: ModuleCall, parent_address: str, group: Group | None, as_box: bool):
        rec = self.trace.modules[call.address]
        name = relative(call.address, parent_address)
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
                drawn = relative(call.address, parent_address)
                lines.append(
                    (
                        f"layers {ranges(group.layers)} of {stack or '<root>'}, drawn once as {drawn}",
                        FS_SMALL,
                        False,
                    )
                )
                last = relative(addresses[-1], parent_address)
                if len(set(addresses)) == n:
                    lines.append(
                        (f"({drawn} … {last}: {n} modules, one op sequence)", FS_SMALL, False)
                    )
                else:
                    lines.append(
                        (
                            f"({len(set(addresses))} modules run {n} times, one op sequence)",
                            FS_SMALL,
                            False,
                        )
                    )
                if group.buffers:  # what the records cannot compare, said where it matters
                    lines.append(("(buffers they read are not compared)", FS_SMALL, False))
            else:
                lines.append((f"layer {group.layers[0]} of {stack or '<root>'}", FS_SMALL, False))
            if group.reason:
                for text in wrap("drawn apart: " + group.reason, BOX_LABEL_CHARS):
                    lines.append((text, FS_SMALL, False))
        else:
            lines.append((f"{name} · {rec.class_name}", FS, True))
        if not as_box:
            n_ops = call.end_op - call.first_op
            out = call.output_ref
            shape = ""
            if type(out) is Ref:
                shape = " → " + fmt_shape(self.trace.ops[out.op].shapes[out.slot])
            lines.append((f"{n_ops} op{'s' if n_ops != 1 else ''}{shape}", FS_SMALL, False))
        return lines

    def _node_for_op(self, i: int) -> Node:
        """The node op `i` is drawn as (its own, or the folded module it ran in); made on first use."""
        chain = self._chain(i)
        depth = self.depth
        parent: Box | None = None
        if self.focus_calls:
            top = next(
                (c for c in self.focus_calls if c.first_op <= i < c.end_op), self.focus_calls[0]
            )
            parent = self._box(top, None, 0)
        folded_at = depth if depth is not None and len(chain) > depth else None
        for level, call in enumerate(
            chain[: len(chain) if folded_at is None else folded_at], start=1
        ):
            parent = self._box(call, parent, level)
        if folded_at is not None:
            call = chain[folded_at]
            nid = self._folded_id(call)
            node = self.nodes.get(nid)
            if node is None:
                group = self.group_of_rep.get(id(call))
                lines = self._call_lines(
                    call,
                    parent.call.address if parent else self._top_address(),
                    group,
                    as_box=False,
                )
                rec = self.trace.modules[call.address]
                node = Node(
                    nid,
                    "module",
                    lines,
                    parent,
                    title=f"{call.address} ({rec.class_name}), call "
                    f"{call.index}: ops #{call.first_op}–#{call.end_op - 1}",
                )
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

    def _op_node(self, i: int, parent: Box | None) -> Node:
        op = self.trace.ops[i]
        if op.name == "input":
            lines = [
                (f"input #{i}", FS, True),
                (f"{fmt_shape(op.shape)} {fmt_dtype(op.dtype)}", FS_SMALL, False),
            ]
            node = Node(f"o{i}", "input", lines, parent, op=i, title=f"op #{i}: a model input")
            node.attrs["data-op"] = str(i)
            return node
        head = f"#{i} {op.name}"
        if op.name == "written_in_place":
            head = f"#{i} written in place"
        shape = fmt_shape(op.shape)
        if len(op.shapes) > 1:
            shape += f" (+{len(op.shapes) - 1} outputs)"
        first = next((r for r in op.inputs if type(r) is Ref), None)
        before = self.trace.ops[first.op].dtypes[first.slot] if first is not None else None
        if before is None or op.dtype != before:
            shape += f" {fmt_dtype(op.dtype)}"
        lines = [(head, FS, True), (shape, FS_SMALL, False)]
        inplace = bool(op.mutated) or op.name == "written_in_place"
        if op.name == "written_in_place":  # recorded as mutated: it stands for the write
            lines.append(("a tensor after an in-place write", FS_SMALL, False))
        elif op.mutated:
            lines.append(("writes its input in place", FS_SMALL, False))
        title = repr(op)
        node = Node(f"o{i}", "op", lines, parent, op=i, title=title, inplace=inplace)
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
                        self.nodes[nid] = Node(
                            nid,
                            "outside",
                            [("from outside", FS_SMALL, True), ("the forward", FS_SMALL, False)],
                            dst.box,
                            title="a tensor that no recorded op produced (not a model input)",
                        )
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
            node = Node(
                nid,
                "param",
                [(relative(name, parent_address), FS_SMALL, False)],
                box,
                title=f"parameter {name}",
            )
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
            self.nodes["out"] = Node(
                "out",
                "output",
                [("output", FS, True), (fmt_shape(shape), FS_SMALL, False)],
                None,
                title="the model's output (its first tensor)",
            )
            self.edges.setdefault((src.id, "out"), "output_edge")

    def _stub(self, i: int, into: bool) -> Node:
        nid = f"{'i' if into else 'x'}{i}"
        node = self.nodes.get(nid)
        if node is None:
            op = self.trace.ops[i]
            word = "from" if into else "to"
            lines = [
                (f"{word} #{i} {op.name}", FS_SMALL, True),
                (f"in {op.module or '<root>'}", FS_SMALL, False),
                (fmt_shape(op.shape), FS_SMALL, False),
            ]
            node = Node(nid, "stub", lines, None, op=i, title=repr(op))
            node.attrs["data-op"] = str(i)
            self.nodes[nid] = node
        return node

    @staticmethod
    def _common(a: Box | None, b: Box | None) -> Box | None:
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

    def node_of_site_op(self, i: int) -> Node | None:
        """The node a mark on op `i`'s output sits on: its own (or its folded module's, or its
        rolled layer's), or a stub just outside a focus; None when the op is not in view."""
        if i in self.visible_set:
            return self._node_for_op(self.canon.get(i, i))
        for prefix in ("i", "x"):
            node = self.nodes.get(f"{prefix}{i}")
            if node is not None:
                return node
        return None

    def holder_of_call(self, call: ModuleCall) -> Box | Node | None:
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
