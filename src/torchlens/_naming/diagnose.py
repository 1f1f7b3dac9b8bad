"""What an engine's tensor equals in a trace: the search behind `Comparison.explanation`.

When a row of [`compare`][torchlens.mechinterp.compare] fails, the engine handed *some* tensor;
this module looks for it among everything the trace holds and says how it relates to the site
the name was meant to read:

- every saved facet and op output, under the layout conversions `compare` accepts and the ones
  it does not (head-major instead of token-major, kv heads tiled instead of repeated);
- the same facet at the neighbouring layers, the same site before or after its norm or RoPE,
  with or without the residual added, a few ops before or after it (a softcap dropped);
- a scalar multiple of any of those (the factor is the least-squares fit);
- the sum of two facets; the element-wise rounding of a candidate to bfloat16 or float16;
- for a tuple the engine handed, its other elements and their sum.

Speed comes from pruning. Only tensors whose shape reaches the engine's shape under some
conversion are looked at. The tensors of one shape are stacked once per trace into a matrix (with
their norms and means); one matrix-vector product with the engine's tensor, brought to their
layout, gives every member's distance `‖E − C‖² = ‖E‖² + ‖C‖² − 2⟨E,C⟩` and least-squares scale,
and only the members that these leave in the running are compared element-wise. Conversions that
change the size (repeated kv heads) are screened by the bounds `|‖E‖ − ‖C‖| ≤ ‖E − C‖` and
`|mean E − mean C|·√n ≤ ‖E − C‖`. Sums of two facets follow from the group's Gram matrix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from torchlens._core.errors import TorchLensError
from torchlens._core.facet_spec import HEAD_MAJOR, KV_HEADS, PER_HEAD, TOKEN_MAJOR, tokens_flattened
from torchlens._core.ops import ADD_OPS, PASS_THROUGH_OPS, RESHAPE_OPS, SCALE_OPS
from torchlens._core.records import Ref
from torchlens._naming.resolver import alias_report

if TYPE_CHECKING:
    from torchlens._trace import Trace

__all__ = ["Candidate", "diagnose"]

# The layout sets (token-major, head-major, kv-head and per-head facets) come from the facet rows.
_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
#: Relative error under which a candidate is "near" (named as nearly equal when nothing matches).
NEAR = 1e-2
#: The relation of a candidate that is the site's own tensor.
SAME = "the same tensor"
#: How many candidates a `Comparison` lists.
KEEP = 5
#: Candidates whose lower bound of the relative error exceeds this are not compared element-wise.
_PRUNE = 0.5


@dataclass(frozen=True)
class Candidate:
    """One thing the engine's tensor was compared with while explaining a mismatch.

    Attributes:
        site: the name in the generation the row was resolved in, else the TorchLens site
            `module:facet`, else the op (`op #41 add in transformer.h.0`); for a tensor derived
            from the trace, how (`softmax of op #104 mul in ...`, `softmax(q · kᵀ)`, `A + B`); for
            the engine's own tuple, `element 1 of the engine's tuple`.
        relation: how it relates to the site the name reads, in words (`"the residual is
            included"`, `"the neighbouring layer (1 instead of 0)"`), or `""` when nothing
            more specific than "another tensor" is known.
        error: relative error `‖E − C‖ / ‖E‖` after the relation's transform (factor, layout,
            rounding); 0 is exact.
        max_abs_error: the largest absolute difference after that transform.
        matches: whether the candidate explains the engine's tensor: the two agree within the
            row's tolerance after the transform, or, for a relation that names a precision
            ("rounded to bfloat16", "computed in bfloat16"), within that precision.
        factor: the scalar `a` of `E ≈ a × C` (least squares), for a scale relation; else None.
        module_address: the module the candidate belongs to (None for a derived tensor).
        facet: its facet, when it is one (None for an op output or a derived tensor).
        op: the index of the op that produced it, when known.
    """

    site: str
    relation: str
    error: float
    max_abs_error: float
    matches: bool
    factor: float | None = None
    module_address: str | None = None
    facet: str | None = None
    op: int | None = None

    def describe(self) -> str:
        """`equals 0.22 × blocks.3.hook_attn_out: a scale factor`-style text (without "equals")."""
        what = f"{_fmt(self.factor)} × {self.site}" if self.factor is not None else self.site
        return what + (f": {self.relation}" if self.relation else "")

    def __str__(self) -> str:
        return f"{self.describe()} (rel. error {self.error:.2g})"


def _fmt(x: float) -> str:
    return f"{x:.3g}"


# -- the pool: every tensor a trace holds, with its statistics -------------------------------------


@dataclass
class _Entry:
    tensor: Tensor
    module: str | None
    facet: str | None
    op: int | None  # op whose output this is (facets: the site's op, when real)
    slot: int
    kind: str  # "facet" | "op"
    order: int  # position in the forward (for ties)
    row: int = -1  # row in its shape group's matrix
    group: _Group | None = None

    @property
    def norm(self) -> float:
        return float(self.group.norms[self.row])

    @property
    def mean(self) -> float:
        return float(self.group.means[self.row])


class _Group:
    """The tensors of one shape, flattened into the rows of one float32 matrix (built on first use).

    One matrix-vector product then gives every member's dot product with the engine's tensor,
    hence its distance and its least-squares scale; norms and means come from the same matrix.
    """

    def __init__(self, entries: list[_Entry]):
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


class _Pool:
    def __init__(self, trace: Trace):
        self._trace = weakref.ref(trace)  # the pool lives as long as the trace, and must not keep it alive
        self.entries: list[_Entry] = []
        self.by_shape: dict[tuple[int, ...], list[_Entry]] = {}
        self.by_op: dict[int, list[_Entry]] = {}
        self.site: dict[tuple[str, str], _Entry] = {}
        self.names: dict[str, tuple[dict, dict]] = {}
        self.groups: dict[tuple[int, ...], _Group] = {}
        seen: set[tuple[int, tuple]] = set()
        for rec in trace.modules.values():
            for call in rec.calls[:1]:
                for name, site in (call.facets.sites.items() if call.facets else ()):
                    t = site.tensor
                    if not isinstance(t, Tensor) or t.dtype not in _FLOATS or t.numel() < 2:
                        continue
                    op = site.op if site.kind == "real" else None
                    e = self._add(t, rec.address, name, op, 0, "facet", site.op if site.op is not None else call.first_op)
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
        return self._trace()

    def _add(self, t, module, facet, op, slot, kind, order) -> _Entry:
        e = _Entry(t.detach().cpu(), module, facet, op, slot, kind, order)  # compare works on the CPU
        self.entries.append(e)
        self.by_shape.setdefault(tuple(t.shape), []).append(e)
        if op is not None:
            self.by_op.setdefault(op, []).append(e)
        return e

    def group(self, shape: tuple[int, ...]) -> _Group:
        g = self.groups.get(shape)
        if g is None:
            g = self.groups[shape] = _Group(self.by_shape[shape])
        return g


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _pool(trace: Trace) -> _Pool:
    pool = _POOLS.get(trace)
    if pool is None:
        pool = _POOLS[trace] = _Pool(trace)
    return pool


# -- names in the user's generation ----------------------------------------------------------------


def _names(pool: _Pool, generation: str) -> tuple[dict[tuple[str, str], str], dict[int, str]]:
    """(module, facet) -> name and op -> name, for the names of `generation` that read a site."""
    if generation not in pool.names:
        by_site: dict[tuple[str, str], str] = {}
        by_op: dict[int, str] = {}
        try:
            rows = alias_report(pool.trace, generation=generation)
        except TorchLensError:  # a trace the generation cannot describe: TorchLens names only
            rows = []
        for r in rows:
            if not r.readable or r.module_address is None or r.facet is None:
                continue
            key = (r.module_address, r.facet)
            by_site.setdefault(key, r.query)
            e = pool.site.get(key)
            if e is not None and e.op is not None:
                by_op.setdefault((_through(pool.trace, e.op), tuple(e.tensor.shape)), r.query)
        pool.names[generation] = (by_site, by_op)
    return pool.names[generation]


# -- layouts ---------------------------------------------------------------------------------------


def _layouts(c_shape: tuple[int, ...], e_shape: tuple[int, ...], facet: str | None) -> Iterator[tuple[str, bool, list]]:
    """Conversions of a tensor of `c_shape` that give `e_shape`: (label, accepted, steps).

    `accepted` says whether `compare` itself would accept the conversion for `facet` (the label
    then describes a layout, not a mistake). Steps are applied in order by `_apply`.
    """
    n = len(c_shape)
    if tokens_flattened(c_shape, e_shape):  # the model flattened [batch, pos] (OPT's MLP), as compare accepts it
        yield "tokens unflattened", True, [("reshape", e_shape)]
        return
    majors: list[tuple[str, bool, list, tuple]] = [("", True, [], c_shape)]
    if n == 4:
        swapped = (c_shape[0], c_shape[2], c_shape[1], c_shape[3])
        if facet in HEAD_MAJOR:
            label, ok = ("token-major", facet in PER_HEAD)  # accepted for z, not for scores/pattern
        elif facet in TOKEN_MAJOR:
            label, ok = ("head-major instead of token-major", False)
        else:
            label, ok = ("axes 1 and 2 swapped", False)
        majors.append((label, ok, [("swap",)], swapped))
    for mlabel, mok, msteps, mshape in majors:
        kvs: list[tuple[str, bool, list, tuple]] = [("", True, [], mshape)]
        if facet in KV_HEADS and len(mshape) == 4:
            axis = 1 if mlabel and facet in TOKEN_MAJOR else 2
            targets = set(e_shape) | ({e_shape[-1] // mshape[3]} if mshape[3] and e_shape[-1] % mshape[3] == 0 else set())
            for target in sorted(targets):
                if target > mshape[axis] and target % mshape[axis] == 0:
                    rep = target // mshape[axis]
                    grown = mshape[:axis] + (target,) + mshape[axis + 1:]
                    kvs.append(("kv heads repeated", True, [("interleave", axis, rep)], grown))
                    kvs.append(("kv heads tiled (repeat) instead of repeated per head (repeat_interleave)", False,
                                [("tile", axis, rep)], grown))
        for klabel, kok, ksteps, kshape in kvs:
            batches = [("", True, [], kshape)]
            if kshape and kshape[0] == 1:
                batches.append(("batch dropped", True, [("drop",)], kshape[1:]))
            for blabel, bok, bsteps, bshape in batches:
                flats = [("", True, [], bshape)]
                if len(bshape) >= 3:
                    flat = bshape[:-2] + (bshape[-2] * bshape[-1],)
                    flats.append(("heads flattened", facet in PER_HEAD, [("flat",)], flat))
                for flabel, fok, fsteps, fshape in flats:
                    if fshape == e_shape:
                        label = ", ".join(x for x in (mlabel, klabel, blabel, flabel) if x) or "as is"
                        yield label, mok and kok and bok and fok, msteps + ksteps + bsteps + fsteps


def _apply(t: Tensor, steps: list) -> Tensor:
    for s in steps:
        if s[0] == "swap":
            t = t.transpose(1, 2)
        elif s[0] == "interleave":
            t = t.repeat_interleave(s[2], dim=s[1])
        elif s[0] == "tile":
            reps = [1] * t.dim()
            reps[s[1]] = s[2]
            t = t.repeat(*reps)
        elif s[0] == "drop":
            t = t[0]
        elif s[0] == "flat":
            t = t.flatten(-2)
        elif s[0] == "reshape":
            t = t.reshape(s[1])
    return t


def _inverse(e: Tensor, c_shape: tuple[int, ...], steps: list) -> Tensor:
    """`e` brought back to the layout of a `c_shape` tensor, undoing `steps` (reshapes and transposes)."""
    shapes = [c_shape]
    t = torch.empty(c_shape, device="meta")
    for st in steps:
        t = _apply(t, [st])
        shapes.append(tuple(t.shape))
    for st, before in zip(reversed(steps), reversed(shapes[:-1])):
        if st[0] == "swap":
            e = e.transpose(1, 2)
        else:
            e = e.reshape(before)
    return e.contiguous()


def _norm_factor(steps: list) -> float:
    """How a conversion scales the norm (repeating heads r times scales it by sqrt(r))."""
    f = 1.0
    for s in steps:
        if s[0] in ("interleave", "tile"):
            f *= math.sqrt(s[2])
    return f


# -- data flow -------------------------------------------------------------------------------------


def _source(trace: Trace, ref) -> int | None:
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


def _through(trace: Trace, index: int) -> int:
    """`index` itself, or the op it copies/casts/reshapes (so two names of one value meet)."""
    src = _source(trace, Ref(index))
    return index if src is None else src


def _add_operands(trace: Trace, index: int | None) -> list[int]:
    if index is None:
        return []
    op = trace.ops[_through(trace, index)]
    if op.name not in ADD_OPS:
        return []
    return [s for s in (_source(trace, r) for r in op.inputs) if s is not None]


def _path(trace: Trace, start: int, end: int, limit: int = 6) -> list[int] | None:
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


def _layer(trace: Trace, address: str | None) -> int | None:
    if address is None:
        return None
    for i, b in enumerate(trace.blocks):
        if address == b or address.startswith(b + "."):
            return i
    return None


def _analogue(trace: Trace, address: str, layer: int, other: int) -> str:
    b = trace.blocks[layer]
    return trace.blocks[other] + address[len(b):]


# -- relations -------------------------------------------------------------------------------------


def _norm_of(pool: _Pool, module: str | None) -> bool:
    return module is not None and module in pool.trace.modules and pool.trace.modules[module].role == "norm"


def _norm_around(pool: _Pool, op: int | None) -> tuple[str, int | None] | None:
    """(norm address, its input op) for the norm whose output or normalized tensor is `op`."""
    if op is None:
        return None
    trace = pool.trace
    module = trace.ops[op].module
    while module is not None and not _norm_of(pool, module):
        module = module.rpartition(".")[0] if module else None
    if module is None:
        return None
    inp = pool.site.get((module, "input"))
    return module, (inp.op if inp is not None else None)


def _relation(pool: _Pool, expected: _Entry | None, cand: _Entry, label: str, accepted: bool) -> str:
    """How `cand` (converted by `label`) relates to the `expected` site, in words."""
    trace = pool.trace
    layout = "" if accepted else label
    if expected is None:
        return layout
    same_site = cand.kind == "facet" and (cand.module, cand.facet) == (expected.module, expected.facet)
    if same_site or (cand.op is not None and expected.op is not None
                     and _through(trace, cand.op) == _through(trace, expected.op)):
        return layout or SAME
    words: list[str] = []
    ex_op, c_op = expected.op, cand.op
    lx, lc = _layer(trace, expected.module), _layer(trace, cand.module)
    if cand.facet is not None and expected.facet is not None and lx is not None and lc is not None and lx != lc:
        if cand.facet == expected.facet and cand.module == _analogue(trace, expected.module, lx, lc):
            words.append(("the neighbouring layer" if abs(lc - lx) == 1 else "another layer")
                         + f" ({lc} instead of {lx})")
    if not words and cand.module == expected.module and {cand.facet, expected.facet} in ({"q", "rot_q"}, {"k", "rot_k"}):
        words.append("after RoPE instead of before" if cand.facet.startswith("rot_") else "before RoPE instead of after")
    if not words and ex_op is not None and c_op is not None:
        ex_src, c_src = _through(trace, ex_op), _through(trace, c_op)
        norm_c = _norm_around(pool, c_op)
        norm_x = _norm_around(pool, ex_op)
        if norm_c is not None and norm_c[1] is not None and _through(trace, norm_c[1]) == ex_src:
            words.append(f"after the norm {_short(pool, norm_c[0])} instead of before it")
        elif norm_x is not None and norm_x[1] is not None and _through(trace, norm_x[1]) == c_src:
            raw = cand.facet == "output" and cand.module in trace.modules and \
                trace.modules[cand.module].role in ("attention", "mlp")
            words.append(f"before the norm {_short(pool, norm_x[0])}: "
                         + ("the raw sublayer output, the norm not applied" if raw else "the norm not applied"))
        elif norm_c is not None and norm_c[1] is not None and ex_src in _add_operands(trace, norm_c[1]):
            words.append(f"the norm {_short(pool, norm_c[0])} of the site plus the residual: a fused add+norm "
                         "wrote its output into the saved tensor in place")
        elif ex_src in _add_operands(trace, c_op):
            others = [o for o in _add_operands(trace, c_op) if o != ex_src]
            words.append("the residual is included" if _residual(pool, others) else "the site plus another tensor")
        elif c_src in _add_operands(trace, ex_op):
            others = [o for o in _add_operands(trace, ex_op) if o != c_src]
            words.append("the residual is missing" if _residual(pool, others) else "the site minus another tensor")
        else:  # one of the two is computed from the other: say which way, and through which ops
            for src, dst, side, softcap in (
                (c_src, ex_src, "before", "before the softcap: the softcap (tanh) is dropped"),
                (ex_src, c_src, "after", "after a softcap (tanh) the site does not have"),
            ):
                path = _path(trace, src, dst)
                if path is not None:
                    names = [trace.ops[i].name for i in path]
                    words.append(softcap if "tanh" in names else
                                 f"{len(path)} op{'s' if len(path) > 1 else ''} {side} the site ({' → '.join(names)})")
                    break
    if layout:
        words.append(layout)
    return "; ".join(words)


def _residual(pool: _Pool, ops: list[int]) -> bool:
    """Whether one of `ops` is the residual stream: a block's input, or its residual between sublayers."""
    trace = pool.trace
    stream = set()
    for b in trace.blocks:
        for name in ("resid_pre", "resid_mid"):
            e = pool.site.get((b, name))
            if e is not None and e.op is not None:
                stream.add(_through(trace, e.op))
    return any(_through(trace, o) in stream for o in ops)


