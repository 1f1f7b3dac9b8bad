"""One resolver for every naming generation: `resolve_alias` and `alias_report`.

`GENERATIONS` holds the tables; a name is matched against their rows' patterns (or read as an
interp-engine special address), and each row it matches is resolved on the trace
(`_naming.site_status.resolve_row`, its layer read by `_naming.layer_index`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from torchlens._core.errors import TorchLensError, close_matches, did_you_mean, hint_of
from torchlens._naming.layer_index import canonical_index, index_value, layer_value, n_layers
from torchlens._naming.results import (
    AliasError,
    AliasReport,
    AliasResolution,
    MalformedAlias,
    UnknownAlias,
    UnknownGeneration,
)
from torchlens._naming.site_status import resolve_row
from torchlens._naming.tables import Row, Table, interp_engine, nnterp, tl2, tl3, tl4

if TYPE_CHECKING:
    from torchlens._trace import Trace

__all__ = ["GENERATIONS", "alias_report", "resolve_alias", "table"]

#: The naming generations, by the key `generation=` takes.
GENERATIONS: dict[str, Table] = {
    t.generation: t for t in (tl2.TABLE, tl3.TABLE, tl4.TABLE, nnterp.TABLE, interp_engine.TABLE)
}


def for_trace(table: Table, trace: Trace) -> Table:
    """The table to read on `trace`: a kind-specific one of `table.by_kind`, else `table` itself."""
    kind = trace.structure.kind if trace.structure is not None else None
    return dict(table.by_kind).get(kind, table) if kind is not None else table


def _patterns(table: Table) -> list[tuple[re.Pattern, Row]]:
    """Each row's pattern (the table's grammar: `Row.pattern`, compiled once per row) with the row."""
    return [(row.pattern, row) for row in table.rows]


def _matches(query: str, tables: list[Table], trace: Trace) -> list[tuple[Table, Row, int | None]]:
    found = []
    for table in tables:
        table = for_trace(table, trace)
        for rx, row in _patterns(table):
            m = rx.match(query)
            if m:
                layer = layer_value(m.group(1), table, query, trace, row) if row.per_layer else None
                found.append((table, row, layer))
            elif table.absent_once and row.facet is None and query == row.bare:
                found.append((table, row, None))  # the report's own spelling of a refused point
            elif row.per_layer and query == row.bare and not n_layers(trace, row):
                found.append(
                    (table, row, None)
                )  # the report's one row for a per-layer name on a trace without layers
    return found


#: An interp-engine address with a coordinate: `point[.layer].coordinate-K` (`resid_pre.0.stream-1`).
_COORDINATE = re.compile(r"^([a-z][a-z0-9_]*)(?:\.(\d+))?\.([a-z][a-z0-9_]*)-(\d+)$")


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
        return resolve_row(trace, table, row, None, query, trace.modules[address].address)
    m = _COORDINATE.match(query)
    if not m:
        return None
    name, layer, coord, stream = m.groups()
    if coord != "stream":
        raise MalformedAlias(
            f"{query!r}: interp-engine addresses know one coordinate, stream-K, not {coord!r}."
        )
    if stream != canonical_index(stream):
        raise MalformedAlias(
            f"{query!r}: write the stream index as {canonical_index(stream)} (ASCII digits, no leading zeros)."
        )
    if name not in interp_engine.STREAM_POINTS:
        raise MalformedAlias(
            f"{query!r}: only {', '.join(sorted(interp_engine.STREAM_POINTS))} take a stream coordinate."
        )
    if layer is None:
        raise MalformedAlias(f"{query!r}: {name} is per-layer: write {name}.N.stream-K")
    idx = layer_value(layer, table, query, trace)
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
        for_trace(t, trace) for t in tables
    ]  # the rows this trace is read with (HookedEncoder's on BERT)
    for table in tables:
        if table.unmapped and query in table.unmapped:
            return UnknownAlias(f"{query!r}: {table.unmapped[query]}")
    n = max(len(trace.blocks), 1)
    digits = re.findall(r"[0-9]+", query)
    layer = digits[0] if digits and index_value(canonical_index(digits[0])) < n else "0"
    names = [r.name.replace("{L}", layer) for t in tables for r in t.rows]
    hits = close_matches(query.strip(), names, n=3)
    if not hits:
        hits = close_matches(re.sub(r"\d+", layer, query.strip()), names, n=3)
    where = tables[0].generation if len(tables) == 1 else "any naming generation"
    if len(tables) == 1:
        elsewhere = _other_generation_hint(query, tables[0], trace)
        if elsewhere:
            return UnknownAlias(f"{query!r} is not a name in {where}: {elsewhere}")
        if tables[0].generation != interp_engine.TABLE.generation and (
            query.startswith("path.") or _COORDINATE.match(query)
        ):
            return UnknownAlias(
                f"{query!r} is not a name in {where}: it is an interp-engine address (a path. "
                "address or a .stream-K coordinate); pass generation='interp-engine'."
            )
    hint = hint_of(hits)
    return UnknownAlias(
        f"{query!r} is not a name in {where}.{hint} Generations: {', '.join(GENERATIONS)}; "
        f"list a generation's names with torchlens.mechinterp.table(generation)."
    )


def _other_generation_hint(query: str, table: Table, trace: Trace) -> str:
    """For a name of another generation: which one it is, and this generation's name for its site."""
    others = [for_trace(t, trace) for t in GENERATIONS.values() if t.generation != table.generation]
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


