"""Turning a finished `Recorder` into the `Trace` that `torchlens.trace` returns.

The steps, in order (`assemble`):

1. `check_compiled`: refuse a trace with a hole where compiled code ran unseen.
2. `drop_overwritten`: a saved op output that a write the mode could not see changed is dropped,
   with a warning, so no value the model did not produce there is served; a facet on it is
   refused, saying so (`OVERWRITTEN`).
3. the structure (`_analysis.structure.find`: stacks, layers, final norm, unembedding; settles roles).
4. the facets of every call (`_analysis.facets.derive`).
5. `CapturePlan.trim` (`torchlens._analysis.selection`): what `save=` does not keep is dropped.
6. `module_records`: each call's `FacetMap`; the `ModuleMap`, whose `ModuleRecord`s (one per
   canonical address, its calls) are made when it is first read.
7. `CapturePlan.check_kept`: a selection that kept nothing in this forward raises; so does, in a
   trace, one naming a facet no module of the forward has (`check_each_named`).

`note_edited_refusals` words the refusal of a site an edit broke, on an edited trace.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from torchlens._analysis.facets import derive
from torchlens._analysis.grads import NO_GRAD_PATH
from torchlens._analysis.graph import Graph
from torchlens._analysis.role_rules import Roles
from torchlens._analysis.selection import CapturePlan
from torchlens._analysis.structure import find as find_structure
from torchlens._capture.compiled import check_compiled
from torchlens._capture.recorder import Recorder
from torchlens._core.records import ModuleMap, Ref
from torchlens._core.sites import FacetMap
from torchlens._trace import Trace

__all__ = ["assemble", "note_cut_gradients", "note_edited_refusals"]


def assemble(
    rec: Recorder,
    model: nn.Module,
    names: dict[nn.Module, str],
    aliases: dict[str, str],
    roles: Roles,
    plan: CapturePlan,
    output: Any,
    overwritten: list[int],
) -> Trace:
    """The `Trace` of the forward `rec` recorded.

    Args:
        rec: the recorder, after the forward.
        model: the traced model.
        names: module -> canonical address.
        aliases: other addresses of shared modules -> canonical address.
        roles: address -> role before the forward; `find` settles it in place.
        plan: the `CapturePlan` the capture ran with.
        output: the model's return value.
        overwritten: indices of ops whose saved output a write the mode could not see changed
            (`Recorder.check_versions`).

    Raises:
        CaptureError: a compiled module ran without a recorded op.
        SaveSpecError: a `save=` selection kept nothing in this forward.
    """
    modules = {addr: m for m, addr in names.items()}
    check_compiled(rec, modules)
    drop_overwritten(rec, overwritten)
    with torch.no_grad():
        flow = Graph(rec.ops, rec.calls, modules)  # one data-flow graph for both steps
        for i in overwritten:  # a facet on a dropped output is refused, saying why
            for slot in range(len(rec.ops[i].shapes)):
                flow.dropped[Ref(i, slot)] = OVERWRITTEN
        structure = find_structure(rec.ops, rec.calls, modules, roles, model, names, flow)
        sites = derive(rec.ops, rec.calls, modules, None, structure, flow)
    plan.trim(rec.ops, rec.calls, sites)
    modules_map = module_records(names, aliases, roles, rec.calls, sites)
    plan.check_kept(rec.calls)
    if rec.deferred is None:  # a trace, not a generation's step (`check_each_named`)
        plan.check_each_named(rec.calls)
    blocks = [layer.call.address for layer in structure.layers]
    return Trace(
        rec.ops,
        modules_map,
        output,
        blocks,
        type(model).__name__,
        plan.spec,
        structure,
    )


#: Why a facet on an op output `drop_overwritten` dropped is refused.
OVERWRITTEN = (
    "the op's output was written in place after it ran by code the capture could not see (under "
    "torch._C.DisableTorchFunction(), in C++ code) or as a sparse tensor, so the value it returned "
    "is gone and TorchLens does not serve the later contents (it warned when the trace ran); saving "
    "more cannot bring it back"
)


def drop_overwritten(rec: Recorder, overwritten: list[int]) -> None:
    """Warn about, and drop, saved op outputs a write the mode could not see changed."""
    if not overwritten:
        return
    labels = ", ".join(f"#{i} {rec.ops[i].name}" for i in overwritten[:5])
    warnings.warn(
        f"torchlens: {len(overwritten)} saved op outputs were written in place by code the capture "
        f"could not see, or as a sparse tensor, which it cannot copy before a write ({labels}); they "
        "are not kept, since they would show the later contents (where the forward used the tensor "
        "again, it is kept as it was then, as a written_in_place op).",
        stacklevel=4,
    )
    for i in overwritten:  # a value the model did not produce there is never served
        rec.ops[i].tensors = (None,) * len(rec.ops[i].tensors)


def module_records(
    names: dict[nn.Module, str],
    aliases: dict[str, str],
    roles: dict[str, str],
    calls: list,
    sites: list[dict],
) -> ModuleMap:
    """The trace's `ModuleMap`: each call gets its `FacetMap` and the aliases the hooks kept during
    capture are released, now; the `ModuleRecord`s, one per canonical address holding its calls,
    are made on the map's first read (`ModuleMap._deferred`)."""
    for call, call_sites in zip(calls, sites):
        call.facets = FacetMap(call.address, call.role, call_sites)
        call._in = call._out = None
    layout = tuple([(addr, type(m).__name__, roles[addr]) for m, addr in names.items()])
    return ModuleMap._deferred(layout, aliases, calls)


