"""Facets rebuilt from one op's recorded arguments: the scores and pattern of a fused attention
kernel (`scaled_dot_product_attention`), and every facet of `nn.MultiheadAttention`
(`multi_head_attention_forward`), each checked against the op's output."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from torchlens._analysis.facets.common import fits, largest, refused, wide
from torchlens._analysis.graph import Graph
from torchlens._core import ops as _ops
from torchlens._core.pending import Pending
from torchlens._core.records import OpRecord
from torchlens._core.sites import FacetSite


class _In:
    """Marks where a tensor argument of a recorded call sits in a pending check's inputs."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


def _pack(args: tuple, kwargs: dict, inputs: list) -> tuple[tuple, dict]:
    """`args` and `kwargs` with each tensor moved into `inputs` (appended) and marked by an `_In`."""

    def put(a: Any) -> Any:
        if isinstance(a, Tensor):
            inputs.append(a)
            return _In(len(inputs) - 1)
        return a

    return tuple(put(a) for a in args), {k: put(v) for k, v in kwargs.items()}


def _unpack(args: tuple, kwargs: dict, inputs: list) -> tuple[tuple, dict]:
    """The arguments `_pack` marked, with the tensors read back from `inputs`."""

    def get(a: Any) -> Any:
        return inputs[a.i] if type(a) is _In else a

    return tuple(get(a) for a in args), {k: get(v) for k, v in kwargs.items()}


def reconstruct(
    g: Graph,
    fused: OpRecord,
    sites: dict[str, FacetSite],
    unpacked: tuple[int, int, int] | None = None,
) -> None:
    """Scores and pattern of a fused attention kernel, rebuilt from its recorded inputs and
    checked against its output on first read (see `FacetSite`).

    With `unpacked` (`(batch, heads, query)`, from `gqa_packed`), the kernel ran on a GQA-packed
    query: the rebuild and its check run in the kernel's layout, and the checked tensors are
    served reshaped back to `[batch, heads, query, key]`.
    """
    qm, km = g.meta(fused.inputs[0]), g.meta(fused.inputs[1])
    if qm is None or km is None:
        return
    shape = qm[0][:-2] + (qm[0][-2], km[0][-2]) if unpacked is None else unpacked + (km[0][-2],)
    # the dtype the kernel computed in: the query's, or under autocast its output's (`rebuild_attention`)
    dtype = fused.dtypes[0] if fused.dtypes[0].is_floating_point else qm[1]
    note = "rebuilt from the fused kernel's inputs, checked against its output"
    if unpacked is not None:
        note += " (in the kernel's GQA-packed layout, then unpacked by the inverse reshape)"
    scores = FacetSite("scores", "reconstructed", shape, dtype, note=note, op=fused.index)
    pattern = FacetSite("pattern", "reconstructed", shape, dtype, note=note, op=fused.index)
    sites["scores"], sites["pattern"] = scores, pattern
    if fused.extra is None or fused.tensor is None:
        return
    stale = fused.extra.get("stale")
    if (
        stale is not None
    ):  # a kept argument was written after the kernel ran, by code the capture could not see
        sites.update(refused(("scores", "pattern"), f"not rebuilt: {stale}"))
        return
    why = sdpa_unsupported(sdpa_bound(fused.extra["args"], fused.extra["kwargs"]))
    if why is not None:  # refused with the reason (not "not saved": save= is not what is missing)
        sites.update(
            refused(("scores", "pattern"), f"not rebuilt: {why}; trace in eval mode to get them")
        )
        return
    inputs: list = []
    args, kwargs = _pack(fused.extra["args"], fused.extra["kwargs"], inputs)
    inputs.append(fused.tensor)

    def run(inputs: list) -> tuple:
        a, kw = _unpack(args, kwargs, inputs)
        s, p, err, tol = rebuild_attention(a, kw, inputs[-1])
        if err <= tol:
            if unpacked is not None:
                s, p = s.reshape(shape), p.reshape(shape)
            return {"scores": s, "pattern": p}, err, None
        return {}, err, f"the rebuild disagreed with the kernel output by {err:.3g} (> {tol:.3g})"

    Pending(run, inputs, [scores, pattern])


