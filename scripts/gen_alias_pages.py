"""Generate the alias-table pages (docs/aliases/*.md) from the tables the resolver reads.

Each page has a hand-written part (kept as is) and a generated part between two marker
comments. The generated part lists every row of one naming generation, with the site and
status it resolves to on a 2-layer GPT-2 and a 2-layer Llama built from small configs with
random weights (`torchlens.testing.build`), under sdpa attention (the default). A generation's
page is `docs/aliases/SLUG.md`, titled with its heading: both are fields of its table.

Usage:
    python scripts/gen_alias_pages.py          # rewrite the pages
    python scripts/gen_alias_pages.py --check  # exit 1 if a committed page is stale

`tests/test_alias_pages.py` runs the check, so a table edit without regenerating fails the
suite.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _outputs import splice, write_or_check

ROOT = Path(__file__).resolve().parent.parent
PAGES = ROOT / "docs" / "aliases"
BEGIN = "<!-- BEGIN GENERATED: scripts/gen_alias_pages.py; edit the tables in src/torchlens/_naming/tables -->"
END = "<!-- END GENERATED -->"
#: generation -> the slug of its page, as its table gives it
SLUGS = {generation: table.slug for generation, table in mi.GENERATIONS.items()}
#: The families every page is generated against.
REFERENCE_FAMILIES = ("gpt2", "llama")


def reference_traces() -> dict[str, tl.Trace]:
    """The two models every page is generated against (fixed seed, offline), by title."""
    ids = torch.tensor([[1, 2, 3, 4]])
    return {
        testing.FAMILIES[name].title: tl.trace(testing.build(name, "sdpa"), ids)
        for name in REFERENCE_FAMILIES
    }


def _site(trace: tl.Trace, row: mi.Row, generation: str) -> tuple[str, str]:
    """`(module : facet, status)` of the row's name for layer 0, the layer written `{L}`."""
    query = row.name.replace("{L}", "0")
    if row.per_layer and row.facet is None and mi.GENERATIONS[generation].absent_once:
        query = row.name.split(".{L}")[0]
    r = mi.resolve_alias(trace, query, generation=generation)
    block0 = trace.blocks[0] if trace.blocks else None
    if r.module_address is None:
        return "—", r.status
    addr = r.module_address
    if row.per_layer and block0 and (addr == block0 or addr.startswith(block0 + ".")):
        addr = block0[: -len("0")] + "{L}" + addr[len(block0) :]
    return f"`{addr or '<root>'}` : `{r.facet}`", r.status


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


_LAYER_WORD = re.compile(r"(?<![`\w])([\w.*\[\]]*\{L\}[\w.*\[\]{}]*?)(?=[,;:)]?(?:\s|$))")


def _prose(text: str) -> str:
    """A table's prose for a cell: names with a `{L}` in them set as code, so they never break."""
    parts = _LAYER_WORD.sub(lambda m: f"`{m[1]}`", text).split("`")
    # Outside code spans, `<...>` ("trace.modules[<final norm address>]") is text, not HTML.
    return _escape("`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts)))


def _table(generation: str, trace: tl.Trace, family: str) -> list[str]:
    table = mi.GENERATIONS[generation]
    lines = [
        f"| name | site on {family}, status | what it reads, and how the two sides differ |",
        "|---|---|---|",
    ]
    for row in table.rows:
        site, status = _site(trace, row, generation)
        facet = " or ".join(f"`{f}`" for f in row.facets) if row.facets else None
        target = f"target `{row.target}` : {facet}" if row.target else "no TorchLens facet"
        if row.or_else is not None:  # the second site, read where the first is structurally absent
            target += f"; where absent, `{row.or_else[0]}` : `{row.or_else[1]}`"
        note = row.note + (" (not in the report)" if not row.in_report else "")
        reads = _prose(row.meaning) + (
            f'<br><span class="tl-note">{_prose(note)}</span>' if note else ""
        )
        lines.append(
            f'| `{_escape(row.name)}` | <span class="tl-site">{site}</span><br>'
            f'<span class="tl-status tl-status--{status}">{status}</span>'
            f' <span class="tl-target">{_escape(target)}</span> | {reads} |'
        )
    return lines


def generated_section(generation: str, traces: dict[str, tl.Trace]) -> str:
    table = mi.GENERATIONS[generation]
    lines = [
        BEGIN,
        "",
        f"{len(table.rows)} names. `{{L}}` is the layer: the decoder block's position in the order the blocks ran. "
        "Each tab resolves every name on one family: a 2-layer model with random weights and the default `sdpa` "
        'attention (under `attn_implementation="eager"` the `scores` and `pattern` rows are `real`). '
        "Under each site: its status, and the target (the module role the name is defined on, found in any family) "
        'and the facet read there; "where absent" gives the site read instead on a model that lays the tensor '
        "out another way (OPT's MLP, held by no module of its own).",
        "",
    ]
    for family, trace in traces.items():
        lines += [f'=== "{family}"', ""]
        lines += ["    " + line for line in _table(generation, trace, family)]
        lines.append("")
    if table.unmapped:
        lines += [
            "Names this library defines that have no row (resolving one raises with this text):",
            "",
        ]
        lines += [f"- `{name}`: {_prose(text)}" for name, text in table.unmapped.items()]
        lines.append("")
    lines += [END]
    return "\n".join(lines)


def render(page: Path, generation: str, traces: dict[str, tl.Trace]) -> str:
    text = (
        page.read_text()
        if page.exists()
        else f"# {mi.GENERATIONS[generation].heading}\n\n{BEGIN}\n{END}\n"
    )
    return splice(page, text, BEGIN, END, generated_section(generation, traces))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="report stale pages instead of writing them"
    )
    args = parser.parse_args(argv)
    traces = reference_traces()
    outputs = {
        PAGES / f"{slug}.md": render(PAGES / f"{slug}.md", generation, traces)
        for generation, slug in SLUGS.items()
    }
    return write_or_check(outputs, args.check, ROOT, "python scripts/gen_alias_pages.py")


if __name__ == "__main__":
    sys.exit(main())
