"""Generate the facet tables of docs/guides/facets.md from the facet specification rows.

The page has hand-written parts (kept as they are) and one generated part between two marker
comments: one table per role, one row per facet of `torchlens._core.facet_spec.SPECS`, giving its
layout, what it is, when a module of its role lacks it, how TorchLens finds it, and whether an
`edit=` can replace it. Nothing is traced, so the output depends on the rows alone.

Usage:
    python scripts/gen_facet_page.py          # rewrite the page
    python scripts/gen_facet_page.py --check  # exit 1 if the committed page is stale

`tests/test_facet_docs.py` runs the check, so a row edited without regenerating fails the suite.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torchlens._core import facet_spec as spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _outputs import main as run
from _outputs import splice

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "guides" / "facets.md"
BEGIN = "<!-- BEGIN GENERATED: scripts/gen_facet_page.py; edit the rows in src/torchlens/_core/facet_spec.py -->"
END = "<!-- END GENERATED -->"

#: The heading of each role's table, in the order the rows list the roles.
TITLES = {
    spec.EVERY_MODULE: "Every module",
    "block": "Decoder block",
    "attention": "Attention",
    "mlp": "MLP",
    "norm": "Norm",
    "embedding": "Embedding",
    "root": "Model root",
}

_SOURCE = {
    "io": "a hook's tensor",
    "op": "an op's output",
    "computed": "computed, read-only",
    "reconstructed": "reconstructed, read-only",
}


#: How a hook of another module than the reporting one is named (`final_norm_input` reads the final norm).
_HOLDER = {"norm": "final norm", "unembed": "unembedding"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _hook(f: spec.FacetSpec, role: str, side: str) -> str:
    which = "input" if side == "in" else "output"
    if role == "root":
        return f"the model's {which}"
    if role in f.roles or role == spec.EVERY_MODULE:
        return f"the module's {which}"
    return f"the {_HOLDER.get(role, role)}'s {which}"


def found_as(f: spec.FacetSpec) -> str:
    """How TorchLens finds the facet's tensor, in words."""
    text = _SOURCE[f.source]
    if f.hooks:
        text += ": " + ", or ".join(_hook(f, role, side) for role, side in f.hooks)
        if f.found_in:  # an io facet the module may compute itself (an embedding's positions)
            text += "; an op's output where the module computes it from its input"
    if f.fused is not None:
        text += f"; {_SOURCE[f.fused]} where the module runs as one fused op"
    return text


def edit_cell(f: spec.FacetSpec) -> str:
    """Whether `edit=` can replace the facet, and what to edit where it cannot."""
    if f.editable:
        return "yes"
    if f.source in ("io", "op"):
        return f"yes, except where {_SOURCE[f.fused].split(',')[0]}: {f.remedy}"
    return f"no: {f.remedy}"


def role_table(role: str) -> list[str]:
    lines = [
        f"### {TITLES[role]}",
        "",
        "| facet | layout | what it is | found as | `edit=` |",
        "|---|---|---|---|---|",
    ]
    for f in spec.SPECS:
        if role not in f.roles:
            continue
        what = f.prose + (f". Absent when {f.absent}" if f.absent else "")
        layout = f"`{f.layout}`" if f.axes else "the module's own"
        lines.append(
            f"| `{f.name}` | {layout} | {_cell(what)} | {_cell(found_as(f))} | {_cell(edit_cell(f))} |"
        )
    return lines + [""]


def generated_section() -> str:
    roles = list(dict.fromkeys(r for f in spec.SPECS for r in f.roles))
    missing = [r for r in roles if r not in TITLES]
    if missing:
        raise SystemExit(
            f"scripts/gen_facet_page.py: no heading for roles {missing}; add them to TITLES"
        )
    lines = [BEGIN, ""]
    for role in roles:
        lines += role_table(role)
    return "\n".join(lines + [END])


def render(text: str) -> str:
    """`text` (the page) with its generated part replaced by the current rows."""
    return splice(PAGE, text, BEGIN, END, generated_section())


def main(argv: list[str] | None = None) -> int:
    return run(
        __doc__,
        lambda: {PAGE: render(PAGE.read_text(encoding="utf-8"))},
        ROOT,
        "python scripts/gen_facet_page.py",
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
