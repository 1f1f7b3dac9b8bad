"""Facets: the named tensors of a module call, found from the recorded data flow.

A facet is found by following which op consumed which tensor inside a module call, never by
reading a tensor's name in the model's source. The module's *role* (from
[`torchlens.families`][torchlens.families]) says which facets to look for:

| role | facets |
|---|---|
| every module | `input`, `output` |
| block | `resid_pre`, `resid_mid`, `resid_post` |
| attention | `q`, `k`, `v`, `rot_q`, `rot_k`, `scores`, `pattern`, `z`, `result` |
| mlp | `pre`, `pre_linear`, `act`, `gated_out`, `post`, `down_out` |
| norm | `normalized`, `inv_rms` or `inv_std`, `scale` |
| embedding | `indices` |
| root | `final_norm_input`, `logits` |

A facet that a module cannot have (no residual add between attention and MLP on a
parallel-attention block, no linear branch on a non-gated MLP) is simply not in its map.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from . import families as fam
from .records import FacetSite, ModuleCall, OpRecord, Ref

#: Every facet name TorchLens can produce, by role, with its layout. This is the vocabulary
#: `save=` selections and the alias tables are checked against.
FACETS: dict[str, dict[str, str]] = {
    "any": {
        "input": "the module's first positional argument, or its first tensor keyword argument when called with keywords only",
        "output": "the module's output tensor, or else the first tensor in its output, depth first: element 0 of a tuple, the first tensor value of a dict/ModelOutput, inside nested tuples/lists/dicts",
    },
    "block": {
        "resid_pre": "[batch, pos, d_model] residual stream entering the block (the block input)",
        "resid_mid": "[batch, pos, d_model] residual stream after the attention add, before the MLP; absent on parallel attention+MLP blocks",
        "resid_post": "[batch, pos, d_model] residual stream leaving the block (the block output)",
    },
    "attention": {
        "q": "[batch, pos, heads, d_head] query projection viewed per head, before the transpose and before RoPE",
        "k": "[batch, pos, kv_heads, d_head] key projection viewed per head (kv heads under GQA), before RoPE",
        "v": "[batch, pos, kv_heads, d_head] value projection viewed per head (kv heads under GQA)",
        "rot_q": "[batch, pos, heads, d_head] query as the attention kernel receives it (after RoPE and any QK-norm), token-major; only where it differs from q",
        "rot_k": "[batch, pos, kv_heads, d_head] key as the attention kernel receives it, token-major, kv heads; only where it differs from k",
        "scores": "[batch, heads, query, key] the tensor entering softmax: scaled, softcapped and masked as the model does (masked entries hold the model's fill, HF: the dtype minimum)",
        "pattern": "[batch, heads, query, key] softmax output, in the model dtype",
        "z": "[batch, heads, pos, d_head] pattern @ v, head-major as the kernel returns it",
        "result": "[batch, pos, heads, d_model] each head's contribution to the output projection (bias excluded); sums over heads plus bias to the projection output",
    },
    "mlp": {
        "pre": "[batch, pos, d_mlp] input of the activation function (GPT-2 c_fc output, Llama gate_proj output)",
        "pre_linear": "[batch, pos, d_mlp] the gated MLP's linear branch (Llama up_proj output); absent on a non-gated MLP",
        "act": "[batch, pos, d_mlp] activation output, act(pre)",
        "gated_out": "[batch, pos, d_mlp] act(pre) * pre_linear; absent on a non-gated MLP",
        "post": "[batch, pos, d_mlp] input of the down projection: act on a plain MLP, gated_out on a gated one",
        "down_out": "[batch, pos, d_model] output of the down projection, before any dropout",
    },
    "norm": {
        "normalized": "[batch, pos, d_model] input centred (LayerNorm) and divided by its RMS/std, before the gain and bias",
        "inv_rms": "[batch, pos, 1] 1/sqrt(mean(x^2)+eps) of an RMSNorm",
        "inv_std": "[batch, pos, 1] 1/sqrt(var(x)+eps) of a LayerNorm",
        "scale": "[batch, pos, 1] the divisor sqrt(mean(x^2)+eps) or sqrt(var(x)+eps): 1/inv_rms (TransformerLens hook_scale)",
    },
    "embedding": {
        "indices": "[batch, pos] token ids entering the embedding",
        "lookup": "[batch, pos, d_model] the rows looked up, before anything the module does after the lookup (Gemma's sqrt(d_model) scaling); equals output elsewhere",
    },
    "root": {
        "final_norm_input": "[batch, pos, d_model] input of the final norm (the last block's output)",
        "logits": "[batch, pos, vocab] the model's logits: the unembedding's output, or the root output when it is computed from it with the same shape (e.g. Gemma-2's final softcap)",
    },
}

ALL_FACETS: frozenset[str] = frozenset(n for table in FACETS.values() for n in table)


class _Graph:
    """Read helpers over the recorded ops: producers, consumers, saved values, shapes."""

    def __init__(self, ops: list[OpRecord], modules: dict[str, nn.Module]):
        self.ops = ops
        self.modules = modules
        self.consumers: dict[int, list[int]] = {}
        for op in ops:
            for r in op.inputs:
                if type(r) is Ref:
                    self.consumers.setdefault(r.op, []).append(op.index)

    def value(self, ref: Any) -> Tensor | None:
        if type(ref) is Ref:
            return self.ops[ref.op].tensors[ref.slot]
        return ref if isinstance(ref, Tensor) else None

    def meta(self, ref: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
        if type(ref) is Ref:
            op = self.ops[ref.op]
            return tuple(op.shapes[ref.slot]), op.dtypes[ref.slot]
        if isinstance(ref, Tensor):
            return tuple(ref.shape), ref.dtype
        return None

    def op(self, ref: Any) -> OpRecord | None:
        return self.ops[ref.op] if type(ref) is Ref else None

    def follow(self, ref: Ref, names: frozenset[str], limit: int = 4) -> Ref:
        """Follow single consumers whose op name is in `names` (casts, dropout) from `ref`."""
        for _ in range(limit):
            nxt = [c for c in self.consumers.get(ref.op, []) if self.ops[c].name in names]
            if len(nxt) != 1 or len(self.consumers.get(ref.op, [])) != 1:
                break
            ref = Ref(nxt[0], 0)
        return ref

    def ancestors(self, ref: Ref, lo: int) -> dict[int, int]:
        """Ops (index -> slot reached) upstream of `ref`, restricted to ops with index >= lo."""
        seen: dict[int, int] = {}
        todo = [ref]
        while todo:
            r = todo.pop()
            if type(r) is not Ref or r.op < lo or r.op in seen:
                continue
            seen[r.op] = r.slot
            todo.extend(self.ops[r.op].inputs)
        return seen


def _site(g: _Graph, name: str, ref: Any, kind: str = "real", note: str = "") -> FacetSite | None:
    m = g.meta(ref)
    if m is None:
        return None
    return FacetSite(name, kind, m[0], m[1], g.value(ref), ref.op if type(ref) is Ref else None, None, note)


def _io(g: _Graph, call: ModuleCall, which: str) -> Any:
    """A module call's input or output: the producing op's Ref, or the alias the hook kept.

    The Ref is preferred (it names the op); the alias is used when the op's tensor was not
    kept, e.g. a retained block whose input came from an op outside it.
    """
    ref, alias = (call._in_ref, call._in) if which == "in" else (call._out_ref, call._out)
    if type(ref) is Ref and (alias is None or g.value(ref) is not None):
        return ref
    return alias if alias is not None else ref


# -- blocks ------------------------------------------------------------------------------------


def block_facets(g: _Graph, call: ModuleCall, kids: list[ModuleCall]) -> dict[str, FacetSite]:
    sites = {}
    for name, which in (("resid_pre", "in"), ("resid_post", "out")):
        s = _site(g, name, _io(g, call, which), note=f"block {which}put")
        if s:
            sites[name] = s
    attn = next((k for k in kids if k.role == "attention"), None)
    mlp = next((k for k in kids if k.role == "mlp"), None)
    if attn is None or mlp is None or type(attn._out_ref) is not Ref or type(mlp._in_ref) is not Ref:
        return sites
    # Ops downstream of the attention output and upstream of the MLP input: the residual add.
    down = {attn._out_ref.op}
    for i in range(attn.end_op, mlp.first_op):
        if any(type(r) is Ref and r.op in down for r in g.ops[i].inputs):
            down.add(i)
    up = g.ancestors(mlp._in_ref, attn.end_op)
    adds = [
        i for i in down & set(up)
        if g.ops[i].name in fam.ADD_OPS and g.ops[i].module == call.address and g.ops[i].call == call.index
    ]
    if adds:
        sites["resid_mid"] = _site(g, "resid_mid", Ref(max(adds), 0), note="residual add after attention")
    return sites


# -- attention ---------------------------------------------------------------------------------


def _head_split(g: _Graph, kernel_ref: Ref, lo: int, d_head: int) -> tuple[Ref, int] | None:
    """Find the per-head view of a projection upstream of an attention kernel input.

    Returns the Ref of the reshape that gave the projection a head axis ([B, T, n, m] from
    [B, T, n*m]) and the offset into its last axis where this input's d_head columns start
    (non-zero only for fused per-head qkv layouts such as GPT-NeoX's).
    """
    up = g.ancestors(kernel_ref, lo)
    for i in sorted(up, reverse=True):
        op = g.ops[i]
        if op.name not in fam.RESHAPE_OPS or len(op.shape) != 4 or not op.inputs:
            continue
        src = g.meta(op.inputs[0])
        if src is None or len(src[0]) != 3 or src[0][:2] != tuple(op.shape[:2]):
            continue
        if op.shape[2] * op.shape[3] != src[0][2] or op.shape[3] % d_head:
            continue
        offset = 0
        if op.shape[3] != d_head:  # fused per-head q|k|v: find which chunk this input took
            splits = [j for j in up if g.ops[j].name in fam.SPLIT_OPS and j > i]
            if not splits:
                continue
            offset = up[min(splits)] * d_head
        return Ref(i, 0), offset
    return None


def _pre_norm_source(g: _Graph, split_ref: Ref, kids: list[ModuleCall]) -> Any:
    """The input of a norm child whose output the head split views, else None.

    A QK-norm applied to the flat projection before the head view (OLMo-2) sits between the
    projection and the reshape; `q`/`k` are the projection output, so the split must look
    through the norm to its input.
    """
    src = g.ops[split_ref.op].inputs[0]
    if type(src) is not Ref:
        return None
    norm = next((k for k in kids if k.role == "norm" and k._out_ref == src), None)
    if norm is None:
        return None
    ref = _io(g, norm, "in")
    m = g.meta(ref)
    return ref if m is not None and m[0] == g.meta(src)[0] else None


def _path_has_math(g: _Graph, start: int, ref: Ref) -> bool:
    """Whether values are transformed between op `start` and `ref` (RoPE, QK-norm), not just moved.

    RoPE multiplies by cos/sin and a norm multiplies by its scale, so a product on the path
    is the sign; reshapes, transposes, the KV-cache concatenation and GQA expansion are not.
    """
    up = g.ancestors(ref, start + 1)
    return any(g.ops[i].name in fam.MUL_OPS or g.ops[i].name in ("rsqrt", "rms_norm", "layer_norm") for i in up)


def attention_facets(g: _Graph, call: ModuleCall, kids: list[ModuleCall]) -> dict[str, FacetSite]:
    ops = g.ops[call.first_op : call.end_op]
    fused = next((op for op in ops if op.name in fam.FUSED_ATTENTION_OPS), None)
    soft = next((op for op in ops if op.name in fam.SOFTMAX_OPS), None)
    sites: dict[str, FacetSite] = {}
    z_ref = q_ref = k_ref = v_ref = None
    if soft is not None and fused is None:
        scores_ref = soft.inputs[0]
        pattern_ref = g.follow(Ref(soft.index, 0), frozenset({"to", "type", "float", "half", "bfloat16"}))
        sites["scores"] = _site(g, "scores", scores_ref, note="input of the softmax")
        sites["pattern"] = _site(g, "pattern", pattern_ref, note="softmax output")
        # z: the matmul that consumes the pattern (possibly through dropout).
        frontier, z_op = [pattern_ref.op], None
        for _ in range(4):
            nxt = [c for f in frontier for c in g.consumers.get(f, [])]
            z_op = next((c for c in nxt if g.ops[c].name in fam.MATMUL_OPS), None)
            if z_op is not None:
                break
            frontier = [c for c in nxt if g.ops[c].name in fam.PASS_THROUGH_OPS]
        if z_op is not None:
            z_ref = Ref(z_op, 0)
            iv = fam.MATMUL_OPERANDS.get(g.ops[z_op].name, (0, 1))[1]
            v_ref = next((r for r in g.ops[z_op].inputs[iv : iv + 1]), None)
        # q and k: the matmul upstream of the scores.
        r = scores_ref
        for _ in range(12):
            op = g.op(r)
            if op is None or op.index < call.first_op:
                break
            if op.name in fam.MATMUL_OPS:
                iq, ik = fam.MATMUL_OPERANDS.get(op.name, (0, 1))
                q_ref, kt = op.inputs[iq], op.inputs[ik]
                kop = g.op(kt)
                k_ref = kop.inputs[0] if kop is not None and kop.name in ("transpose", "mT", "T") else kt
                break
            r = next((x for x in op.inputs if type(x) is Ref), None)
    elif fused is not None:
        z_ref = Ref(fused.index, 0)
        q_ref, k_ref, v_ref = (fused.inputs + (None, None, None))[:3]
        _reconstruct(g, fused, sites)
    if z_ref is not None:
        sites["z"] = _site(g, "z", z_ref, note="pattern @ v, head-major")
    qm = g.meta(q_ref)
    if qm is None:
        return {k: v for k, v in sites.items() if v is not None}
    d_head = qm[0][-1]
    for name, ref in (("q", q_ref), ("k", k_ref), ("v", v_ref)):
        if type(ref) is not Ref:
            continue
        found = _head_split(g, ref, call.first_op, d_head)
        if found is None:
            continue
        split_ref, offset = found
        site = _site(g, name, split_ref, note="projection viewed per head")
        if site is None:
            continue
        start = split_ref.op
        pre_norm = _pre_norm_source(g, split_ref, kids)
        if pre_norm is not None:  # QK-norm on the flat projection (OLMo-2): q is the norm's input
            t = g.value(pre_norm)
            site.tensor = None if t is None else t.reshape(site.shape)
            site.op = pre_norm.op if type(pre_norm) is Ref else None
            site.note = "projection viewed per head, before the QK-norm"
            start = pre_norm.op if type(pre_norm) is Ref else start
        if site.shape[-1] != d_head:
            site.shape = site.shape[:-1] + (d_head,)
            site.tensor = None if site.tensor is None else site.tensor[..., offset : offset + d_head]
        sites[name] = site
        if name in ("q", "k") and _path_has_math(g, start, ref):
            sites["rot_" + name] = _rot_site(g, "rot_" + name, ref, site.shape)
    sites.update(_result_site(g, call, kids, sites.get("z")))
    return {k: v for k, v in sites.items() if v is not None}


def _rot_site(g: _Graph, name: str, kernel_ref: Ref, shape: tuple[int, ...]) -> FacetSite | None:
    m = g.meta(kernel_ref)
    if m is None or len(m[0]) != 4:
        return None
    t = g.value(kernel_ref)
    kv = shape[2]
    if t is not None:
        if t.shape[1] != kv and t.shape[1] % kv == 0:  # GQA-expanded kernel input: one copy per kv head
            t = t[:, :: t.shape[1] // kv]
        t = t.transpose(1, 2)
    return FacetSite(name, "real", (m[0][0], m[0][2], kv, m[0][3]), m[1], t, kernel_ref.op, None,
                     "attention kernel input (after RoPE), token-major")


def _reconstruct(g: _Graph, fused: OpRecord, sites: dict[str, FacetSite]) -> None:
    """Rebuild scores and pattern of a fused attention kernel from its recorded inputs."""
    qm, km = g.meta(fused.inputs[0]), g.meta(fused.inputs[1])
    if qm is None or km is None:
        return
    shape = qm[0][:-2] + (qm[0][-2], km[0][-2])
    dtype = qm[1]
    note = "rebuilt from the fused kernel's inputs, checked against its output"
    scores = FacetSite("scores", "reconstructed", shape, dtype, note=note, op=fused.index)
    pattern = FacetSite("pattern", "reconstructed", shape, dtype, note=note, op=fused.index)
    sites["scores"], sites["pattern"] = scores, pattern
    if fused.extra is None or fused.tensor is None:
        return
    with torch.no_grad():
        try:
            s, p, err, tol = rebuild_attention(fused.extra["args"], fused.extra["kwargs"], fused.tensor)
        except ValueError as e:
            scores.note = pattern.note = f"not rebuilt: {e}"
            return
    scores.check_error = pattern.check_error = err
    if err <= tol:
        scores.tensor, pattern.tensor = s, p
    else:
        scores.note = pattern.note = f"rebuild disagreed with the kernel output by {err:.3g} (> {tol:.3g}); not served"


def rebuild_attention(args: tuple, kwargs: dict, out: Tensor) -> tuple[Tensor, Tensor, float, float]:
    """Recompute `scaled_dot_product_attention`'s scores and pattern, eager-style.

    Scores are `q @ k^T * scale` in the input dtype, masked with the dtype's minimum (as
    Hugging Face's eager attention does), pattern is softmax in float32 cast back. The rebuilt
    `pattern @ v` is compared with the kernel output `out` on every query row that has at
    least one visible key.

    Returns:
        scores, pattern, the largest absolute difference, and the tolerance it must meet.

    Raises:
        ValueError: the kernel ran with dropout, so no deterministic pattern exists.
    """
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    mask, scale = bound.get("attn_mask"), bound.get("scale")
    if bound.get("dropout_p", 0.0):
        raise ValueError("the kernel ran with dropout_p > 0 (training mode)")
    if k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    fill = torch.finfo(scores.dtype).min
    visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
    if bound.get("is_causal"):
        visible = visible.tril()
    if mask is not None:
        if mask.dtype == torch.bool:
            visible = visible & mask
        else:
            scores = scores + mask
    scores = scores.masked_fill(~visible, fill)
    pattern = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    z = torch.matmul(pattern, v)
    rows = visible.expand(scores.shape).any(-1, keepdim=True)
    if mask is not None and mask.dtype != torch.bool:
        rows = rows & (mask > fill / 2).expand(scores.shape).any(-1, keepdim=True)
    diff = torch.where(rows, (z.float() - out.float()).abs(), torch.zeros((), device=z.device))
    err = float(diff.nan_to_num(nan=float("inf")).max()) if diff.numel() else 0.0
    tol = fam.reconstruction_tolerance(q.dtype) * max(1.0, float(v.float().abs().max()))
    return scores, pattern, err, tol


def _result_site(g: _Graph, call: ModuleCall, kids: list[ModuleCall], z: FacetSite | None) -> dict[str, FacetSite]:
    """Per-head contribution to the output projection: z split by head times that head's W_O."""
    if z is None or z.op is None:
        return {}
    proj = next((k for k in kids if k.first_op > z.op and hasattr(g.modules[k.address], "weight")), None)
    if proj is None:
        return {}
    module = g.modules[proj.address]
    layout = fam.weight_layout(module)
    if len(z.shape) != 4:  # no head axis (e.g. a single-head attention without a reshape)
        return {}
    b, h, t, dh = z.shape
    out_m = g.meta(_io(g, proj, "out"))
    if layout is None or out_m is None:
        return {}
    d_out = out_m[0][-1]
    site = FacetSite("result", "computed", (b, t, h, d_out), z.dtype, note="z per head times W_O per head")
    zt = z.tensor
    if zt is not None:
        with torch.no_grad():
            w = module.weight.detach()
            w3 = w.view(d_out, h, dh) if layout == "out_in" else w.view(h, dh, d_out).permute(2, 0, 1)
            result = torch.einsum("bhtd,ohd->btho", zt, w3.to(zt.dtype))
            actual = g.value(_io(g, proj, "out"))
            if actual is not None:
                bias = getattr(module, "bias", None)
                total = result.sum(2) + (bias.detach().to(result.dtype) if isinstance(bias, Tensor) else 0)
                site.check_error = float((total.float() - actual.float()).abs().max())
        site.tensor = result
    return {"result": site}


# -- MLP ---------------------------------------------------------------------------------------


def _weighted(g: _Graph, call: ModuleCall) -> bool:
    return isinstance(getattr(g.modules[call.address], "weight", None), Tensor) and fam.weight_layout(
        g.modules[call.address]
    ) is not None


def mlp_facets(g: _Graph, call: ModuleCall, kids: list[ModuleCall]) -> dict[str, FacetSite]:
    linears = [k for k in kids if _weighted(g, k)]
    if len(linears) < 2:
        return {}
    down = linears[-1]
    post_ref, sites = _io(g, down, "in"), {}
    sites["post"] = _site(g, "post", post_ref, note="input of the down projection")
    sites["down_out"] = _site(g, "down_out", _io(g, down, "out"), note="down projection output")
    linear_outs = {k._out_ref for k in linears if type(k._out_ref) is Ref}

    def is_linear_branch(ref: Any) -> bool:
        for _ in range(4):
            if ref in linear_outs:
                return True
            op = g.op(ref)
            if op is None or op.name not in fam.SPLIT_OPS | fam.RESHAPE_OPS | {"__getitem__"}:
                return False
            ref = op.inputs[0]
        return False

    act_call = next((k for k in kids if k._out_ref == post_ref and not _weighted(g, k)), None)
    act_ref = post_ref
    prod = g.op(post_ref)
    if act_call is None and prod is not None and prod.name in fam.MUL_OPS and len(prod.inputs) == 2:
        a, b = prod.inputs
        if is_linear_branch(a) != is_linear_branch(b):
            lin, act_ref = (a, b) if is_linear_branch(a) else (b, a)
            sites["gated_out"] = _site(g, "gated_out", post_ref, note="act(pre) * pre_linear")
            sites["pre_linear"] = _site(g, "pre_linear", lin, note="linear branch of the gated MLP")
    if act_ref is not None:
        sites["act"] = _site(g, "act", act_ref, note="activation output")
        act_call = next((k for k in kids if k._out_ref == act_ref and not _weighted(g, k)), None)
        if act_call is not None:
            pre_ref = _io(g, act_call, "in")
        else:
            op = g.op(act_ref)
            pre_ref = op.inputs[0] if op is not None and op.inputs else None
        if pre_ref is not None and (is_linear_branch(pre_ref)):
            sites["pre"] = _site(g, "pre", pre_ref, note="input of the activation")
    return {k: v for k, v in sites.items() if v is not None}


# -- norms -------------------------------------------------------------------------------------


def norm_facets(g: _Graph, call: ModuleCall) -> dict[str, FacetSite]:
    module = g.modules[call.address]
    rms = fam.is_rms_norm(module)
    inv_name = "inv_rms" if rms else "inv_std"
    x_ref = _io(g, call, "in")
    xm = g.meta(x_ref)
    if xm is None:
        return {}
    ops = g.ops[call.first_op : call.end_op]
    rsqrt = next((op for op in ops if op.name == "rsqrt"), None)
    sites: dict[str, FacetSite] = {}
    stat_shape = xm[0][:-1] + (1,)
    if rsqrt is not None:
        inv_ref = Ref(rsqrt.index, 0)
        sites[inv_name] = _site(g, inv_name, inv_ref, note="the norm's rsqrt op")
        mul = next((c for c in g.consumers.get(rsqrt.index, []) if g.ops[c].name in fam.MUL_OPS), None)
        if mul is not None:
            n_ref = g.follow(Ref(mul, 0), frozenset({"to", "type", "float", "half", "bfloat16"}))
            sites["normalized"] = _site(g, "normalized", n_ref, note="input times the rsqrt, before the gain")
    x = g.value(x_ref)
    if inv_name not in sites or "normalized" not in sites:
        inv = normalized = None
        if x is not None:
            with torch.no_grad():
                xf = x.float()
                centred = xf if rms else xf - xf.mean(-1, keepdim=True)
                inv = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + fam.norm_eps(module))
                normalized = (centred * inv).to(x.dtype)
        note = "computed from the norm's input (the norm ran as one fused op)"
        sites.setdefault(inv_name, FacetSite(inv_name, "computed", stat_shape, torch.float32, inv, note=note))
        sites.setdefault("normalized", FacetSite("normalized", "computed", xm[0], xm[1], normalized, note=note))
    inv_site = sites[inv_name]
    scale = None if inv_site.tensor is None else torch.reciprocal(inv_site.tensor)
    sites["scale"] = FacetSite("scale", "computed", inv_site.shape, inv_site.dtype, scale, note=f"1 / {inv_name}")
    return {k: v for k, v in sites.items() if v is not None}


