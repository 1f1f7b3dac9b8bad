"""The pool the diagnosis searches: every tensor a trace holds, with its statistics, grouped by
shape; the data-flow relations between two of them; and the primitives of the search."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from torchlens._core.errors import TorchLensError
from torchlens._core.ops import ADD_OPS, PASS_THROUGH_OPS, RESHAPE_OPS
from torchlens._core.records import Ref
from torchlens._naming.resolver import alias_report
from torchlens._naming.results import AliasReport

if TYPE_CHECKING:
    from torchlens._trace import Trace

# The layout sets (token-major, head-major, kv-head and per-head facets) come from the facet rows.

_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
#: Relative error under which a candidate is "near" (named as nearly equal when nothing matches).
NEAR = 1e-2
#: The relation of a candidate that is the site's own tensor.
SAME = "the same tensor"
#: How many candidates a `Comparison` lists.
KEEP = 5
#: Candidates whose lower bound of the relative error exceeds this are not compared element-wise.
PRUNE = 0.5


def fmt(x: float) -> str:
    return f"{x:.3g}"


# -- the pool: every tensor a trace holds, with its statistics -------------------------------------


@dataclass
class Entry:
    tensor: Tensor
    module: str | None
    facet: str | None
    op: int | None  # op whose output this is (facets: the site's op, when real)
    slot: int
    kind: str  # "facet" | "op"
    order: int  # position in the forward (for ties)
    row: int = -1  # row in its shape group's matrix
    group: Group | None = None

    @property
    def norm(self) -> float:
        assert self.group is not None  # read once `Pool.group` has grouped the entry's shape
        return float(self.group.norms[self.row])

    @property
    def mean(self) -> float:
        assert self.group is not None  # read once `Pool.group` has grouped the entry's shape
        return float(self.group.means[self.row])


class Group:
    """The tensors of one shape, flattened into the rows of one float32 matrix (built on first use).

    One matrix-vector product then gives every member's dot product with the engine's tensor,
    hence its distance and its least-squares scale; norms and means come from the same matrix.
    """

    def __init__(self, entries: list[Entry]):
        self.entries = entries
        with torch.no_grad():
            self.matrix = torch.stack([e.tensor.reshape(-1).float() for e in entries])
            self.norms = torch.linalg.vector_norm(self.matrix, dim=1).double()
            self.means = self.matrix.mean(dim=1).double()
        self._gram: Tensor | None = None
        for i, e in enumerate(entries):
            e.row, e.group = i, self

    def gram(self) -> Tensor:
        if self._gram is None:
            self._gram = (self.matrix @ self.matrix.T).double()
        return self._gram


class Pool:
    def __init__(self, trace: Trace):
        self._trace = weakref.ref(
            trace
        )  # the pool lives as long as the trace, and must not keep it alive
        self.entries: list[Entry] = []
        self.by_shape: dict[tuple[int, ...], list[Entry]] = {}
        self.by_op: dict[int, list[Entry]] = {}
        self.site: dict[tuple[str, str], Entry] = {}
        self.names: dict[str, tuple[dict, dict]] = {}
        self.groups: dict[tuple[int, ...], Group] = {}
        seen: set[tuple[int, tuple]] = set()
        for rec in trace.modules.values():
            for call in rec.calls[:1]:
                for name, site in call.facets.sites.items() if call.facets else ():
                    t = site.tensor
                    if not isinstance(t, Tensor) or t.dtype not in _FLOATS or t.numel() < 2:
                        continue
                    op = site.op if site.kind == "real" else None
                    e = self._add(
                        t,
                        rec.address,
                        name,
                        op,
                        0,
                        "facet",
                        site.op if site.op is not None else call.first_op,
                    )
                    self.site[(rec.address, name)] = e
                    if op is not None:
                        seen.add((op, tuple(t.shape)))
        for op in trace.ops:
            for slot, t in enumerate(op.tensors):
                if not isinstance(t, Tensor) or t.dtype not in _FLOATS or t.numel() < 2:
                    continue
                if (op.index, tuple(t.shape)) in seen and slot == 0:
                    continue
                self._add(t, op.module, None, op.index, slot, "op", op.index)

    @property
    def trace(self) -> Trace:
        trace = self._trace()
        assert trace is not None  # `POOLS` holds a pool only while its trace is alive
        return trace

    def _add(self, t, module, facet, op, slot, kind, order) -> Entry:
        e = Entry(
            t.detach().cpu(), module, facet, op, slot, kind, order
        )  # compare works on the CPU
        self.entries.append(e)
        self.by_shape.setdefault(tuple(t.shape), []).append(e)
        if op is not None:
            self.by_op.setdefault(op, []).append(e)
        return e

    def group(self, shape: tuple[int, ...]) -> Group:
        g = self.groups.get(shape)
        if g is None:
            g = self.groups[shape] = Group(self.by_shape[shape])
        return g


POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pool_of(trace: Trace) -> Pool:
    pool = POOLS.get(trace)
    if pool is None:
        pool = POOLS[trace] = Pool(trace)
    return pool


# -- names in the user's generation ----------------------------------------------------------------


def names_in(
    pool: Pool, generation: str
) -> tuple[dict[tuple[str, str], str], dict[tuple[int, tuple[int, ...]], str]]:
    """(module, facet) -> name and (op, shape) -> name, for the names of `generation` that read
    a site (the op is the one it copies, `through`)."""
    if generation not in pool.names:
        by_site: dict[tuple[str, str], str] = {}
        by_op: dict[tuple[int, tuple[int, ...]], str] = {}
        try:
            rows = alias_report(pool.trace, generation=generation)
        except TorchLensError:  # a trace the generation cannot describe: TorchLens names only
            rows = AliasReport()
        for r in rows:
            if not r.readable or r.module_address is None or r.facet is None:
                continue
            key = (r.module_address, r.facet)
            by_site.setdefault(key, r.query)
            e = pool.site.get(key)
            if e is not None and e.op is not None:
                by_op.setdefault((through(pool.trace, e.op), tuple(e.tensor.shape)), r.query)
        pool.names[generation] = (by_site, by_op)
    return pool.names[generation]


# -- data flow -------------------------------------------------------------------------------------


def source(trace: Trace, ref) -> int | None:
    """The op a Ref comes from, looking through casts, dropout and reshapes."""
    for _ in range(6):
        if type(ref) is not Ref:
            return None
        op = trace.ops[ref.op]
        if op.name in PASS_THROUGH_OPS | RESHAPE_OPS and op.inputs:
            ref = op.inputs[0]
            continue
        return ref.op
    return ref.op if type(ref) is Ref else None


def through(trace: Trace, index: int) -> int:
    """`index` itself, or the op it copies/casts/reshapes (so two names of one value meet)."""
    src = source(trace, Ref(index))
    return index if src is None else src


def add_operands(trace: Trace, index: int | None) -> list[int]:
    if index is None:
        return []
    op = trace.ops[through(trace, index)]
    if op.name not in ADD_OPS:
        return []
    return [s for s in (source(trace, r) for r in op.inputs) if s is not None]


def op_path(trace: Trace, start: int, end: int, limit: int = 6) -> list[int] | None:
    """Ops from `start` (exclusive) to `end` (inclusive) along inputs, if `end` is a few ops downstream."""
    if end <= start:
        return None
    frontier = {end: [end]}
    for _ in range(limit):
        nxt = {}
        for idx, path in frontier.items():
            for r in trace.ops[idx].inputs:
                if type(r) is not Ref:
                    continue
                if r.op == start:
                    return list(reversed(path))
                if r.op > start and r.op not in nxt:
                    nxt[r.op] = path + [r.op]
        frontier = nxt
        if not frontier:
            return None
    return None


def layer_of(trace: Trace, address: str | None) -> int | None:
    if address is None:
        return None
    for i, b in enumerate(trace.blocks):
        if address == b or address.startswith(b + "."):
            return i
    return None


def analogue(trace: Trace, address: str, layer: int, other: int) -> str:
    b = trace.blocks[layer]
    return trace.blocks[other] + address[len(b) :]


# -- relations -------------------------------------------------------------------------------------


def norm_of(pool: Pool, module: str | None) -> bool:
    return (
        module is not None
        and module in pool.trace.modules
        and pool.trace.modules[module].role == "norm"
    )


def norm_around(pool: Pool, op: int | None) -> tuple[str, int | None] | None:
    """(norm address, its input op) for the norm whose output or normalized tensor is `op`."""
    if op is None:
        return None
    trace = pool.trace
    module = trace.ops[op].module
    while module is not None and not norm_of(pool, module):
        module = module.rpartition(".")[0] if module else None
    if module is None:
        return None
    inp = pool.site.get((module, "input"))
    return module, (inp.op if inp is not None else None)


def relation(pool: Pool, expected: Entry | None, cand: Entry, label: str, accepted: bool) -> str:
    """How `cand` (converted by `label`) relates to the `expected` site, in words."""
    trace = pool.trace
    layout = "" if accepted else label
    if expected is None:
        return layout
    same_site = cand.kind == "facet" and (cand.module, cand.facet) == (
        expected.module,
        expected.facet,
    )
    if same_site or (
        cand.op is not None
        and expected.op is not None
        and through(trace, cand.op) == through(trace, expected.op)
    ):
        return layout or SAME
    words: list[str] = []
    ex_op, c_op = expected.op, cand.op
    lx, lc = layer_of(trace, expected.module), layer_of(trace, cand.module)
    if (
        cand.facet is not None
        and expected.facet is not None
        and expected.module is not None
        and lx is not None
        and lc is not None
        and lx != lc
    ):
        if cand.facet == expected.facet and cand.module == analogue(trace, expected.module, lx, lc):
            words.append(
                ("the neighbouring layer" if abs(lc - lx) == 1 else "another layer")
                + f" ({lc} instead of {lx})"
            )
    if (
        not words
        and cand.facet is not None
        and cand.module == expected.module
        and {cand.facet, expected.facet} in ({"q", "rot_q"}, {"k", "rot_k"})
    ):
        words.append(
            "after RoPE instead of before"
            if cand.facet.startswith("rot_")
            else "before RoPE instead of after"
        )
    if not words and ex_op is not None and c_op is not None:
        ex_src, c_src = through(trace, ex_op), through(trace, c_op)
        norm_c = norm_around(pool, c_op)
        norm_x = norm_around(pool, ex_op)
        if norm_c is not None and norm_c[1] is not None and through(trace, norm_c[1]) == ex_src:
            words.append(f"after the norm {short(pool, norm_c[0])} instead of before it")
        elif norm_x is not None and norm_x[1] is not None and through(trace, norm_x[1]) == c_src:
            raw = (
                cand.facet == "output"
                and cand.module is not None
                and cand.module in trace.modules
                and trace.modules[cand.module].role in ("attention", "mlp")
            )
            words.append(
                f"before the norm {short(pool, norm_x[0])}: "
                + (
                    "the raw sublayer output, the norm not applied"
                    if raw
                    else "the norm not applied"
                )
            )
        elif (
            norm_c is not None
            and norm_c[1] is not None
            and ex_src in add_operands(trace, norm_c[1])
        ):
            words.append(
                f"the norm {short(pool, norm_c[0])} of the site plus the residual: a fused add+norm "
                "wrote its output into the saved tensor in place"
            )
        elif ex_src in add_operands(trace, c_op):
            others = [o for o in add_operands(trace, c_op) if o != ex_src]
            words.append(
                "the residual is included"
                if residual(pool, others)
                else "the site plus another tensor"
            )
        elif c_src in add_operands(trace, ex_op):
            others = [o for o in add_operands(trace, ex_op) if o != c_src]
            if expected.facet == "scores" and any(_is_mask(trace, o) for o in others):
                words.append(
                    "before the attention mask: the scores without the mask added (the site adds it)"
                )
            else:
                words.append(
                    "the residual is missing"
                    if residual(pool, others)
                    else "the site minus another tensor"
                )
        else:  # one of the two is computed from the other: say which way, and through which ops
            for src, dst, side, softcap in (
                (c_src, ex_src, "before", "before the softcap: the softcap (tanh) is dropped"),
                (ex_src, c_src, "after", "after a softcap (tanh) the site does not have"),
            ):
                path = op_path(trace, src, dst)
                if path is not None:
                    names = [trace.ops[i].name for i in path]
                    rope = (
                        side == "before"
                        and expected.facet in ("rot_q", "rot_k")
                        and cand.module is not None
                        and expected.module is not None
                        and cand.module.startswith(expected.module)
                        and not set(names) & _NORM_MATH
                    )
                    words.append(
                        softcap
                        if "tanh" in names
                        else ("before RoPE: " if rope else "")
                        + f"{len(path)} op{'s' if len(path) > 1 else ''} {side} the site ({' → '.join(names)})"
                    )
                    break
    if layout:
        words.append(layout)
    return "; ".join(words)


#: Ops that normalize (a norm written out): a path holding one is not RoPE alone.
_NORM_MATH = frozenset(
    {"rsqrt", "pow", "mean", "var", "layer_norm", "rms_norm", "group_norm", "norm", "sqrt"}
)


def _is_mask(trace: Trace, index: int) -> bool:
    """Whether op `index`'s saved output is an attention mask: it holds -inf or the dtype's most
    negative values (what a masked position adds to the scores)."""
    t = trace.ops[index].tensors[0] if trace.ops[index].tensors else None
    if t is None or not t.is_floating_point() or not t.numel():
        return False
    return bool((t <= torch.finfo(t.dtype).min / 2).any())


def residual(pool: Pool, ops: list[int]) -> bool:
    """Whether one of `ops` is the residual stream: a block's input, or its residual between sublayers."""
    trace = pool.trace
    stream = set()
    for b in trace.blocks:
        for name in ("resid_pre", "resid_mid"):
            e = pool.site.get((b, name))
            if e is not None and e.op is not None:
                stream.add(through(trace, e.op))
    return any(through(trace, o) in stream for o in ops)