_MHA_FACETS = ("q", "k", "v", "scores", "pattern", "z", "result")


def mha_facets(g: Graph, op: OpRecord, h: int | None) -> dict[str, FacetSite]:
    """Facets of an `nn.MultiheadAttention` call (`h` heads), rebuilt from
    `F.multi_head_attention_forward`'s recorded arguments and checked (the rebuilt output
    projection must match the op's output) on first read of any of them."""
    qm, km = g.meta(op.inputs[0]), g.meta(op.inputs[1])
    if qm is None or km is None or len(qm[0]) != 3 or not isinstance(h, int) or qm[0][2] % h:
        return {}
    (t, b, e), s_len, dtype = qm[0], km[0][0], qm[1]
    note = "rebuilt from multi_head_attention_forward's inputs, checked against its output"
    dh = e // h
    shapes = {
        "q": (b, t, h, dh),
        "k": (b, s_len, h, dh),
        "v": (b, s_len, h, dh),
        "scores": (b, h, t, s_len),
        "pattern": (b, h, t, s_len),
        "z": (b, h, t, dh),
        "result": (b, t, h, e),
    }
    sites = {
        n: FacetSite(n, "reconstructed", shapes[n], dtype, op=op.index, note=note)
        for n in _MHA_FACETS
    }
    if op.tensor is None or op.extra is None:
        return sites
    stale = op.extra.get("stale")
    if (
        stale is not None
    ):  # a kept argument was written after the op ran, by code the capture could not see
        return refused(_MHA_FACETS, f"not rebuilt: {stale}")
    why = _mha_unsupported(_mha_bound(op.extra["args"], op.extra["kwargs"]))
    if why is not None:
        return refused(_MHA_FACETS, f"not rebuilt: {why}")
    inputs: list = []
    args, kwargs = _pack(op.extra["args"], op.extra["kwargs"], inputs)
    inputs.append(op.tensor)

    def run(inputs: list) -> tuple:
        a, kw = _unpack(args, kwargs, inputs)
        rebuilt, err, tol = rebuild_mha(a, kw, inputs[-1])
        if not err <= tol:
            return {}, err, f"the rebuild disagreed with the op output by {err:.3g} (> {tol:.3g})"
        return rebuilt, err, None

    Pending(run, inputs, list(sites.values()))
    return sites


_MHA_ARGS = (
    "query",
    "key",
    "value",
    "embed_dim_to_check",
    "num_heads",
    "in_proj_weight",
    "in_proj_bias",
    "bias_k",
    "bias_v",
    "add_zero_attn",
    "dropout_p",
    "out_proj_weight",
    "out_proj_bias",
    "training",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "use_separate_proj_weight",
    "q_proj_weight",
    "k_proj_weight",
    "v_proj_weight",
    "static_k",
    "static_v",
    "average_attn_weights",
    "is_causal",
)


def _mha_bound(args: tuple, kwargs: dict) -> dict[str, Any]:
    """`F.multi_head_attention_forward`'s arguments by name."""
    a = dict(zip(_MHA_ARGS, args))
    a.update(kwargs)
    return a


def _mha_unsupported(a: dict[str, Any]) -> str | None:
    """Why `rebuild_mha` cannot rebuild a call with these (bound) arguments, or None."""
    if a.get("dropout_p") and a.get("training", True):
        return "it ran with dropout in training mode"
    if a.get("bias_k") is not None or a.get("add_zero_attn") or a.get("static_k") is not None:
        return "bias_k/bias_v, add_zero_attn and static keys are not rebuilt"
    if not isinstance(a.get("query"), Tensor) or a["query"].dim() != 3:
        return "unbatched input"
    return None