def _short(pool: _Pool, address: str) -> str:
    return address or "<root>"


def _label(pool: _Pool, e: _Entry, generation: str | None) -> str:
    if generation is not None:
        by_site, by_op = _names(pool, generation)
        if e.kind == "facet" and (e.module, e.facet) in by_site:
            return by_site[(e.module, e.facet)]
        alias = (_through(pool.trace, e.op), tuple(e.tensor.shape)) if e.op is not None and e.slot == 0 else None
        if alias in by_op:
            return by_op[alias]
    if e.kind == "facet":
        return f"{e.module or '<root>'}:{e.facet}"
    op = pool.trace.ops[e.op]
    slot = f" (output {e.slot})" if e.slot else ""
    return f"op #{op.index} {op.name}{slot} in {op.module or '<root>'}"


# -- the search ------------------------------------------------------------------------------------


def _rel(engine: Tensor, other: Tensor, norm_e: float, vis: Tensor | None = None) -> tuple[float, float]:
    if vis is not None:
        engine, other = engine[vis], other[vis]
    d = engine - other.float()
    if d.numel() == 0:
        return 0.0, 0.0
    norm = float(torch.linalg.vector_norm(d))
    if math.isnan(norm):
        return float("inf"), float("inf")
    return norm / max(norm_e, 1e-30), float(d.abs().max())


