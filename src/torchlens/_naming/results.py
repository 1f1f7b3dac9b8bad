"""What resolving a name gives: an `AliasResolution` (one name's site and status), an `AliasReport`
(every name of a generation), their plain-text and notebook renderings, and the lookup errors."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torchlens._core import html
from torchlens._core.errors import LookupFailed, NoGradients

if TYPE_CHECKING:
    from torchlens._trace import Trace

__all__ = [
    "STATUSES",
    "AliasError",
    "AliasReport",
    "AliasResolution",
    "LayerOutOfRange",
    "MalformedAlias",
    "UnknownAlias",
    "UnknownGeneration",
]


STATUSES = {
    "real": "an op of the forward produced this tensor; the trace holds it",
    "reconstructed_read_only": "derived from recorded tensors (e.g. a fused attention kernel's inputs, checked "
    "against its output): readable, not editable",
    "needs_capture": "the site exists, but this trace does not hold it: save= did not keep it, or (scores, "
    "pattern) the fused kernel's rebuild is not served; another capture of the same forward serves it (the "
    "remedy says which)",
    "refused": "the site exists and TorchLens found it, but its check against a relation the model fixes failed "
    "or could not run (the reason says which); it is not served",
    "structurally_absent": "this architecture has no such site, or TorchLens has no facet for it",
    "ambiguous": "several sites match the name",
}


class AliasError(LookupFailed):
    """A name could not be resolved (base class of the errors below)."""


class UnknownAlias(AliasError):
    """The name is in no naming table."""


class UnknownGeneration(AliasError, ValueError):
    """`generation=` is not one of `GENERATIONS`."""


class LayerOutOfRange(AliasError, IndexError):
    """The name's layer index is outside the trace's blocks."""


class MalformedAlias(AliasError, ValueError):
    """The name looks like a known spelling but breaks its grammar."""


@dataclass(frozen=True)
class AliasResolution:
    """Where one name of another library points in a trace, and whether it can be read there.

    Attributes:
        query: the name as given (per-layer rows of a report carry their layer).
        generation: the naming generation the name was found in.
        status: one of `STATUSES`: `real`, `reconstructed_read_only`, `needs_capture`,
            `refused`, `structurally_absent`, `ambiguous`. A pending site keeps its status word
            with `checked` False until its check runs (it may then become `refused`).
        module_address: the module that holds the site (None when there is none).
        facet: the facet read there (None when TorchLens has no facet for the name).
        layer: the layer index, for per-layer names.
        reason: why the status is what it is, in one sentence.
        remedy: what to do to read the tensor, when the status is not `real`.
        pattern: the table row's pattern (`"blocks.{L}.hook_resid_post"`).
        meaning: what the other library reads there.
        note: where the two sides differ (layout, mask fill, conditions).
        shape: the site's tensor shape, when known.
        call: which call of the module holds the site (a block run several times is one layer per
            call); None when the module ran once or there is no site.
        trace: the [`Trace`][torchlens.Trace] the name was resolved on (not shown in the repr and
            not compared); `tensor` reads from it.
        checked: False when the status rests on a check that has not run yet: the site is
            derived (or a real site with an expensive check, `z`, `resid_mid`) and its check
            runs on first read (see [`FacetSite`][torchlens.FacetSite]). `resolve_alias` runs
            the check of the one site it resolves, so its status is final; `alias_report`
            computes nothing, so its rows on such sites say so (`checked` False, and the reason
            says the site is not checked yet). Reading `tensor` runs the check: a failing one
            raises `FacetNotFound` with the reason.
    """

    query: str
    generation: str
    status: str
    module_address: str | None
    facet: str | None
    layer: int | None
    reason: str
    remedy: str
    pattern: str
    meaning: str
    note: str = ""
    shape: tuple[int, ...] | None = None
    call: int | None = None
    trace: Trace | None = field(default=None, repr=False, compare=False)
    checked: bool = True

    @property
    def readable(self) -> bool:
        """Whether the trace holds the tensor (status `real` or `reconstructed_read_only`)."""
        return self.status in ("real", "reconstructed_read_only")

    @property
    def tensor(self):
        """The tensor this name reads in the trace it was resolved on, like `FacetSite.tensor`.

        Raises:
            AliasError: the name has no site in the trace.
            FacetNotFound: the site's facet is not served (its reason says why).
            FacetNotSaved: the site exists but `save=` did not keep its tensor.
        """
        if self.module_address is None or self.facet is None:
            raise AliasError(f"{self.query!r} has no site in this trace: {self.reason}")
        if self.trace is None:
            raise AliasError(
                f"{self.query!r} was built without a trace; use resolve_alias(trace, name).tensor"
            )
        rec = self.trace.modules[self.module_address]
        if self.call is not None:
            facets = rec.calls[self.call].facets
            assert facets is not None  # every call of an assembled trace has its map
            return facets[self.facet]
        return rec.facets[self.facet]

    @property
    def grad(self):
        """d loss / d the tensor this name reads, in a trace taken with `grads=`: the gradient
        counterpart of `tensor`, from `trace.modules[address].grads` (same site, same layout).

        Raises:
            AliasError: the name has no site in the trace.
            NoGradients: the trace was taken without `grads=`.
            GradNotFound: the site's gradient is not served (its reason says why).
            GradNotSaved: `save=` did not keep the site, so its gradient was not kept either.
        """
        if self.module_address is None or self.facet is None:
            raise AliasError(f"{self.query!r} has no site in this trace: {self.reason}")
        if self.trace is None:
            raise AliasError(
                f"{self.query!r} was built without a trace; use resolve_alias(trace, name).grad"
            )
        rec = self.trace.modules[self.module_address]
        if self.call is not None:
            grads = rec.calls[self.call].grads
            if grads is None:
                raise NoGradients(f"resolve_alias(trace, {self.query!r}).grad")
            return grads[self.facet]
        return rec.grads[self.facet]

    def __repr__(self) -> str:
        status = self.status if self.checked else f"{self.status}, not checked yet"
        return f"AliasResolution({self.query!r} -> {_site(self)} [{status}], generation={self.generation!r})"

    def _repr_html_(self) -> str:
        return _html_table([self])


def _site(r: AliasResolution) -> str:
    """`module:facet` (`<root>` for the root module), `-` for a missing part."""
    address = "<root>" if r.module_address == "" else (r.module_address or "-")
    return f"{address}:{r.facet or '-'}"


_STATUS_COLORS = {
    "real": "#2e7d32",
    "reconstructed_read_only": "#1565c0",
    "needs_capture": "#ef6c00",
    "refused": "#ad1457",
    "structurally_absent": "#757575",
    "ambiguous": "#c62828",
}


def _status_counts(rows) -> dict[str, int]:
    """How many rows have each status, in order of first appearance."""
    return dict(Counter(r.status for r in rows))


def _counts_line(rows) -> str:
    listed = ", ".join(f"{n} {status}" for status, n in _status_counts(rows).items())
    return f"{len(rows)} name{'s' if len(rows) != 1 else ''}: {listed}"


def _html_table(rows: list[AliasResolution], caption: str = "") -> str:
    body = []
    for r in rows:
        color = _STATUS_COLORS.get(r.status, "#1f2328")
        has_site = (
            r.module_address is not None
            and r.facet is not None
            and r.status != "structurally_absent"
        )
        why = r.reason + (f" Remedy: {r.remedy}" if r.remedy and not r.readable else "")
        body.append(
            [
                html.code(r.query),
                f'<span style="color:{color}">{html.esc(r.status)}</span>',
                html.nowrap(html.code(_site(r))) if has_site else "",
                html.nowrap(html.esc(list(r.shape))) if r.shape is not None else "",
                html.esc(why),
            ]
        )
    return html.table(
        ["name", "status", "site", "shape", "reason"],
        body,
        caption=caption,
        note=_counts_line(rows) if len(rows) > 1 else "",
    )


class AliasReport(list):
    """The list `alias_report` returns: `AliasResolution`s that print as a table.

    `print(report)` shows one line per name: its status, and the `module:facet` it reads (marked
    "not checked yet" while that site's check is pending), or, when there is no site to read, `-`
    and the reason; a last line counts the statuses. In a notebook
    the report renders as an HTML table with the reasons and remedies.
    """

    def __repr__(self) -> str:
        if not self:
            return "AliasReport([])"
        w = max(len(r.query) for r in self)
        s = max(len(r.status) for r in self)
        lines = [f"{'name'.ljust(w)}  {'status'.ljust(s)}  site"]
        for r in self:
            if (
                r.module_address is not None
                and r.facet is not None
                and r.status != "structurally_absent"
            ):
                site = _site(r) + ("" if r.checked else "  (not checked yet)")
                if r.status == "refused":
                    site += "  - " + r.reason.rstrip(".")
            else:
                site = "- " + r.reason.rstrip(".")
            lines.append(f"{r.query.ljust(w)}  {r.status.ljust(s)}  {site}".rstrip())
        lines.append(f"({_counts_line(self)})")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return _html_table(list(self))

    def counts(self) -> dict[str, int]:
        """How many rows have each status."""
        return _status_counts(self)