def rebuild_mha(args: tuple, kwargs: dict, out: Tensor) -> tuple[dict[str, Tensor], float, float]:
    """Recompute `F.multi_head_attention_forward` step by step, keeping the per-head tensors.

    Returns:
        The facets (`q`, `k`, `v` token-major, `scores`, `pattern`, `z` head-major, `result`),
        the largest absolute difference between the rebuilt output and `out`, and the tolerance.

    Raises:
        ValueError: a variant the rebuild does not cover (dropout in training, bias_k/bias_v,
            add_zero_attn, static keys, unbatched input).
    """
    a = _mha_bound(args, kwargs)
    why = _mha_unsupported(a)
    if why is not None:
        raise ValueError(why)
    query, key, value, h = a["query"], a["key"], a["value"], a["num_heads"]
    t, b, e = query.shape
    s_len, dh = key.shape[0], e // h
    if a.get("use_separate_proj_weight"):
        ws = (a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"])
    else:
        ws = a["in_proj_weight"].chunk(3)
    bias = a.get("in_proj_bias")
    bs = bias.chunk(3) if bias is not None else (None, None, None)
    q, k, v = (
        torch.nn.functional.linear(x, w, bb).view(x.shape[0], b, h, dh).transpose(0, 1)
        for x, w, bb in zip((query, key, value), ws, bs)
    )  # [batch, pos, heads, d_head]
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(dh)
    masked = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    mask = a.get("attn_mask")
    if mask is not None:
        mask = mask.view(b, h, t, s_len) if mask.dim() == 3 else mask
        if mask.dtype == torch.bool:
            masked = masked | mask
        else:
            scores = scores + mask
    kpm = a.get("key_padding_mask")
    if kpm is not None:
        if kpm.dtype == torch.bool:
            masked = masked | kpm.view(b, 1, 1, s_len)
        else:
            scores = scores + kpm.view(b, 1, 1, s_len)
    scores = scores.masked_fill(masked, float("-inf"))
    softmax = torch.softmax(scores, dim=-1)
    w_o, b_o = a["out_proj_weight"], a.get("out_proj_bias")
    want = wide(out.transpose(0, 1))
    tol = _ops.reconstruction_tolerance(query.dtype) * max(
        1.0, float(want.nan_to_num(0.0).abs().max())
    )
    # A query row with no visible key has no softmax (NaN); the op gives NaN there (the step-by-step
    # path) or uses no weights (the fused one: zero). Both readings are checked on every row; the
    # pattern served is the one the op's output proves.
    empty = masked.all(-1, keepdim=True) | softmax.isnan().all(-1, keepdim=True)
    candidates = [softmax] + ([softmax.masked_fill(empty, 0)] if bool(empty.any()) else [])
    best: tuple[float, Tensor, Tensor, Tensor] | None = None
    for pattern in candidates:
        z = torch.einsum("bhts,bshd->bhtd", pattern, v)
        result = torch.einsum("bhtd,ohd->btho", z, w_o.view(e, h, dh))
        got = wide(result.sum(2) + (b_o if b_o is not None else 0))
        same_nan = got.isnan() & want.isnan()  # NaN where the model's own output is NaN
        diff = torch.where(~same_nan, (got - want).abs(), torch.zeros((), device=out.device))
        err = float(diff.nan_to_num(nan=float("inf")).max()) if diff.numel() else 0.0
        if best is None or err < best[0]:
            best = (err, pattern, z, result)
        if err <= tol:
            break
    assert best is not None  # candidates is never empty
    err, pattern, z, result = best
    facets = {
        "q": q,
        "k": k,
        "v": v,
        "scores": scores,
        "pattern": pattern,
        "z": z,
        "result": result,
    }
    return facets, err, tol


def sdpa_bound(args: tuple, kwargs: dict) -> dict[str, Any]:
    """`scaled_dot_product_attention`'s arguments by name."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def sdpa_unsupported(bound: dict[str, Any]) -> str | None:
    """Why `rebuild_attention` cannot rebuild a kernel call with these (bound) arguments, or None."""
    if bound.get("dropout_p", 0.0):
        return "the kernel ran with dropout_p > 0 (training mode)"
    return None


def rebuild_attention(
    args: tuple, kwargs: dict, out: Tensor
) -> tuple[Tensor, Tensor, float, float]:
    """Recompute `scaled_dot_product_attention`'s scores and pattern, eager-style.

    Scores are `q @ k^T * scale` in the input dtype, masked with the dtype's minimum (as
    Hugging Face's eager attention does), pattern is softmax in float32 cast back. A query row
    with no visible key whose kernel output row is exactly zero gets zero weights (what the
    kernel used). The rebuilt `pattern @ v` is compared with the kernel output `out` on every
    query row, except one where both are NaN.

    Returns:
        scores, pattern, the largest absolute difference, and the tolerance it must meet.

    Raises:
        ValueError: the kernel ran with dropout, so no deterministic pattern exists.
    """
    bound = sdpa_bound(args, kwargs)
    why = sdpa_unsupported(bound)
    if why is not None:
        raise ValueError(why)
    q, k, v = bound["query"], bound["key"], bound["value"]
    mask, scale = bound.get("attn_mask"), bound.get("scale")
    if out.is_floating_point() and any(x.dtype != out.dtype for x in (q, k, v)):
        # Under autocast the kernel computed in its output's dtype: its floating inputs (a float32
        # query after RoPE next to a bfloat16 value, a float32 mask) were cast to it first.
        q, k, v = (x.to(out.dtype) if x.is_floating_point() else x for x in (q, k, v))
        if mask is not None and mask.is_floating_point():
            mask = mask.to(out.dtype)
    if k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # Every step writes into the one freshly built scores tensor where the dtype and shape allow
    # it (the same kernels as out of place, so the same values), rather than allocating a
    # [batch, heads, query, key] tensor per step.
    scores = torch.matmul(q, k.transpose(-2, -1)).mul_(scale)
    fill = torch.finfo(scores.dtype).min
    causal, bool_mask = bool(bound.get("is_causal")), mask is not None and mask.dtype == torch.bool
    visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
    if causal:
        visible = visible.tril()
    if mask is not None:
        if bool_mask:
            visible = visible & mask
        elif fits(scores, mask):
            scores.add_(mask)
        else:  # the mask widens the dtype or the shape: as the model adds it
            scores = scores + mask
    if causal or bool_mask:  # else every key is visible and nothing is filled
        hidden = ~visible
        scores = (
            scores.masked_fill_(hidden, fill)
            if fits(scores, hidden)
            else scores.masked_fill(hidden, fill)
        )
    pattern = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(
        q.dtype
    )
    # Query rows without a visible key ([..., query, 1]): the softmax has no answer there (uniform
    # over masked scores, or NaN), and kernels differ. Where the kernel's output row is exactly
    # zero, it used no weights: that row of the pattern is zero. Every row is then checked; a row
    # is left out only where both the rebuild and the kernel give NaN on it (the kernel's own NaN).
    rows = visible.any(-1, keepdim=True)
    if mask is not None and mask.dtype != torch.bool:
        rows = rows & (mask > fill / 2).any(-1, keepdim=True)
    empty = ~rows.expand(scores.shape[:-1] + (1,))
    if bool(empty.any()):
        zero = empty & (out == 0).all(-1, keepdim=True)
        if bool(zero.any()):
            pattern = pattern.masked_fill(zero, 0)
    z = torch.matmul(pattern, v)
    checked = (
        ~(empty & z.isnan().all(-1, keepdim=True) & out.isnan().all(-1, keepdim=True))
        if bool(empty.any())
        else empty.logical_not()
    )
    err = largest(torch.sub(wide(z), wide(out)).abs_(), checked)
    tol = _ops.reconstruction_tolerance(q.dtype) * max(1.0, float(v.abs().max()))
    return scores, pattern, err, tol
