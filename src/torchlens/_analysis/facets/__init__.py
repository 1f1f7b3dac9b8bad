"""Facets: the named tensors of a module call, found from the recorded data flow.

A facet is found by following which op consumed which tensor inside a module call, never by
reading a tensor's name in the model's source. The module's *role* (from
`torchlens._analysis.structure`) says which facets to look for:

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
(`torchlens._core.pending.Pending`) over the tensors it needs, captured here. It runs, and its facets
are served or refused, on the first read of any of them (see `FacetSite`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchlens._analysis.facets.attention import attention_facets
from torchlens._analysis.facets.block import block_facets
from torchlens._analysis.facets.common import io_ref, make_site
from torchlens._analysis.facets.mlp import mlp_facets
from torchlens._analysis.facets.norm import norm_facets
from torchlens._analysis.graph import Graph
from torchlens._core import ops as _ops
from torchlens._core.facet_spec import EVERY_MODULE, SPECS, FacetSpecError
from torchlens._core.records import ModuleCall, OpRecord, Ref
from torchlens._core.sites import FacetSite

# -- the whole trace ---------------------------------------------------------------------------


_IO_SITES = (("input", "in", "module input"), ("output", "out", "module output"))


def derive(
    ops: list[OpRecord],
    calls: list[ModuleCall],
    modules: dict[str, nn.Module],
    keep: Callable[[str, str], bool] | None,
    structure: Any = None,
    graph: Graph | None = None,
) -> list[dict[str, FacetSite]]:
    """The facet sites of every call, in the order of `calls`; tensors dropped where `keep` says no.

    Nothing is computed here beyond cheap views: derived facets and the expensive checks are left
    pending on their sites, each holding the tensors it will compute from (`FacetSite._inputs`).
    `graph` is the `Graph` of `ops`, `calls` and `modules` when the caller has built it.
    """
    g = graph if graph is not None else Graph(ops, calls, modules)
    out: list[dict[str, FacetSite]] = []
    side: dict[int, dict[str, FacetSite]] = {}  # call id -> facets a block found for its sublayer
    no_kids: list[ModuleCall] = []  # read only, as every rule reads a call's kids
    for call in calls:
        kids = g.kids.get(id(call), no_kids)
        sites: dict[str, FacetSite] = {}
        for name, which, note in _IO_SITES:
            s = make_site(g, name, io_ref(g, call, which), "real", note)
            if s:
                sites[name] = s
        role = call.role
        if role == "block":
            sites.update(block_facets(g, call, kids, side))
        else:
            finder = FINDERS.get(role)
            if finder is not None:
                sites.update(finder(g, call, kids, calls, structure))
        out.append(sites)
    for call, sites in zip(calls, out):
        found = side.get(id(call))
        if found:
            sites.update(found)
        if keep is not None:
            for name, s in sites.items():
                if s.saved and not keep(call.address, name):
                    s.tensor = None
    return out


def _logits_site(g: Graph, root: ModuleCall, unembed: ModuleCall) -> FacetSite | None:
    """The model's logits: the root output when it is computed from the unembedding output
    with the same shape by elementwise ops only (a final softcap, a cast: `LOGIT_MAP_OPS`), else
    the unembedding output itself (so `log_softmax(lm_head(h))` gives `lm_head`'s output)."""
    u_ref, r_ref = io_ref(g, unembed, "out"), io_ref(g, root, "out")
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
            return make_site(
                g,
                "logits",
                r_ref,
                note="model output, computed elementwise from the unembedding output",
            )
    return make_site(g, "logits", u_ref, note="unembedding output")


def _root_facets(
    g: Graph, root: ModuleCall, calls: list[ModuleCall], structure: Any
) -> dict[str, FacetSite]:
    """`logits` (from the unembedding) and `final_norm_input` (from `_analysis.structure`'s one final-norm rule)."""
    sites = {}
    unembed = (
        structure.unembed
        if structure is not None
        else next((c for c in calls if c.role == "unembed"), None)
    )
    norm = structure.final_norm if structure is not None else None
    # a root facet read from a module that ran several times (once per decoding step) would be one
    # of its calls without saying which: none is served (the module's calls are)
    ran: dict[str, int] = {}
    for c in calls:
        ran[c.address] = ran.get(c.address, 0) + 1
    unembed = unembed if unembed is not None and ran[unembed.address] == 1 else None
    norm = norm if norm is not None and ran[norm.address] == 1 else None
    if unembed is not None:
        s = _logits_site(g, root, unembed)
        if s:
            sites["logits"] = s
    if norm is not None:
        s = make_site(g, "final_norm_input", io_ref(g, norm, "in"), note="input of the final norm")
        if s:
            sites["final_norm_input"] = s
    return sites


def _embedding_facets(g: Graph, call: ModuleCall) -> dict[str, FacetSite]:
    """`indices` (the indices the embedding looked up) and `lookup` (its embedding op's output).

    `indices` is the index tensor of the module's `embedding` op, not the module's first
    argument: a learned position embedding that makes its positions itself (MBart's, BioGPT's:
    `arange(T) + offset`) is called with something else first (the embeddings, "just for the
    shape", or the attention mask). Where the lookup read a model input, that input is the
    module's (the call's `input`), served when it is that tensor's shape. Only an integer tensor
    is served; otherwise `indices` is refused, with what the module was given.
    """
    lookup = next((op for op in g.ops[call.first_op : call.end_op] if op.name == "embedding"), None)
    x_ref = io_ref(g, call, "in")
    if lookup is None:
        if g.meta(x_ref) is None:  # no tensor input (the call's `input` site is missing too)
            return {}
        ref, note = x_ref, "the module's input (it ran no embedding op)"
    else:
        ref, note = (
            (lookup.inputs[0] if lookup.inputs else None),
            "the index tensor of the embedding op",
        )
        if type(ref) is Ref and ref == call.input_ref:  # the module's input: the hook's tensor
            ref = x_ref  # (its alias where capture kept no op output outside the module)
        if (
            ref is None
        ):  # a tensor from outside the forward: the module's own input, if it is that tensor
            xm = g.meta(x_ref)
            ref = x_ref if xm is not None and tuple(xm[0]) == tuple(lookup.shape[:-1]) else None
            note = "the index tensor of the embedding op (the module's input)"
    sites: dict[str, FacetSite] = {}
    m = g.meta(ref)
    if m is not None and not m[1].is_floating_point and not m[1].is_complex and m[1] != torch.bool:
        site = make_site(g, "indices", ref, note=note)
        if site is not None:
            sites["indices"] = site
    elif (xm := g.meta(x_ref)) is not None:
        sites["indices"] = FacetSite(
            "indices",
            "refused",
            xm[0],
            xm[1],
            note=(
                f"the indices the lookup read were not found as an integer tensor (the module was given a "
                f"{str(xm[1]).replace('torch.', '')} tensor first, which is not what it looked up)"
            ),
        )
    if lookup is not None:
        sites["lookup"] = make_site(
            g, "lookup", Ref(lookup.index, 0), note="the embedding lookup op"
        )
    return sites


#: role -> the rule that finds that role's facets in one call, `(graph, call, its child calls, every
#: call, the structure)`. Every role a facet row of `_core.facet_spec.SPECS` names has one (checked
#: below), and no other role has facets beyond `input` and `output`.
FINDERS: dict[str, Callable[..., dict[str, FacetSite]]] = {
    "block": lambda g, call, kids, calls, structure: block_facets(g, call, kids),
    "attention": lambda g, call, kids, calls, structure: attention_facets(g, call, kids),
    "mlp": lambda g, call, kids, calls, structure: mlp_facets(g, call, kids),
    "norm": lambda g, call, kids, calls, structure: norm_facets(g, call),
    "embedding": lambda g, call, kids, calls, structure: _embedding_facets(g, call),
    "root": lambda g, call, kids, calls, structure: _root_facets(g, call, calls, structure),
}
_SPEC_ROLES = {r for f in SPECS for r in f.roles if r != EVERY_MODULE}
if _SPEC_ROLES != set(FINDERS):
    raise FacetSpecError(
        f"the facet rows name roles {sorted(_SPEC_ROLES)} and facet rules exist for "
        f"{sorted(FINDERS)}: every role with facets needs one rule"
    )
