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

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from torchlens._core.facet_spec import HEAD_MAJOR, KV_HEADS, PER_HEAD
from torchlens._naming.alternatives import (
    patterns,
    qk_patterns,
    roundings,
    scalar_path,
    sums,
    tuple_elements,
)
from torchlens._naming.layouts import apply, conversions, inverse, norm_factor
from torchlens._naming.pool import (
    KEEP,
    NEAR,
    PRUNE,
    SAME,
    Entry,
    Found,
    Group,
    Pool,
    fmt,
    label_of,
    mask_floor,
    names_in,
    pool_of,
    rel,
    relation,
    through,
    within,
)

if TYPE_CHECKING:
    from torchlens._trace import Trace

__all__ = ["Candidate", "diagnose"]

# The layout sets (token-major, head-major, kv-head and per-head facets) come from the facet rows.


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
        what = f"{fmt(self.factor)} × {self.site}" if self.factor is not None else self.site
        return what + (f": {self.relation}" if self.relation else "")

    def __str__(self) -> str:
        return f"{self.describe()} (rel. error {self.error:.2g})"


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
    pool = pool_of(trace)
    if not pool.entries:
        return (
            "cannot be explained: the trace kept no tensors to search (trace with save='all')",
            (),
        )
    e = engine.detach().cpu().float()
    n = e.numel()
    if n == 0:
        return "", ()
    masked = e <= mask_floor(engine.dtype)  # masked attention scores: compare the visible ones
    vis = ~masked if bool(masked.any()) else None
    shown = e if vis is None else e[vis]
    norm_e = float(torch.linalg.vector_norm(shown, dtype=torch.float64))
    mean_e = float(shown.mean(dtype=torch.float64)) if shown.numel() else 0.0
    expected = (
        pool.site.get((module_address, facet)) if module_address is not None and facet else None
    )
    found: list[Found] = []
    shape = tuple(e.shape)

    # 1. Every tensor whose shape reaches the engine's shape. For the members of a shape group of
    # the engine's size, E is brought to their layout (undoing a reshape or transpose) and one
    # matrix-vector product gives each one's distance and least-squares scale. Repeated kv heads
    # (which change the size) and masked scores are screened by norm and mean bounds instead.
    scaled_pending: list[tuple[Entry, str, bool, list]] = []
    layouts: dict[tuple, list] = {}
    for c_shape, entries in pool.by_shape.items():
        size = math.prod(c_shape)
        if size > n or n % max(size, 1):
            continue  # no conversion changes the size except repeating kv heads (which grows it)
        if size < n and not any(c.facet in KV_HEADS for c in entries):
            continue
        group = pool.group(c_shape)
        batches: dict[tuple, list[tuple[Entry, str, bool, list]]] = {}
        for c in entries:
            key = (c_shape, c.facet if c.facet in PER_HEAD | HEAD_MAJOR else None)
            if key not in layouts:
                layouts[key] = list(conversions(c_shape, shape, key[1]))
            for label, accepted, steps in layouts[key]:
                if (
                    vis is None and size == n
                ):  # a reshape or transpose: E can be brought to C's layout
                    batches.setdefault(tuple(tuple(st) for st in steps), []).append(
                        (c, label, accepted, steps)
                    )
                else:
                    _consider(
                        c,
                        label,
                        accepted,
                        steps,
                        e,
                        norm_e,
                        mean_e,
                        atol,
                        rtol,
                        found,
                        scaled_pending,
                        vis,
                    )
        for steps, ordered in batches.items():
            _screen(
                group,
                ordered,
                e,
                inverse(e, c_shape, steps).reshape(-1),
                norm_e,
                atol,
                rtol,
                found,
            )

    # 2. Scalar multiples of the tensors screened by bounds that did not match as they are.
    if vis is None and not any(f.matches for f in found):
        for c, label, accepted, steps in scaled_pending:
            _scaled(c, label, accepted, steps, e, norm_e, mean_e, atol, rtol, found)

    # 3. A rounding of a near candidate (or of the site) to half precision.
    roundings(found, expected, e, norm_e, engine.dtype, pool, shape, vis)

    # 4. The other elements of the engine's tuple, and their sum.
    if expected is not None and alternatives:
        tuple_elements(expected, alternatives, shape, engine, norm_e, atol, rtol, found)

    # 5. The softmax of an earlier op on the way to the scores (a softcap or mask left out).
    if expected is not None and expected.facet == "pattern" and not any(f.matches for f in found):
        patterns(pool, expected, e, norm_e, atol, rtol, found, shape, vis)
        if not any(f.matches for f in found):
            qk_patterns(pool, expected, e, norm_e, atol, rtol, found, shape, vis, generation)

    # 6. The sum of two facets.
    if vis is None and not any(f.matches for f in found):
        sums(pool, e, norm_e, mean_e, atol, rtol, found, shape)

    named = names_in(pool, generation)[0] if generation is not None else {}
    for f in found:
        if f.entry is not None and f.other is not None:  # a sum (`sums`) has both terms
            f.site = (
                f"{label_of(pool, f.entry, generation)} + {label_of(pool, f.other, generation)}"
            )
            f.relation = "the sum of two sites"
        if f.entry is not None:
            f.relation = f.relation or relation(pool, expected, f.entry, f.label, f.accepted)
            if not f.site and expected is not None and _same_value(pool, f.entry, expected):
                f.site = label_of(
                    pool, expected, generation
                )  # the site's own name for its own tensor
            f.site = f.site or label_of(pool, f.entry, generation)
        if f.factor is not None and f.relation == SAME:
            f.relation = "a scale factor"
        if f.entry is not None and f.factor is None and expected is not None and f.matches:
            factor = scalar_path(pool, expected, f.entry)
            if factor is not None:  # an op that only multiplies the site by a constant
                f.relation = f"a scale factor (the model computes this product as {f.site})"
                f.site, f.factor = label_of(pool, expected, generation), factor
        if f.extra:
            f.relation = f.extra if f.relation in ("", SAME) else f"{f.relation}; {f.extra}"
        if "{site}" in f.relation:
            assert expected is not None  # written only by `tuple_elements`, given the site
            f.relation = f.relation.replace("{site}", label_of(pool, expected, generation))
        if not (math.isfinite(f.error) and math.isfinite(f.max_abs)):
            f.matches = False  # an infinite or NaN difference explains nothing
        f.rank = _rank(f, named, expected, pool)
    # Matches by how much the relation says, then by error; the rest by error alone.
    found.sort(
        key=lambda f: (
            not f.matches,
            f.rank if f.matches else (0, 0),
            f.error,
            f.rank,
            f.entry.order if f.entry else -1,
        )
    )
    cands: list[Candidate] = []
    seen: set = set()
    for f in found:
        e_ = f.entry
        seen_key: tuple[Any, ...]
        if e_ is None:
            seen_key = (f.site, f.relation)
        else:
            ident = (
                ("op", through(trace, e_.op))
                if e_.op is not None
                else ("site", e_.module, e_.facet)
            )
            seen_key = (
                ident,
                f.label,
                None if f.factor is None else round(f.factor, 3),
                f.other is not None,
                bool(f.extra),
            )
        if seen_key in seen:
            continue
        seen.add(seen_key)
        cands.append(
            Candidate(
                f.site,
                f.relation,
                f.error,
                f.max_abs,
                f.matches,
                f.factor,
                e_.module if e_ else None,
                e_.facet if e_ else None,
                e_.op if e_ else None,
            )
        )
        if len(cands) >= KEEP:
            break
    return _explain(cands), tuple(cands)


