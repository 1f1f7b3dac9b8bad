"""The naming tables: one module per naming generation, each a tuple of `Row`s.

Why tables and not code: every interpretability library names the same few dozen sites of a
transformer, and the names drift between versions. Keeping each generation as plain data —
one row per name: the pattern, the site it points at, what it means — makes the mapping
reviewable line by line, lets one resolver serve every generation, and lets the docs print
the very rows the resolver reads (`scripts/gen_alias_pages.py`).

A row points at a *site*: a **target** module (see [`torchlens.mechinterp._targets`][]) and
a **facet** of it. `{L}` in a pattern is the layer: the position of the decoder block in the
order the blocks ran.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    """

    name: str
    target: str | None
    facet: str | tuple[str, ...] | None
    meaning: str
    note: str = ""
    in_report: bool = True
    stack: str | None = None

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
    """

    generation: str
    title: str
    rows: tuple[Row, ...]
    absent_once: bool = False
    unmapped: dict[str, str] | None = None
    negative_layers: bool = False
    decoder_only: bool = False
    by_kind: tuple[tuple[str, Table], ...] = ()
