"""Attention facets found in the data flow: `q`, `k`, `v` (from the head split), `rot_q`/`rot_k`,
`scores`, `pattern`, `z` (checked: pattern @ v) and the per-head `result` (checked: the sum over
heads is the output projection)."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import Tensor

from torchlens._analysis.facets.common import fits, held, io_ref, make_site, refused, wide
from torchlens._analysis.facets.rebuild import mha_facets, reconstruct
from torchlens._analysis.graph import Graph
from torchlens._core import ops as _ops
from torchlens._core import roles as _roles
from torchlens._core.pending import Pending
from torchlens._core.records import ModuleCall, Ref
from torchlens._core.sites import FacetSite

# -- attention ---------------------------------------------------------------------------------


def _head_split(g: Graph, kernel_ref: Ref, lo: int, d_head: int) -> tuple[Ref, int] | None:
    """Find the per-head view of a projection upstream of an attention kernel input.

    Returns the Ref of the reshape that gave the projection a head axis ([B, T, n, m] from
    [B, T, n*m]; for a grouped layout [B, T, g, m, d], the slice of it this input took) and the
    offset into its last axis where this input's d_head columns start
    (non-zero only for fused per-head qkv layouts such as GPT-NeoX's).
    """
    up = g.ancestors(kernel_ref, lo)
    for i in sorted(up, reverse=True):
        op = g.ops[i]
        if (
            op.name in _ops.RESHAPE_OPS and len(op.shape) == 5 and op.inputs
        ):  # grouped q|k|v view [B, T, g, m, d]
            src = g.meta(op.inputs[0])
            if (
                src is not None
                and len(src[0]) == 3
                and src[0][:2] == tuple(op.shape[:2])
                and op.shape[2] * op.shape[3] * op.shape[4] == src[0][2]
                and op.shape[4] == d_head
            ):
                for j in sorted(
                    j for j in up if j > i
                ):  # the slice of the group's heads this input took
                    sh = tuple(g.ops[j].shapes[up[j]])
                    if (
                        g.ops[j].name == "__getitem__"
                        and sh[:3] == tuple(op.shape[:3])
                        and sh[-1] == d_head
                        and ((len(sh) == 5 and sh[3] < op.shape[3]) or len(sh) == 4)
                    ):  # a slice, or one index of m
                        return Ref(j, up[j]), 0
            continue
        if op.name not in _ops.RESHAPE_OPS or len(op.shape) != 4 or not op.inputs:
            continue
        src = g.meta(op.inputs[0])
        if src is None or len(src[0]) != 3 or src[0][:2] != tuple(op.shape[:2]):
            continue
        if op.shape[2] * op.shape[3] != src[0][2] or op.shape[3] % d_head:
            continue
        offset = 0
        if op.shape[3] != d_head:  # fused per-head q|k|v: find which chunk this input took
            splits = [j for j in up if g.ops[j].name in _ops.SPLIT_OPS and j > i]
            # Each chunk must be one head wide ([B, T, H, 3 * d_head] cut into d_head columns, GPT-NeoX);
            # CodeGen's [B, T, mp, 3 * local] holds groups of heads there, not heads.
            if not splits or g.ops[min(splits)].shapes[up[min(splits)]][-1] != d_head:
                continue
            offset = up[min(splits)] * d_head
        else:  # one view holds every head (Falcon's multi-query q|k|v): the slice taking this input's heads
            for j in sorted(j for j in up if j > i):
                sh = tuple(g.ops[j].shapes[up[j]])
                if (
                    g.ops[j].name in _ops.SPLIT_OPS | _ops.INDEX_OPS
                    and len(sh) == 4
                    and sh[:2] == tuple(op.shape[:2])
                    and sh[3] == d_head
                    and sh[2] < op.shape[2]
                ):
                    return Ref(j, up[j]), 0
        return Ref(i, 0), offset
    return None


def _pre_norm_source(g: Graph, split_ref: Ref, kids: list[ModuleCall]) -> Any:
    """The input of a norm child whose output the head split views, else None.

    A QK-norm applied to the flat projection before the head view (OLMo-2) sits between the
    projection and the reshape; `q`/`k` are the projection output, so the split must look
    through the norm to its input.
    """
    src = g.ops[split_ref.op].inputs[0]
    if type(src) is not Ref:
        return None
    norm = next((k for k in kids if k.role == "norm" and k.output_ref == src), None)
    if norm is None:
        return None
    ref = io_ref(g, norm, "in")
    m, src_m = g.meta(ref), g.meta(src)
    return ref if m is not None and src_m is not None and m[0] == src_m[0] else None


def _pre_scale_source(g: Graph, split_ref: Ref, kids: list[ModuleCall]) -> Any:
    """The projection output, when the head view reads it multiplied by a constant (OPT's `q_proj(x) * scaling`).

    `q` is the projection viewed per head; the scaled tensor is what the scores' matmul reads.
    """
    src = g.ops[split_ref.op].inputs[0]
    op = g.op(src)
    if op is None or op.name not in _ops.SCALE_OPS or len(op.inputs) != 1:
        return None
    proj = next(
        (
            k
            for k in kids
            if k.output_ref == op.inputs[0] and hasattr(g.modules[k.address], "weight")
        ),
        None,
    )
    proj_m, src_m = g.meta(op.inputs[0]), g.meta(src)
    if proj is None or proj_m is None or src_m is None or proj_m[0] != src_m[0]:
        return None
    return op.inputs[0]


def _path_math(g: Graph, start: int, ref: Ref) -> list[str]:
    """The names of the ops that transform values between op `start` and `ref` (RoPE, QK-norm, a
    scale), not just move them; empty when there are none.

    RoPE multiplies by cos/sin and a norm multiplies by its scale, so a product on the path
    is the sign; reshapes, transposes, the KV-cache concatenation and GQA expansion are not.
    """
    up = g.ancestors(ref, start + 1)
    return sorted(
        {
            g.ops[i].name
            for i in up
            if g.ops[i].name in _ops.MUL_OPS or g.ops[i].name in _ops.NORM_OPS
        }
    )


def attention_facets(g: Graph, call: ModuleCall, kids: list[ModuleCall]) -> dict[str, FacetSite]:
    ops = g.ops[call.first_op : call.end_op]
    mha = next((op for op in ops if op.name == "multi_head_attention_forward"), None)
    if mha is not None:
        return mha_facets(g, mha, getattr(g.modules[call.address], "num_heads", None))
    fused = next((op for op in ops if op.name in _ops.FUSED_ATTENTION_OPS), None)
    soft = next((op for op in ops if op.name in _ops.SOFTMAX_OPS), None)
    sites: dict[str, FacetSite | None] = {}  # None for a site not found, dropped at the end
    z_ref = q_ref = k_ref = v_ref = unpacked = None
    if soft is not None and fused is None:
        scores_ref = soft.inputs[0]
        pattern_ref = g.follow(Ref(soft.index, 0), _ops.CAST_OPS)
        sites["scores"] = make_site(g, "scores", scores_ref, note="input of the softmax")
        sites["pattern"] = make_site(g, "pattern", pattern_ref, note="softmax output")
        # z: the matmul that consumes the pattern (possibly through dropout, or through an index
        # that drops softmax columns that are not keys: attention sinks).
        frontier, z_op, key_slice = [pattern_ref.op], None, None
        p_meta = g.meta(pattern_ref)
        for _ in range(4):
            nxt = [c for f in frontier for c in g.consumers.get(f, [])]
            z_op = next((c for c in nxt if g.ops[c].name in _ops.MATMUL_OPS), None)
            if z_op is not None:
                break
            # through dropout, and a reshape merging batch and heads (DeBERTa's bmm over [b * h, q, k])
            frontier = [c for c in nxt if g.ops[c].name in _ops.PASS_THROUGH_OPS | _ops.RESHAPE_OPS]
            for c in nxt:
                sh = tuple(g.ops[c].shape)
                if (
                    key_slice is None
                    and g.ops[c].name in _ops.INDEX_OPS
                    and p_meta is not None
                    and len(sh) == len(p_meta[0])
                    and sh[:-1] == p_meta[0][:-1]
                    and sh[-1] < p_meta[0][-1]
                ):
                    key_slice = c
                    frontier.append(c)
        if key_slice is not None:
            _sink_columns(g, call, sites, scores_ref, pattern_ref, key_slice)
        if z_op is not None:
            z_ref = Ref(z_op, 0)
            zs = tuple(g.ops[z_op].shape)
            if (
                p_meta is not None
                and len(p_meta[0]) == 4
                and len(zs) == 3
                and zs[0] == p_meta[0][0] * p_meta[0][1]
            ):
                # pattern @ v ran on merged [batch * heads] rows: z is the view that splits them back
                z_ref = next(
                    (
                        Ref(c, 0)
                        for c in g.consumers.get(z_op, [])
                        if g.ops[c].name in _ops.RESHAPE_OPS
                        and tuple(g.ops[c].shape) == tuple(p_meta[0][:3]) + (zs[2],)
                    ),
                    z_ref,
                )
            iv = _ops.MATMUL_OPERANDS.get(g.ops[z_op].name, (0, 1))[1]
            v_ref = next((r for r in g.ops[z_op].inputs[iv : iv + 1]), None)
        # q and k: the matmul upstream of the scores.
        r = scores_ref
        for _ in range(12):
            op = g.op(r)
            if op is None or op.index < call.first_op:
                break
            if op.name in _ops.MATMUL_OPS:
                iq, ik = _ops.MATMUL_OPERANDS.get(op.name, (0, 1))
                q_ref, kt = op.inputs[iq], op.inputs[ik]
                kop = g.op(kt)
                k_ref = kop.inputs[0] if kop is not None and kop.name in _ops.TRANSPOSE_OPS else kt
                break
            r = next((x for x in op.inputs if type(x) is Ref), None)
    elif fused is not None:
        z_ref = Ref(fused.index, 0)
        q_ref, k_ref, v_ref = (fused.inputs + (None, None, None))[:3]
        packed = gqa_packed(g, q_ref)
        if (
            packed is not None
        ):  # the kernel saw [b, kv_heads, n_rep * T, d]: unpack to [b, heads, T, ...]
            q_ref, unpacked = packed
        rebuilt: dict[str, FacetSite] = {}
        reconstruct(g, fused, rebuilt, unpacked)
        sites.update(rebuilt)
    if z_ref is not None:
        sites["z"] = make_site(g, "z", z_ref, note="pattern @ v, head-major")
        z = sites["z"]
        if unpacked is not None and z is not None:
            z.shape = unpacked + (z.shape[-1],)
            zt = held(z)
            z.tensor = None if zt is None else zt.reshape(z.shape)
            z.note = (
                "the kernel output, head-major: the kernel ran on the query packed as [batch, kv_heads, "
                "heads per kv head * query, d_head] (GQA single-token decode), unpacked by the inverse reshape"
            )
        if fused is None:
            sites.update(_check_z(g, sites.get("pattern"), v_ref, sites["z"]))
    qm = g.meta(q_ref)
    if qm is None:
        return _head_guard({k: v for k, v in sites.items() if v is not None})
    d_head = qm[0][-1]
    for name, ref in (("q", q_ref), ("k", k_ref), ("v", v_ref)):
        if type(ref) is not Ref:
            continue
        found = _head_split(g, ref, call.first_op, d_head)
        site = (
            None
            if found is None
            else make_site(g, name, found[0], note="projection viewed per head")
        )
        if found is None or site is None:
            sites.update(_unsplit(g, call, name, ref))
            continue
        split_ref, offset = found
        start = split_ref.op
        pre_norm = _pre_norm_source(g, split_ref, kids)
        if pre_norm is not None:  # QK-norm on the flat projection (OLMo-2): q is the norm's input
            t = g.value(pre_norm)
            site.tensor = None if t is None else t.reshape(site.shape)
            site.op = pre_norm.op if type(pre_norm) is Ref else None
            site.note = "projection viewed per head, before the QK-norm"
            start = pre_norm.op if type(pre_norm) is Ref else start
        elif (unscaled := _pre_scale_source(g, split_ref, kids)) is not None:
            t = g.value(unscaled)
            site.tensor = None if t is None else t.reshape(site.shape)
            site.op = unscaled.op
            site.note = "projection viewed per head, before the model scales it"
            start = unscaled.op
        if site.shape[-1] != d_head:
            site.shape = site.shape[:-1] + (d_head,)
            site.tensor = (
                None if site.tensor is None else site.tensor[..., offset : offset + d_head]
            )
        if (
            len(site.shape) == 5
        ):  # grouped layout (Falcon's new one): heads are groups x heads per group
            site.shape = site.shape[:2] + (site.shape[2] * site.shape[3], site.shape[4])
            site.tensor = None if site.tensor is None else site.tensor.reshape(site.shape)
            site.note = "projection viewed per head (grouped q|k|v layout: group-major heads)"
        sites[name] = site
        math = _path_math(g, start, ref) if name in ("q", "k") else []
        if math:
            sites["rot_" + name] = _rot_site(
                g, "rot_" + name, _before_cache(g, start, ref), site.shape, math
            )
    sites = _head_guard(sites)
    sites.update(_result_site(g, call, kids, sites.get("z")))
    return {k: v for k, v in sites.items() if v is not None}


def _unsplit(g: Graph, call: ModuleCall, name: str, ref: Ref) -> dict[str, FacetSite]:
    """Refusals, with the true reason, for a kernel input whose per-head projection was not found.

    The model computes the tensor (the kernel reads it), so "the module does not compute it" would
    be false: its projection is not one weight's output viewed per head (q, k and v cut from one
    fused projection, or k concatenated from parts, as in multi-head latent attention), and the
    cut is not proven here. For q and k, a transform on the way (RoPE) cannot be told from the
    rest either, so `rot_q`/`rot_k` are refused too, never called absent for want of RoPE.
    """
    op = g.op(ref)
    how = "" if op is None else f" (it reaches the kernel from op #{op.index} {op.name})"
    reason = (
        f"the model computes {name}{how}, but not as one projection viewed per head: it is cut from a "
        f"fused projection or put together from parts, and that split is not proven from the data flow, "
        f"so {name} per head is not served"
    )
    out = refused((name,), reason)
    if name in ("q", "k"):
        math = _path_math(g, call.first_op - 1, ref)
        out.update(
            refused(
                ("rot_" + name,),
                (
                    f"{name} is not found per head (see {name}), so its transform before the kernel"
                    + (f" ({', '.join(math)})" if math else "")
                    + " cannot be served as rot_"
                    + name
                ),
            )
        )
    return out


def _sink_columns(
    g: Graph,
    call: ModuleCall,
    sites: dict[str, FacetSite | None],
    scores_ref: Any,
    pattern_ref: Ref,
    key_slice: int,
) -> None:
    """Scores and pattern of a softmax over more columns than there are keys (GPT-OSS's attention
    sinks: softmax over `cat([scores, sink])`, then the sink column dropped before `@ v`).

    The spec's `[batch, heads, query, key]` holds keys only, so `pattern` is the index op's output
    (the weights that multiply v; its rows sum below 1, the rest is the sinks' mass) and `scores`
    the softmax input's first columns, when the softmax input comes from a `cat` whose first part
    has exactly that many columns. Served only once the pattern is shown, on first read, to equal
    those first columns of the softmax output; refused when the key columns cannot be told.
    """
    n = g.ops[key_slice].shape[-1]
    s_meta = g.meta(scores_ref)
    up = g.ancestors(scores_ref, call.first_op) if type(scores_ref) is Ref else {}
    cat = next(
        (
            i
            for i in sorted(up, reverse=True)
            if g.ops[i].name in ("cat", "concat", "concatenate")
            and s_meta is not None
            and tuple(g.ops[i].shape) == s_meta[0]
            and g.ops[i].inputs
            and (m := g.meta(g.ops[i].inputs[0])) is not None
            and m[0] == s_meta[0][:-1] + (n,)
        ),
        None,
    )
    if cat is None or s_meta is None:
        sites.update(
            refused(
                ("scores", "pattern"),
                (
                    f"the softmax runs over {s_meta[0][-1] if s_meta else '?'} columns but {n} of them multiply v, and "
                    f"which columns are keys was not found in the data flow"
                ),
            )
        )
        return
    note = (
        f"the softmax's first {n} columns, the keys (the softmax also covers {s_meta[0][-1] - n} column(s) that are not keys, "
        "e.g. attention sinks, whose weight is not in the pattern: rows sum below 1)"
    )
    pattern = make_site(g, "pattern", Ref(key_slice, 0), note="weights that multiply v: " + note)
    scores_full = g.value(scores_ref)
    scores = FacetSite(
        "scores",
        "real",
        s_meta[0][:-1] + (n,),
        s_meta[1],
        None if scores_full is None else scores_full[..., :n],
        scores_ref.op if type(scores_ref) is Ref else None,
        None,
        "input of the softmax, " + note,
    )
    sites["scores"], sites["pattern"] = scores, pattern
    soft_out = g.value(pattern_ref)
    if soft_out is None or held(pattern) is None:
        scores.tensor = pattern.tensor = None  # the key columns cannot be shown, so not served
        return

    def run(inputs: list) -> tuple:
        p, full = inputs
        if not torch.equal(p, full[..., :n].to(p.dtype)):
            return (
                {},
                None,
                f"the weights that multiply v are not the softmax's first {n} columns (the keys)",
            )
        return {}, 0.0, None

    Pending(run, [held(pattern), soft_out], [scores, pattern])


_HEAD_AXIS_FACETS = ("scores", "pattern", "z", "result")

#: the sites `_head_guard` is given, with or without the None of a site not found
_Site = TypeVar("_Site", FacetSite, "FacetSite | None")


def _head_guard(sites: dict[str, _Site]) -> dict[str, _Site]:
    """Refuse scores, pattern, z and result when their head axis does not hold the query's heads.

    `q` is `[batch, pos, heads, d_head]` (found from the head split of the projection); `z`,
    `scores` and `pattern` are `[batch, heads, query, ...]`. A kernel that ran on a regrouped
    query (kv heads times heads per group as its head and query axes) that TorchLens could not
    unpack would serve another head's values at `[b, h]`, so nothing with that axis is served.
    """
    q = sites.get("q")
    if q is None or len(q.shape) != 4:
        return sites
    bad = [
        s
        for n in ("scores", "pattern", "z")
        if (s := sites.get(n)) is not None
        and len(s.shape) == 4
        and (s.shape[1], s.shape[2]) != (q.shape[2], q.shape[1])
    ]
    if not bad:
        return sites
    reason = (
        f"the kernel's head and query axes {list(bad[0].shape[1:3])} are not the {q.shape[2]} heads x "
        f"{q.shape[1]} positions found for the query projection: either the kernel ran on a regrouped query "
        f"that is not unpacked here, or the projection's head split was misread, and TorchLens cannot tell "
        f"which, so nothing with a head axis is served ([b, h] could read another head's values)"
    )
    out = dict(sites)
    per_head = ("q", "k", "v", "rot_q", "rot_k")
    out.update(
        refused(
            tuple(f for f in _HEAD_AXIS_FACETS + per_head if f in sites or f == "result"), reason
        )
    )
    return out


def gqa_packed(g: Graph, q_ref: Any) -> tuple[Ref, tuple[int, int, int]] | None:
    """Whether the kernel's query is a GQA-packed reshape of a per-head query, and how to unpack.

    Hugging Face's sdpa path for one decode token (`pack_gqa`) reshapes the query from
    `[b, heads, T, d]` to `[b, kv_heads, heads / kv_heads * T, d]`, so the kernel reads kv heads x
    heads per group as its head and query axes. When that reshape is the op producing the kernel's
    query, it is a pure regrouping (the same elements in the same order), and reshaping the kernel's
    `[b, kv_heads, n_rep * T, x]` results back to `[b, heads, T, x]` is its exact inverse.

    Returns:
        The Ref of the unpacked query and `(b, heads, T)`, the leading shape to reshape the
        kernel's results to; None when the kernel's query is not such a reshape.
    """
    op = g.op(q_ref)
    if (
        op is None
        or op.name not in _ops.RESHAPE_OPS
        or not op.inputs
        or type(op.inputs[0]) is not Ref
    ):
        return None
    src, out = g.meta(op.inputs[0]), g.meta(q_ref)
    if src is None or out is None or len(src[0]) != 4 or len(out[0]) != 4:
        return None
    (b, h, t, d), (b2, kv, rows, d2) = src[0], out[0]
    if (b, d) != (b2, d2) or kv >= h or h % kv or rows != (h // kv) * t:
        return None
    return op.inputs[0], (b, h, t)


def _check_z(
    g: Graph, pattern: FacetSite | None, v_ref: Any, z: FacetSite | None
) -> dict[str, FacetSite]:
    """Refuse `z` unless `pattern @ v` equals it (it does not when dropout ran between them).
    The check is deferred to the first read of `z`."""
    if z is None or held(z) is None:
        return {}
    v = g.value(v_ref)
    if pattern is None or held(pattern) is None or v is None:
        z.tensor = None  # cannot be checked, so not served
        return {}
    dtype = z.dtype

    def run(inputs: list) -> tuple:
        p, v, zt = inputs
        if v.shape[-3] != p.shape[-3] and v.dim() == 4 and p.shape[-3] % v.shape[-3] == 0:
            v = v.repeat_interleave(p.shape[-3] // v.shape[-3], dim=-3)
        try:
            err = float((wide(torch.matmul(p.to(v.dtype), v)) - wide(zt)).abs().max())
        except RuntimeError as exc:
            return {}, None, f"pattern @ v could not be formed ({exc})"
        tol = _ops.reconstruction_tolerance(dtype) * max(1.0, float(v.abs().max()))
        if not err <= tol:
            return (
                {},
                err,
                f"pattern @ v differs from z by {err:.3g} (> {tol:.3g}), e.g. dropout ran between them",
            )
        return {}, err, None

    Pending(run, [held(pattern), v, held(z)], [z])
    return {}


def _before_cache(g: Graph, start: int, ref: Ref) -> Ref:
    """The tensor of this forward's positions on its way into a KV cache, where the path from the
    projection (op `start`) to the kernel input `ref` joins cached keys to it (`_core.ops.CACHE_JOIN_OPS`:
    a concatenation, a write into a static cache's buffer); `ref` itself where it joins none.

    With a cache the kernel reads every cached position, but `rot_k`, like `k`, is a facet of the
    positions the forward computed: the joining op's input computed from the projection.
    """
    up = g.ancestors(ref, start + 1)
    for i in sorted(up):
        op = g.ops[i]
        if op.name not in _ops.CACHE_JOIN_OPS:
            continue
        flat = [r for r in op.inputs if type(r) is Ref]
        ours = [r for r in flat if r.op == start or start in g.ancestors(r, start)]
        if len(ours) == 1 and len(op.inputs) >= 2:
            mine = g.meta(ours[0])
            if mine is not None and len(mine[0]) == 4:
                return ours[0]
    return ref


def _rot_site(
    g: Graph, name: str, kernel_ref: Ref, shape: tuple[int, ...], math: list[str]
) -> FacetSite | None:
    m = g.meta(kernel_ref)
    if m is None or len(m[0]) != 4:
        return None
    t = g.value(kernel_ref)
    kv = shape[2]
    if t is not None:
        if (
            t.shape[1] != kv and t.shape[1] % kv == 0
        ):  # GQA-expanded kernel input: one copy per kv head
            t = t[:, :: t.shape[1] // kv]
        t = t.transpose(1, 2)
    return FacetSite(
        name,
        "real",
        (m[0][0], m[0][2], kv, m[0][3]),
        m[1],
        t,
        kernel_ref.op,
        None,
        f"attention kernel input, token-major: the projection after {', '.join(math)} "
        "(RoPE, a QK-norm or a scale)",
    )


def _per_head_weight(w: Tensor, layout: str, d_out: int, h: int, dh: int) -> Tensor:
    """The output projection's weight as `[d_out, heads, d_head]`, from either weight layout."""
    return w.view(d_out, h, dh) if layout == "out_in" else w.view(h, dh, d_out).permute(2, 0, 1)


def _result_site(
    g: Graph, call: ModuleCall, kids: list[ModuleCall], z: FacetSite | None
) -> dict[str, FacetSite]:
    """Per-head contribution to the output projection: z split by head times that head's W_O."""
    if z is None or z.op is None:
        return {}
    proj = next(
        (k for k in kids if k.first_op > z.op and hasattr(g.modules[k.address], "weight")), None
    )
    if proj is None:
        return {}
    module = g.modules[proj.address]
    layout = _roles.weight_layout(module)
    if len(z.shape) != 4:  # no head axis (e.g. a single-head attention without a reshape)
        return {}
    b, h, t, dh = z.shape
    out_m = g.meta(io_ref(g, proj, "out"))
    weight = getattr(module, "weight", None)
    if layout is None or out_m is None or not isinstance(weight, Tensor):
        return {}
    d_out = out_m[0][-1]
    site = FacetSite(
        "result", "computed", (b, t, h, d_out), z.dtype, note="z per head times W_O per head"
    )
    zt = held(z)
    if zt is None:
        return {"result": site}
    actual = g.value(io_ref(g, proj, "out"))
    if actual is None:
        return {"result": site}  # cannot be checked, so not served (no tensor)
    bias = getattr(module, "bias", None)
    bias = bias.detach() if isinstance(bias, Tensor) else None

    def run(inputs: list) -> tuple:
        zt, w, actual, bias = inputs
        w3 = _per_head_weight(w, layout, d_out, h, dh)
        result = torch.einsum("bhtd,ohd->btho", zt, w3.to(zt.dtype))
        total = result.sum(2)  # a new tensor, so the bias and the difference are taken in place
        if bias is not None:
            b_ = bias.to(result.dtype)
            total = total.add_(b_) if fits(total, b_) else total + b_
        total, want = wide(total), wide(actual)
        total = total.sub_(want) if fits(total, want) else total - want
        err = float(total.abs_().max())
        tol = _ops.reconstruction_tolerance(actual.dtype) * max(1.0, float(actual.abs().max()))
        if not err <= tol:
            return (
                {},
                err,
                f"the sum over heads plus bias differs from the output projection by {err:.3g} (> {tol:.3g})",
            )
        if zt.dtype in (torch.bfloat16, torch.float16):
            # Half precision: the tolerance above is floored at 1, looser than small outputs
            # themselves, so a wrong W_O layout could pass it. Check the layout once more in
            # float32 against the output's own scale: only the output's rounding remains.
            exact = torch.einsum("bhtd,ohd->bto", zt.float(), w3.float())
            if bias is not None:
                exact.add_(bias.float())
            err32 = float(exact.sub_(actual.float()).abs_().max())
            tol32 = _ops.reconstruction_tolerance(actual.dtype) * float(actual.abs().max())
            if not err32 <= tol32:
                return (
                    {},
                    err,
                    (
                        f"the sum over heads plus bias, in float32, differs from the output "
                        f"projection by {err32:.3g} (> {tol32:.3g}, its scale)"
                    ),
                )
        return {"result": result}, err, None

    # Its own check (sum over heads + bias = the output projection) decides, not z's pattern @ v:
    # z is the tensor the projection read even where dropout makes z's own check fail, so
    # save="all" and save=["result"] give result the same status.
    Pending(run, [zt, weight.detach(), actual, bias], [site])
    return {"result": site}
