"""What `compare` returns: a `Comparison` per name, and the `ComparisonReport` that holds them
and prints them as a table (plain text, or HTML in a notebook)."""

from __future__ import annotations

from dataclasses import dataclass

from torchlens._core import html
from torchlens._naming.diagnose import Candidate

__all__ = ["Comparison", "ComparisonReport"]


@dataclass(frozen=True)
class Comparison:
    """One name's comparison.

    Attributes:
        name: the name as given.
        status: the name's resolution status, one of `torchlens.mechinterp.STATUSES` (`refused`
            when TorchLens found the site but does not serve it because its check failed; an
            `editable=True` row on a read-only site keeps `reconstructed_read_only` and fails,
            its hint saying why).
        module_address: the module of the TorchLens site (None when there is none).
        facet: the facet of the TorchLens site (None when there is none).
        engine_shape: the shape of the tensor as handed in.
        reference_shape: the shape of the tensor as TorchLens holds it.
        layout: the conversion applied to the TorchLens tensor to match the engine's layout.
        max_abs_error: the largest absolute difference after conversion (None if not compared).
        passed: whether the two agree within tolerance.
        hint: what to look at when they do not agree.
        explanation: for a failed row, what the engine's tensor equals in the trace, in one line
            and in the generation's own names (`"equals blocks.0.hook_resid_mid: the residual is
            included"`), or that it matches nothing, with the nearest candidates; `""` for a row
            that passed.
        candidates: the ranked [`Candidate`][torchlens.mechinterp.Candidate]s behind the
            explanation (site or op, relation, relative error); empty for a row that passed.
        tolerance: the `(atol, rtol)` the row was checked with (per site under
            `tolerance="auto"`).
    """

    name: str
    status: str
    module_address: str | None
    facet: str | None
    engine_shape: tuple[int, ...] | None
    reference_shape: tuple[int, ...] | None
    layout: str
    max_abs_error: float | None
    passed: bool
    hint: str = ""
    explanation: str = ""
    candidates: tuple[Candidate, ...] = ()
    tolerance: tuple[float, float] | None = None


class ComparisonReport(list):
    """The list `compare` returns; prints as a table."""

    @property
    def ok(self) -> bool:
        """True when every name was compared and agreed."""
        return all(c.passed for c in self)

    @property
    def mismatched(self) -> list[str]:
        """The names that did not pass (including names without a readable site)."""
        return [c.name for c in self if not c.passed]

    def __repr__(self) -> str:
        if not self:
            return "ComparisonReport([])"
        w = max(len(c.name) for c in self)
        s = max(len(c.status) for c in self)
        lines = [f"{'name'.ljust(w)}  ok   {'max |diff|':>10}  {'status'.ljust(s)}  site / hint"]
        for c in self:
            tail = _site(c) + (f" [{c.layout}]" if c.layout != "as is" else "")
            if c.hint:
                tail += f"  ({c.hint})"
            if c.explanation:
                tail += f"  => {c.explanation}"
            ok = "yes" if c.passed else "NO "
            lines.append(f"{c.name.ljust(w)}  {ok}  {_err(c):>10}  {c.status.ljust(s)}  {tail}")
        lines.append(f"({_summary(self)})")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = [
            [
                html.code(c.name),
                '<span style="color:#2e7d32">yes</span>'
                if c.passed
                else '<span style="color:#c62828">no</span>',
                html.esc(_err(c)) if c.max_abs_error is not None else "",
                html.esc(c.status),
                html.nowrap(html.code(_site(c)))
                + (f" <small>[{html.esc(c.layout)}]</small>" if c.layout != "as is" else ""),
                (f"<b>{html.esc(c.explanation)}</b><br/>" if c.explanation else "")
                + html.esc(c.hint),
            ]
            for c in self
        ]
        return html.table(
            ["name", "ok", "max |diff|", "status", "site", "hint"],
            rows,
            note=_summary(self) if self else "",
        )


def _site(c: Comparison) -> str:
    if c.module_address is None or c.facet is None or c.status == "structurally_absent":
        return "-"
    return f"{c.module_address or '<root>'}:{c.facet}"


def _err(c: Comparison) -> str:
    return "-" if c.max_abs_error is None else f"{c.max_abs_error:.3g}"


def _summary(report: ComparisonReport) -> str:
    failed = sum(not c.passed for c in report)
    return f"{len(report)} compared: {len(report) - failed} agree, {failed} do not"
