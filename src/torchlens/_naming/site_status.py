"""The status of one row's site on a trace: the module call and facet a row names at a layer, and
whether the trace holds that tensor (`real`, `reconstructed_read_only`, `needs_capture`,
`refused`, `ambiguous`, `structurally_absent`), with the reason and the remedy."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from torchlens._core.facet_spec import KERNEL_REBUILT, absent_reason
from torchlens._naming.layer_index import n_layers
from torchlens._naming.results import AliasResolution
from torchlens._naming.tables import Row, Table
from torchlens._naming.targets import find_call

if TYPE_CHECKING:
    from torchlens._trace import Trace


def resolve_row(
    trace: Trace,
    table: Table,
    row: Row,
    layer: int | None,
    query: str,
    address: str | None = None,
    force: bool = True,
) -> AliasResolution:
    """The resolution of one row at `layer`. With `force`, the site's pending check runs first
    (so the status is final); without, nothing is computed and a pending site says so. Where the
    row's site is structurally absent and the row has an `or_else`, that site is read instead (and
    where it is absent too, both reasons are given)."""
    first = _status_of_site(trace, table, row, layer, query, address, force)
    if first.status != "structurally_absent" or row.or_else is None or address is not None:
        return first
    target, facet = row.or_else
    other = _status_of_site(
        trace,
        table,
        replace(row, target=target, facet=facet, or_else=None),
        layer,
        query,
        None,
        force,
    )
    if other.status != "structurally_absent":
        return other
    # Both absent: the row's own reason, and the general site's (often why both are absent)
    why = f"{first.reason.rstrip('. ')}; and its other site is absent too: {other.reason}"
    return replace(first, reason=why)


def _status_of_site(
    trace: Trace,
    table: Table,
    row: Row,
    layer: int | None,
    query: str,
    address: str | None = None,
    force: bool = True,
) -> AliasResolution:
    call = None

    def res(status, addr, facet, reason, remedy="", shape=None, checked=True):
        return AliasResolution(
            query,
            table.generation,
            status,
            addr,
            facet,
            layer,
            reason,
            remedy,
            row.name,
            row.meaning,
            row.note,
            shape,
            call.index if call is not None and len(trace.modules[call.address].calls) > 1 else None,
            trace,
            checked,
        )

    structure = trace.structure
    if (
        table.decoder_only
        and structure is not None
        and structure.kind not in ("decoder-only", "no-stack")
    ):
        return res(
            "structurally_absent",
            None,
            row.facets[0] if row.facets else None,
            f"{table.title.split(' ')[0]} names sites of decoder-only language models; this model is "
            f"{structure.kind} ({structure.describe()})",
            "use a TransformerLens generation, or read trace.modules[address].facets directly",
        )
    if row.facet is None:
        return res(
            "structurally_absent", None, None, f"TorchLens has no site for it: {row.note}", ""
        )
    if (
        row.per_layer
        and row.stack is None
        and structure is not None
        and structure.lm_stack is None
        and len(structure.stacks) > 1
    ):
        return res(
            "ambiguous",
            None,
            row.facets[0],
            f"this model has {len(structure.stacks)} stacks of layers ({structure.describe()}) and none feeds a "
            f"language-model head, so a layer index could name a layer of any of them",
            "read trace.structure.stacks[name].layers[i] for the stack you mean",
        )
    if address is None:
        if row.per_layer and layer is None:
            if n_layers(trace, row) == 0:
                return res(
                    "structurally_absent",
                    None,
                    row.facets[0],
                    "TorchLens found no stack of layers in this model, so no per-layer name has a site",
                    "name the blocks: trace(model, ..., roles={'<holder address>.*': 'block'})",
                )
            return res("structurally_absent", None, row.facets[0], "per-layer name without a layer")
        assert row.target is not None  # a row with a facet names its target (`Row`)
        call, why = find_call(trace, row.target, layer, row.stack)
        if call is None:
            return res("structurally_absent", None, row.facets[0], f"{why}.")
        address = call.address
    rec = trace.modules[address]
    if call is None:
        if len(rec.calls) != 1:
            if not rec.calls:
                return res(
                    "structurally_absent",
                    address,
                    row.facets[0],
                    f"{address} did not run in this forward.",
                )
            return res(
                "ambiguous",
                address,
                row.facets[0],
                f"{address} ran {len(rec.calls)} times in this forward.",
                f"read trace.modules[{address!r}].calls[i].facets[{row.facets[0]!r}] for the call you mean",
            )
        call = rec.calls[0]
    # The first of the row's facets the call has, served or refused: a refused one is reported
    # as refused, never replaced by a later facet of the row (another tensor).
    facet_map = call.facets
    assert facet_map is not None  # every call of a trace holds its FacetMap (`_assemble`)
    sites, refusals = facet_map.sites, getattr(facet_map, "refused", {})
    facet = next((f for f in row.facets if f in sites or f in refusals), None)
    while (
        force and facet is not None and facet in sites and not sites[facet].checked
    ):  # the status rests on its check: run it
        facet_map.check(facet)
        sites, refusals = facet_map.sites, getattr(facet_map, "refused", {})
        facet = next((f for f in row.facets if f in sites or f in refusals), None)
    refused = refusals.get(facet) if facet is not None and facet not in sites else None
    if refused is not None:  # TorchLens derived it, but its check against the model failed
        # A fused kernel's pattern is a real softmax op under eager attention; nn.MultiheadAttention
        # runs as one op (multi_head_attention_forward) in any capture, so there no capture serves it.
        mha = any(
            op.name == "multi_head_attention_forward"
            for op in trace.ops[call.first_op : call.end_op]
        )
        if facet in KERNEL_REBUILT and not mha:
            return res(
                "needs_capture",
                address,
                facet,
                f"{facet} is not served: {refused}.",
                "trace a copy of the model loaded with attn_implementation='eager'",
            )
        return res(
            "refused",
            address,
            facet,
            f"{facet} is not served: {refused}.",
            _refusal_remedy(refused, address),
        )
    if facet is None:
        rerun = _root_source_rerun(trace, address, row.facets[0])
        if rerun is not None:
            source, n = rerun
            return res(
                "ambiguous",
                address,
                row.facets[0],
                f"{row.facets[0]} is read from {source}, which ran {n} times in this forward (once per "
                f"decoding step), so the root's {row.facets[0]} would be one of {n} calls; none is served as it",
                f"read trace.modules[{source!r}].calls[i] for the call you mean",
            )
        absent = absent_reason(row.facets[0])
        return res(
            "structurally_absent",
            address,
            row.facets[0],
            f"{address} ({rec.class_name}) has no {row.facets[0]!r} facet: {absent}.",
        )
    site = sites[facet]
    if not site.saved:  # (computes nothing: a pending site is saved until its check refuses it)
        if site.kind == "reconstructed" and trace.save_spec.keep(address, facet):
            return res(
                "needs_capture",
                address,
                facet,
                f"{facet} could not be rebuilt: {site.note}.",
                "trace a copy of the model loaded with attn_implementation='eager'",
                site.shape,
            )
        where = address or "<root>"
        pick = f"save=[{facet!r}]" if not address else f"save=[{address!r}] or save=[{facet!r}]"
        return res(
            "needs_capture",
            address,
            facet,
            f"{where}:{facet} exists but save= did not keep it.",
            f"trace again with save='all' or {pick}",
            site.shape,
        )
    if site.kind == "real":
        pending = (
            ""
            if site.checked
            else " Not checked yet: its check runs on first read (or trace.check())."
        )
        return res("real", address, facet, f"{site.note}.{pending}", "", site.shape, site.checked)
    how = (
        "rebuilt from the fused kernel's inputs and checked against its output"
        if site.kind == "reconstructed"
        else "computed from recorded tensors"
    )
    if not site.checked:
        how += " on first read (or trace.check()); not computed or checked yet"
    return res(
        "reconstructed_read_only",
        address,
        facet,
        f"{how}; no op produced this tensor.",
        "to edit it, trace a model with attn_implementation='eager' (real softmax op)"
        if site.kind == "reconstructed"
        else "edit the tensors it is computed from",
        site.shape,
        site.checked,
    )


#: The root's facets read from one module call (`_analysis.facets._root_facets`): facet -> the
#: `Structure` attribute naming that call.
_ROOT_SOURCES = {"logits": "unembed", "final_norm_input": "final_norm"}


def _root_source_rerun(trace: Trace, address: str, facet: str) -> tuple[str, int] | None:
    """(module, calls) where a root facet is absent because the module it is read from ran several times."""
    source = (
        getattr(trace.structure, _ROOT_SOURCES.get(facet, ""), None)
        if address == "" and trace.structure
        else None
    )
    if source is None or source.address not in trace.modules:
        return None
    n = len(trace.modules[source.address].calls)
    return (source.address, n) if n > 1 else None


def _refusal_remedy(reason: str, address: str) -> str:
    """What to read instead of a facet refused for `reason` (a `refused` status's remedy)."""
    if "this trace edited it" in reason:
        return "read it on a trace without that edit; the edit changed what the relation joins"
    if "dropout" in reason:
        return (
            "dropout in training mode drew a mask the relation cannot see; trace the model in eval mode "
            "(model.eval()) if dropout is not what you study"
        )
    where = address or "<root>"
    return (
        f"read the recorded tensors the relation joins (the other facets of {where}: "
        f"trace.modules[{address!r}].facets, or trace.ops)"
    )