def _same_value(pool: Pool, a: Entry, b: Entry | None) -> bool:
    """Whether `a` is `b`'s tensor (the same op's output, looking through casts and reshapes)."""
    if b is None or a.op is None or b.op is None or tuple(a.tensor.shape) != tuple(b.tensor.shape):
        return a is b
    return through(pool.trace, a.op) == through(pool.trace, b.op)


def _rank(
    f: Found, named: dict, expected: Entry | None = None, pool: Pool | None = None
) -> tuple[int, int]:
    """(how specific the relation is, how the site is named): lower is better.

    A match that only guesses a layout (axes swapped, heads flattened) of another tensor than
    the site's own ranks last among matches: an exact match as is, above all on another named
    site (v handed as `hook_k` equals `hook_v`), says more than an axis swap of some op does.
    """
    r = f.relation
    if f.entry is None and f.matches:
        return -1, 0  # the engine's own tuple, or a derived pattern: says most
    if not f.matches:
        quality = 0
    elif (
        not f.accepted
        and r == f.label
        and f.factor is None
        and not f.extra
        and f.other is None
        and not (pool is not None and f.entry is not None and _same_value(pool, f.entry, expected))
    ):
        quality = 3
    elif not r or r == SAME:
        quality = 2
    elif " op" in r and ("before the site" in r or "after the site" in r):
        quality = 1
    else:
        quality = 0
    e = f.entry
    if (
        e is None
        or (e.kind == "facet" and (e.module, e.facet) in named)
        or f.site in named.values()
    ):
        naming = 0
    elif e.kind == "facet":
        naming = 1
    else:
        naming = 2
    return quality, naming


