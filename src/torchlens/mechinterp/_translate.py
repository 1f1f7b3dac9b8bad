"""`translate`: the name another library's naming generation gives the site one name reads.

Every answer comes from the naming tables, read through the one resolver (`_naming.resolver`):

- Without a model, from the tables alone: the rows of the other generation that name the same
  target and facet as the name's row. Where the tables cannot settle it (one row falls back to
  another site on some models, reads the first of several facets, or names a target that is
  the same module as another target only on some models), the answer says that it depends on
  the model family, and which names read the site on some families.
- With `trace=` (or `family=`, one of `torchlens.testing.FAMILIES`, built with
  `torchlens.testing.build`), by resolving: the name is resolved on the trace, every name of
  the other generation is resolved on it too, and the answer is the names that resolve to the
  same site (the same module call and facet).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from torchlens import testing
from torchlens._core.errors import close_matches, did_you_mean, hint_of
from torchlens._naming.layer_index import canonical_index, n_layers
from torchlens._naming.resolver import GENERATIONS, for_trace, resolve_alias, tables_of
from torchlens._naming.results import AliasError, AliasResolution, MalformedAlias, UnknownAlias
from torchlens._naming.site_status import resolve_row
from torchlens._naming.tables import Row, Table
from torchlens._trace import Trace
from torchlens._tracing import trace as run_trace

__all__ = ["TRANSLATION_STATUSES", "Translation", "UnknownFamily", "translate"]

#: What each status of a [`Translation`][torchlens.mechinterp.Translation] means.
TRANSLATION_STATUSES = {
    "same_site": "the names read the same site: without a model, their rows name the same target and facet, so "
    "they read one site on every model; on a trace, both resolve to the same module call and facet",
    "depends_on_family": "without a model the tables cannot settle it: the names read the same site on some model "
    "families and not on others (the reason says when); pass family= or trace= for an answer",
    "no_name": "the other generation has no name for the site: no row names its target and facet, or, on a trace, "
    "no name resolves to it",
    "no_site": "the name reads no TorchLens site (in the tables, or on this trace), so there is nothing to translate",
}

#: Pairs of targets that find the same module on some models and different modules on others (a
#: post-sublayer norm where the block has one, else the sublayer itself; a gated MLP is the MLP).
#: `tests/test_translate.py` checks the set against every family of `torchlens.testing.FAMILIES`:
#: it is exactly the pairs of targets some family's trace finds on one module call.
SHARED_MODULES = frozenset(
    {
        frozenset({"attention", "attn_out_final"}),
        frozenset({"attn_post_norm", "attn_out_final"}),
        frozenset({"mlp", "mlp_out_final"}),
        frozenset({"mlp_post_norm", "mlp_out_final"}),
        frozenset({"mlp", "mlp_gated"}),
        frozenset({"mlp_gated", "mlp_out_final"}),
        frozenset({"block", "first_block"}),
        # one norm feeds both sublayers of a parallel block (GPT-J, Phi, CodeGen, Falcon)
        frozenset({"ln1", "ln2"}),
        # a post-LN encoder's last block is its last norm's block (BERT, RoBERTa, ELECTRA)
        frozenset({"block", "post_ln_block"}),
        frozenset({"first_block", "post_ln_block"}),
        # DistilBERT's norm after the attention's residual add is the one its MLP reads
        frozenset({"ln2", "post_ln1"}),
        # the token embedding as passed on is the embedding itself where no norm follows it, and
        # the embedding norm where one does (BLOOM's over the embedding alone, BERT's over a sum)
        frozenset({"embedded_sum", "embedded_tokens"}),
        frozenset({"embedded_sum", "token_embed"}),
        frozenset({"embedded_tokens", "token_embed"}),
        frozenset({"embed_norm", "embedded_sum"}),
        frozenset({"embed_norm", "embedded_tokens"}),
        # a sublayer's own output is the sublayer's, except where the module adds the residual
        frozenset({"attention", "attention_own"}),
        frozenset({"attention_own", "attn_out_final"}),
        frozenset({"mlp", "mlp_own"}),
        frozenset({"mlp_gated", "mlp_own"}),
        frozenset({"mlp_out_final", "mlp_own"}),
        # a decoder layer's norms by sublayer: before each (pre-LN: the norms feeding them; on a
        # decoder-only model, ln1 and ln2), after each on post-LN BART
        frozenset({"dec_ln1", "dec_ln3"}),
        frozenset({"dec_ln1", "ln1"}),
        frozenset({"dec_ln1", "ln2"}),
        frozenset({"dec_ln1", "ln_cross"}),
        frozenset({"dec_ln2", "ln2"}),
        frozenset({"dec_ln2", "ln_cross"}),
        frozenset({"dec_ln3", "ln1"}),
        frozenset({"dec_ln3", "ln2"}),
        frozenset({"dec_ln3", "post_ln1"}),
    }
)


def _one_module(a: str | None, b: str | None) -> bool:
    """Whether targets `a` and `b` are one module on every model (the same target) or on some
    (`SHARED_MODULES`)."""
    return a == b or frozenset({a, b}) in SHARED_MODULES


class UnknownFamily(AliasError, ValueError):
    """`family=` is not one of `torchlens.testing.FAMILIES`, or both `family=` and `trace=` were given."""


@dataclass(frozen=True)
class Translation:
    """Another generation's names for the site one name reads.

    Attributes:
        name: the name as given (surrounding whitespace removed).
        from_generation: the generation `name` is a name of.
        to_generation: the generation asked for.
        status: one of `TRANSLATION_STATUSES`: `same_site`, `depends_on_family`, `no_name`, `no_site`.
        names: the names of `to_generation`, in the row order of its table: for `same_site` the names
            that read the site; for `depends_on_family` the names that read it on some families;
            empty otherwise.
        also: without a model, for `same_site`: further names that read the same site on some
            families only (the reason says when); empty otherwise.
        site: without a model, `target:facet` of the name's row (`"block:resid_post"`); on a trace,
            `module:facet` (`"transformer.h.1:resid_post"`, `<root>` for the root module); empty when
            the name reads no site.
        reason: why the answer is what it is, in one sentence.
        layer: the layer the name indexes (None for a name without one, and for a negative layer
            translated without a model).
        family: the `torchlens.testing` family the answer was resolved on, if any.
        site_status: on a trace, the status `resolve_alias` gives the name (`real`,
            `reconstructed_read_only`, `needs_capture`, ...); empty without a model.
    """

    name: str
    from_generation: str
    to_generation: str
    status: str
    names: tuple[str, ...]
    site: str
    reason: str
    also: tuple[str, ...] = ()
    layer: int | None = None
    family: str | None = None
    site_status: str = ""

    def __repr__(self) -> str:
        on = f", family={self.family!r}" if self.family else ""
        also = f", also on some families: {list(self.also)}" if self.also else ""
        return (
            f"Translation({self.name!r} {self.from_generation} -> {self.to_generation}: "
            f"{list(self.names)} [{self.status}]{also}{on})"
        )

    def __str__(self) -> str:
        names = ", ".join(self.names) if self.names else "(no name)"
        return f"{self.name} ({self.from_generation}) -> {names} ({self.to_generation}) [{self.status}]: {self.reason}"


def _generation(value: str, what: str) -> Table:
    try:
        return tables_of(value)[0]
    except AliasError as error:
        raise type(error)(f"{what}: {error}") from None


def _fill(row: Row, layer: int | str | None) -> str:
    return row.name if layer is None or not row.per_layer else row.name.replace("{L}", str(layer))


# -- without a model: the tables ---------------------------------------------------------------------


def _parse(query: str, table: Table) -> tuple[Row, str | None]:
    """The row `query` is a name of, and its layer as written (canonical), by the table's grammar."""
    for row in table.rows:
        match = row.pattern.match(query)
        if match is None:
            continue
        if not row.per_layer:
            return row, None
        text = match.group(1)
        canonical = canonical_index(text)
        if text != canonical:
            raise MalformedAlias(
                f"{query!r}: write the layer as {canonical} (ASCII digits, no leading zeros)."
            )
        if canonical.startswith("-") and not table.negative_layers:
            raise MalformedAlias(f"{query!r}: {table.generation} layer indices are non-negative.")
        return row, canonical
    for row in table.rows:
        if table.absent_once and row.facet is None and query == row.bare:
            return row, None
    raise _unknown(query, table)


