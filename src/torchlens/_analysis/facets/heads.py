"""The per-head facets of an attention: `q`, `k` and `v` from the head split of their projections
(`head_split`), `rot_q`/`rot_k` (the projection after what transforms it on the way to the kernel:
RoPE, a QK-norm, a scale; read before a KV cache joins cached keys), the refusals where the split
is not found (`unsplit`), a query the kernel read GQA-packed (`gqa_packed`), and the guard that
refuses every facet with a head axis when the kernel's heads are not the query's (`head_guard`)."""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from torchlens._analysis.facets.common import io_ref, refused
from torchlens._analysis.graph import Graph
from torchlens._core import ops as _ops
from torchlens._core.records import ModuleCall, Ref
from torchlens._core.sites import FacetSite


def head_split(g: Graph, kernel_ref: Ref, lo: int, d_head: int) -> tuple[Ref, int] | None:
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


def pre_norm_source(g: Graph, split_ref: Ref, kids: list[ModuleCall]) -> Any:
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


def pre_scale_source(g: Graph, split_ref: Ref, kids: list[ModuleCall]) -> Any:
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


def path_math(g: Graph, start: int, ref: Ref) -> list[str]:
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


def unsplit(g: Graph, call: ModuleCall, name: str, ref: Ref) -> dict[str, FacetSite]:
    """Refusals, with the true reason, for a kernel input whose per-head projection was not found.

    The model computes the tensor (the kernel reads it), so "the module does not compute it" would
    be false: its projection is not one weight's output viewed per head (q, k and v cut from one
    fused projection, or k concatenated from parts, as in multi-head latent attention), and the
    cut is not proven here. For q and k, a transform on the way (RoPE) cannot be told from the
    rest either, so `rot_q`/`rot_k` are refused too, never called absent for want of RoPE.
    """
    op = g.op(ref)
    how = "" if op is None else f" (it reaches the kernel from op #{op.index} {op.name})"
    if op is not None and (op.mutated or op.name == "written_in_place"):
        # a static or sliding-window cache the forward wrote the new keys into, then read whole
        reason = (
            f"the model computes {name}{how}, but the kernel reads it from memory the forward wrote "
            f"in place (a static or sliding-window KV cache), not from its projection viewed per "
            f"head, and the path from the projection through that write is not proven from the "
            f"data flow, so {name} per head is not served"
        )
    else:
        reason = (
            f"the model computes {name}{how}, but not as one projection viewed per head: it is cut "
            f"from a fused projection or put together from parts, and that split is not proven from "
            f"the data flow, so {name} per head is not served"
        )
    out = refused((name,), reason)
    if name in ("q", "k"):
        math = path_math(g, call.first_op - 1, ref)
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


_HEAD_AXIS_FACETS = ("scores", "pattern", "z", "result")

#: the sites `head_guard` is given, with or without the None of a site not found
_Site = TypeVar("_Site", FacetSite, "FacetSite | None")


def head_guard(sites: dict[str, _Site]) -> dict[str, _Site]:
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


def before_cache(g: Graph, start: int, ref: Ref) -> Ref:
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


def rot_site(
    g: Graph, name: str, kernel_ref: Ref, shape: tuple[int, ...], math: list[str]
) -> FacetSite | None:
    m = g.meta(kernel_ref)
    if m is None or len(m[0]) != 4:
        return None
    t = g.value(kernel_ref)
    kv = shape[2]
    copies = m[0][1] // kv if m[0][1] != kv and m[0][1] % kv == 0 else None
    if t is not None:
        if copies:  # GQA-expanded kernel input: one copy per kv head
            grouped = t.unflatten(1, (kv, copies))
            if not torch.equal(grouped, grouped[:, :, :1].expand_as(grouped)):
                return FacetSite(
                    name,
                    "refused",
                    (m[0][0], m[0][2], kv, m[0][3]),
                    m[1],
                    note=(
                        f"the kernel reads {m[0][1]} heads, {copies} for each of the {kv} key/value "
                        f"heads, and they are not copies of one tensor (the model made them differ "
                        f"after repeating it), so there is no one {name} per key/value head to serve"
                    ),
                )
            t = t[:, ::copies]
        t = t.transpose(1, 2)
    site = FacetSite(
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
    site._copies = copies  # its gradient sums those of the copies (`_analysis.grads`)
    return site