def _within(engine: Tensor, other: Tensor, atol: float, rtol: float, vis: Tensor | None = None) -> bool:
    if vis is not None:
        engine, other = engine[vis], other[vis]
    o = other.float()
    return bool(((engine - o).abs() <= atol + rtol * o.abs()).all())


@dataclass
class _Found:
    entry: _Entry | None
    label: str
    accepted: bool
    steps: list
    error: float
    max_abs: float
    matches: bool
    factor: float | None = None
    relation: str = ""
    site: str = ""
    rank: int = 3
    other: _Entry | None = None  # the second term of a sum
    extra: str = ""  # a precision note added to the structural relation


def diagnose(
    trace: Trace,
    engine: Tensor,
    module_address: str | None,
    facet: str | None,
    generation: str | None,
    atol: float,
    rtol: float,
    alternatives: tuple[Tensor, ...] = (),
) -> tuple[str, tuple[Candidate, ...]]:
    """Explain what `engine` equals in `trace`: (one-line explanation, ranked candidates).

    Args:
        trace: the reference trace (it must hold the tensors, e.g. `save="all"`).
        engine: the engine's tensor (as handed to `compare`).
        module_address, facet: the site the name reads (None when it has none).
        generation: the naming generation to name candidates in.
        atol, rtol: what counts as equal (the row's tolerance).
        alternatives: the other elements of a tuple the engine handed (element 0 was `engine`).
    """
    pool = _pool(trace)
    if not pool.entries:
        return "cannot be explained: the trace kept no tensors to search (trace with save='all')", ()
    e = engine.detach().cpu().float()
    n = e.numel()
    if n == 0:
        return "", ()
    masked = e <= torch.finfo(torch.float32).min / 2  # masked attention scores: compare the visible ones
    vis = ~masked if bool(masked.any()) else None
    shown = e if vis is None else e[vis]
    norm_e = float(torch.linalg.vector_norm(shown, dtype=torch.float64))
    mean_e = float(shown.mean(dtype=torch.float64)) if shown.numel() else 0.0
    expected = pool.site.get((module_address, facet)) if module_address is not None and facet else None
    found: list[_Found] = []
    shape = tuple(e.shape)

    # 1. Every tensor whose shape reaches the engine's shape. For the members of a shape group of
    # the engine's size, E is brought to their layout (undoing a reshape or transpose) and one
    # matrix-vector product gives each one's distance and least-squares scale. Repeated kv heads
    # (which change the size) and masked scores are screened by norm and mean bounds instead.
    scaled_pending: list[tuple[_Entry, str, bool, list]] = []
    layouts: dict[tuple, list] = {}
    for c_shape, entries in pool.by_shape.items():
        size = math.prod(c_shape)
        if size > n or n % max(size, 1):
            continue  # no conversion changes the size except repeating kv heads (which grows it)
        if size < n and not any(c.facet in KV_HEADS for c in entries):
            continue
        group = pool.group(c_shape)
        batches: dict[tuple, list[tuple[_Entry, str, bool, list]]] = {}
        for c in entries:
            key = (c_shape, c.facet if c.facet in PER_HEAD | HEAD_MAJOR else None)
            if key not in layouts:
                layouts[key] = list(_layouts(c_shape, shape, key[1]))
            for label, accepted, steps in layouts[key]:
                if vis is None and size == n:  # a reshape or transpose: E can be brought to C's layout
                    batches.setdefault(tuple(tuple(st) for st in steps), []).append((c, label, accepted, steps))
                else:
                    _consider(c, label, accepted, steps, e, norm_e, mean_e, atol, rtol, found, scaled_pending, vis)
        for steps, ordered in batches.items():
            _screen(group, ordered, e, _inverse(e, c_shape, list(steps)).reshape(-1), norm_e, atol, rtol, found)

    # 2. Scalar multiples of the tensors screened by bounds that did not match as they are.
    if vis is None and not any(f.matches for f in found):
        for c, label, accepted, steps in scaled_pending:
            _scaled(c, label, accepted, steps, e, norm_e, mean_e, atol, rtol, found)

    # 3. A rounding of a near candidate (or of the site) to half precision.
    _roundings(found, expected, e, norm_e, engine.dtype, pool, shape, vis)

    # 4. The other elements of the engine's tuple, and their sum.
    if expected is not None and alternatives:
        _tuple_elements(expected, alternatives, shape, engine, norm_e, atol, rtol, found)

    # 5. The softmax of an earlier op on the way to the scores (a softcap or mask left out).
    if expected is not None and expected.facet == "pattern" and not any(f.matches for f in found):
        _patterns(pool, expected, e, norm_e, atol, rtol, found, shape, vis)
        if not any(f.matches for f in found):
            _qk_patterns(pool, expected, e, norm_e, atol, rtol, found, shape, vis, generation)

    # 6. The sum of two facets.
    if vis is None and not any(f.matches for f in found):
        _sums(pool, e, norm_e, mean_e, atol, rtol, found, shape)

    named = _names(pool, generation)[0] if generation is not None else {}
    for f in found:
        if f.other is not None:
            f.site = f"{_label(pool, f.entry, generation)} + {_label(pool, f.other, generation)}"
            f.relation = "the sum of two sites"
        if f.entry is not None:
            f.relation = f.relation or _relation(pool, expected, f.entry, f.label, f.accepted)
            if not f.site and _same_value(pool, f.entry, expected):
                f.site = _label(pool, expected, generation)  # the site's own name for its own tensor
            f.site = f.site or _label(pool, f.entry, generation)
        if f.factor is not None and f.relation == SAME:
            f.relation = "a scale factor"
        if f.entry is not None and f.factor is None and expected is not None and f.matches:
            factor = _scalar_path(pool, expected, f.entry)
            if factor is not None:  # an op that only multiplies the site by a constant
                f.relation = f"a scale factor (the model computes this product as {f.site})"
                f.site, f.factor = _label(pool, expected, generation), factor
        if f.extra:
            f.relation = f.extra if f.relation in ("", SAME) else f"{f.relation}; {f.extra}"
        if "{site}" in f.relation:
            f.relation = f.relation.replace("{site}", _label(pool, expected, generation))
        f.rank = _rank(f, named)
    # Matches by how much the relation says, then by error; the rest by error alone.
    found.sort(key=lambda f: (not f.matches, f.rank if f.matches else (0, 0), f.error, f.rank,
                              f.entry.order if f.entry else -1))
    cands: list[Candidate] = []
    seen: set = set()
    for f in found:
        e_ = f.entry
        if e_ is None:
            key = (f.site, f.relation)
        else:
            ident = ("op", _through(trace, e_.op)) if e_.op is not None else ("site", e_.module, e_.facet)
            key = (ident, f.label, None if f.factor is None else round(f.factor, 3), f.other is not None,
                   bool(f.extra))
        if key in seen:
            continue
        seen.add(key)
        cands.append(Candidate(f.site, f.relation, f.error, f.max_abs, f.matches, f.factor,
                               e_.module if e_ else None, e_.facet if e_ else None, e_.op if e_ else None))
        if len(cands) >= KEEP:
            break
    return _explain(cands), tuple(cands)


