"""Candidates beyond a single tensor in some layout: roundings to half precision, the other
elements of a tuple the engine handed, sums of two facets, and attention patterns computed from
other scores or queries and keys."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from torchlens._core.ops import PASS_THROUGH_OPS, RESHAPE_OPS, SCALE_OPS
from torchlens._core.records import Ref
from torchlens._naming.layouts import apply, conversions
from torchlens._naming.pool import (
    NEAR,
    Entry,
    Found,
    Pool,
    label_of,
    op_path,
    rel,
    same_mask,
    through,
    within,
)

# The layout sets (token-major, head-major, kv-head and per-head facets) come from the facet rows.


def roundings(found, expected, e, norm_e, engine_dtype, pool, shape, vis):
    """A candidate rounded to bfloat16/float16 that explains the engine's tensor exactly."""
    dtypes = (
        [engine_dtype]
        if engine_dtype in (torch.bfloat16, torch.float16)
        else [torch.bfloat16, torch.float16]
    )
    pool_near = [f for f in found if f.factor is None and f.error < 0.05 and not f.matches]
    if expected is not None and not any(f.entry is expected for f in pool_near):
        for label, accepted, steps in conversions(
            tuple(expected.tensor.shape), shape, expected.facet
        ):
            if accepted:
                v = apply(expected.tensor, steps)
                err, mx = rel(e, v, norm_e, vis)
                pool_near.append(Found(expected, label, accepted, steps, err, mx, False))
                break
    for f in pool_near[:8]:
        v = apply(f.entry.tensor, f.steps).float()
        for dt in dtypes:
            if v.dtype == dt:
                continue
            r = v.to(dt).float()
            err, mx = rel(e, r, norm_e, vis)
            name = str(dt)[6:]
            eps = torch.finfo(dt).eps
            ee, rr = (e, r) if vis is None else (e[vis], r[vis])
            # Finite values only: |x - inf| <= eps * inf holds for an infinite entry (a masked score).
            if (
                math.isfinite(err)
                and same_mask(r, vis)
                and bool(torch.isfinite(rr).all())
                and bool(((ee - rr).abs() <= eps * rr.abs() + 1e-30).all())
            ):
                found.append(
                    Found(
                        f.entry,
                        f.label,
                        f.accepted,
                        f.steps,
                        err,
                        mx,
                        True,
                        extra=f"rounded to {name}: the values agree at {name} precision "
                        "(compare with tolerance='auto' or loosen atol/rtol)",
                    )
                )
                return
            if engine_dtype == dt and f.error < 4 * eps and math.isfinite(f.max_abs):
                found.append(
                    Found(
                        f.entry,
                        f.label,
                        f.accepted,
                        f.steps,
                        f.error,
                        f.max_abs,
                        True,
                        extra=f"computed in {name}: differences at {name} precision "
                        "(compare with tolerance='auto' or loosen atol/rtol)",
                    )
                )
                return


def tuple_elements(expected: Entry, alternatives, shape, engine, norm_e, atol, rtol, found):
    """Another element of the engine's tuple is the site, or the elements sum to it."""

    def as_site(t: Tensor, relation: str, site: str) -> Found | None:
        """`t`, in an accepted layout of the site, equal to the site within the tolerance."""
        for label, accepted, steps in conversions(
            tuple(expected.tensor.shape), tuple(t.shape), expected.facet
        ):
            if accepted:
                ref = apply(expected.tensor, steps).float()
                err, mx = rel(t, ref, float(torch.linalg.vector_norm(t, dtype=torch.float64)))
                if not within(t, ref, atol, rtol):
                    return None
                return Found(None, label, True, steps, err, mx, True, relation=relation, site=site)
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
        hit = as_site(
            a,
            "is {site}: the wrong tuple element was read",
            f"element {i} of the engine's tuple",
        )
        if hit is not None:
            found.append(hit)
            return
    hit = (
        as_site(
            total,
            "is {site}: the engine returns (output, residual) and the residual was not added",
            "the sum of the engine's tuple elements",
        )
        if summable
        else None
    )
    if hit is not None:
        found.append(hit)