def _unknown(query: str, table: Table) -> UnknownAlias:
    if table.unmapped and query in table.unmapped:
        return UnknownAlias(f"{query!r}: {table.unmapped[query]}")
    digits = re.findall(r"-?[0-9]+", query)
    layer = digits[0] if digits else "0"
    hits = close_matches(query, [_fill(r, layer) for r in table.rows], n=3)
    others = [
        t.generation
        for t in GENERATIONS.values()
        if t is not table
        and any(r.pattern.match(query) or (t.absent_once and query == r.bare) for r in t.rows)
    ]
    elsewhere = (
        f" It is a name of {' and '.join(others)}: pass from_generation={others[0]!r}."
        if others
        else ""
    )
    hint = hint_of(hits)
    return UnknownAlias(
        f"{query!r} is not a name in {table.generation}.{elsewhere}{hint} "
        f"List its names with torchlens.mechinterp.table({table.generation!r})."
    )


def _site_words(row: Row) -> str:
    return f"{row.target}:{'|'.join(row.facets)}"


def _from_tables(query: str, src: Table, dst: Table) -> Translation:
    if src.generation == "interp-engine" and query.startswith("path."):
        return Translation(
            query,
            src.generation,
            dst.generation,
            "depends_on_family",
            (),
            "",
            "a path. address names a module of one particular model; pass family= or trace=",
        )
    row, layer_text = _parse(query, src)
    layer = None if layer_text is None or layer_text.startswith("-") else int(layer_text)
    answer = functools.partial(Translation, query, src.generation, dst.generation, layer=layer)
    if row.facet is None:
        return answer(
            "no_site",
            (),
            "",
            f"TorchLens has no site for {src.generation}'s {row.name}: {row.note}",
        )
    site = _site_words(row)
    if layer_text is not None and layer_text.startswith("-") and not dst.negative_layers:
        return answer(
            "depends_on_family",
            (),
            site,
            f"layer {layer_text} counts from the last layer, and {dst.generation} needs the layer's number, "
            f"which depends on the model's depth; pass family= or trace=",
        )
    same, maybe, why = [], [], []
    for other in dst.rows:
        if other.facet is None or other.stack != row.stack:
            continue
        if other.target == row.target and other.facets == row.facets:
            if other.or_else == row.or_else:
                same.append(other)
            else:
                maybe.append(other)
                why.append(
                    f"where {row.target} has no {row.facets[0]}, {src.generation} reads "
                    f"{_or(row.or_else)} and {dst.generation}'s {other.name} reads {_or(other.or_else)}"
                )
        elif other.target == row.target and set(other.facets) & set(row.facets):
            maybe.append(other)
            why.append(
                f"{dst.generation}'s {other.name} reads {_facets(other)} of {row.target}, "
                f"{src.generation}'s {row.name} {_facets(row)}"
            )
        elif frozenset({other.target, row.target}) in SHARED_MODULES and set(other.facets) & set(
            row.facets
        ):
            maybe.append(other)
            why.append(
                f"{row.target} and {other.target} are one module on some models and two on others"
            )
        elif (
            row.or_else is not None
            and _one_module(row.or_else[0], other.target)
            and row.or_else[1] in other.facets
        ):
            maybe.append(other)
            why.append(
                f"{src.generation} reads {_or(row.or_else)} on models where {row.target} has no "
                f"{row.facets[0]}"
            )
        elif (
            other.or_else is not None
            and _one_module(other.or_else[0], row.target)
            and other.or_else[1] in row.facets
        ):
            maybe.append(other)
            why.append(
                f"{dst.generation}'s {other.name} reads {site} on models where {other.target} has no "
                f"{other.facets[0]}"
            )
        elif row.or_else is not None and row.or_else == other.or_else:
            maybe.append(other)
            why.append(
                f"on models with neither {row.target}:{row.facets[0]} nor {other.target}:"
                f"{other.facets[0]}, both read {_or(row.or_else)}"
            )
    names = lambda rows: tuple(
        dict.fromkeys(_fill(r, _layer_for(row, r, layer_text)) for r in rows)
    )
    if same:
        reason = (
            f"{'its row and theirs name' if len(same) == 1 else 'their rows and its row name'} the same target "
            f"and facet ({site}), so they read one site on every model"
        )
        if maybe:
            reason += f"; on some families {', '.join(names(maybe))} read it too: " + "; ".join(
                dict.fromkeys(why)
            )
        return answer("same_site", names(same), site, reason, names(maybe))
    if maybe:
        return answer(
            "depends_on_family",
            names(maybe),
            site,
            f"no {dst.generation} row names {site}; these read the same site on some families: "
            + "; ".join(dict.fromkeys(why)),
        )
    return answer("no_name", (), site, f"no {dst.generation} row names {site} ({row.meaning})")


