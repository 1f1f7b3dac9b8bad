"""Gradients of the kept sites: one backward of the loss, mapped onto every call's facets.

`trace(..., grads=loss_fn)` records, next to each tensor it keeps, that tensor's gradient edge
(`torchlens._capture.edges.Edges`). Once the facets are found and `save=` has trimmed them,
`backward` runs ONE `torch.autograd.grad` of the loss with respect to the edges the kept facets
stand on, and `grad_maps` gives every call a `GradMap` beside its `FacetMap`:

- a real facet whose tensor is an op output, a module input or output the hook kept, or a view
  of one (a projection viewed per head, a slice of a fused projection, a transposed kernel
  input) gets autograd's gradient at that tensor, viewed the same way: each element of the
  facet is an element of the tensor the model used, and its gradient is that element's;
- a facet on no path to the loss gets zeros (the loss does not depend on it), said in its note;
- a facet whose value is refused or not kept has its gradient refused or not kept alike;
- a derived facet (computed or reconstructed: no op of the model produced it) gets a gradient
  derived from autograd's gradients where the model did run an op, served only where a relation
  the model fixes checks it against autograd's own gradients: the pattern and scores rebuilt
  under a fused attention kernel (`_kernel_grads`: checked at the kernel's value and query), a
  norm's `normalized`, `inv_std` / `inv_rms` and `scale`, and attention's per-head `result`
  (`_analysis.derived_grads`: checked at the norm's input through the norm, and at z); any
  other derived facet is refused with the reason, as is a tensor that does not require grad
  (token ids, a mask).

A derived gradient is pending when `trace` returns, as a derived facet's value is: its site holds
what the derivation computes from (autograd's gradients, the forward's tensors, the weights it
reads) in a `_core.pending.Pending`, and the derivation and its check run on the first read of
any gradient of its group (or `GradMap.check`; `Trace.save` runs them all); a failed check
refuses them then, with the reason. The snapshot, a store and the sealing of pending checks treat those inputs as
they treat the facet values' (`_core.holdings.held_tensors` walks the gradient maps too).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from torchlens._analysis import derived_grads as _derived
from torchlens._analysis.facets.rebuild import _pack, _unpack, rebuild_attention, sdpa_bound
from torchlens._capture.edges import Edges
from torchlens._core import ops as _ops
from torchlens._core.errors import GradientError
from torchlens._core.grad_sites import GradMap
from torchlens._core.pending import Pending
from torchlens._core.records import ModuleCall, OpRecord, Ref
from torchlens._core.sites import FacetSite

__all__ = ["loss_of", "backward", "grad_maps"]

#: why a derived facet without a derivation of its gradient has none
_DERIVED = (
    "it is {kind} (no op of the model produced it: TorchLens derived it), so autograd has no gradient "
    "at it in the model's forward, and no checked derivation of its gradient exists for this facet"
)


#: why a tensor computed from frozen parameters alone has no gradient
_FROZEN_ONLY = (
    "its tensor is a frozen parameter of the model or is computed from frozen parameters alone (no "
    "input on its path): grads= leaves the parameters frozen, and autograd's graph starts at the "
    "first ops that read a parameter together with the input, so it does not reach this tensor; "
    "make the parameters it is computed from require grad (requires_grad_(True)) to have its gradient"
)


def loss_of(loss_fn: Callable[[Any], Any], output: Any, name: str) -> Tensor:
    """`loss_fn(output)`, checked: a one-element floating-point tensor on the autograd graph
    (`torch.autograd.grad` takes it as it is, whatever its shape).

    Raises:
        GradientError: the loss function raised, or returned something else.
    """
    try:
        loss = loss_fn(output)
    except Exception as exc:
        raise GradientError(
            f"grads={name} raised {type(exc).__name__}: {exc}. grads= takes a function of the model's output (what "
            f"model(...) returns) giving a scalar tensor, e.g. grads=lambda out: out.logits[0, -1].max()."
        ) from exc
    if not isinstance(loss, Tensor):
        raise GradientError(
            f"grads={name} returned a {type(loss).__name__}, not a tensor: it must return a scalar tensor computed "
            "from the model's output (e.g. out.logits[0, -1, token] or a loss's .sum())."
        )
    if loss.numel() != 1:
        raise GradientError(
            f"grads={name} returned a tensor of shape {list(loss.shape)}; the gradient is of a scalar: reduce it "
            "(.sum() keeps each element's gradient as it is, .mean() divides them by the count)."
        )
    if not loss.dtype.is_floating_point and not loss.dtype.is_complex:
        raise GradientError(
            f"grads={name} returned a {loss.dtype} tensor, which has no gradient: return a float."
        )
    if not loss.requires_grad:
        raise GradientError(
            f"grads={name} returned a loss that does not depend on anything differentiable in the forward: no "
            "parameter of the model and no input requires grad along a path to it (integer outputs, or a loss "
            "computed from a detached tensor)."
        )
    if loss.grad_fn is None:  # a leaf: made outside the forward, it depends on none of it
        raise GradientError(
            f"grads={name} returned a tensor that requires grad but was computed from nothing (an "
            "autograd leaf, such as torch.tensor(1.0, requires_grad=True)): it depends on no tensor "
            "of the forward, so every gradient would be zero. Compute it from the model's output, "
            "e.g. grads=lambda out: out.logits[0, -1].max()."
        )
    return loss


def backward(
    loss: Tensor,
    edges: Edges,
    ops: list[OpRecord],
    calls: list[ModuleCall],
    modules: dict[str, nn.Module],
    io: dict[int, tuple[Any, Any]],
) -> dict[int, Any]:
    """d loss / d each kept facet's tensor: `id(site)` -> `(gradient, unused)` for a real facet,
    `(derivation, facet name)` for a derived one (a `_analysis.derived_grads.Deferred`, run on
    first read), or a str saying why there is none.
    One `torch.autograd.grad` over the edges the sites stand on; a norm's derived gradients take
    one more, from the norm's output to its input, for their check (`_analysis.derived_grads`).
    `modules` maps addresses to modules (their weights), `io` each call's id to the input and
    output aliases its hooks kept (None where the op's output was kept instead)."""
    found: dict[int, Any] = {}
    wanted: dict[
        int, tuple[Any, Tensor]
    ] = {}  # id(edge source) -> (edge, the tensor it is the edge of)
    plans: list[tuple[FacetSite, int, Tensor, Tensor]] = []
    by_storage: dict[
        int, list[tuple[Any, Tensor]]
    ] = {}  # the kept aliases, by the memory they are on
    for a, e in edges.aliases.values():
        by_storage.setdefault(_storage(a), []).append((e, a))
    kernels: dict[
        int, dict[str, FacetSite]
    ] = {}  # fused attention op -> its rebuilt scores / pattern sites
    frozen = {  # the memory of the frozen parameters, which no graph reaches (`_FROZEN_ONLY`)
        _storage(p)
        for m in modules.values()
        for p in m._parameters.values()
        if p is not None and not p.requires_grad
    }
    derived: list[tuple[str, _derived.Plan]] = []  # ("norm" or "result", its plan)
    kids: dict[int, list[ModuleCall]] = {}  # id(call) -> the calls it made
    for call in calls:
        if call.parent is not None:
            kids.setdefault(id(call.parent), []).append(call)
    for call in calls:
        if call.facets is None:
            continue
        planned = _derived_plans(call, kids, edges, ops, modules, io, derived, found, wanted)
        for site in call.facets._sites.values():
            if id(site) in planned:
                continue
            t = site._value
            if (
                site.kind == "reconstructed"
                and site.name in ("scores", "pattern")
                and site.op is not None
                and ops[site.op].name in _ops.FUSED_ATTENTION_OPS
                and site.saved
            ):
                kernels.setdefault(site.op, {})[site.name] = site
                continue
            if site.kind != "real":
                found[id(site)] = _DERIVED.format(kind=site.kind)
                continue
            if not isinstance(t, Tensor):
                continue  # not kept: its gradient is not kept either
            base = _base_of(site, t, edges, ops, by_storage, frozen)
            if isinstance(base, str):
                found[id(site)] = base
                continue
            edge, h = base
            wanted.setdefault(id(h), (edge, h))
            plans.append((site, id(h), h, t))
    kernel_plans = []
    for i, sites in kernels.items():
        plan = _kernel_plan(i, ops[i], edges)
        if isinstance(plan, str):
            for site in sites.values():
                found[id(site)] = plan
            continue
        for edge, h in plan[1:4]:
            wanted.setdefault(id(h), (edge, h))
        kernel_plans.append((i, sites, plan))
    if not wanted:
        return found
    keys = list(wanted)
    try:
        gs = torch.autograd.grad(
            loss, [wanted[k][0] for k in keys], retain_graph=True, allow_unused=True
        )
    except RuntimeError as exc:
        raise GradientError(
            f"the backward of the loss failed: {exc}. TorchLens runs one torch.autograd.grad of the loss with "
            "respect to the kept sites; the same error would come from loss.backward() on this forward."
        ) from exc
    grads = dict(zip(keys, gs))
    for site, key, h, t in plans:
        g = grads[key]
        unused = g is None
        if unused:
            g = torch.zeros_like(h)
        copies = site._copies
        mapped = _sum_copies(g, h, t, copies) if copies else _view_like(g, h, t)
        if mapped is None:
            found[id(site)] = (
                "its tensor is not laid out as a view of the tensor the model used, so which "
                "element's gradient is which cannot be told"
            )
            continue
        found[id(site)] = (mapped, unused, copies)
    for i, sites, plan in kernel_plans:
        bound, (_, z), (_, q), (_, v) = plan
        got = [grads[id(x)] for x in (z, q, v)]
        dz, dq, dv = [torch.zeros_like(x) if g is None else g for g, x in zip(got, (z, q, v))]
        kernel = _kernel_grads(sites, ops[i], bound, z, dz, dq, dv)
        for name, site in sites.items():
            found[id(site)] = kernel if isinstance(kernel, str) else (kernel, name)
    for what, dplan in derived:
        g_out = grads[id(dplan.grad_of[1])]
        if what == "norm":
            out = _derived.norm_grads(dplan, g_out)
        else:
            assert dplan.z is not None
            out = _derived.result_grads(dplan, g_out, found.get(id(dplan.z)))
        for name, site in dplan.sites.items():
            found[id(site)] = out if isinstance(out, str) else (out, name)
    return found


def _derived_plans(
    call: ModuleCall,
    kids: dict[int, list[ModuleCall]],
    edges: Edges,
    ops: list[OpRecord],
    modules: dict[str, nn.Module],
    io: dict[int, tuple[Any, Any]],
    derived: list[tuple[str, _derived.Plan]],
    found: dict[int, Any],
    wanted: dict[int, tuple[Any, Tensor]],
) -> set[int]:
    """Plan the derived gradients of one call (a norm's statistics, attention's per-head
    `result`): each plan goes to `derived` and the edge it needs to `wanted`; a site that cannot
    be planned gets its reason in `found`. Returns the ids of the sites dealt with."""
    assert call.facets is not None
    sites = call.facets._sites
    plans: list[tuple[str, Any, dict[str, FacetSite]]] = []
    done: set[int] = set()  # a derivable site not kept: its gradient is not kept either
    if call.role == "norm":
        norm = {
            n: s for n, s in sites.items() if n in _derived.NORM_DERIVED and s.kind == "computed"
        }
        done.update(id(s) for s in norm.values())
        norm = {n: s for n, s in norm.items() if s.saved}
        if norm:
            module = modules.get(call.address)
            plan = _derived.norm_plan(call, norm, edges, ops, module, io.get(id(call)))
            plans.append(("norm", plan, norm))
    result = sites.get("result")
    if call.role == "attention" and result is not None and result.kind == "computed":
        done.add(id(result))
    if (
        call.role == "attention"
        and result is not None
        and result.kind == "computed"
        and result.saved
    ):
        refused = call.facets.refused.get("z")
        plan = (
            f"the check needs autograd's gradient at z, whose value is not served ({refused})"
            if refused is not None
            else _derived.result_plan(
                call, result, sites.get("z"), kids.get(id(call), []), edges, modules, io
            )
        )
        plans.append(("result", plan, {"result": result}))
    for what, plan, planned in plans:
        done.update(id(s) for s in planned.values())
        if isinstance(plan, str):
            for s in planned.values():
                found[id(s)] = plan
            continue
        edge, h = plan.grad_of
        wanted.setdefault(id(h), (edge, h))
        derived.append((what, plan))
    return done


def _kernel_plan(i: int, op: OpRecord, edges: Edges) -> Any:
    """For a fused attention op: (its bound arguments, then (edge, tensor) of its output, its
    query and its value as the kernel read them), or why its scores and pattern get no gradient."""
    out = edges.ops.get((i, 0))
    if op.extra is None or out is None:
        return "the fused kernel's output or arguments were not kept with their gradient edges"
    bound = sdpa_bound(op.extra["args"], op.extra["kwargs"])
    q, v = bound.get("query"), bound.get("value")
    eq, ev = edges.arg(i, q), edges.arg(i, v)
    if eq is None or ev is None:
        return (
            "the kernel's query or value does not require grad, so the relation that checks the derived "
            "gradient cannot be formed"
        )
    return bound, out, (eq, q), (ev, v)


def _kernel_grads(
    sites: dict[str, FacetSite],
    op: OpRecord,
    bound: dict,
    out: Tensor,
    dz: Tensor,
    dq: Tensor,
    dv: Tensor,
) -> _derived.Deferred | str:
    """d loss / d the rebuilt pattern and scores of one fused kernel (`op`, its arguments `bound`,
    its output `out`): dP = dZ Vᵀ per head (z = P V) and dS = P ⊙ (dP - rowsum(dP ⊙ P))
    (P = softmax(S)), served when autograd's own gradients at the kernel's value and query agree:
    Pᵀ dZ (summed over a GQA group) = d loss / d v and scale · dS K = d loss / d q. Derived and
    checked on first read, from the kernel's kept arguments and output (P rebuilt from them as the
    pattern's value is, and checked the same way), so a later write into the served pattern cannot
    change it; or why not."""
    pattern = sites.get("pattern")
    if pattern is None:
        return "the derivation needs the pattern, which save= did not keep beside the scores"
    assert op.extra is not None  # `_kernel_plan` refuses a kernel without its kept arguments
    inputs: list = []
    args, kwargs = _pack(op.extra["args"], op.extra["kwargs"], inputs)
    # the kernel's output, which the rebuild is checked against: the one the pattern's own
    # rebuild reads while that is pending, else the one the gradient edge was kept for
    value_inputs = pattern._inputs
    inputs.append(value_inputs[-1] if value_inputs else out.detach())
    n = len(inputs)
    inputs += [dz, dq, dv]
    p_shape = tuple(pattern.shape)
    shapes = {name: (site.dtype, site.shape) for name, site in sites.items()}
    scale_arg = bound.get("scale")

    def run(inputs: list) -> tuple:
        if pattern._refusal is not None:  # its value's own check ran and failed
            return {}, None, "the pattern, which the derivation needs, is not served"
        a, kw = _unpack(args, kwargs, inputs)
        try:
            _, p, err, tol = rebuild_attention(a, kw, inputs[n - 1])
        except ValueError:
            err, tol = float("nan"), 0.0
        if not err <= tol:  # the pattern's value is refused by this very check
            return {}, None, "the pattern, which the derivation needs, is not served"
        p = p.reshape(p_shape)
        dz, dq, dv = inputs[n:]
        b = sdpa_bound(a, kw)
        q, k, v = b["query"], b["key"], b["value"]
        if p.shape[:-2] != q.shape[:-2] or p.shape[-2] != q.shape[-2] or p.shape[-1] != k.shape[-2]:
            return (
                {},
                None,
                "the kernel ran in a packed layout (GQA decode), for which the derivation is not served",
            )
        w = torch.float64 if dz.dtype == torch.float64 else torch.float32
        heads, kv = q.shape[-3], v.shape[-3]
        if heads % kv:
            return {}, None, f"{heads} query heads do not group over {kv} value heads"
        rep = heads // kv
        P, dZ = p.to(w), dz.to(w)
        V, K = v.to(w).repeat_interleave(rep, dim=-3), k.to(w).repeat_interleave(rep, dim=-3)
        dP = dZ @ V.transpose(-1, -2)
        dS = P * (dP - (dP * P).sum(-1, keepdim=True))
        dV_pred = P.transpose(-1, -2) @ dZ
        dV_pred = dV_pred.unflatten(-3, (kv, rep)).sum(-3)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale_arg is None else float(scale_arg)
        dQ_pred = scale * (dS @ K)
        tol_rel = _ops.reconstruction_tolerance(dz.dtype)
        errs = []
        for name, pred, real in (("value", dV_pred, dv), ("query", dQ_pred, dq)):
            real = real.to(w)
            e = float((pred - real).abs().max()) if real.numel() else 0.0
            t = tol_rel * max(float(real.abs().max()) if real.numel() else 0.0, 1e-30)
            if not e <= t:
                return (
                    {},
                    None,
                    f"derived as dZ·Vᵀ per head, but autograd's gradient at the kernel's {name} differs "
                    f"from the one the derivation implies by {e:.3g} (> {t:.3g}), so it is not served",
                )
            errs.append(e)
        values = {"pattern": dP, "scores": dS}
        return (
            {
                name: values[name].to(dtype).reshape(shape)
                for name, (dtype, shape) in shapes.items()
            },
            max(errs),
            None,
        )

    check = (
        "; checked: autograd's gradients at the kernel's value (Pᵀ·dZ) and query (scale·dS·K) agree"
    )
    how = {
        "pattern": "derived: dZ·Vᵀ per head",
        "scores": "derived: the softmax's VJP of dZ·Vᵀ",
    }
    return _derived.Deferred(run, inputs, {name: how[name] + check for name in sites})


def _base_of(
    site: FacetSite,
    t: Tensor,
    edges: Edges,
    ops: list[OpRecord],
    by_storage: dict[int, list[tuple[Any, Tensor]]],
    frozen: set[int],
) -> Any:
    """The (edge, tensor) the site's tensor `t` is, or is a view of, or why there is none
    (`frozen`: the memory of the model's frozen parameters)."""
    candidates: list[tuple[Any, Tensor]] = []
    if site.op is not None:
        for slot in range(len(ops[site.op].shapes)):
            entry = edges.ops.get((site.op, slot))
            if entry is not None:
                candidates.append(entry)
    edge = edges.alias(t)
    if edge is not None:
        candidates.insert(0, (edge, t))
    key = _storage(t)
    candidates += by_storage.get(key, [])
    for edge, h in candidates:
        if h is t:
            return edge, h
    for edge, h in candidates:
        if h.dtype == t.dtype and _storage(h) == key and _within(h, t):
            return edge, h
    if not t.dtype.is_floating_point and not t.dtype.is_complex:
        return f"its tensor is {t.dtype}, which has no gradient"
    if not candidates:
        if _from_parameters(site, t, ops, frozen):
            return _FROZEN_ONLY
        if site.op is not None and site.op in edges.off:
            return (
                "its tensor was computed where autograd was off in the model's own forward (inside "
                "a custom autograd.Function's forward, or under the model's torch.no_grad()), so "
                "autograd keeps no gradient at it; the gradients at the tensors around that region "
                "are served"
            )
        return NO_GRAD_PATH
    return (
        "its tensor is not the tensor the model used there nor a view of it (a copy rearranged from it), so "
        "which element's gradient is which cannot be told"
    )


#: Why a site's gradient is refused where nothing on its tensor's path requires grad.
NO_GRAD_PATH = (
    "its tensor does not require grad: nothing it is computed from requires grad (no input that "
    "requires grad, and no parameter together with the input, on its path)"
)


def _from_parameters(site: FacetSite, t: Tensor, ops: list[OpRecord], frozen: set[int]) -> bool:
    """Whether the site's tensor is a frozen parameter (or a view of one), or the output of an op
    computed from frozen parameters alone: a tensor `grads=` puts on no autograd graph, where the
    parameters themselves would require grad (`_capture.op_recorder.OpRecorder._grad_leaves`)."""
    if _storage(t) in frozen:
        return True
    if site.op is None:
        return False
    seen: dict[int, bool] = {}

    def only_params(i: int) -> bool:
        if i not in seen:
            seen[i] = False  # a cycle cannot occur; this only stops a repeated walk
            refs = ops[i].inputs
            seen[i] = bool(refs) and all(
                isinstance(r, str) or (isinstance(r, Ref) and only_params(r.op)) for r in refs
            )
        return seen[i]

    return only_params(site.op)


def _storage(t: Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return -1


def _within(h: Tensor, t: Tensor) -> bool:
    """Whether every element of `t` is an element of `h` (same storage assumed)."""
    return _index_map(h, t) is not None


def _index_map(h: Tensor, t: Tensor) -> Tensor | None:
    """For each element of `t` (a view into `h`'s memory), the flat index of that element in `h`;
    None when an element of `t` is not one of `h`'s, or `h` overlaps itself."""
    if t.numel() == 0:
        return torch.zeros(t.shape, dtype=torch.long)
    lo = h.storage_offset()
    rel = t.storage_offset() - lo
    h_end = sum((n - 1) * s for n, s in zip(h.shape, h.stride())) + 1 if h.numel() else 0
    t_end = rel + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    if rel < 0 or t_end > h_end or any(s < 0 for s in t.stride()):
        return None
    where = torch.full((h_end,), -1, dtype=torch.long)
    where.as_strided(h.shape, h.stride(), 0).copy_(torch.arange(h.numel()).view(h.shape))
    if h.numel() and int((where >= 0).sum()) != h.numel():
        return None  # h overlaps itself (an expanded tensor): an element is several of h's
    idx = where.as_strided(t.shape, t.stride(), rel)
    if bool((idx < 0).any()):
        return None
    return idx


def _sum_copies(g: Tensor, h: Tensor, t: Tensor, copies: int) -> Tensor | None:
    """The gradient of a site holding the first of each `copies` consecutive heads of `h` (`[b,
    heads, t, d]`, a key the model broadcast to its group's query heads before RoPE), token-major
    as the site is: the sum of `g` (d loss / d `h`) over each group's copies, d loss / d the
    group's tensor the copies were made from. None unless `t` is that selection."""
    if h.dim() != 4 or h.shape[1] % copies:
        return None
    if tuple(t.shape) != (h.shape[0], h.shape[2], h.shape[1] // copies, h.shape[3]):
        return None
    return g.unflatten(1, (h.shape[1] // copies, copies)).sum(2).transpose(1, 2)


def _view_like(g: Tensor, h: Tensor, t: Tensor) -> Tensor | None:
    """The gradient of `t` from the gradient `g` of `h`, where `t`'s elements are elements of `h`."""
    if t is h or (
        t.shape == h.shape and t.stride() == h.stride() and t.storage_offset() == h.storage_offset()
    ):
        return g
    if h.is_contiguous():
        rel = t.storage_offset() - h.storage_offset()
        flat = g.contiguous().view(-1)
        t_end = rel + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
        if rel >= 0 and t_end <= flat.numel() and all(s >= 0 for s in t.stride()):
            return flat.as_strided(t.shape, t.stride(), flat.storage_offset() + rel)
        return None
    idx = _index_map(h, t)
    if idx is None:
        return None
    return g.reshape(-1)[idx.to(g.device).reshape(-1)].reshape(t.shape)


def grad_maps(calls: list[ModuleCall], found: dict[int, Any], loss: str) -> None:
    """Give each call its `GradMap`: the same keys as its facets, refusals and unsaved alike; a
    derived gradient's site is pending (`_core.pending.Pending`), its derivation run on first
    read."""
    for call in calls:
        facets = call.facets
        if facets is None:
            continue
        sites: dict[str, FacetSite] = {}
        for name, reason in facets.refused.items():
            sites[name] = FacetSite(
                name, "refused", (), torch.float32, note=f"its value is not served ({reason})"
            )
        deferred: dict[int, tuple[_derived.Deferred, list[FacetSite]]] = {}
        for name, s in facets._sites.items():
            got = found.get(id(s))
            if isinstance(got, str):
                sites[name] = FacetSite(name, "refused", s.shape, s.dtype, note=got)
            elif got is None:  # not kept
                sites[name] = FacetSite(
                    name, "real", s.shape, s.dtype, None, s.op, None, "not kept"
                )
            elif isinstance(got[0], _derived.Deferred):  # derived: checked on first read
                how, key = got
                site = FacetSite(
                    name, "computed", s.shape, s.dtype, None, s.op, None, how.notes[key]
                )
                deferred.setdefault(id(how), (how, []))[1].append(site)
                sites[name] = site
            else:
                g, unused, copies = got
                note = (
                    "zeros: the loss does not depend on this tensor (not on any path to it)"
                    if unused
                    else "autograd's gradient at the tensor the model used"
                    if not copies
                    else f"the sum of autograd's gradients at the {copies} copies of each head the "
                    "model read (it broadcast the tensor to its group's query heads before this site)"
                )
                sites[name] = FacetSite(name, "real", s.shape, s.dtype, g, s.op, None, note)
        for how, group in deferred.values():
            Pending(how.fn, how.inputs, group)  # before the map, which becomes its owner
        gm = GradMap(call.address, call.role, sites, ran=facets.ran)
        gm.loss = loss
        gm._values = facets
        call.grads = gm