def _same_value(pool: _Pool, a: _Entry, b: _Entry | None) -> bool:
    """Whether `a` is `b`'s tensor (the same op's output, looking through casts and reshapes)."""
    if b is None or a.op is None or b.op is None or tuple(a.tensor.shape) != tuple(b.tensor.shape):
        return a is b
    return _through(pool.trace, a.op) == _through(pool.trace, b.op)


def _rank(f: _Found, named: dict) -> tuple[int, int]:
    """(how specific the relation is, how the site is named): lower is better."""
    r = f.relation
    if f.entry is None and f.matches:
        return -1, 0  # the engine's own tuple, or a derived pattern: says most
    if not f.matches:
        quality = 0
    elif not r or r == SAME:
        quality = 2
    elif " op" in r and ("before the site" in r or "after the site" in r):
        quality = 1
    else:
        quality = 0
    e = f.entry
    if e is None or (e.kind == "facet" and (e.module, e.facet) in named) or f.site in named.values():
        naming = 0
    elif e.kind == "facet":
        naming = 1
    else:
        naming = 2
    return quality, naming


def _screen(group: _Group, ordered, e, flat_e, norm_e, atol, rtol, found):
    """Exact checks for the members of one shape group that the dot products leave in the running."""
    dots = (group.matrix @ flat_e).double()
    norms = group.norms
    dist = (norm_e ** 2 + norms ** 2 - 2 * dots).clamp(min=0).sqrt() / max(norm_e, 1e-30)
    cos = dots / (norms * norm_e).clamp(min=1e-30)
    sin = (1 - cos ** 2).clamp(min=0).sqrt()
    factor = dots / (norms ** 2).clamp(min=1e-30)
    rows = torch.tensor([c.row for c, *_ in ordered])
    d_rows, s_rows = dist[rows], sin[rows]
    near = set(torch.argsort(d_rows)[:KEEP].tolist())  # the nearest few are listed even without a match
    any_exact = bool((d_rows < 1e-2).any())
    for i, (c, label, accepted, steps) in enumerate(ordered):
        d = float(d_rows[i])
        if d < 0.05 or i in near:
            v = _apply(c.tensor, steps)
            err, mx = _rel(e, v, norm_e)
            found.append(_Found(c, label, accepted, steps, err, mx, err < 0.1 and _within(e, v, atol, rtol)))
        a = float(factor[rows[i]])
        if not any_exact and float(s_rows[i]) < 2 * NEAR and abs(a - 1) > 1e-3 and 1e-12 < abs(a) < 1e12:
            v = a * _apply(c.tensor, steps).float()
            err, mx = _rel(e, v, norm_e)
            found.append(_Found(c, label, accepted, steps, err, mx, _within(e, v, atol, rtol), factor=a))