def _screen(group: Group, ordered, e, flat_e, norm_e, atol, rtol, found):
    """Exact checks for the members of one shape group that the dot products leave in the running."""
    dots = (group.matrix @ flat_e).double()
    norms = group.norms
    dist = (norm_e**2 + norms**2 - 2 * dots).clamp(min=0).sqrt() / max(norm_e, 1e-30)
    cos = dots / (norms * norm_e).clamp(min=1e-30)
    sin = (1 - cos**2).clamp(min=0).sqrt()
    factor = dots / (norms**2).clamp(min=1e-30)
    rows = torch.tensor([c.row for c, *_ in ordered])
    d_rows, s_rows = dist[rows], sin[rows]
    near = set(
        torch.argsort(d_rows)[:KEEP].tolist()
    )  # the nearest few are listed even without a match
    any_exact = bool((d_rows < 1e-2).any())
    for i, (c, label, accepted, steps) in enumerate(ordered):
        d = float(d_rows[i])
        if d < 0.05 or i in near:
            v = apply(c.tensor, steps)
            err, mx = rel(e, v, norm_e)
            found.append(
                Found(c, label, accepted, steps, err, mx, err < 0.1 and within(e, v, atol, rtol))
            )
        a = float(factor[rows[i]])
        if (
            not any_exact
            and float(s_rows[i]) < 2 * NEAR
            and abs(a - 1) > 1e-3
            and 1e-12 < abs(a) < 1e12
        ):
            v = a * apply(c.tensor, steps).float()
            err, mx = rel(e, v, norm_e)
            found.append(
                Found(c, label, accepted, steps, err, mx, within(e, v, atol, rtol), factor=a)
            )


def _consider(
    c: Entry, label, accepted, steps, e, norm_e, mean_e, atol, rtol, found, scaled_pending, vis=None
):
    norm_c = c.norm * norm_factor(steps)
    n = e.numel()
    lb = max(abs(norm_e - norm_c), abs(mean_e - c.mean) * math.sqrt(n)) / max(norm_e, 1e-30)
    if not math.isfinite(lb) and vis is None:
        return  # a tensor with infinite entries (masked scores) is no match for a finite one
    if vis is not None:
        lb = 0.0  # the statistics cover masked entries too: no bound
    elif lb > PRUNE:
        scaled_pending.append((c, label, accepted, steps))
        return
    v = apply(c.tensor, steps)
    err, mx = rel(e, v, norm_e, vis)
    ok = err < 0.1 and within(e, v, atol, rtol, vis)
    found.append(Found(c, label, accepted, steps, err, mx, ok))
    if not ok and err > 1e-3:
        scaled_pending.append((c, label, accepted, steps))


def _scaled(c: Entry, label, accepted, steps, e, norm_e, mean_e, atol, rtol, found):
    """`E ≈ a × C` with the least-squares `a`; pruned by the normalized means (sin θ ≥ |Δ mean|·√(n/2))."""
    norm_c = c.norm * norm_factor(steps)
    if norm_c == 0 or norm_e == 0 or not math.isfinite(norm_c):
        return
    n = e.numel()
    mu, mv = mean_e / norm_e, c.mean / norm_c
    if min(abs(mu - mv), abs(mu + mv)) * math.sqrt(n / 2) > NEAR:
        return
    v = apply(c.tensor, steps).float()
    dot = float(torch.dot(e.reshape(-1), v.reshape(-1)))
    a = dot / (norm_c * norm_c)
    if abs(a) < 1e-12 or abs(a - 1) < 1e-3:
        return
    cos = dot / (norm_e * norm_c)
    if 1 - cos * cos > NEAR * NEAR * 4:
        return
    err, mx = rel(e, a * v, norm_e)
    found.append(
        Found(
            c, label, accepted, steps, err, mx, within(e, a * v, atol, rtol), factor=a, relation=""
        )
    )


def _explain(cands: list[Candidate]) -> str:
    if (
        cands
        and cands[0].matches
        and cands[0].module_address is None
        and cands[0].relation.startswith("is ")
    ):
        return f"{cands[0].site} {cands[0].relation}"  # the engine's own tuple holds the site
    if cands and cands[0].matches:
        return f"equals {cands[0].describe()}"
    if not cands:
        return (
            "matches no tensor of the trace (none of its saved tensors reaches the engine's shape)"
        )
    near = ", ".join(
        f"{fmt(c.factor) + ' × ' if c.factor is not None else ''}{c.site} ({c.error:.2g})"
        for c in cands[:3]
    )
    return f"matches no tensor of the trace; nearest by relative error: {near}"