# -- the whole trace ---------------------------------------------------------------------------


def derive(
    ops: list[OpRecord],
    calls: list[ModuleCall],
    modules: dict[str, nn.Module],
    keep: Callable[[str, str], bool] | None,
    structure: Any = None,
) -> None:
    """Attach a site dict to every call (`call._sites`); tensors dropped where `keep` says no."""
    g = _Graph(ops, modules)
    kids_of: dict[int, list[ModuleCall]] = {}
    for c in calls:
        if c.parent is not None:
            kids_of.setdefault(id(c.parent), []).append(c)
    for call in calls:
        kids = kids_of.get(id(call), [])
        sites: dict[str, FacetSite] = {}
        for name, which in (("input", "in"), ("output", "out")):
            s = _site(g, name, _io(g, call, which), note=f"module {which}put")
            if s:
                sites[name] = s
        role = call.role
        if role == "block":
            sites.update(block_facets(g, call, kids))
        elif role == "attention":
            sites.update(attention_facets(g, call, kids))
        elif role == "mlp":
            sites.update(mlp_facets(g, call, kids))
        elif role == "norm":
            sites.update(norm_facets(g, call))
        elif role == "embedding" and "input" in sites:
            sites["indices"] = _site(g, "indices", _io(g, call, "in"), note="token ids")
            lookup = next((op for op in g.ops[call.first_op : call.end_op] if op.name == "embedding"), None)
            if lookup is not None:
                sites["lookup"] = _site(g, "lookup", Ref(lookup.index, 0), note="the embedding lookup op")
        elif role == "root":
            sites.update(_root_facets(g, call, calls, structure))
        if keep is not None:
            for name, s in sites.items():
                if s.tensor is not None and not keep(call.address, name):
                    s.tensor = None
        call._sites = sites  # type: ignore[attr-defined]