def _consider(c: _Entry, label, accepted, steps, e, norm_e, mean_e, atol, rtol, found, scaled_pending, vis=None):
    norm_c = c.norm * _norm_factor(steps)
    n = e.numel()
    lb = max(abs(norm_e - norm_c), abs(mean_e - c.mean) * math.sqrt(n)) / max(norm_e, 1e-30)
    if not math.isfinite(lb) and vis is None:
        return  # a tensor with infinite entries (masked scores) is no match for a finite one
    if vis is not None:
        lb = 0.0  # the statistics cover masked entries too: no bound
    elif lb > _PRUNE:
        scaled_pending.append((c, label, accepted, steps))
        return
    v = _apply(c.tensor, steps)
    err, mx = _rel(e, v, norm_e, vis)
    ok = err < 0.1 and _within(e, v, atol, rtol, vis)
    found.append(_Found(c, label, accepted, steps, err, mx, ok))
    if not ok and err > 1e-3:
        scaled_pending.append((c, label, accepted, steps))


def _scaled(c: _Entry, label, accepted, steps, e, norm_e, mean_e, atol, rtol, found):
    """`E ≈ a × C` with the least-squares `a`; pruned by the normalized means (sin θ ≥ |Δ mean|·√(n/2))."""
    norm_c = c.norm * _norm_factor(steps)
    if norm_c == 0 or norm_e == 0 or not math.isfinite(norm_c):
        return
    n = e.numel()
    mu, mv = mean_e / norm_e, c.mean / norm_c
    if min(abs(mu - mv), abs(mu + mv)) * math.sqrt(n / 2) > NEAR:
        return
    v = _apply(c.tensor, steps).float()
    dot = float(torch.dot(e.reshape(-1), v.reshape(-1)))
    a = dot / (norm_c * norm_c)
    if abs(a) < 1e-12 or abs(a - 1) < 1e-3:
        return
    cos = dot / (norm_e * norm_c)
    if 1 - cos * cos > NEAR * NEAR * 4:
        return
    err, mx = _rel(e, a * v, norm_e)
    found.append(_Found(c, label, accepted, steps, err, mx, _within(e, a * v, atol, rtol), factor=a,
                        relation=""))