def short(pool: Pool, address: str) -> str:
    return address or "<root>"


def label_of(pool: Pool, e: Entry, generation: str | None) -> str:
    if generation is not None:
        by_site, by_op = names_in(pool, generation)
        if (
            e.kind == "facet"
            and e.module is not None
            and e.facet is not None
            and (e.module, e.facet) in by_site
        ):
            return by_site[(e.module, e.facet)]
        alias = (
            (through(pool.trace, e.op), tuple(e.tensor.shape))
            if e.op is not None and e.slot == 0
            else None
        )
        if alias is not None and alias in by_op:
            return by_op[alias]
    if e.kind == "facet":
        return f"{e.module or '<root>'}:{e.facet}"
    assert e.op is not None  # an "op" entry is an op's output (`Pool._add`)
    op = pool.trace.ops[e.op]
    slot = f" (output {e.slot})" if e.slot else ""
    return f"op #{op.index} {op.name}{slot} in {op.module or '<root>'}"


# -- the search ------------------------------------------------------------------------------------


def rel(
    engine: Tensor, other: Tensor, norm_e: float, vis: Tensor | None = None
) -> tuple[float, float]:
    if vis is not None:
        engine, other = engine[vis], other[vis]
    d = engine - other.float()
    if d.numel() == 0:
        return 0.0, 0.0
    norm = float(torch.linalg.vector_norm(d))
    if math.isnan(norm):
        return float("inf"), float("inf")
    return norm / max(norm_e, 1e-30), float(d.abs().max())