def sums(pool: Pool, e, norm_e, mean_e, atol, rtol, found, shape):
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
            for _, accepted, steps in conversions(c_shape, shape, None)
        ):
            continue
        group = pool.group(c_shape)
        rows = [c.row for c in entries if c.kind == "facet"]
        if len(rows) < 2:
            continue
        idx = torch.tensor(rows)
        d = (group.matrix[idx] @ flat_e).double()
        nn2 = group.norms[idx] ** 2
        g = group.gram()[idx][:, idx]
        r2 = norm_e**2 + nn2[:, None] + nn2[None, :] - 2 * d[:, None] - 2 * d[None, :] + 2 * g
        ops = [group.entries[r].op for r in rows]
        same = torch.tensor([[a is not None and a == b for b in ops] for a in ops])
        r2 = r2.masked_fill(same | torch.eye(len(rows), dtype=torch.bool), float("inf"))
        k = int(torch.argmin(r2))
        i, j = divmod(k, len(rows))
        distance = math.sqrt(max(float(r2[i, j]), 0.0)) / max(norm_e, 1e-30)
        if distance < NEAR and (best is None or distance < best[0]):
            best = (distance, group.entries[rows[i]], group.entries[rows[j]])
    if best is not None:
        _, a, b = best
        if a.order > b.order:
            a, b = b, a
        s_ = a.tensor.reshape(e.shape).float() + b.tensor.reshape(e.shape).float()
        err, mx = rel(e, s_, norm_e)
        if err < NEAR:
            found.append(Found(a, "as is", True, (), err, mx, within(e, s_, atol, rtol), other=b))


def scalar_path(pool: Pool, expected: Entry, cand: Entry) -> float | None:
    """The constant `a` when `cand` is `a × expected` computed by multiplications by a scalar."""
    trace = pool.trace
    if cand.op is None or expected.op is None:
        return None
    path = op_path(trace, through(trace, expected.op), through(trace, cand.op))
    if not path:
        return None
    for i in path:
        op = trace.ops[i]
        refs = [
            r for r in op.inputs if type(r) is Ref and math.prod(trace.ops[r.op].shapes[r.slot]) > 1
        ]
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


def patterns(pool: Pool, expected: Entry, e, norm_e, atol, rtol, found, shape, vis):
    """softmax(U) for each op U a few steps before the module's scores, with and without the mask."""
    if expected.module is None:  # an op's output: no module, so no scores site
        return
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
        nxt = next(
            (
                r.op
                for r in op.inputs
                if type(r) is Ref and tuple(trace.ops[r.op].shape) == tuple(op.shape)
            ),
            None,
        )
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
            for label, accepted, steps in conversions(tuple(p.shape), shape, "pattern"):
                if not accepted:
                    continue
                v = apply(p, steps)
                err, mx = rel(e, v, norm_e, vis)
                if err > NEAR:
                    continue
                path = op_path(trace, u, scores.op) or []
                names = [trace.ops[i].name for i in path]
                what = []
                if "tanh" in names:
                    what.append("the softcap (tanh) dropped")
                if not with_mask:
                    what.append("no causal/attention mask applied")
                elif names and not what:
                    what.append(f"the ops {' → '.join(names)} left out")
                op = trace.ops[u]
                found.append(
                    Found(
                        None,
                        label,
                        True,
                        steps,
                        err,
                        mx,
                        within(e, v, atol, rtol, vis),
                        site=f"softmax of op #{op.index} {op.name} in {op.module or '<root>'}",
                        relation="the pattern with "
                        + " and ".join(what or ["the scores as they are"]),
                    )
                )
                break


def qk_patterns(pool: Pool, expected: Entry, e, norm_e, atol, rtol, found, shape, vis, generation):
    """softmax(a·q·kᵀ) from the module's q/k facets: without the mask, or without RoPE."""
    mod = expected.module
    if mod is None:  # an op's output: no module, so no scores site
        return
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
            if not den or float(torch.linalg.vector_norm(y - a * x)) > 1e-3 * float(
                torch.linalg.vector_norm(y)
            ):
                a = 1 / math.sqrt(qt.shape[-1])
        for with_mask in (True, False):
            if n == 0 and with_mask:
                continue  # that is the pattern itself
            x = a * qk
            p = torch.softmax(x.masked_fill(masked, float("-inf")) if with_mask else x, dim=-1)
            for label, accepted, steps in conversions(tuple(p.shape), shape, "pattern"):
                if not accepted:
                    continue
                v = apply(p, steps)
                err, mx = rel(e, v, norm_e, vis)
                if err > NEAR:
                    break
                what = []
                if n:
                    what.append("RoPE not applied to q and k")
                if not with_mask:
                    what.append(
                        "no causal or attention mask applied (an attention module called on its own, "
                        "such as an eager copy outside the model's forward, gets no mask)"
                    )
                site = (
                    f"softmax({label_of(pool, q, generation)} · {label_of(pool, k, generation)}ᵀ)"
                )
                found.append(
                    Found(
                        None,
                        label,
                        True,
                        steps,
                        err,
                        mx,
                        within(e, v, atol, rtol, vis),
                        site=site,
                        relation="; ".join(what),
                    )
                )
                break
