"""The page for a reader deciding whether to use TorchLens (docs/why.md), and the home page's way to it.

The side-by-side table must name every peer a reader would pick instead, and every TorchLens cell
must point at a page of this site that runs or measures what the cell claims. The home page must
name what TorchLens does beyond recording (translation, `compare`, edits, stored references,
engine checks, coverage), link the pages a newcomer needs next, and print what its example makes.
"""

from __future__ import annotations

import pathlib
import re

from torchlens import testing

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
PEERS = ("upstream TorchLens", "TransformerLens", "nnsight", "nnterp", "interp-engine")
_LINK = re.compile(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)")


def _table(text: str) -> list[list[str]]:
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows]


def test_the_why_page_is_in_the_nav_and_sets_each_peer_beside_torchlens():
    assert "- Why TorchLens: why.md" in (DOCS.parent / "mkdocs.yml").read_text(encoding="utf-8")
    text = (DOCS / "why.md").read_text(encoding="utf-8")
    header, *rows = _table(text)
    assert header[1] == "TorchLens (this project)" and tuple(header[2:]) == PEERS, header
    assert len(rows) >= 8
    for row in rows:
        assert len(row) == len(header), row[0]
        assert all(cell for cell in row), row[0]


def test_every_torchlens_claim_links_a_page_that_exists():
    """Each TorchLens cell that claims a check or a measurement links the page that runs it."""
    text = (DOCS / "why.md").read_text(encoding="utf-8")
    _, *rows = _table(text)
    linked = 0
    for row in rows:
        if row[0] == "What it is":
            continue
        targets = _LINK.findall(row[1])
        assert targets, f"the TorchLens cell of {row[0]!r} links no page"
        for target in targets:
            assert (DOCS / target).is_file(), (row[0], target)
        linked += 1
    assert linked == len(rows) - 1


def test_the_home_page_names_what_torchlens_checks_and_links_the_next_pages():
    text = (DOCS / "index.md").read_text(encoding="utf-8")
    for words in (
        "name translation",
        "`compare` with explanations",
        "edits",
        "stored references",
        "engine checks and coverage",
    ):
        assert words in text, words
    links = set(_LINK.findall(text))
    for page in (
        "why.md",
        "guides/cross-engine.md",
        "guides/wrong-hooks.md",
        "aliases/index.md",
        "aliases/translation.md",
        "guides/interventions.md",
    ):
        assert page in links, page
        assert (DOCS / page).is_file(), page
    first_block = text.split("```python", 1)[1].split("```", 1)[0]
    assert "print(" in first_block


def test_the_home_page_counts_the_families_the_coverage_page_checks():
    text = (DOCS / "index.md").read_text(encoding="utf-8")
    said = int(re.search(r"the (\d+) model families of the \[coverage\]", text)[1])
    assert said == sum(1 for f in testing.FAMILIES.values() if f.structure is not None)