def _logits_site(g: _Graph, root: ModuleCall, unembed: ModuleCall) -> FacetSite | None:
    """The model's logits: the root output when it is computed from the unembedding output
    with the same shape (a final softcap, a cast), else the unembedding output itself."""
    u_ref, r_ref = _io(g, unembed, "out"), _io(g, root, "out")
    u_m, r_m = g.meta(u_ref), g.meta(r_ref)
    if (
        type(unembed._out_ref) is Ref
        and type(root._out_ref) is Ref
        and root._out_ref != unembed._out_ref
        and u_m is not None
        and r_m is not None
        and u_m[0] == r_m[0]
        and unembed._out_ref.op in g.ancestors(root._out_ref, unembed._out_ref.op)
    ):
        return _site(g, "logits", r_ref, note="model output, computed from the unembedding output")
    return _site(g, "logits", u_ref, note="unembedding output")


def _root_facets(g: _Graph, root: ModuleCall, calls: list[ModuleCall], structure: Any) -> dict[str, FacetSite]:
    """`logits` (from the unembedding) and `final_norm_input` (from `_structure`'s one final-norm rule)."""
    sites = {}
    unembed = structure.unembed if structure is not None else next((c for c in calls if c.role == "unembed"), None)
    if unembed is not None:
        s = _logits_site(g, root, unembed)
        if s:
            sites["logits"] = s
    norm = structure.final_norm if structure is not None else None
    if norm is not None:
        s = _site(g, "final_norm_input", _io(g, norm, "in"), note="input of the final norm")
        if s:
            sites["final_norm_input"] = s
    return sites