def _facets(row: Row) -> str:
    return row.facets[0] if len(row.facets) == 1 else f"the first of {', '.join(row.facets)} it has"


def _or(or_else: tuple[str, str] | None) -> str:
    return "nothing" if or_else is None else f"{or_else[0]}:{or_else[1]}"


def _layer_for(row: Row, other: Row, layer_text: str | None) -> str | None:
    """The layer to write into `other`: the name's own, or 0 where a one-block target meets a per-layer one."""
    if not other.per_layer:
        return None
    return layer_text if row.per_layer else "0"


# -- with a model: resolve both sides ------------------------------------------------------------------


def _key(r: AliasResolution) -> tuple | None:
    """The site a resolution reads (module, call, facet), or None when it reads none."""
    if (
        r.module_address is None
        or r.facet is None
        or r.status in ("structurally_absent", "ambiguous")
    ):
        return None
    return (r.module_address, r.call, r.facet)


def names_by_site(trace: Trace, generation: str) -> dict[tuple, list[AliasResolution]]:
    """Every name of `generation` that resolves to a site on `trace`, by site `(module, call, facet)`.

    Each per-layer name is instantiated at every layer of its stack; nothing is computed (the
    resolutions of sites whose checks are pending say so; `resolve_alias` runs a site's check).
    """
    table = for_trace(GENERATIONS[generation], trace)
    out: dict[tuple, list[AliasResolution]] = {}
    for row in table.rows:
        if row.facet is None:
            continue
        for layer in range(n_layers(trace, row)) if row.per_layer else [None]:
            r = resolve_row(trace, table, row, layer, _fill(row, layer), force=False)
            if (key := _key(r)) is not None:
                out.setdefault(key, []).append(r)
    return out


