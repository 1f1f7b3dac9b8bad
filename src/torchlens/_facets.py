"""Facets: the named tensors of a module call, found from the recorded data flow.

A facet is found by following which op consumed which tensor inside a module call, never by
reading a tensor's name in the model's source. The module's *role* (from
`torchlens._structure`) says which facets to look for:

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

`derive` finds every site eagerly, from refs, shapes and dtypes alone. The tensor work is
deferred: a derived facet (the scores and pattern rebuilt from a fused kernel, the facets of
`nn.MultiheadAttention`, `result`, a norm's `normalized`/`inv_*`/`scale`) and the expensive check
of a real one (`z`: pattern @ v; `resid_mid`: the residual sums) become a pending check
(`torchlens._records._Pending`) over the tensors it needs, captured here. It runs, and its facets
are served or refused, on the first read of any of them (see `FacetSite`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from . import _ops, _roles
from ._facet_spec import tokens_flattened
from ._records import FacetSite, ModuleCall, OpRecord, Ref, _Dropped, _Pending

class _Graph:
    """Read helpers over the recorded ops: producers, consumers, saved values, shapes."""

    def __init__(self, ops: list[OpRecord], modules: dict[str, nn.Module]):
        self.ops = ops
        self.modules = modules
        self.consumers: dict[int, list[int]] = {}
        self.dropped: dict[Ref, str] = {}  # a ref `_io` fell back to because its alias was dropped -> why
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

    def source(self, ref: Any, names: frozenset[str], limit: int = 4) -> Any:
        """Walk back from `ref` through producers whose op name is in `names` (dropout, casts) to
        the tensor they pass on: what `follow` does downstream, upstream."""
        for _ in range(limit):
            op = self.op(ref)
            if op is None or op.name not in names or not op.inputs or type(op.inputs[0]) is not Ref:
                break
            ref = op.inputs[0]
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


def _held(site: FacetSite | None) -> Tensor | None:
    """The tensor `site` holds now, without running its pending check."""
    return None if site is None else site.__dict__.get("tensor")


def _wide(t: Tensor) -> Tensor:
    """`t` in the precision a check computes in: float64 stays float64, anything else is float32."""
    return t if t.dtype == torch.float64 else t.float()


def _site(g: _Graph, name: str, ref: Any, kind: str = "real", note: str = "") -> FacetSite | None:
    if type(ref) is _Dropped:
        return FacetSite(name, "refused", ref.shape, ref.dtype, note=ref.reason)
    m = g.meta(ref)
    if m is None:
        return None
    value = g.value(ref)
    if value is None and g.dropped and type(ref) is Ref and ref in g.dropped:
        return FacetSite(name, "refused", m[0], m[1], note=g.dropped[ref])
    return FacetSite(name, kind, m[0], m[1], value, ref.op if type(ref) is Ref else None, None, note)


def _io(g: _Graph, call: ModuleCall, which: str) -> Any:
    """A module call's input or output: the producing op's Ref, or the alias the hook kept.

    The Ref is preferred (it names the op); the alias is used when the op's tensor was not
    kept, e.g. a retained block whose input came from an op outside it.
    """
    ref, alias = (call.input_ref, call._in) if which == "in" else (call.output_ref, call._out)
    if type(alias) is _Dropped and type(ref) is Ref:  # the Ref still leads through the graph
        if g.value(ref) is None:
            g.dropped[ref] = alias.reason
        return ref
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
    if mlp is None and attn is not None:
        mlp = _split_mlp_norm(g, call, kids, attn)
    if attn is None or mlp is None or type(attn.output_ref) is not Ref or type(mlp.input_ref) is not Ref:
        return sites
    # Ops downstream of the attention output and upstream of the MLP input: the residual add.
    down = {attn.output_ref.op}
    for i in range(attn.end_op, mlp.first_op):
        if any(type(r) is Ref and r.op in down for r in g.ops[i].inputs):
            down.add(i)
    up = g.ancestors(mlp.input_ref, attn.end_op)
    adds = [
        i for i in down & set(up)
        if g.ops[i].name in _ops.ADD_OPS and g.ops[i].module == call.address and g.ops[i].call == call.index
    ]
    if adds:
        sites["resid_mid"] = _site(g, "resid_mid", Ref(_pick_resid_mid(g, attn, adds), 0), note="residual add after attention")
        sites.update(_check_resid_mid(g, sites, kids, attn, mlp))
    return sites


def _split_mlp_norm(g: _Graph, call: ModuleCall, kids: list[ModuleCall], attn: ModuleCall) -> ModuleCall | None:
    """Where the block holds its MLP's layers itself (OPT: `final_layer_norm`, `fc1`, `fc2`), the
    norm child whose output the first weighted layer after the attention reads: the MLP branch
    starts there, so `resid_mid` is the residual add before it. None for a post-LN block (its
    output is a norm's), where the residual carried on is that norm's output."""
    after = [k for k in kids if k.first_op >= attn.end_op]
    lins = [k for k in after if _weighted(g, k)]
    if not lins or type(lins[0].input_ref) is not Ref:
        return None
    norms = [k for k in after if _roles.is_norm(g.modules[k.address])]
    if any(type(k.output_ref) is Ref and k.output_ref == call.output_ref for k in norms):
        return None
    return next((k for k in norms if k.output_ref == lins[0].input_ref), None)


def _pick_resid_mid(g: _Graph, attn: ModuleCall, adds: list[int]) -> int:
    """The residual add after attention: the last add fed by the attention and feeding the MLP."""
    return max(adds)


def _check_resid_mid(
    g: _Graph, sites: dict[str, FacetSite], kids: list[ModuleCall], attn: ModuleCall, mlp: ModuleCall
) -> dict[str, FacetSite]:
    """Refuse `resid_mid` unless resid_pre + the attention branch = resid_mid and resid_mid + the
    MLP branch = resid_post. A branch's output is its sublayer's output or that of a later
    sibling (a post-sublayer norm, a dropout), so Gemma-2's post-norms pass. The check is
    deferred to the first read (see `FacetSite`); only whether it can run is settled here."""
    mid, pre, post = (sites.get(n) for n in ("resid_mid", "resid_pre", "resid_post"))
    if mid is None or _held(mid) is None:
        return {}
    if pre is None or post is None or _held(pre) is None or _held(post) is None:
        mid.tensor = None  # cannot be checked, so not served
        return {}
    attn_branch = [k for k in kids if attn.first_op <= k.first_op < mlp.first_op]
    mlp_branch = [k for k in kids if k.first_op >= mlp.first_op]
    branch_outs = [[g.value(_io(g, k, "out")) for k in branch] for branch in (attn_branch, mlp_branch)]
    inputs = [_held(pre), _held(mid), _held(post), *branch_outs[0], *branch_outs[1]]
    n_attn, dtype = len(branch_outs[0]), mid.dtype

    def run(inputs: list) -> tuple:
        pre_t, mid_t, post_t = inputs[:3]
        m = _wide(mid_t)
        tol = _ops.reconstruction_tolerance(dtype) * max(1.0, float(post_t.abs().max()))

        def best(base: Tensor, target: Tensor, outs: list) -> float:
            errors = [float("inf")]
            for v in outs:
                if v is not None and tokens_flattened(v.shape, target.shape):
                    v = v.reshape(target.shape)  # a branch run on flattened tokens (OPT's MLP)
                if v is not None and v.shape == target.shape:
                    errors.append(float((base + _wide(v)).sub_(target).abs_().max()))
                    if errors[-1] <= tol:
                        break
            return min(errors)

        err = max(best(_wide(pre_t), m, inputs[3 : 3 + n_attn]), best(m, _wide(post_t), inputs[3 + n_attn :]))
        if not err <= tol:
            return {}, err, (f"resid_pre + attention branch = resid_mid = resid_post - MLP branch does not hold "
                             f"(off by {err:.3g} > {tol:.3g})")
        return {}, err, None

    _Pending(run, inputs, [mid])
    return {}


# -- attention ---------------------------------------------------------------------------------


def _head_split(g: _Graph, kernel_ref: Ref, lo: int, d_head: int) -> tuple[Ref, int] | None:
    """Find the per-head view of a projection upstream of an attention kernel input.

    Returns the Ref of the reshape that gave the projection a head axis ([B, T, n, m] from
    [B, T, n*m]; for a grouped layout [B, T, g, m, d], the slice of it this input took) and the
    offset into its last axis where this input's d_head columns start
    (non-zero only for fused per-head qkv layouts such as GPT-NeoX's).
    """
    up = g.ancestors(kernel_ref, lo)
    for i in sorted(up, reverse=True):
        op = g.ops[i]
        if op.name in _ops.RESHAPE_OPS and len(op.shape) == 5 and op.inputs:  # grouped q|k|v view [B, T, g, m, d]
            src = g.meta(op.inputs[0])
            if (src is not None and len(src[0]) == 3 and src[0][:2] == tuple(op.shape[:2])
                    and op.shape[2] * op.shape[3] * op.shape[4] == src[0][2] and op.shape[4] == d_head):
                for j in sorted(j for j in up if j > i):  # the slice of the group's heads this input took
                    sh = tuple(g.ops[j].shapes[up[j]])
                    if g.ops[j].name == "__getitem__" and sh[:3] == tuple(op.shape[:3]) and sh[-1] == d_head and (
                            (len(sh) == 5 and sh[3] < op.shape[3]) or len(sh) == 4):  # a slice, or one index of m
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
                if (g.ops[j].name in _ops.SPLIT_OPS | _ops.INDEX_OPS and len(sh) == 4 and sh[:2] == tuple(op.shape[:2])
                        and sh[3] == d_head and sh[2] < op.shape[2]):
                    return Ref(j, up[j]), 0
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
    norm = next((k for k in kids if k.role == "norm" and k.output_ref == src), None)
    if norm is None:
        return None
    ref = _io(g, norm, "in")
    m = g.meta(ref)
    return ref if m is not None and m[0] == g.meta(src)[0] else None


def _pre_scale_source(g: _Graph, split_ref: Ref, kids: list[ModuleCall]) -> Any:
    """The projection output, when the head view reads it multiplied by a constant (OPT's `q_proj(x) * scaling`).

    `q` is the projection viewed per head; the scaled tensor is what the scores' matmul reads.
    """
    src = g.ops[split_ref.op].inputs[0]
    op = g.op(src)
    if op is None or op.name not in _ops.SCALE_OPS or len(op.inputs) != 1:
        return None
    proj = next((k for k in kids if k.output_ref == op.inputs[0] and hasattr(g.modules[k.address], "weight")), None)
    if proj is None or g.meta(op.inputs[0]) is None or g.meta(op.inputs[0])[0] != g.meta(src)[0]:
        return None
    return op.inputs[0]


def _path_math(g: _Graph, start: int, ref: Ref) -> list[str]:
    """The names of the ops that transform values between op `start` and `ref` (RoPE, QK-norm, a
    scale), not just move them; empty when there are none.

    RoPE multiplies by cos/sin and a norm multiplies by its scale, so a product on the path
    is the sign; reshapes, transposes, the KV-cache concatenation and GQA expansion are not.
    """
    up = g.ancestors(ref, start + 1)
    return sorted({g.ops[i].name for i in up if g.ops[i].name in _ops.MUL_OPS or g.ops[i].name in _ops.NORM_OPS})


def attention_facets(g: _Graph, call: ModuleCall, kids: list[ModuleCall]) -> dict[str, FacetSite]:
    ops = g.ops[call.first_op : call.end_op]
    mha = next((op for op in ops if op.name == "multi_head_attention_forward"), None)
    if mha is not None:
        return _mha_facets(g, mha, getattr(g.modules[call.address], "num_heads", None))
    fused = next((op for op in ops if op.name in _ops.FUSED_ATTENTION_OPS), None)
    soft = next((op for op in ops if op.name in _ops.SOFTMAX_OPS), None)
    sites: dict[str, FacetSite] = {}
    z_ref = q_ref = k_ref = v_ref = unpacked = None
    if soft is not None and fused is None:
        scores_ref = soft.inputs[0]
        pattern_ref = g.follow(Ref(soft.index, 0), _ops.CAST_OPS)
        sites["scores"] = _site(g, "scores", scores_ref, note="input of the softmax")
        sites["pattern"] = _site(g, "pattern", pattern_ref, note="softmax output")
        # z: the matmul that consumes the pattern (possibly through dropout, or through an index
        # that drops softmax columns that are not keys: attention sinks).
        frontier, z_op, key_slice = [pattern_ref.op], None, None
        p_meta = g.meta(pattern_ref)
        for _ in range(4):
            nxt = [c for f in frontier for c in g.consumers.get(f, [])]
            z_op = next((c for c in nxt if g.ops[c].name in _ops.MATMUL_OPS), None)
            if z_op is not None:
                break
            frontier = [c for c in nxt if g.ops[c].name in _ops.PASS_THROUGH_OPS]
            for c in nxt:
                sh = tuple(g.ops[c].shape)
                if (key_slice is None and g.ops[c].name in _ops.INDEX_OPS and p_meta is not None
                        and len(sh) == len(p_meta[0]) and sh[:-1] == p_meta[0][:-1] and sh[-1] < p_meta[0][-1]):
                    key_slice = c
                    frontier.append(c)
        if key_slice is not None:
            _sink_columns(g, call, sites, scores_ref, pattern_ref, key_slice)
        if z_op is not None:
            z_ref = Ref(z_op, 0)
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
        packed = _gqa_packed(g, q_ref)
        if packed is not None:  # the kernel saw [b, kv_heads, n_rep * T, d]: unpack to [b, heads, T, ...]
            q_ref, unpacked = packed
        _reconstruct(g, fused, sites, unpacked)
    if z_ref is not None:
        sites["z"] = _site(g, "z", z_ref, note="pattern @ v, head-major")
        if unpacked is not None and sites["z"] is not None:
            z = sites["z"]
            z.shape = unpacked + (z.shape[-1],)
            z.tensor = None if _held(z) is None else _held(z).reshape(z.shape)
            z.note = ("the kernel output, head-major: the kernel ran on the query packed as [batch, kv_heads, "
                      "heads per kv head * query, d_head] (GQA single-token decode), unpacked by the inverse reshape")
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
        elif (unscaled := _pre_scale_source(g, split_ref, kids)) is not None:
            t = g.value(unscaled)
            site.tensor = None if t is None else t.reshape(site.shape)
            site.op = unscaled.op
            site.note = "projection viewed per head, before the model scales it"
            start = unscaled.op
        if site.shape[-1] != d_head:
            site.shape = site.shape[:-1] + (d_head,)
            site.tensor = None if site.tensor is None else site.tensor[..., offset : offset + d_head]
        if len(site.shape) == 5:  # grouped layout (Falcon's new one): heads are groups x heads per group
            site.shape = site.shape[:2] + (site.shape[2] * site.shape[3], site.shape[4])
            site.tensor = None if site.tensor is None else site.tensor.reshape(site.shape)
            site.note = "projection viewed per head (grouped q|k|v layout: group-major heads)"
        sites[name] = site
        math = _path_math(g, start, ref) if name in ("q", "k") else []
        if math:
            sites["rot_" + name] = _rot_site(g, "rot_" + name, ref, site.shape, math)
    sites = _head_guard(sites)
    sites.update(_result_site(g, call, kids, sites.get("z")))
    return {k: v for k, v in sites.items() if v is not None}


def _sink_columns(g: _Graph, call: ModuleCall, sites: dict[str, FacetSite | None], scores_ref: Any,
                  pattern_ref: Ref, key_slice: int) -> None:
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
    cat = next((i for i in sorted(up, reverse=True) if g.ops[i].name in ("cat", "concat", "concatenate")
                and s_meta is not None and tuple(g.ops[i].shape) == s_meta[0] and g.ops[i].inputs
                and (m := g.meta(g.ops[i].inputs[0])) is not None and m[0] == s_meta[0][:-1] + (n,)), None)
    if cat is None or s_meta is None:
        sites.update(_refused(("scores", "pattern"), (
            f"the softmax runs over {s_meta[0][-1] if s_meta else '?'} columns but {n} of them multiply v, and "
            f"which columns are keys was not found in the data flow")))
        return
    note = ("the softmax's first {n} columns, the keys (the softmax also covers {k} column(s) that are not keys, "
            "e.g. attention sinks, whose weight is not in the pattern: rows sum below 1)").format(
                n=n, k=s_meta[0][-1] - n)
    pattern = _site(g, "pattern", Ref(key_slice, 0), note="weights that multiply v: " + note)
    scores_full = g.value(scores_ref)
    scores = FacetSite("scores", "real", s_meta[0][:-1] + (n,), s_meta[1],
                       None if scores_full is None else scores_full[..., :n], scores_ref.op if type(scores_ref) is Ref
                       else None, None, "input of the softmax, " + note)
    sites["scores"], sites["pattern"] = scores, pattern
    soft_out = g.value(pattern_ref)
    if soft_out is None or _held(pattern) is None:
        scores.tensor = pattern.tensor = None  # the key columns cannot be shown, so not served
        return

    def run(inputs: list) -> tuple:
        p, full = inputs
        if not torch.equal(p, full[..., :n].to(p.dtype)):
            return {}, None, f"the weights that multiply v are not the softmax's first {n} columns (the keys)"
        return {}, 0.0, None

    _Pending(run, [_held(pattern), soft_out], [scores, pattern])


_HEAD_AXIS_FACETS = ("scores", "pattern", "z", "result")


def _head_guard(sites: dict[str, FacetSite | None]) -> dict[str, FacetSite | None]:
    """Refuse scores, pattern, z and result when their head axis does not hold the query's heads.

    `q` is `[batch, pos, heads, d_head]` (found from the head split of the projection); `z`,
    `scores` and `pattern` are `[batch, heads, query, ...]`. A kernel that ran on a regrouped
    query (kv heads times heads per group as its head and query axes) that TorchLens could not
    unpack would serve another head's values at `[b, h]`, so nothing with that axis is served.
    """
    q = sites.get("q")
    if q is None or len(q.shape) != 4:
        return sites
    bad = [n for n in ("scores", "pattern", "z") if sites.get(n) is not None and len(sites[n].shape) == 4
           and (sites[n].shape[1], sites[n].shape[2]) != (q.shape[2], q.shape[1])]
    if not bad:
        return sites
    n = bad[0]
    reason = (f"the kernel's head and query axes {list(sites[n].shape[1:3])} are not the {q.shape[2]} heads x "
              f"{q.shape[1]} positions found for the query projection: either the kernel ran on a regrouped query "
              f"that is not unpacked here, or the projection's head split was misread, and TorchLens cannot tell "
              f"which, so nothing with a head axis is served ([b, h] could read another head's values)")
    out = dict(sites)
    per_head = ("q", "k", "v", "rot_q", "rot_k")
    out.update(_refused(tuple(f for f in _HEAD_AXIS_FACETS + per_head if f in sites or f == "result"), reason))
    return out


def _gqa_packed(g: _Graph, q_ref: Any) -> tuple[Ref, tuple[int, int, int]] | None:
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
    if op is None or op.name not in _ops.RESHAPE_OPS or not op.inputs or type(op.inputs[0]) is not Ref:
        return None
    src, out = g.meta(op.inputs[0]), g.meta(q_ref)
    if src is None or out is None or len(src[0]) != 4 or len(out[0]) != 4:
        return None
    (b, h, t, d), (b2, kv, rows, d2) = src[0], out[0]
    if (b, d) != (b2, d2) or kv >= h or h % kv or rows != (h // kv) * t:
        return None
    return op.inputs[0], (b, h, t)


def _check_z(g: _Graph, pattern: FacetSite | None, v_ref: Any, z: FacetSite | None) -> dict[str, FacetSite]:
    """Refuse `z` unless `pattern @ v` equals it (it does not when dropout ran between them).
    The check is deferred to the first read of `z`."""
    if z is None or _held(z) is None:
        return {}
    v = g.value(v_ref)
    if pattern is None or _held(pattern) is None or v is None:
        z.tensor = None  # cannot be checked, so not served
        return {}
    dtype = z.dtype

    def run(inputs: list) -> tuple:
        p, v, zt = inputs
        if v.shape[-3] != p.shape[-3] and v.dim() == 4 and p.shape[-3] % v.shape[-3] == 0:
            v = v.repeat_interleave(p.shape[-3] // v.shape[-3], dim=-3)
        try:
            err = float((_wide(torch.matmul(p.to(v.dtype), v)) - _wide(zt)).abs().max())
        except RuntimeError as exc:
            return {}, None, f"pattern @ v could not be formed ({exc})"
        tol = _ops.reconstruction_tolerance(dtype) * max(1.0, float(v.abs().max()))
        if not err <= tol:
            return {}, err, f"pattern @ v differs from z by {err:.3g} (> {tol:.3g}), e.g. dropout ran between them"
        return {}, err, None

    _Pending(run, [_held(pattern), v, _held(z)], [z])
    return {}


def _rot_site(g: _Graph, name: str, kernel_ref: Ref, shape: tuple[int, ...], math: list[str]) -> FacetSite | None:
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
                     f"attention kernel input, token-major: the projection after {', '.join(math)} "
                     "(RoPE, a QK-norm or a scale)")


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


def _reconstruct(g: _Graph, fused: OpRecord, sites: dict[str, FacetSite],
                 unpacked: tuple[int, int, int] | None = None) -> None:
    """Scores and pattern of a fused attention kernel, rebuilt from its recorded inputs and
    checked against its output on first read (see `FacetSite`).

    With `unpacked` (`(batch, heads, query)`, from `_gqa_packed`), the kernel ran on a GQA-packed
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
    if stale is not None:  # a kept argument was written after the kernel ran, by code the capture could not see
        sites.update(_refused(("scores", "pattern"), f"not rebuilt: {stale}"))
        return
    why = _sdpa_unsupported(_sdpa_bound(fused.extra["args"], fused.extra["kwargs"]))
    if why is not None:  # refused with the reason (not "not saved": save= is not what is missing)
        sites.update(_refused(("scores", "pattern"), f"not rebuilt: {why}; trace in eval mode to get them"))
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

    _Pending(run, inputs, [scores, pattern])


_MHA_FACETS = ("q", "k", "v", "scores", "pattern", "z", "result")


def _mha_facets(g: _Graph, op: OpRecord, h: int | None) -> dict[str, FacetSite]:
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
        "q": (b, t, h, dh), "k": (b, s_len, h, dh), "v": (b, s_len, h, dh), "scores": (b, h, t, s_len),
        "pattern": (b, h, t, s_len), "z": (b, h, t, dh), "result": (b, t, h, e),
    }
    sites = {n: FacetSite(n, "reconstructed", shapes[n], dtype, op=op.index, note=note) for n in _MHA_FACETS}
    if op.tensor is None or op.extra is None:
        return sites
    stale = op.extra.get("stale")
    if stale is not None:  # a kept argument was written after the op ran, by code the capture could not see
        return _refused(_MHA_FACETS, f"not rebuilt: {stale}")
    why = _mha_unsupported(_mha_bound(op.extra["args"], op.extra["kwargs"]))
    if why is not None:
        return _refused(_MHA_FACETS, f"not rebuilt: {why}")
    inputs: list = []
    args, kwargs = _pack(op.extra["args"], op.extra["kwargs"], inputs)
    inputs.append(op.tensor)

    def run(inputs: list) -> tuple:
        a, kw = _unpack(args, kwargs, inputs)
        rebuilt, err, tol = rebuild_mha(a, kw, inputs[-1])
        if not err <= tol:
            return {}, err, f"the rebuild disagreed with the op output by {err:.3g} (> {tol:.3g})"
        return rebuilt, err, None

    _Pending(run, inputs, list(sites.values()))
    return sites


_MHA_ARGS = (
    "query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias",
    "bias_k", "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training",
    "key_padding_mask", "need_weights", "attn_mask", "use_separate_proj_weight", "q_proj_weight",
    "k_proj_weight", "v_proj_weight", "static_k", "static_v", "average_attn_weights", "is_causal",
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
    want = _wide(out.transpose(0, 1))
    tol = _ops.reconstruction_tolerance(query.dtype) * max(1.0, float(want.nan_to_num(0.0).abs().max()))
    # A query row with no visible key has no softmax (NaN); the op gives NaN there (the step-by-step
    # path) or uses no weights (the fused one: zero). Both readings are checked on every row; the
    # pattern served is the one the op's output proves.
    empty = masked.all(-1, keepdim=True) | softmax.isnan().all(-1, keepdim=True)
    candidates = [softmax] + ([softmax.masked_fill(empty, 0)] if bool(empty.any()) else [])
    best = None
    for pattern in candidates:
        z = torch.einsum("bhts,bshd->bhtd", pattern, v)
        result = torch.einsum("bhtd,ohd->btho", z, w_o.view(e, h, dh))
        got = _wide(result.sum(2) + (b_o if b_o is not None else 0))
        same_nan = got.isnan() & want.isnan()  # NaN where the model's own output is NaN
        diff = torch.where(~same_nan, (got - want).abs(), torch.zeros((), device=out.device))
        err = float(diff.nan_to_num(nan=float("inf")).max()) if diff.numel() else 0.0
        if best is None or err < best[0]:
            best = (err, pattern, z, result)
        if err <= tol:
            break
    err, pattern, z, result = best
    facets = {"q": q, "k": k, "v": v, "scores": scores, "pattern": pattern, "z": z, "result": result}
    return facets, err, tol


def _refused(names: tuple[str, ...], reason: str) -> dict[str, FacetSite]:
    """Sites that are not served: their check failed or could not run. `FacetMap` keeps the
    reason, and asking for the facet raises `FacetNotFound` with it."""
    return {n: FacetSite(n, "refused", (), torch.float32, note=reason) for n in names}


def _fits(t: Tensor, other: Tensor) -> bool:
    """Whether `t op= other` gives what `t op other` does: same dtype, and `other` broadcasts to `t`'s shape."""
    return torch.result_type(t, other) == t.dtype and torch.broadcast_shapes(t.shape, other.shape) == t.shape


def _largest(diff: Tensor, rows: Tensor) -> float:
    """The largest entry of the absolute difference `diff` (overwritten) on the rows where `rows`
    holds: a NaN counts as infinitely large, an infinity as the dtype's largest finite value."""
    if not diff.numel():
        return 0.0
    if not bool(rows.all()):
        diff.masked_fill_(~rows, 0)
    m = float(diff.max())  # a NaN anywhere makes the max NaN
    return float("inf") if m != m else float(torch.finfo(diff.dtype).max) if m == float("inf") else m


def _sdpa_bound(args: tuple, kwargs: dict) -> dict[str, Any]:
    """`scaled_dot_product_attention`'s arguments by name."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _sdpa_unsupported(bound: dict[str, Any]) -> str | None:
    """Why `rebuild_attention` cannot rebuild a kernel call with these (bound) arguments, or None."""
    if bound.get("dropout_p", 0.0):
        return "the kernel ran with dropout_p > 0 (training mode)"
    return None


def rebuild_attention(args: tuple, kwargs: dict, out: Tensor) -> tuple[Tensor, Tensor, float, float]:
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
    bound = _sdpa_bound(args, kwargs)
    why = _sdpa_unsupported(bound)
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
        elif _fits(scores, mask):
            scores.add_(mask)
        else:  # the mask widens the dtype or the shape: as the model adds it
            scores = scores + mask
    if causal or bool_mask:  # else every key is visible and nothing is filled
        hidden = ~visible
        scores = scores.masked_fill_(hidden, fill) if _fits(scores, hidden) else scores.masked_fill(hidden, fill)
    pattern = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
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
    checked = ~(empty & z.isnan().all(-1, keepdim=True) & out.isnan().all(-1, keepdim=True)) if bool(
        empty.any()) else empty.logical_not()
    err = _largest(torch.sub(_wide(z), _wide(out)).abs_(), checked)
    tol = _ops.reconstruction_tolerance(q.dtype) * max(1.0, float(v.abs().max()))
    return scores, pattern, err, tol


def _per_head_weight(w: Tensor, layout: str, d_out: int, h: int, dh: int) -> Tensor:
    """The output projection's weight as `[d_out, heads, d_head]`, from either weight layout."""
    return w.view(d_out, h, dh) if layout == "out_in" else w.view(h, dh, d_out).permute(2, 0, 1)


def _result_site(g: _Graph, call: ModuleCall, kids: list[ModuleCall], z: FacetSite | None) -> dict[str, FacetSite]:
    """Per-head contribution to the output projection: z split by head times that head's W_O."""
    if z is None or z.op is None:
        return {}
    proj = next((k for k in kids if k.first_op > z.op and hasattr(g.modules[k.address], "weight")), None)
    if proj is None:
        return {}
    module = g.modules[proj.address]
    layout = _roles.weight_layout(module)
    if len(z.shape) != 4:  # no head axis (e.g. a single-head attention without a reshape)
        return {}
    b, h, t, dh = z.shape
    out_m = g.meta(_io(g, proj, "out"))
    if layout is None or out_m is None:
        return {}
    d_out = out_m[0][-1]
    site = FacetSite("result", "computed", (b, t, h, d_out), z.dtype, note="z per head times W_O per head")
    zt = _held(z)
    if zt is None:
        return {"result": site}
    actual = g.value(_io(g, proj, "out"))
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
            total = total.add_(b_) if _fits(total, b_) else total + b_
        total, want = _wide(total), _wide(actual)
        total = total.sub_(want) if _fits(total, want) else total - want
        err = float(total.abs_().max())
        tol = _ops.reconstruction_tolerance(actual.dtype) * max(1.0, float(actual.abs().max()))
        if not err <= tol:
            return {}, err, f"the sum over heads plus bias differs from the output projection by {err:.3g} (> {tol:.3g})"
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
                return {}, err, (f"the sum over heads plus bias, in float32, differs from the output "
                                 f"projection by {err32:.3g} (> {tol32:.3g}, its scale)")
        return {"result": result}, err, None

    # Its own check (sum over heads + bias = the output projection) decides, not z's pattern @ v:
    # z is the tensor the projection read even where dropout makes z's own check fail, so
    # save="all" and save=["result"] give result the same status.
    _Pending(run, [zt, module.weight.detach(), actual, bias], [site])
    return {"result": site}


# -- MLP ---------------------------------------------------------------------------------------


def _weighted(g: _Graph, call: ModuleCall) -> bool:
    return isinstance(getattr(g.modules[call.address], "weight", None), Tensor) and _roles.weight_layout(
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
    linear_outs = {k.output_ref for k in linears if type(k.output_ref) is Ref}

    def is_linear_branch(ref: Any) -> bool:
        for _ in range(4):
            if ref in linear_outs:
                return True
            op = g.op(ref)
            if op is None or op.name not in _ops.SLICE_OPS:
                return False
            ref = op.inputs[0]
        return False

    def back(ref: Any) -> Any:
        """Back from `ref` over what sits between the activation (or the gating product) and
        the down projection: dropout and casts (T5), a norm child (Kosmos-2's `ffn_layernorm`,
        BitNet's `ffn_sub_norm`). In training mode the down projection reads the dropped-out
        tensor (`post`), not the activation's output (`act`)."""
        for _ in range(4):
            ref = g.source(ref, _ops.PASS_THROUGH_OPS)
            norm = next((k for k in kids if k.output_ref == ref and _roles.is_norm(g.modules[k.address])), None)
            if norm is None or type(norm.input_ref) is not Ref:
                break
            ref = norm.input_ref
        return ref

    def activation_module(ref: Any) -> ModuleCall | None:
        return next((k for k in kids if k.output_ref == ref and not _weighted(g, k)
                     and not _roles.is_norm(g.modules[k.address])), None)

    def activation_input(ref: Any) -> Any:
        """The input of the activation that produced `ref` (an activation module's, or a
        functional activation op's); None when `ref` is not an activation's output."""
        module = activation_module(ref)
        if module is not None:
            return _io(g, module, "in")
        op = g.op(ref)
        return op.inputs[0] if op is not None and op.name in _ops.ACTIVATION_OPS and op.inputs else None

    core = back(post_ref)
    act_ref, gated = core, False
    prod = g.op(core)
    # An activation module's output is the activation even where its last op is a product
    # (CLIP's QuickGELU: x * sigmoid(1.702 x)); only a bare product can be the gate.
    if activation_module(core) is None and prod is not None and prod.name in _ops.MUL_OPS and len(prod.inputs) == 2:
        a, b = prod.inputs
        if is_linear_branch(a) != is_linear_branch(b):
            lin, other = (a, b) if is_linear_branch(a) else (b, a)
            act_ref, gated = g.source(other, _ops.PASS_THROUGH_OPS), True
            sites["pre_linear"] = _site(g, "pre_linear", lin, note="linear branch of the gated MLP")
            if act_ref == other:  # nothing between act and the product: it is act(pre) * pre_linear
                sites["gated_out"] = _site(g, "gated_out", core, note="act(pre) * pre_linear")
    # `act` only where it is an activation of the up projection: a scale, an in-place write or
    # anything else in between would otherwise be served under its name.
    pre_ref = activation_input(act_ref)
    if pre_ref is not None and is_linear_branch(pre_ref):
        sites["act"] = _site(g, "act", act_ref, note="activation output")
        sites["pre"] = _site(g, "pre", pre_ref, note="input of the activation")
    else:  # not known to be an activation of the up projection, so not known to be gated either
        sites.pop("gated_out", None)
        sites.pop("pre_linear", None)
        m, op = g.meta(act_ref), g.op(act_ref)
        if m is not None and op is not None:
            sites["act"] = FacetSite("act", "refused", m[0], m[1], note=(
                f"what reaches the down projection{' through the gating product' if gated else ''} comes from "
                f"op #{op.index} {op.name}, not from an activation of the up projection, so no tensor of this MLP "
                "is known to be act(pre)"))
    return {k: v for k, v in sites.items() if v is not None}


# -- norms -------------------------------------------------------------------------------------


def _norm_kind(module: nn.Module, ops: list[OpRecord]) -> str:
    """`"rms"`, `"std"` or `"group"`: what the norm divides by, from the ops it ran.

    A fused op names it (`rms_norm`, `layer_norm`, `group_norm`); a norm written out with
    `rsqrt` centres its input first (a subtraction) only when it is a LayerNorm, so T5's
    `T5LayerNorm`, which is an RMS norm, is found to be one.
    """
    names = {op.name for op in ops}
    if "group_norm" in names or isinstance(module, nn.GroupNorm):
        return "group"
    if "rms_norm" in names:
        return "rms"
    if "layer_norm" in names:
        return "std"
    if "rsqrt" in names:
        return "std" if names & _ops.SUB_OPS else "rms"
    return "rms" if _roles.is_rms_norm(module) else "std"


def _n_normalized(module: nn.Module) -> int:
    """How many trailing dimensions a LayerNorm/RMSNorm normalizes over: its `normalized_shape`
    (default: the last one)."""
    shape = getattr(module, "normalized_shape", None)
    return len(shape) if isinstance(shape, (tuple, list, torch.Size)) and shape else 1


def _normalize(x: Tensor, kind: str, eps: float, n_dims: int, groups: int | None) -> tuple[Tensor, Tensor | None]:
    """The norm's input centred (unless RMS) and divided by its RMS/std over its last `n_dims`
    dimensions (over each of `groups` groups for GroupNorm), in float32; and the inverse divisor
    (None for GroupNorm, whose statistics are per group, not per position)."""
    xf = _wide(x)
    if kind == "group":
        g = xf.reshape(xf.shape[0], groups, -1)
        g = g - g.mean(-1, keepdim=True)
        inv = torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
        return (g * inv).reshape(xf.shape), None
    dims = tuple(range(x.dim() - n_dims, x.dim()))
    centred = xf if kind == "rms" else xf - xf.mean(dims, keepdim=True)
    inv = torch.rsqrt(centred.pow(2).mean(dims, keepdim=True) + eps)
    return centred * inv, inv


def _affine_error(normalized: Tensor, out: Tensor, w: Tensor | None, b: Tensor | None, kind: str,
                  tol: float = 0.0) -> float:
    """How far `normalized * gain + bias` is from the norm's output, for the gain the model uses.

    The gain is the module's weight `w`, or `1 + w` (Gemma's RMSNorm stores the offset), or
    1 without a weight; the smallest error over those is returned (the first within `tol`).
    """
    n, o = _wide(normalized), _wide(out)
    shape = (-1,) + (1,) * (n.dim() - 2) if kind == "group" else None
    bias = 0 if b is None else (_wide(b).view(shape) if shape else _wide(b))
    gains = [None] if w is None else [_wide(w), 1 + _wide(w)]
    errors = []
    for gain in gains:
        y = n + bias if gain is None else (n * (gain.view(shape) if shape else gain)).add_(bias)  # new tensors
        errors.append(float(y.sub_(o).abs_().max()) if o.numel() else 0.0)
        if errors[-1] <= tol:
            break
    return min(errors)


def norm_facets(g: _Graph, call: ModuleCall) -> dict[str, FacetSite]:
    """`normalized`, `inv_rms`/`inv_std` and `scale` of a norm call, each checked.

    The real ops (a `rsqrt` and the product with it) are taken where the norm is written out;
    otherwise (a fused `layer_norm`, `rms_norm`, `group_norm`) they are computed from the input
    over the normalized shape. Either way the facets are served only if `normalized * gain + bias`
    equals the norm's output within the dtype's tolerance; else they are refused with the error.
    What is computed, and the check, run on first read of any of them (see `FacetSite`).
    GroupNorm has `normalized` only (its statistics are per group).
    """
    module = g.modules[call.address]
    x_ref, out_ref = _io(g, call, "in"), _io(g, call, "out")
    xm, om = g.meta(x_ref), g.meta(out_ref)
    if xm is None or om is None or xm[0] != om[0]:
        return {}
    ops = g.ops[call.first_op : call.end_op]
    kind = _norm_kind(module, ops)
    inv_name = "inv_rms" if kind == "rms" else "inv_std"
    names = ("normalized",) if kind == "group" else ("normalized", inv_name, "scale")
    rsqrt = next((op for op in ops if op.name == "rsqrt"), None) if kind != "group" else None
    sites: dict[str, FacetSite] = {}
    if rsqrt is not None:
        sites[inv_name] = _site(g, inv_name, Ref(rsqrt.index, 0), note="the norm's rsqrt op")
        mul = next((c for c in g.consumers.get(rsqrt.index, []) if g.ops[c].name in _ops.MUL_OPS), None)
        if mul is not None:
            n_ref = g.follow(Ref(mul, 0), _ops.CAST_OPS)
            sites["normalized"] = _site(g, "normalized", n_ref, note="input times the rsqrt, before the gain")
    x, out = g.value(x_ref), g.value(out_ref)
    compute = any(sites.get(n) is None for n in names[:2])
    n_dims, eps, groups = _n_normalized(module), _roles.norm_eps(module), getattr(module, "num_groups", None)
    if compute:
        note = "computed from the norm's input over its normalized shape (the norm ran as one fused op)"
        dims = range(len(xm[0]) - n_dims, len(xm[0]))
        stat_shape = tuple(1 if i in dims else d for i, d in enumerate(xm[0]))
        sites["normalized"] = FacetSite("normalized", "computed", xm[0], xm[1], note=note)
        if kind != "group":
            sites[inv_name] = FacetSite(inv_name, "computed", stat_shape, torch.float32, note=note)
    if kind != "group":
        inv_site = sites[inv_name]
        sites["scale"] = FacetSite("scale", "computed", inv_site.shape, inv_site.dtype, note=f"1 / {inv_name}")
    if (x if compute else _held(sites["normalized"])) is None:
        # Nothing is served, so nothing needs checking; a written-out norm whose product was not
        # kept still serves its rsqrt, and the scale from it.
        inv = None if compute or kind == "group" else _held(sites[inv_name])
        if inv is not None:
            with torch.no_grad():
                sites["scale"].tensor = torch.reciprocal(inv)
        return sites
    if out is None:  # cannot be checked, so not served; a save= that keeps the norm serves it
        for site in sites.values():
            site.tensor = None
        return sites
    w, b = getattr(module, "weight", None), getattr(module, "bias", None)
    w = w.detach() if isinstance(w, Tensor) else None
    b = b.detach() if isinstance(b, Tensor) else None
    inputs = [x if compute else None, out, w, b,
              None if compute or kind == "group" else _held(sites[inv_name]),
              None if compute else _held(sites["normalized"])]

    def run(inputs: list) -> tuple:
        x, out, w, b, inv, normalized = inputs
        values: dict[str, Tensor] = {}
        if compute:
            normalized, inv = _normalize(x, kind, eps, n_dims, groups)
            values["normalized"] = normalized = normalized.to(x.dtype)
            if kind != "group":
                values[inv_name] = inv
        if kind != "group":
            values["scale"] = torch.reciprocal(inv)
        tol = _ops.reconstruction_tolerance(out.dtype) * max(1.0, float(out.abs().max()))
        err = _affine_error(normalized, out, w, b, kind, tol)
        if not err <= tol:
            return {}, err, f"normalized * gain + bias differs from the norm's output by {err:.3g} (> {tol:.3g})"
        return values, err, None

    _Pending(run, inputs, list(sites.values()))
    return sites


# -- the whole trace ---------------------------------------------------------------------------


_IO_SITES = (("input", "in", "module input"), ("output", "out", "module output"))


def derive(
    ops: list[OpRecord],
    calls: list[ModuleCall],
    modules: dict[str, nn.Module],
    keep: Callable[[str, str], bool] | None,
    structure: Any = None,
) -> list[dict[str, FacetSite]]:
    """The facet sites of every call, in the order of `calls`; tensors dropped where `keep` says no.

    Nothing is computed here beyond cheap views: derived facets and the expensive checks are left
    pending on their sites, each holding the tensors it will compute from (`FacetSite._inputs`).
    """
    g = _Graph(ops, modules)
    kids_of: dict[int, list[ModuleCall]] = {}
    for c in calls:
        if c.parent is not None:
            kids_of.setdefault(id(c.parent), []).append(c)
    out: list[dict[str, FacetSite]] = []
    for call in calls:
        kids = kids_of.get(id(call), [])
        sites: dict[str, FacetSite] = {}
        for name, which, note in _IO_SITES:
            s = _site(g, name, _io(g, call, which), note=note)
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
                if s.saved and not keep(call.address, name):
                    s.tensor = None
        out.append(sites)
    return out


def _logits_site(g: _Graph, root: ModuleCall, unembed: ModuleCall) -> FacetSite | None:
    """The model's logits: the root output when it is computed from the unembedding output
    with the same shape by elementwise ops only (a final softcap, a cast: `LOGIT_MAP_OPS`), else
    the unembedding output itself (so `log_softmax(lm_head(h))` gives `lm_head`'s output)."""
    u_ref, r_ref = _io(g, unembed, "out"), _io(g, root, "out")
    u_m, r_m = g.meta(u_ref), g.meta(r_ref)
    if (
        type(unembed.output_ref) is Ref
        and type(root.output_ref) is Ref
        and root.output_ref != unembed.output_ref
        and u_m is not None
        and r_m is not None
        and u_m[0] == r_m[0]
    ):
        between = g.ancestors(root.output_ref, unembed.output_ref.op)
        between.pop(unembed.output_ref.op, None)
        if unembed.output_ref.op in g.ancestors(root.output_ref, unembed.output_ref.op) and all(
            g.ops[i].name in _ops.LOGIT_MAP_OPS for i in between
        ):
            return _site(g, "logits", r_ref, note="model output, computed elementwise from the unembedding output")
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
