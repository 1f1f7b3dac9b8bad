"""What the decode check returns: a row per site of a step compared, a verdict per step, and the
report that holds both and prints one line per step."""

from __future__ import annotations

from dataclasses import dataclass

from torchlens._core import html
from torchlens._naming.diagnose import Candidate

__all__ = ["DecodeReport", "DecodeRow", "StepVerdict"]


@dataclass
class DecodeRow:
    """One site of one decode step, compared with the full forward.

    Attributes:
        step: the step (`GenerationTrace.steps[step]`).
        site: `"address:facet"` (with `" (call n)"` for a module's later calls).
        module_address: the module.
        call: the module's call within the step's forward.
        facet: the facet.
        shape: the step's tensor's shape.
        reference_shape: the full forward's tensor's shape, before taking the step's positions.
        layout: how the two were lined up: `"last N positions"`, and for scores and patterns how
            the step's keys map to the prefix's positions.
        max_abs_error: the largest absolute difference.
        passed: whether every element is within tolerance.
        tolerance: `(atol, rtol)` of the row.
        hint: a note on the row (what the tolerance rests on, a site the full forward lacks).
    """

    step: int
    site: str
    module_address: str
    call: int
    facet: str
    shape: tuple[int, ...]
    reference_shape: tuple[int, ...] | None
    layout: str
    max_abs_error: float | None
    passed: bool
    tolerance: tuple[float, float] | None
    hint: str = ""


@dataclass
class StepVerdict:
    """One decode step's verdict.

    Attributes:
        step: the step.
        passed: every row of the step passed.
        rows: how many sites were compared.
        first: the first row that failed, in forward order (None when the step passed).
        explanation: for a step that failed, where it first differs and what explains it, in
            words; `""` for a step that passed.
        candidates: the hypotheses tested (`Candidate.matches` says which held), best first.
    """

    step: int
    passed: bool
    rows: int
    first: DecodeRow | None = None
    explanation: str = ""
    candidates: tuple[Candidate, ...] = ()


class DecodeReport(list):
    """The rows `check_decode` returns (a list of [`DecodeRow`][torchlens.DecodeRow]), with a
    verdict per step (`steps`); prints as one line per step."""

    def __init__(self, rows=(), steps: dict[int, StepVerdict] | None = None):
        super().__init__(rows)
        self.steps: dict[int, StepVerdict] = dict(steps or {})

    @property
    def ok(self) -> bool:
        """True when every site of every checked step agreed."""
        return all(v.passed for v in self.steps.values()) and all(r.passed for r in self)

    @property
    def failed_steps(self) -> list[int]:
        """The steps with a row that failed."""
        return [s for s, v in self.steps.items() if not v.passed]

    @property
    def mismatched(self) -> list[tuple[int, str]]:
        """`(step, site)` of every row that failed."""
        return [(r.step, r.site) for r in self if not r.passed]

    @property
    def explanation(self) -> str:
        """The explanation of the first step that failed (`""` when every step passed)."""
        bad = self.failed_steps
        return self.steps[bad[0]].explanation if bad else ""

    def __repr__(self) -> str:
        if not self.steps:
            return "DecodeReport([])"
        lines = [
            f"decode check: {len(self.steps)} steps, {len(self)} sites, "
            f"{'every site agrees with a full forward' if self.ok else f'{len(self.failed_steps)} steps differ'}"
        ]
        for s, v in self.steps.items():
            worst = max((r.max_abs_error or 0.0 for r in self if r.step == s), default=0.0)
            line = f"  step {s:>3}: {'ok ' if v.passed else 'BAD'} {v.rows:>4} sites, max |diff| {worst:.3g}"
            if not v.passed:
                line += f"\n           {v.explanation}"
            lines.append(line)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = []
        for s, v in self.steps.items():
            worst = max((r.max_abs_error or 0.0 for r in self if r.step == s), default=0.0)
            rows.append(
                [
                    html.esc(s),
                    "ok" if v.passed else "<b>differs</b>",
                    html.esc(v.rows),
                    html.esc(f"{worst:.3g}"),
                    html.esc(v.explanation),
                ]
            )
        return html.table(
            ["step", "verdict", "sites", "max |diff|", "explanation"], rows, caption="decode check"
        )
