"""Attention facets found in the data flow: `attention_facets` finds `scores`, `pattern` and `z`
from the softmax or the fused kernel, and `q`, `k`, `v`, `rot_q`/`rot_k` through the head split
(`torchlens._analysis.facets.heads`); `z` is checked as pattern @ v
(`torchlens._analysis.facets.pattern_checks`), and the per-head `result` here (checked: the sum
over heads is the output projection)."""

from __future__ import annotations

import torch
from torch import Tensor

from torchlens._analysis.facets.common import fits, held, io_ref, make_site, refused, wide
from torchlens._analysis.facets.heads import (
    before_cache,
    gqa_packed,
    head_guard,
    head_split,
    path_math,
    pre_norm_source,
    pre_scale_source,
    rot_site,
    unsplit,
)
from torchlens._analysis.facets.pattern_checks import check_z, sink_columns
from torchlens._analysis.facets.rebuild import mha_facets, reconstruct
from torchlens._analysis.graph import Graph
from torchlens._core import ops as _ops
from torchlens._core import roles as _roles
from torchlens._core.pending import Pending
from torchlens._core.records import ModuleCall, OpRecord, Ref
from torchlens._core.sites import FacetSite


def _feeds_matmul(g: Graph, op: OpRecord) -> bool:
    """Whether `op`'s output reaches a matmul within a few steps through dropout, casts, reshapes
    and indexing (a softmax's pattern on its way to pattern @ v)."""
    through = _ops.PASS_THROUGH_OPS | _ops.RESHAPE_OPS | _ops.CAST_OPS | {"__getitem__"}
    frontier = [op.index]
    for _ in range(4):
        nxt = [c for f in frontier for c in g.consumers.get(f, [])]
        if any(g.ops[c].name in _ops.MATMUL_OPS for c in nxt):
            return True
        frontier = [c for c in nxt if g.ops[c].name in through]
    return False


def _split_rows(site: FacetSite | None, batch_heads: tuple[int, ...]) -> None:
    """`site` (a tensor over merged [batch * heads] rows) served as [batch, heads, ...]: the same
    values, viewed (an edit is given that view and its result is viewed back)."""
    if site is None:
        return
    shape = tuple(batch_heads) + tuple(site.shape[1:])
    t = held(site)
    site.shape = shape
    site.tensor = None if t is None else t.reshape(shape)
    site.note = f"{site.note}; its [batch * heads] rows split into [batch, heads]"