def note_cut_gradients(result: Trace) -> None:
    """A gradient refused because nothing on its tensor's path requires grad, where an edit of
    this trace lies on that path, says which edit: an edit that puts a tensor without autograd
    history in the forward (a constant, `torch.zeros_like(x)`) cuts autograd's path there, so
    the edited site and everything computed from it alone have no gradient."""
    cut: dict[int, Any] = {}  # op index -> the key of the edit on its path
    for r in result.edits:
        calls = result.modules[r.module_address].calls
        for c in r.calls:
            facets = calls[c].facets if c < len(calls) else None
            site = facets._sites.get(r.facet) if facets is not None else None
            if site is not None and site.op is not None:
                cut.setdefault(site.op, r.key)
    if not cut:
        return
    for op in result.ops[min(cut) :]:
        if op.index not in cut:
            key = next((cut[i.op] for i in op.inputs if type(i) is Ref and i.op in cut), None)
            if key is not None:
                cut[op.index] = key
    for rec in result.modules.values():
        for call in rec.calls:
            grads, facets = getattr(call, "grads", None), call.facets
            if grads is None or facets is None:
                continue
            for name, reason in list(grads.refused.items()):
                site = facets._sites.get(name)
                if reason == NO_GRAD_PATH and site is not None and site.op in cut:
                    grads.explain_refusal(
                        name,
                        f" (this trace's edit={{{cut[site.op]!r}: ...}} lies on its path: an edit whose "
                        "tensor does not require grad, a constant or a function's result made without "
                        "autograd such as torch.zeros_like(x), cuts autograd's path there)",
                    )


def note_edited_refusals(result: Trace) -> None:
    """An edited site whose check the edit broke (editing z breaks pattern @ v = z) is refused;
    its reason says that the edit is why (also when the check is pending and refuses it later)."""
    for r in result.edits:
        calls = result.modules[r.module_address].calls
        for c in r.calls:
            if (
                c < len(calls) and calls[c].facets is not None
            ):  # now, or when a pending check refuses it
                calls[c].facets.explain_refusal(
                    r.facet,
                    f" (this trace edited it, edit={{{r.key!r}: ...}}, which breaks that relation)",
                )