@functools.cache
def _family_trace(family: str) -> Trace:
    """A trace of `torchlens.testing.build(family)` on `testing.inputs(family)` (five tokens, or an
    image), every tensor saved (built once per process)."""
    args, kwargs = testing.inputs(family)
    return run_trace(testing.build(family), *args, save="all", **kwargs)


@functools.cache
def _family_sites(family: str, generation: str) -> dict[tuple, list[AliasResolution]]:
    return names_by_site(_family_trace(family), generation)


def _address(key: tuple) -> str:
    return f"{key[0] or '<root>'}:{key[2]}" + (f" (call {key[1]})" if key[1] is not None else "")


def _on_trace(query: str, src: Table, dst: Table, trace: Trace, family: str | None) -> Translation:
    r = resolve_alias(trace, query, generation=src.generation)
    answer = functools.partial(
        Translation,
        query,
        src.generation,
        dst.generation,
        layer=r.layer,
        family=family,
        site_status=r.status,
    )
    key = _key(r)
    if key is None:
        return answer("no_site", (), "", r.reason)
    sites = (
        _family_sites(family, dst.generation) if family else names_by_site(trace, dst.generation)
    )
    found = tuple(dict.fromkeys(o.query for o in sites.get(key, [])))
    where = f"on {family}" if family else "on this trace"
    if found:
        return answer(
            "same_site",
            found,
            _address(key),
            f"{'it resolves' if len(found) == 1 else 'they resolve'} to {_address(key)} {where}, as "
            f"{query} does",
        )
    return answer(
        "no_name",
        (),
        _address(key),
        f"{query} reads {_address(key)} {where}, and no {dst.generation} name resolves to it",
    )


