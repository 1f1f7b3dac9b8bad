"""One resolver for every naming generation: `resolve_alias` and `alias_report`."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING

from torchlens._core.errors import close_matches
from torchlens._core.facet_spec import KERNEL_REBUILT, absent_reason
from torchlens._naming import targets
from torchlens._naming.results import (
    AliasError,
    AliasReport,
    AliasResolution,
    LayerOutOfRange,
    MalformedAlias,
    UnknownAlias,
    UnknownGeneration,
)
from torchlens._naming.tables import Row, Table, interp_engine, nnterp, tl2, tl3, tl4

if TYPE_CHECKING:
    from torchlens._trace import Trace

__all__ = ["GENERATIONS", "alias_report", "resolve_alias", "table"]

#: The naming generations, by the key `generation=` takes.
GENERATIONS: dict[str, Table] = {
    t.generation: t for t in (tl2.TABLE, tl3.TABLE, tl4.TABLE, nnterp.TABLE, interp_engine.TABLE)
}

#: What each status means.

# -- parsing -----------------------------------------------------------------------------------

#: Longer digit strings are out of range of any trace, and need not be converted to an int
#: (Python refuses int() on more than 4300 digits).
_MAX_DIGITS = 18


def _canonical_index(text: str) -> str:
    """`text` (an optional '-' and Unicode digits) as it must be written: ASCII, no leading zeros, no '-0'."""
    negative = text.startswith("-")
    digits = "".join(str(int(c)) for c in (text[1:] if negative else text)).lstrip("0") or "0"
    return "-" + digits if negative and digits != "0" else digits


def _index_value(canonical: str) -> int:
    """The int a canonical index names; a huge one is clamped to a value no trace reaches."""
    if len(canonical.lstrip("-")) > _MAX_DIGITS:
        return -(10**_MAX_DIGITS) if canonical.startswith("-") else 10**_MAX_DIGITS
    return int(canonical)


def _layer_value(text: str, table: Table, query: str, trace: Trace, row: Row | None = None) -> int:
    n = _n_layers(trace, row)
    canonical = _canonical_index(text)
    if text != canonical:
        raise MalformedAlias(
            f"{query!r}: write the layer as {canonical} (ASCII digits, no leading zeros)."
        )
    value = _index_value(canonical)
    if value < 0:
        if not table.negative_layers:
            raise MalformedAlias(
                f"{query!r}: {table.generation} layer indices are non-negative (0..{n - 1} in this trace)."
            )
        value += n
    if not 0 <= value < n:
        where = _layers_counted(trace, row)
        raise LayerOutOfRange(
            f"{query!r}: layer {text} is out of range: {where}, so layers are 0..{n - 1}"
            if n
            else f"{query!r}: {where}, so no per-layer name resolves"
        )
    return value


def _layers_counted(trace: Trace, row: Row | None) -> str:
    """What a layer index of `row` counts in `trace`, as it is: the stack it indexes and its
    length, or every stack when none can be chosen, or that there is none."""
    s = trace.structure
    stacks = list(s.stacks.values()) if s is not None else []
    listing = ", ".join(
        f"{st.name or '<root>'} ({len(st.layers)} layer{'s' if len(st.layers) != 1 else ''})"
        for st in stacks
    )
    if row is not None and row.stack is not None:
        stack = targets.stack_of_kind(trace, row.stack)
        if stack is None:
            return f"this trace has no single {row.stack} stack (its stacks: {listing or 'none'})"
        return f"a layer index counts the layers of the {row.stack} stack {stack.name} ({len(stack.layers)})"
    if s is not None and s.lm_stack is not None:
        stack = s.stacks[s.lm_stack]
        return (
            f"a layer index counts the layers of the language-model stack {stack.name or '<root>'}, which ran "
            f"{len(stack.layers)} layer{'s' if len(stack.layers) != 1 else ''}"
        )
    if stacks:
        return (
            f"this trace has {len(stacks)} stacks of layers and none feeds a language-model head: {listing}; "
            f"a layer index counts up to the longest"
        )
    return "TorchLens found no stack of layers in this trace"


def _for_trace(table: Table, trace: Trace) -> Table:
    """The table to read on `trace`: a kind-specific one of `table.by_kind`, else `table` itself."""
    kind = trace.structure.kind if trace.structure is not None else None
    return dict(table.by_kind).get(kind, table) if kind is not None else table


def _patterns(table: Table) -> list[tuple[re.Pattern, Row]]:
    """Each row's pattern (the table's grammar: `Row.pattern`, compiled once per row) with the row."""
    return [(row.pattern, row) for row in table.rows]


def _n_layers(trace: Trace, row: Row | None = None) -> int:
    """How many layers a per-layer name can index: its own stack's (a row with `stack`), the
    language-model stack's, or, with several stacks and none feeding a language-model head, the
    longest (such names then resolve `ambiguous`)."""
    s = trace.structure
    if row is not None and row.stack is not None:
        stack = targets.stack_of_kind(trace, row.stack)
        return len(stack.layers) if stack is not None else 0
    if s is not None and s.lm_stack is None and len(s.stacks) > 1:
        return max(len(st.layers) for st in s.stacks.values())
    return len(trace.blocks)


def _matches(query: str, tables: list[Table], trace: Trace) -> list[tuple[Table, Row, int | None]]:
    found = []
    for table in tables:
        table = _for_trace(table, trace)
        for rx, row in _patterns(table):
            m = rx.match(query)
            if m:
                layer = (
                    _layer_value(m.group(1), table, query, trace, row) if row.per_layer else None
                )
                found.append((table, row, layer))
            elif table.absent_once and row.facet is None and query == row.bare:
                found.append((table, row, None))  # the report's own spelling of a refused point
            elif row.per_layer and query == row.bare and not _n_layers(trace, row):
                found.append(
                    (table, row, None)
                )  # the report's one row for a per-layer name on a trace without layers
    return found


def _interp_engine_special(query: str, trace: Trace) -> AliasResolution | None:
    """`path.<module>` addresses and `.stream-K` coordinates of interp-engine."""
    table = interp_engine.TABLE
    if query.startswith("path."):
        address = query[len("path.") :]
        top = [a for a in trace.modules if a and "." not in a]
        if not address:
            raise MalformedAlias(
                f"{query!r}: path. takes a module address, e.g. {', '.join('path.' + a for a in top[:3])}."
            )
        if address not in trace.modules:
            hits = close_matches(address, trace.modules)
            hint = (
                f" Did you mean {', '.join('path.' + h for h in hits)}?"
                if hits
                else f" Top-level modules: {', '.join('path.' + a for a in top[:6])}."
            )
            raise UnknownAlias(f"{query!r}: no module at address {address!r} in this trace.{hint}")
        row = Row(query, None, "output", "module output (interp-engine path address)")
        return _status(trace, table, row, None, query, trace.modules[address].address)
    m = re.match(r"^([a-z][a-z0-9_]*)(?:\.(\d+))?\.([a-z][a-z0-9_]*)-(\d+)$", query)
    if not m:
        return None
    name, layer, coord, stream = m.groups()
    if coord != "stream":
        raise MalformedAlias(
            f"{query!r}: interp-engine addresses know one coordinate, stream-K, not {coord!r}."
        )
    if stream != _canonical_index(stream):
        raise MalformedAlias(
            f"{query!r}: write the stream index as {_canonical_index(stream)} (ASCII digits, no leading zeros)."
        )
    if name not in interp_engine.STREAM_POINTS:
        raise MalformedAlias(
            f"{query!r}: only {', '.join(sorted(interp_engine.STREAM_POINTS))} take a stream coordinate."
        )
    if layer is None:
        raise MalformedAlias(f"{query!r}: {name} is per-layer: write {name}.N.stream-K")
    idx = _layer_value(layer, table, query, trace)
    row = next(r for r in table.rows if r.name == f"{name}.{{L}}")
    return AliasResolution(
        query,
        table.generation,
        "structurally_absent",
        None,
        None,
        idx,
        "this model has a single residual stream, so no stream coordinate names a site",
        f"drop the coordinate: {name}.{idx}",
        row.name,
        row.meaning,
    )


def _unknown(query: str, tables: list[Table], trace: Trace) -> AliasError:
    tables = [
        _for_trace(t, trace) for t in tables
    ]  # the rows this trace is read with (HookedEncoder's on BERT)
    for table in tables:
        if table.unmapped and query in table.unmapped:
            return UnknownAlias(f"{query!r}: {table.unmapped[query]}")
    n = max(len(trace.blocks), 1)
    digits = re.findall(r"[0-9]+", query)
    layer = digits[0] if digits and _index_value(_canonical_index(digits[0])) < n else "0"
    names = [r.name.replace("{L}", layer) for t in tables for r in t.rows]
    hits = close_matches(query.strip(), names, n=3)
    if not hits:
        hits = close_matches(re.sub(r"\d+", layer, query.strip()), names, n=3)
    where = tables[0].generation if len(tables) == 1 else "any naming generation"
    if len(tables) == 1:
        elsewhere = _other_generation_hint(query, tables[0], trace)
        if elsewhere:
            return UnknownAlias(f"{query!r} is not a name in {where}: {elsewhere}")
    hint = f" Did you mean {', '.join(repr(h) for h in hits)}?" if hits else ""
    return UnknownAlias(
        f"{query!r} is not a name in {where}.{hint} Generations: {', '.join(GENERATIONS)}; "
        f"list a generation's names with torchlens.mechinterp.table(generation)."
    )


def _other_generation_hint(query: str, table: Table, trace: Trace) -> str:
    """For a name of another generation: which one it is, and this generation's name for its site."""
    others = [
        _for_trace(t, trace) for t in GENERATIONS.values() if t.generation != table.generation
    ]
    try:
        found = _matches(query, others, trace)
    except AliasError:
        return ""
    if not found:
        return ""
    by_suggestion: dict[str, list[str]] = {}
    for other, row, layer in found:
        same = [
            r
            for r in table.rows
            if r.target is not None and r.target == row.target and r.facets == row.facets
        ]
        same = same or [
            r
            for r in table.rows
            if r.target is not None and r.target == row.target and set(r.facets) & set(row.facets)
        ]
        same = [r for r in same if r.per_layer == (layer is not None)]
        names = ", ".join(repr(r.name.replace("{L}", str(layer))) for r in same)
        by_suggestion.setdefault(names, []).append(other.generation)
    parts = []
    for names, generations in by_suggestion.items():
        of = (
            ", ".join(generations[:-1]) + " and " + generations[-1]
            if len(generations) > 1
            else generations[0]
        )
        if names:
            parts.append(f"it is a name of {of}; in {table.generation} the same site is {names}.")
        else:
            parts.append(
                f"it is a name of {of}, and {table.generation} has no name for its site; "
                f"pass generation={generations[0]!r}."
            )
    return " ".join(parts)


