"""The Facets guide documents every facet TorchLens can produce, each in a row of its own table.

A facet counts as documented only where it opens a row of one of the guide's facet tables
(``| `name` | layout and meaning |``); a mention elsewhere on the page (``k`` in a sentence) does
not. The rows name no facet that TorchLens does not have, so the guide cannot go stale either.
"""

import re
from pathlib import Path

from torchlens._facet_spec import ALL_FACETS, FACETS

PAGE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "facets.md"
# The guide's tables of kinds and statuses open rows with these; they are not facets.
NOT_FACETS = {"real", "computed", "reconstructed"}


def documented(text: str) -> set[str]:
    """The names that open a table row: `| `a`, `b` / `c` (root) | ... |` gives a, b and c."""
    names = set()
    for line in text.splitlines():
        m = re.match(r"^\|\s*([^|]+?)\s*\|", line)
        if m and m.group(1).startswith("`"):
            names.update(re.findall(r"`([^`]+)`", m.group(1)))
    return names - NOT_FACETS


def test_every_facet_opens_a_row_of_the_guide():
    rows = documented(PAGE.read_text())
    missing = sorted(name for table in FACETS.values() for name in table if name not in rows)
    assert missing == [], f"docs/guides/facets.md has no row for: {missing}"


def test_the_guide_documents_no_facet_torchlens_lacks():
    unknown = sorted(documented(PAGE.read_text()) - ALL_FACETS)
    assert unknown == [], f"docs/guides/facets.md documents facets that do not exist: {unknown}"


def test_a_mention_outside_a_row_does_not_count():
    assert documented("The `k` projection.\n| `q` | the query |\n") == {"q"}