def translate(
    name: str,
    *,
    from_generation: str,
    to_generation: str,
    trace: Trace | None = None,
    family: str | None = None,
) -> Translation:
    """Another generation's name for the site one name reads.

    Without `trace` or `family`, the answer comes from the naming tables: the rows of
    `to_generation` that name the same target and facet as the name's row read the same site on
    every model (`same_site`). Where that depends on the model (one row falls back to another
    site where its own is absent, reads the first of several facets, or names a module that is
    another row's module on some models only), the status is `depends_on_family`, with the names
    that read the site on some families and the reason.

    With `trace` (or `family`, a trace of `torchlens.testing.build(family)`), both sides are
    resolved on it: the answer is the `to_generation` names that resolve to the module call and
    facet the name resolves to.

    Args:
        name: a name of `from_generation` (`"blocks.3.hook_mlp_out"`, `"layers_output[1]"`,
            `"resid_post.5"`); surrounding whitespace is ignored.
        from_generation: the generation `name` belongs to, one of `GENERATIONS`.
        to_generation: the generation to translate to, one of `GENERATIONS`.
        trace: a [`Trace`][torchlens.Trace] to resolve both names on.
        family: a key of `torchlens.testing.FAMILIES` (`"gemma2"`): resolve on a trace of that
            family's small model instead (built once per process).

    Returns:
        A [`Translation`][torchlens.mechinterp.Translation]: its `status`, the `names`, the
        `site` and the `reason`.

    Raises:
        UnknownAlias: `name` is not a name of `from_generation` (close matches, and the
            generation it belongs to, are suggested).
        MalformedAlias: the name breaks its generation's grammar (a layer written `01`).
        LayerOutOfRange: on a trace, the layer is not one of its layers.
        UnknownGeneration: a generation is not one of `GENERATIONS`.
        UnknownFamily: `family` is not a key of `torchlens.testing.FAMILIES`, or both `family`
            and `trace` were given.

    Examples:
        >>> import torchlens.mechinterp as mi
        >>> mi.translate("blocks.3.hook_resid_post", from_generation="2.x", to_generation="nnterp")
        Translation('blocks.3.hook_resid_post' 2.x -> nnterp: ['layers_output[3]'] [same_site])
        >>> mi.translate("blocks.0.hook_mlp_out", from_generation="2.x", to_generation="4.x", family="gpt2")
        Translation('blocks.0.hook_mlp_out' 2.x -> 4.x: ['blocks.0.mlp.hook_out'] [same_site], family='gpt2')
        >>> mi.translate("blocks.0.hook_mlp_out", from_generation="2.x", to_generation="4.x", family="gemma2").status
        'no_name'
    """
    src = _generation(from_generation, "from_generation")
    dst = _generation(to_generation, "to_generation")
    if not isinstance(name, str) or not name.strip():
        raise UnknownAlias(
            f"a name must be a non-empty string, got {name!r}; pass e.g. 'blocks.0.hook_resid_pre'."
        )
    query = name.strip()
    if family is not None:
        if trace is not None:
            raise UnknownFamily("pass trace= or family=, not both: family= traces its own model")
        if family not in testing.FAMILIES:
            hint = did_you_mean(str(family), testing.FAMILIES)
            raise UnknownFamily(
                f"unknown family {family!r}.{hint} Families (torchlens.testing.FAMILIES): "
                f"{', '.join(testing.FAMILIES)}."
            )
        return _on_trace(query, src, dst, _family_trace(family), family)
    if trace is not None:
        return _on_trace(query, src, dst, trace, None)
    return _from_tables(query, src, dst)