def _roundings(found, expected, e, norm_e, engine_dtype, pool, shape, vis):
    """A candidate rounded to bfloat16/float16 that explains the engine's tensor exactly."""
    dtypes = [engine_dtype] if engine_dtype in (torch.bfloat16, torch.float16) else [torch.bfloat16, torch.float16]
    pool_near = [f for f in found if f.factor is None and f.error < 0.05 and not f.matches]
    if expected is not None and not any(f.entry is expected for f in pool_near):
        for label, accepted, steps in _layouts(tuple(expected.tensor.shape), shape, expected.facet):
            if accepted:
                v = _apply(expected.tensor, steps)
                err, mx = _rel(e, v, norm_e, vis)
                pool_near.append(_Found(expected, label, accepted, steps, err, mx, False))
                break
    for f in pool_near[:8]:
        v = _apply(f.entry.tensor, f.steps).float()
        for dt in dtypes:
            if v.dtype == dt:
                continue
            r = v.to(dt).float()
            err, mx = _rel(e, r, norm_e, vis)
            name = str(dt)[6:]
            eps = torch.finfo(dt).eps
            ee, rr = (e, r) if vis is None else (e[vis], r[vis])
            if bool(((ee - rr).abs() <= eps * rr.abs() + 1e-30).all()):
                found.append(_Found(f.entry, f.label, f.accepted, f.steps, err, mx, True,
                                    extra=f"rounded to {name}: the values agree at {name} precision "
                                    "(compare with tolerance='auto' or loosen atol/rtol)"))
                return
            if engine_dtype == dt and f.error < 4 * eps:
                found.append(_Found(f.entry, f.label, f.accepted, f.steps, f.error, f.max_abs, True,
                                    extra=f"computed in {name}: differences at {name} precision "
                                    "(compare with tolerance='auto' or loosen atol/rtol)"))
                return