# -- resolving ---------------------------------------------------------------------------------


def _status(
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
    row's site is structurally absent and the row has an `or_else`, that site is read instead."""
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
    return first if other.status == "structurally_absent" else other


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
            if _n_layers(trace, row) == 0:
                return res(
                    "structurally_absent",
                    None,
                    row.facets[0],
                    "TorchLens found no stack of layers in this model, so no per-layer name has a site",
                    "name the blocks: trace(model, ..., roles={'<holder address>.*': 'block'})",
                )
            return res("structurally_absent", None, row.facets[0], "per-layer name without a layer")
        assert row.target is not None  # a row with a facet names its target (`Row`)
        call, why = targets.find_call(trace, row.target, layer, row.stack)
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


def _tables(generation: str | None, *, any_generation: bool = False) -> list[Table]:
    if generation is None and any_generation:
        return list(GENERATIONS.values())
    if not isinstance(generation, str) or generation not in GENERATIONS:
        hits = close_matches(str(generation), GENERATIONS)
        hint = f" Did you mean {', '.join(repr(h) for h in hits)}?" if hits else ""
        raise UnknownGeneration(
            f"unknown generation {generation!r}.{hint} Generations: {', '.join(repr(g) for g in GENERATIONS)}."
        )
    return [GENERATIONS[generation]]


def table(generation: str) -> tuple[Row, ...]:
    """The rows of one naming generation, as the resolver reads them."""
    return _tables(generation)[0].rows


def resolve_alias(trace: Trace, name: str, generation: str | None = None) -> AliasResolution:
    """Resolve a name from another library to the site it reads in `trace`.

    Args:
        trace: a [`Trace`][torchlens.Trace].
        name: a TransformerLens 2.x hook name, 3.x bridge-cache name or 4.x canonical name, an
            nnterp accessor (`"layers_output[1]"`), or an interp-engine address
            (`"resid_post.1"`, `"path.transformer.wpe"`). Surrounding whitespace is ignored.
        generation: look only in this generation's table; by default every table is tried and
            a name found in several must point at the same site.

    Returns:
        An [`AliasResolution`][torchlens.mechinterp.AliasResolution] whose `status` says whether
        the trace holds the tensor.

    Raises:
        UnknownAlias: the name is in no table (close matches are suggested).
        LayerOutOfRange: the layer index is not one of the trace's blocks.
        MalformedAlias: the name breaks its generation's grammar.
        UnknownGeneration: `generation` is not a known generation.

    Examples:
        >>> import torch, transformers, torchlens
        >>> from torchlens.mechinterp import resolve_alias
        >>> _ = torch.manual_seed(0)
        >>> cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
        >>> t = torchlens.trace(transformers.GPT2LMHeadModel(cfg).eval(), torch.tensor([[1, 2, 3]]))
        >>> resolve_alias(t, "blocks.1.hook_resid_post")
        AliasResolution('blocks.1.hook_resid_post' -> transformer.h.1:resid_post [real], generation='2.x')
    """
    if not isinstance(name, str):
        raise UnknownAlias(f"a name must be a string, got {type(name).__name__} {name!r}.")
    tables = _tables(generation, any_generation=True)
    query = name.strip()
    if not query:
        raise UnknownAlias(
            "an empty name resolves to nothing; pass e.g. 'blocks.0.hook_resid_pre'."
        )
    found = _matches(query, tables, trace)
    if not found:
        if interp_engine.TABLE in tables:
            special = _interp_engine_special(query, trace)
            if special is not None:
                return special
        raise _unknown(query, tables, trace)
    results = [_status(trace, t, row, layer, query) for t, row, layer in found]
    if len({_same_tensor_key(trace, r) for r in results}) == 1:
        return results[0]
    listing = "; ".join(f"{r.generation}: {r.module_address}:{r.facet}" for r in results)
    first = results[0]
    return AliasResolution(
        query,
        first.generation,
        "ambiguous",
        None,
        None,
        first.layer,
        f"{query!r} names different sites in different generations ({listing})",
        f"pass generation= one of {', '.join(repr(r.generation) for r in results)}",
        first.pattern,
        first.meaning,
    )


def _same_tensor_key(trace: Trace, r: AliasResolution) -> tuple:
    """Two resolutions read the same tensor if they name the same site, or two facets of one op.

    On GPT-2 the 2.x `hook_embed` (the lookup) and the 3.x `hook_embed` (the module output) are
    one op's output; on Gemma the module scales the lookup, so they differ and the bare name is
    ambiguous.
    """
    if r.module_address is not None and r.facet is not None and r.readable:
        facet_map = trace.modules[r.module_address].calls[r.call or 0].facets
        assert facet_map is not None  # every call of a trace holds its FacetMap (`_assemble`)
        site = facet_map.sites[r.facet]
        if site.op is not None and site.kind == "real":
            return ("op", site.op, tuple(site.shape))
    return ("site", r.module_address, r.call, r.facet)


def alias_report(trace: Trace, generation: str = "2.x") -> AliasReport:
    """Every name of one generation, instantiated on `trace`, with its status.

    Per-layer names get one row per decoder block that ran (layer = position in run order).
    For interp-engine, a point TorchLens has no site for is listed once, without a layer.

    The report computes nothing: a row on a site whose check has not run yet (a rebuilt pattern,
    a per-head result, before their first read) keeps the status the site has while its check
    is pending (`real`, `reconstructed_read_only`), with `checked` False and a reason that says
    it is not checked yet (the check runs on first read). Run `trace.check()` first for final statuses throughout.

    Args:
        trace: a [`Trace`][torchlens.Trace].
        generation: one of `GENERATIONS`: `"2.x"`, `"3.x"`, `"4.x"`, `"nnterp"`,
            `"interp-engine"`.

    Returns:
        An `AliasReport` (a list of [`AliasResolution`][torchlens.mechinterp.AliasResolution])
        that prints as a table.
    """
    table_ = _for_trace(_tables(generation)[0], trace)
    rows = AliasReport()
    for row in table_.rows:
        if not row.in_report:
            continue
        if row.per_layer and not (table_.absent_once and row.facet is None):
            for layer in range(_n_layers(trace, row)):
                rows.append(
                    _status(
                        trace, table_, row, layer, row.name.replace("{L}", str(layer)), force=False
                    )
                )
            if not _n_layers(trace, row):  # no layer found: one row says so, rather than none
                rows.append(_status(trace, table_, row, None, row.bare, force=False))
        else:
            query = row.bare if row.per_layer else row.name
            rows.append(_status(trace, table_, row, None, query, force=False))
    return rows