def tables_of(generation: str | None, *, any_generation: bool = False) -> list[Table]:
    """The table of `generation` (with `any_generation`, every table when it is None).

    Raises:
        UnknownGeneration: `generation` is no key of `GENERATIONS`.
    """
    if generation is None and any_generation:
        return list(GENERATIONS.values())
    if not isinstance(generation, str) or generation not in GENERATIONS:
        hint = did_you_mean(str(generation), GENERATIONS)
        raise UnknownGeneration(
            f"unknown generation {generation!r}.{hint} Generations: {', '.join(repr(g) for g in GENERATIONS)}."
        )
    return [GENERATIONS[generation]]


def table(generation: str) -> tuple[Row, ...]:
    """The rows of one naming generation, as the resolver reads them."""
    return tables_of(generation)[0].rows


def need_trace(trace: object, who: str) -> None:
    """Raise `TorchLensError` unless `trace` is a `Trace` (what `torchlens.trace` returns), saying
    what to pass instead of what was given."""
    if hasattr(trace, "structure") and hasattr(trace, "modules"):
        return
    kind = type(trace).__name__
    if hasattr(trace, "steps") and hasattr(trace, "sequences"):
        instead = "a GenerationTrace holds one Trace per forward call: pass one, gen.steps[i]"
    elif hasattr(trace, "named_modules"):
        instead = "trace the model first: torchlens.trace(model, *inputs)"
    else:
        instead = "pass what torchlens.trace(model, *inputs) returns"
    raise TorchLensError(f"{who}: needs a torchlens.Trace, got {kind}; {instead}.")


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
    need_trace(trace, "resolve_alias")
    if not isinstance(name, str):
        raise UnknownAlias(f"a name must be a string, got {type(name).__name__} {name!r}.")
    tables = tables_of(generation, any_generation=True)
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
    results = [resolve_row(trace, t, row, layer, query) for t, row, layer in found]
    if len({_same_tensor_key(trace, r) for r in results}) == 1:
        return results[0]
    if all(r.module_address is None for r in results):  # no generation's site is here
        return results[0]
    listing = "; ".join(
        f"{r.generation}: "
        + (
            f"{r.module_address or '<root>'}:{r.facet}"
            if r.module_address is not None
            else r.status
        )
        for r in results
    )  # a generation without a site here says its status (ALBERT's 2.x resid_post: absent)
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
    need_trace(trace, "alias_report")
    table_ = for_trace(tables_of(generation)[0], trace)
    rows = AliasReport()
    for row in table_.rows:
        if not row.in_report:
            continue
        if row.per_layer and not (table_.absent_once and row.facet is None):
            for layer in range(n_layers(trace, row)):
                rows.append(
                    resolve_row(
                        trace, table_, row, layer, row.name.replace("{L}", str(layer)), force=False
                    )
                )
            if not n_layers(trace, row):  # no layer found: one row says so, rather than none
                rows.append(resolve_row(trace, table_, row, None, row.bare, force=False))
        else:
            query = row.bare if row.per_layer else row.name
            rows.append(resolve_row(trace, table_, row, None, query, force=False))
    return rows