def _tuple_elements(expected: _Entry, alternatives, shape, engine, norm_e, atol, rtol, found):
    """Another element of the engine's tuple is the site, or the elements sum to it."""

    def as_site(t: Tensor):
        for label, accepted, steps in _layouts(tuple(expected.tensor.shape), tuple(t.shape), expected.facet):
            if accepted:
                return _apply(expected.tensor, steps).float(), label, steps
        return None

    total = engine.detach().cpu().float()
    summable = True
    for i, alt in enumerate(alternatives, start=1):
        if not isinstance(alt, Tensor):
            summable = False
            continue
        a = alt.detach().cpu().float()
        if tuple(a.shape) == shape:
            total = total + a
        else:
            summable = False
        hit = as_site(a)
        if hit is None:
            continue
        ref, label, steps = hit
        err, mx = _rel(a, ref, float(torch.linalg.vector_norm(a, dtype=torch.float64)))
        if _within(a, ref, atol, rtol):
            found.append(_Found(None, label, True, steps, err, mx, True,
                                relation="is {site}: the wrong tuple element was read",
                                site=f"element {i} of the engine's tuple"))
            return
    hit = as_site(total) if summable else None
    if hit is not None:
        ref, label, steps = hit
        err, mx = _rel(total, ref, float(torch.linalg.vector_norm(total, dtype=torch.float64)))
        if _within(total, ref, atol, rtol):
            found.append(_Found(None, label, True, steps, err, mx, True,
                                relation="is {site}: the engine returns (output, residual) and the residual was "
                                "not added",
                                site="the sum of the engine's tuple elements"))


def _sums(pool: _Pool, e, norm_e, mean_e, atol, rtol, found, shape):
    """`E ≈ A + B` for two facets A, B of the engine's shape (as is or batch dropped).

    The distance of every pair follows from the dot products with E and the group's Gram
    matrix, `‖E − A − B‖² = ‖E‖² + ‖A‖² + ‖B‖² − 2⟨E,A⟩ − 2⟨E,B⟩ + 2⟨A,B⟩`; only the best pair
    is checked element-wise.
    """
    flat_e = e.reshape(-1)
    best = None
    for c_shape, entries in pool.by_shape.items():
        if math.prod(c_shape) != e.numel() or not any(
                accepted and not any(st[0] == "flat" for st in steps)
                for _, accepted, steps in _layouts(c_shape, shape, None)):
            continue
        group = pool.group(c_shape)
        rows = [c.row for c in entries if c.kind == "facet"]
        if len(rows) < 2:
            continue
        idx = torch.tensor(rows)
        d = (group.matrix[idx] @ flat_e).double()
        nn2 = group.norms[idx] ** 2
        g = group.gram()[idx][:, idx]
        r2 = norm_e ** 2 + nn2[:, None] + nn2[None, :] - 2 * d[:, None] - 2 * d[None, :] + 2 * g
        ops = [group.entries[r].op for r in rows]
        same = torch.tensor([[a is not None and a == b for b in ops] for a in ops])
        r2 = r2.masked_fill(same | torch.eye(len(rows), dtype=torch.bool), float("inf"))
        k = int(torch.argmin(r2))
        i, j = divmod(k, len(rows))
        rel = math.sqrt(max(float(r2[i, j]), 0.0)) / max(norm_e, 1e-30)
        if rel < NEAR and (best is None or rel < best[0]):
            best = (rel, group.entries[rows[i]], group.entries[rows[j]])
    if best is not None:
        _, a, b = best
        if a.order > b.order:
            a, b = b, a
        s_ = a.tensor.reshape(e.shape).float() + b.tensor.reshape(e.shape).float()
        err, mx = _rel(e, s_, norm_e)
        if err < NEAR:
            found.append(_Found(a, "as is", True, [], err, mx, _within(e, s_, atol, rtol), other=b))


def _scalar_path(pool: _Pool, expected: _Entry, cand: _Entry) -> float | None:
    """The constant `a` when `cand` is `a × expected` computed by multiplications by a scalar."""
    trace = pool.trace
    if cand.op is None or expected.op is None:
        return None
    path = _path(trace, _through(trace, expected.op), _through(trace, cand.op))
    if not path:
        return None
    for i in path:
        op = trace.ops[i]
        refs = [r for r in op.inputs if type(r) is Ref and math.prod(trace.ops[r.op].shapes[r.slot]) > 1]
        if op.name not in SCALE_OPS | PASS_THROUGH_OPS | RESHAPE_OPS or len(refs) != 1:
            return None
    x, c = expected.tensor.double().reshape(-1), cand.tensor.double().reshape(-1)
    if x.numel() != c.numel():
        return None
    den = float(x @ x)
    if not den:
        return None
    a = float(x @ c) / den
    if float(torch.linalg.vector_norm(c - a * x)) > 1e-4 * float(torch.linalg.vector_norm(c)):
        return None  # not one constant (a per-feature gain, say)
    return a


