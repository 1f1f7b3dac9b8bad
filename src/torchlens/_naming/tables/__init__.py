"""The naming tables: one module per naming generation, each a tuple of `Row`s.

Why tables and not code: every interpretability library names the same few dozen sites of a
transformer, and the names drift between versions. Keeping each generation as plain data —
one row per name: the pattern, the site it points at, what it means — makes the mapping
reviewable line by line, lets one resolver serve every generation, and lets the docs print
the very rows the resolver reads (`scripts/gen_alias_pages.py`).

A row points at a *site*: a **target** module (see [`torchlens._naming.targets`][]) and
a **facet** of it. `{L}` in a pattern is the layer: the position of the decoder block in the
order the blocks ran (`LAYER` is what it matches).

Every `Table` is checked when it is built, so a mistyped table fails at import instead of
quietly reporting its names `structurally_absent`: each row's facets exist
(`torchlens._core.facet_spec.ALL_FACETS`) and fit its target's role, each target exists
(`targets.TARGETS`), no name appears twice, and no row's pattern matches another row's
names; and its generation's metadata (heading, slug, library, release) is given whole and well
formed. A violation raises `TableError` naming the table and the row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from torchlens._core.errors import TorchLensError, did_you_mean
from torchlens._core.facet_spec import ALL_FACETS, BY_NAME, EVERY_MODULE
from torchlens._naming.targets import TARGETS

#: What `{L}` in a pattern matches: an optionally negative run of digits (the resolver then
#: insists on ASCII digits without leading zeros, and checks the range).
LAYER = r"(-?\d+)"
#: The stacks a row's `{L}` can count the layers of (None: the language-model stack).
STACKS = (None, "encoder", "decoder")


class TableError(TorchLensError, ValueError):
    """A naming table contradicts the facet specification, the targets, or itself (raised at import)."""


@dataclass(frozen=True)
class Row:
    """One name of one generation.

    Attributes:
        name: the pattern, with `{L}` standing for the layer index.
        target: which module the name reads (a key of `targets.TARGETS`), or None when TorchLens
            has no site for it.
        facet: the facet read on the target; a tuple means "the first of these the module has".
            None when TorchLens has no site for the name.
        meaning: what the other library reads there, in one line.
        note: where the two sides differ (layout, mask fill, conditions), or, for a name with no
            site, the reason.
        in_report: whether `alias_report` lists the row (every row resolves either way).
        stack: which stack `{L}` counts the layers of, by kind (`"encoder"` / `"decoder"`); None
            for the language-model stack.
        or_else: a `(target, facet)` read where the row's own site is structurally absent because
            the model lays the same tensor out another way: an MLP held by no module of its own
            (OPT's `fc1`/`fc2`), whose activation input is the up projection's `output`.
    """

    name: str
    target: str | None
    facet: str | tuple[str, ...] | None
    meaning: str
    note: str = ""
    in_report: bool = True
    stack: str | None = None
    or_else: tuple[str, str] | None = None

    @property
    def per_layer(self) -> bool:
        """Whether the name takes a layer index."""
        return "{L}" in self.name

    @property
    def facets(self) -> tuple[str, ...]:
        """The facet alternatives, as a tuple (empty when the row has no site)."""
        if self.facet is None:
            return ()
        return self.facet if isinstance(self.facet, tuple) else (self.facet,)

    @cached_property
    def pattern(self) -> re.Pattern:
        """The compiled pattern: the name, literally, with `{L}` matching `LAYER` (group 1)."""
        return re.compile("^" + LAYER.join(re.escape(p) for p in self.name.split("{L}")) + "$")

    @property
    def bare(self) -> str:
        """The name without its layer (`"q_norm_in.{L}"` -> `"q_norm_in"`): how a report spells a
        per-layer name listed once."""
        return re.sub(r"[.\[]?\{L\}\]?", "", self.name)

    def spellings(self, absent_once: bool = False) -> tuple[str, ...]:
        """The names this row answers to that the checks compare: layer 0 (and 1) written in, and,
        for a name listed once without a layer (`absent_once`), its bare form."""
        if not self.per_layer:
            return (self.name,)
        out = (self.name.replace("{L}", "0"), self.name.replace("{L}", "1"))
        return out + ((self.bare,) if absent_once and self.facet is None else ())


@dataclass(frozen=True)
class Table:
    """One naming generation.

    Attributes:
        generation: the key users pass as `generation=` (`"2.x"`, `"nnterp"`, ...).
        title: the library and version the table describes.
        rows: the names.
        absent_once: report a name without a site once, without a layer, instead of once per
            layer (interp-engine refuses such a point whatever the layer).
        unmapped: names the library defines that have no row, with the reason and where the
            tensor can be read instead; resolving one raises with that text.
        negative_layers: the library indexes layers like a Python list (`[-1]` is the last).
        decoder_only: the library serves decoder-only language models only; on any other kind of
            model every name of the table is reported `structurally_absent`, saying so.
        by_kind: (model kind, table) pairs: on a trace of that kind (`trace.structure.kind`) the
            resolver reads that table instead (TransformerLens 2.x names BERT's sites with
            `HookedEncoder`'s rows).
        heading: how the site names the generation: its alias page's title, its entry in the
            nav of `mkdocs.yml` and its column in the block diagrams.
        slug: the file name of its alias page under `docs/aliases/` (`tl-2x` is `tl-2x.md`).
        library: the distribution whose names these are, as pip installs it (`"transformer-lens"`).
        checked: the release of `library` the rows were checked against (`"2.18"`); a generation
            named `"N.x"` is checked against an N release.
        names: what the library calls these names, in two or three words (the block diagrams
            print it under the heading; may be empty).

    `heading`, `slug`, `library` and `checked` are given on every table of `GENERATIONS` and on
    no table of a `by_kind` (that one is read in place of its parent, under the parent's
    metadata, and has the parent's `generation`).
    """

    generation: str
    title: str
    rows: tuple[Row, ...]
    absent_once: bool = False
    unmapped: dict[str, str] | None = None
    negative_layers: bool = False
    decoder_only: bool = False
    by_kind: tuple[tuple[str, Table], ...] = ()
    heading: str = ""
    slug: str = ""
    library: str = ""
    checked: str = ""
    names: str = ""

    def __post_init__(self) -> None:
        check_table(self)


def _row_error(table: Table, row: Row, what: str) -> TableError:
    return TableError(
        f"naming table {table.title!r} ({table.generation}), row {row.name!r}: {what}"
    )


def check_table(table: Table) -> None:
    """Check one table against the facet specification, the targets, and itself.

    Raises:
        TableError: naming the table and the first row that breaks a rule: an unknown facet or
            target, a facet of another role than the target's, a site half given (a target
            without a facet or the reverse), an unknown stack, a name given twice (or also
            listed as unmapped), or a pattern that matches another row's names; or metadata given
            in part, malformed, of another series than the generation's, or on a `by_kind` table.
    """
    _check_metadata(table)
    seen: dict[str, Row] = {}
    for row in table.rows:
        if row.name in seen:
            raise _row_error(
                table, row, "the name appears twice in this generation; give each name one row."
            )
        seen[row.name] = row
        if (row.target is None) != (row.facet is None):
            raise _row_error(
                table,
                row,
                f"target={row.target!r} and facet={row.facet!r}: a row names both (a "
                f"site) or neither (no TorchLens site, with the reason in its note).",
            )
        if row.stack not in STACKS:
            raise _row_error(table, row, f"stack={row.stack!r} is not one of {list(STACKS)}.")
        if row.target is None:
            if row.or_else is not None:
                raise _row_error(
                    table,
                    row,
                    "or_else gives a second site to a row that has none; give the row its site.",
                )
            continue
        sites = [(row.target, row.facets)] + (
            [(row.or_else[0], (row.or_else[1],))] if row.or_else else []
        )
        for target, facets in sites:
            _check_site(table, row, target, facets)
    for name in table.unmapped or {}:
        if name in seen:
            raise TableError(
                f"naming table {table.title!r} ({table.generation}): {name!r} is both a row and "
                f"an unmapped name; keep one."
            )
    for row in table.rows:
        for other in table.rows:
            if other is row:
                continue
            hit = next(
                (n for n in other.spellings(table.absent_once) if row.pattern.match(n)), None
            )
            if hit is not None:
                raise _row_error(
                    table,
                    row,
                    f"its pattern also matches {hit!r}, a name of row {other.name!r}; "
                    f"a name must read one row.",
                )


#: A page slug and a distribution name: lowercase words joined by `-`.
_SLUG = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
#: A release: dotted numbers.
_RELEASE = re.compile(r"\d+(?:\.\d+)*")
_METADATA = ("heading", "slug", "library", "checked")


def _check_metadata(table: Table) -> None:
    """The generation's metadata: all of `_METADATA` or none, well formed, and its release in
    its series; a `by_kind` table has the parent's generation and no metadata of its own."""
    where = f"naming table {table.title!r} ({table.generation})"
    given = [name for name in _METADATA if getattr(table, name)]
    if given and len(given) < len(_METADATA):
        missing = [name for name in _METADATA if name not in given]
        raise TableError(
            f"{where}: gives {', '.join(given)} but not {', '.join(missing)}; a table of "
            f"GENERATIONS gives all of {', '.join(_METADATA)}, a by_kind table none."
        )
    if not given and table.names:
        raise TableError(
            f"{where}: names={table.names!r} without a heading; a by_kind table has no metadata."
        )
    if given:
        for name, pattern in (("slug", _SLUG), ("library", _SLUG), ("checked", _RELEASE)):
            if not pattern.fullmatch(getattr(table, name)):
                raise TableError(
                    f"{where}: {name}={getattr(table, name)!r} is not of the form {pattern.pattern}."
                )
        series = re.fullmatch(r"(\d+)\.x", table.generation)
        if series and table.checked.split(".")[0] != series.group(1):
            raise TableError(
                f"{where}: checked={table.checked!r} is not a {table.generation} release."
            )
    for kind, sub in table.by_kind:
        if sub.generation != table.generation:
            raise TableError(
                f"{where}: its {kind} table {sub.title!r} is of generation {sub.generation!r}; a "
                f"by_kind table is read under its parent's generation."
            )
        if any(getattr(sub, name) for name in (*_METADATA, "names")):
            raise TableError(
                f"{where}: its {kind} table {sub.title!r} has metadata of its own; it is read under "
                f"the parent's (leave heading, slug, library, checked and names empty)."
            )


def _check_site(table: Table, row: Row, target: str, facets: tuple[str, ...]) -> None:
    """A row's site (or its `or_else`): the target exists and each facet fits its role."""
    if target not in TARGETS:
        hint = did_you_mean(target, TARGETS)
        raise _row_error(
            table,
            row,
            f"target {target!r} is not a target.{hint} Targets: {', '.join(sorted(TARGETS))}.",
        )
    roles = TARGETS[target].roles
    for facet in facets:
        if facet not in ALL_FACETS:
            hint = did_you_mean(facet, ALL_FACETS)
            raise _row_error(
                table,
                row,
                f"facet {facet!r} is not a facet TorchLens produces, so the name would "
                f"always read as structurally_absent.{hint} Facets: {', '.join(sorted(ALL_FACETS))}.",
            )
        have = BY_NAME[facet].roles
        if EVERY_MODULE not in have and not set(have) & set(roles):
            raise _row_error(
                table,
                row,
                f"facet {facet!r} belongs to {list(have)} modules, but target "
                f"{target!r} finds a {' or '.join(roles)} module.",
            )