def attention_facets(g: Graph, call: ModuleCall, kids: list[ModuleCall]) -> dict[str, FacetSite]:
    ops = g.ops[call.first_op : call.end_op]
    mha = next((op for op in ops if op.name == "multi_head_attention_forward"), None)
    if mha is not None:
        return mha_facets(g, mha, getattr(g.modules[call.address], "num_heads", None))
    fused = next((op for op in ops if op.name in _ops.FUSED_ATTENTION_OPS), None)
    # The attention's softmax is an attention kernel (`Graph.is_kernel`: over 3 or more
    # dimensions), and the one whose output reaches a matmul (pattern @ v) where there are
    # several: a router's softmax over experts in the same call (JetMoe's mixture of attention
    # heads) is neither.
    softs = [op for op in ops if op.name in _ops.SOFTMAX_OPS and g.is_kernel(op)]
    feeding = [op for op in softs if _feeds_matmul(g, op)]
    soft = feeding[0] if feeding else (softs[0] if softs else None)
    sites: dict[str, FacetSite | None] = {}  # None for a site not found, dropped at the end
    z_ref = q_ref = k_ref = v_ref = unpacked = None
    # more than one attention kernel in the call (DiffLlama's differential attention runs two):
    # what one of them computed is part of the attention, not its pattern or z
    two_kernels = len([op for op in ops if op.name in _ops.FUSED_ATTENTION_OPS]) + len(feeding) > 1
    two_values = False  # the pattern multiplies more than one value tensor
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
            z_ops = [c for c in nxt if g.ops[c].name in _ops.MATMUL_OPS]
            z_op = z_ops[0] if z_ops else None
            if len(z_ops) > 1:  # pattern @ v1 and pattern @ v2 (DiffLlama): no one of them is z
                two_values = True
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
            sink_columns(g, call, sites, scores_ref, pattern_ref, key_slice)
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
            elif (
                p_meta is not None
                and len(p_meta[0]) == 3
                and len(zs) == 3
                and zs[0] == p_meta[0][0]
            ):
                # the softmax and pattern @ v both ran on merged [batch * heads] rows (XGLM's
                # bmm): the view of z that splits them back gives batch and heads, and scores
                # and pattern are served split the same way ([batch, heads, query, key])
                split = next(
                    (
                        c
                        for c in g.consumers.get(z_op, [])
                        if g.ops[c].name in _ops.RESHAPE_OPS
                        and len(g.ops[c].shape) == 4
                        and g.ops[c].shape[0] * g.ops[c].shape[1] == zs[0]
                        and tuple(g.ops[c].shape[2:]) == zs[1:]
                    ),
                    None,
                )
                if split is not None:
                    z_ref = Ref(split, 0)
                    for name in ("scores", "pattern"):
                        _split_rows(sites.get(name), tuple(g.ops[split].shape[:2]))
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
            sites.update(check_z(g, sites.get("pattern"), v_ref, sites["z"]))
    qm = g.meta(q_ref)
    if qm is None:
        return head_guard({k: v for k, v in sites.items() if v is not None})
    d_head = qm[0][-1]
    for name, ref in (("q", q_ref), ("k", k_ref), ("v", v_ref)):
        if type(ref) is not Ref:
            continue
        found = head_split(g, ref, call.first_op, d_head)
        site = (
            None
            if found is None
            else make_site(g, name, found[0], note="projection viewed per head")
        )
        if found is None or site is None:
            sites.update(unsplit(g, call, name, ref))
            continue
        split_ref, offset = found
        start = split_ref.op
        pre_norm = pre_norm_source(g, split_ref, kids)
        if pre_norm is not None:  # QK-norm on the flat projection (OLMo-2): q is the norm's input
            t = g.value(pre_norm)
            site.tensor = None if t is None else t.reshape(site.shape)
            site.op = pre_norm.op if type(pre_norm) is Ref else None
            site.note = "projection viewed per head, before the QK-norm"
            start = pre_norm.op if type(pre_norm) is Ref else start
        elif (unscaled := pre_scale_source(g, split_ref, kids)) is not None:
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
        math = path_math(g, start, ref) if name in ("q", "k") else []
        if math:
            sites["rot_" + name] = rot_site(
                g, "rot_" + name, before_cache(g, start, ref), site.shape, math
            )
    sites = head_guard(sites)
    sites.update(_result_site(g, call, kids, sites.get("z")))
    if two_kernels or two_values:
        names = ("scores", "pattern", "z", "result") if two_kernels else ("z", "result")
        sites.update(
            refused(
                tuple(n for n in names if sites.get(n) is not None),
                "the attention runs more than one attention kernel (differential attention: DiffLlama), "
                "so no single pattern or z is the attention's"
                if two_kernels
                else "the attention multiplies its pattern by more than one value tensor (differential "
                "attention: DiffLlama), so no one product is its z",
            )
        )
    return {k: v for k, v in sites.items() if v is not None}


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
    attn_m = g.meta(io_ref(g, call, "out"))
    width = attn_m[0][-1] if attn_m is not None and len(attn_m[0]) else None
    if tuple(weight.shape) != ((d_out, h * dh) if layout == "out_in" else (h * dh, d_out)) or (
        width is not None and width != d_out
    ):
        return refused(
            ("result",),
            f"the first projection after z ({proj.address}, weight {tuple(weight.shape)}) is not one "
            f"map from all {h} heads' z (width {h * dh}) to the attention's output (width {width}): "
            "a grouped or low-rank output path (DeepSeek-V4's o_a_proj), so no per-head W_O splits it",
        )
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