def mask_floor(dtype: torch.dtype) -> float:
    """Below this a score counts as masked (a fill of -inf or the dtype's minimum, or near it):
    half `dtype`'s minimum for a floating dtype (float16's is -65504), else float32's."""
    return (
        torch.finfo(dtype).min if dtype.is_floating_point else torch.finfo(torch.float32).min
    ) / 2


def same_mask(other: Tensor, vis: Tensor | None) -> bool:
    """Whether `other` masks every entry the engine's tensor masks (those not in `vis`): each is
    below `other`'s `mask_floor` too (a candidate that explains masked scores on the entries both
    leave visible is no explanation where the engine masks more)."""
    return vis is None or bool((other[~vis].float() <= mask_floor(other.dtype)).all())


def within(
    engine: Tensor,
    other: Tensor,
    atol: float,
    rtol: float,
    vis: Tensor | None = None,
) -> bool:
    if vis is not None:
        if not same_mask(other, vis):
            return False
        engine, other = engine[vis], other[vis]
    o = other.float()
    return bool(((engine - o).abs() <= atol + rtol * o.abs()).all())


@dataclass
class Found:
    entry: Entry | None
    label: str
    accepted: bool
    steps: tuple  # a layout conversion's steps (`layouts.conversions`)
    error: float
    max_abs: float
    matches: bool
    factor: float | None = None
    relation: str = ""
    site: str = ""
    rank: tuple[int, int] | int = 3  # `diagnose._rank`'s, set on every candidate before sorting
    other: Entry | None = None  # the second term of a sum
    extra: str = ""  # a precision note added to the structural relation
