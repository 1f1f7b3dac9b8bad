"""The Facets guide documents every facet TorchLens can produce, each in a row of its own table.

The tables are generated from the facet rows (`scripts/gen_facet_page.py`); the check that the
committed page is current runs here, with edited rows showing that it can fail.

A facet counts as documented only where it opens a row of one of the guide's facet tables
(``| `name` | layout and meaning |``); a mention elsewhere on the page (``k`` in a sentence) does
not. The rows name no facet that TorchLens does not have, so the guide cannot go stale either.

Tests internals: `torchlens._core.facet_spec` (`SPECS`, the rows the page is generated from and the
test edits; `FACETS` and `ALL_FACETS`, what the page must document).
"""

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from torchlens._core import facet_spec as spec
from torchlens._core.facet_spec import ALL_FACETS, FACETS

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


# -- the generated tables (scripts/gen_facet_page.py) ---------------------------------------------

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gen_facet_page.py"


@pytest.fixture(scope="module")
def gen():
    s = importlib.util.spec_from_file_location("gen_facet_page", SCRIPT)
    module = importlib.util.module_from_spec(s)
    s.loader.exec_module(module)
    return module


def test_committed_page_is_current(gen, capsys):
    before = PAGE.read_text()
    rc = gen.main(["--check"])
    out = capsys.readouterr().out
    assert rc == 0, (
        f"stale facet page; run `python scripts/gen_facet_page.py` and commit it:\n{out}"
    )
    assert PAGE.read_text() == before, "--check must not write the page"


@pytest.mark.parametrize(
    "field,value",
    [
        ("prose", "a prose edited in memory"),
        ("absent", "an absent reason edited in memory"),
        ("axes", ("batch", "pos", "d_mlp")),
        ("source", "computed"),
    ],
)
def test_check_reports_an_edited_row(gen, monkeypatch, capsys, field, value):
    """An edit of any rendered field of one row makes the committed page stale."""
    i = next(i for i, f in enumerate(spec.SPECS) if f.name == "resid_mid")
    rows = list(spec.SPECS)
    rows[i] = dataclasses.replace(rows[i], **{field: value})
    monkeypatch.setattr(spec, "SPECS", tuple(rows))
    before = PAGE.read_text()
    assert gen.main(["--check"]) == 1
    assert "docs/guides/facets.md" in capsys.readouterr().out
    assert PAGE.read_text() == before


def test_each_row_renders_its_own_cells(gen):
    """Ground truth written here, not derived from the rows: a few facets' cells, spelled out."""
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in gen.generated_section().splitlines()
        if line.startswith("| `")
    }
    assert rows["`k`"][0] == "`[batch, pos, kv_heads, d_head]`"
    assert rows["`resid_post`"][2:] == ["a hook's tensor: the module's output", "yes"]
    assert rows["`result`"][2].startswith("computed, read-only") and rows["`result`"][3].startswith(
        "no: edit 'z'"
    )
    assert (
        rows["`pattern`"][2]
        == "an op's output; reconstructed, read-only where the module runs as one fused op"
    )
    assert rows["`final_norm_input`"][2] == "a hook's tensor: the final norm's input"
    assert "Absent when the MLP is not gated" in rows["`pre_linear`"][1]
    assert rows["`input`"][0] == "the module's own"