def _patterns(pool: _Pool, expected: _Entry, e, norm_e, atol, rtol, found, shape, vis):
    """softmax(U) for each op U a few steps before the module's scores, with and without the mask."""
    scores = pool.site.get((expected.module, "scores"))
    if scores is None or scores.op is None:
        return
    trace = pool.trace
    masked = scores.tensor <= torch.finfo(torch.float32).min / 2
    masked = masked | torch.isinf(scores.tensor)
    idx = scores.op
    upstream = []
    for _ in range(6):
        op = trace.ops[idx]
        nxt = next((r.op for r in op.inputs if type(r) is Ref and tuple(trace.ops[r.op].shape) == tuple(op.shape)), None)
        if nxt is None:
            break
        upstream.append(nxt)
        idx = nxt
    for u in [scores.op] + upstream:
        t = trace.ops[u].tensor
        if t is None or tuple(t.shape) != tuple(scores.tensor.shape):
            continue
        for with_mask in (True, False):
            if u == scores.op and with_mask:
                continue
            x = t.float().masked_fill(masked, float("-inf")) if with_mask else t.float()
            p = torch.softmax(x, dim=-1)
            for label, accepted, steps in _layouts(tuple(p.shape), shape, "pattern"):
                if not accepted:
                    continue
                v = _apply(p, steps)
                err, mx = _rel(e, v, norm_e, vis)
                if err > NEAR:
                    continue
                path = _path(trace, u, scores.op) or []
                names = [trace.ops[i].name for i in path]
                what = []
                if "tanh" in names:
                    what.append("the softcap (tanh) dropped")
                if not with_mask:
                    what.append("no causal/attention mask applied")
                elif names and not what:
                    what.append(f"the ops {' → '.join(names)} left out")
                op = trace.ops[u]
                found.append(_Found(None, label, True, steps, err, mx, _within(e, v, atol, rtol, vis),
                                    site=f"softmax of op #{op.index} {op.name} in {op.module or '<root>'}",
                                    relation="the pattern with " + " and ".join(what or ["the scores as they are"])))
                break


def _qk_patterns(pool: _Pool, expected: _Entry, e, norm_e, atol, rtol, found, shape, vis, generation):
    """softmax(a·q·kᵀ) from the module's q/k facets: without the mask, or without RoPE."""
    mod = expected.module
    scores = pool.site.get((mod, "scores"))
    if scores is None:
        return
    s = scores.tensor.float()
    masked = (s <= torch.finfo(torch.float32).min / 2) | torch.isinf(s)
    pairs = [("rot_q", "rot_k"), ("q", "k")] if (mod, "rot_q") in pool.site else [("q", "k")]
    a = None
    for n, (qn, kn) in enumerate(pairs):
        q, k = pool.site.get((mod, qn)), pool.site.get((mod, kn))
        if q is None or k is None or q.tensor.dim() != 4 or k.tensor.dim() != 4:
            continue
        qt = q.tensor.float().transpose(1, 2)
        kt = k.tensor.float().transpose(1, 2)
        if qt.shape[1] % kt.shape[1]:
            continue
        kt = kt.repeat_interleave(qt.shape[1] // kt.shape[1], dim=1)
        qk = qt @ kt.transpose(-1, -2)
        if qk.shape != s.shape:
            continue
        if a is None:  # the kernel's scale, fitted on the visible scores (else 1/sqrt(d_head))
            x, y = qk[~masked].double(), s[~masked].double()
            den = float(x @ x)
            a = float(x @ y) / den if den else 0.0
            if not den or float(torch.linalg.vector_norm(y - a * x)) > 1e-3 * float(torch.linalg.vector_norm(y)):
                a = 1 / math.sqrt(qt.shape[-1])
        for with_mask in (True, False):
            if n == 0 and with_mask:
                continue  # that is the pattern itself
            x = a * qk
            p = torch.softmax(x.masked_fill(masked, float("-inf")) if with_mask else x, dim=-1)
            for label, accepted, steps in _layouts(tuple(p.shape), shape, "pattern"):
                if not accepted:
                    continue
                v = _apply(p, steps)
                err, mx = _rel(e, v, norm_e, vis)
                if err > NEAR:
                    break
                what = []
                if n:
                    what.append("RoPE not applied to q and k")
                if not with_mask:
                    what.append("no causal or attention mask applied (an attention module called on its own, "
                                "such as an eager copy outside the model's forward, gets no mask)")
                site = f"softmax({_label(pool, q, generation)} · {_label(pool, k, generation)}ᵀ)"
                found.append(_Found(None, label, True, steps, err, mx, _within(e, v, atol, rtol, vis),
                                    site=site, relation="; ".join(what)))
                break


def _explain(cands: list[Candidate]) -> str:
    if cands and cands[0].matches and cands[0].module_address is None and cands[0].relation.startswith("is "):
        return f"{cands[0].site} {cands[0].relation}"  # the engine's own tuple holds the site
    if cands and cands[0].matches:
        return f"equals {cands[0].describe()}"
    if not cands:
        return "matches no tensor of the trace (none of its saved tensors reaches the engine's shape)"
    near = ", ".join(f"{_fmt(c.factor) + ' × ' if c.factor is not None else ''}{c.site} ({c.error:.2g})"
                     for c in cands[:3])
    return f"matches no tensor of the trace; nearest by relative error: {near}"
