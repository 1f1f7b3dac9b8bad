"""The generated alias-table pages (docs/aliases/*.md) must match the tables the resolver reads.

`scripts/gen_alias_pages.py --check` renders every page from the tables in
`src/torchlens/_naming/tables` and reports the committed pages that differ. The first test
runs that check on the working tree; the others edit a table in memory and make sure the check
notices, so the first test can actually fail.

Tests internals: none of TorchLens's; the tables are edited through the public
`torchlens.mechinterp.GENERATIONS`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

import torchlens.mechinterp as mi

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gen_alias_pages.py"
SLUGS_EXPECTED = ("tl-2x", "tl-3x", "tl-4x", "nnterp", "interp-engine")


def _load_script():
    spec = importlib.util.spec_from_file_location("gen_alias_pages", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():
    return _load_script()


@pytest.fixture
def fresh_parser_cache():
    """Nothing to reset: each row compiles its own pattern (`Row.pattern`), so an edited table
    never meets a pattern cached from the table it replaced."""
    yield


def _snapshot(gen) -> dict[pathlib.Path, str]:
    return {p: p.read_text() for p in sorted(gen.PAGES.glob("*.md"))}


def test_every_generation_has_a_page(gen):
    assert set(gen.SLUGS) == set(mi.GENERATIONS)
    for slug in gen.SLUGS.values():
        page = gen.PAGES / f"{slug}.md"
        assert page.exists(), f"{page} is missing: run python scripts/gen_alias_pages.py"
        text = page.read_text()
        assert gen.BEGIN in text and gen.END in text


def test_committed_pages_are_current(gen, capsys):
    before = _snapshot(gen)
    rc = gen.main(["--check"])
    out = capsys.readouterr().out
    assert rc == 0, (
        f"stale alias pages; run `python scripts/gen_alias_pages.py` and commit them:\n{out}"
    )
    assert _snapshot(gen) == before, "--check must not write the pages"


def test_every_row_is_on_its_page(gen):
    for generation, slug in gen.SLUGS.items():
        text = (gen.PAGES / f"{slug}.md").read_text()
        for row in mi.GENERATIONS[generation].rows:
            assert f"| `{gen._escape(row.name)}` |" in text, f"{row.name} missing from {slug}.md"


def test_check_reports_an_edited_meaning(gen, monkeypatch, capsys, fresh_parser_cache):
    table = mi.GENERATIONS["nnterp"]
    rows = list(table.rows)
    i = next(i for i, r in enumerate(rows) if r.name == "layers_output[{L}]")
    rows[i] = dataclasses.replace(rows[i], meaning="decoder layer output, edited in memory")
    monkeypatch.setitem(mi.GENERATIONS, "nnterp", dataclasses.replace(table, rows=tuple(rows)))
    before = _snapshot(gen)
    rc = gen.main(["--check"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "docs/aliases/nnterp.md" in out
    # Only the edited generation's page is stale.
    for slug in ("tl-2x", "tl-3x", "tl-4x", "interp-engine"):
        assert f"docs/aliases/{slug}.md" not in out
    assert _snapshot(gen) == before, "--check must not write the pages"


def test_check_reports_an_edited_site(gen, monkeypatch, capsys, fresh_parser_cache):
    """A row pointed at another facet changes the rendered site and status, not only the text."""
    table = mi.GENERATIONS["interp-engine"]
    rows = list(table.rows)
    i = next(i for i, r in enumerate(rows) if r.name == "resid_mid.{L}")
    rows[i] = dataclasses.replace(rows[i], facet="resid_post")
    monkeypatch.setitem(
        mi.GENERATIONS, "interp-engine", dataclasses.replace(table, rows=tuple(rows))
    )
    rc = gen.main(["--check"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "docs/aliases/interp-engine.md" in out


def test_check_reports_an_edited_unmapped_text(gen, monkeypatch, capsys, fresh_parser_cache):
    table = mi.GENERATIONS["nnterp"]
    unmapped = dict(table.unmapped)
    unmapped["ln_final.output"] = "edited in memory"
    monkeypatch.setitem(mi.GENERATIONS, "nnterp", dataclasses.replace(table, unmapped=unmapped))
    rc = gen.main(["--check"])
    assert rc == 1
    assert "docs/aliases/nnterp.md" in capsys.readouterr().out


_RENDER_ALL = """
import hashlib, importlib.util, sys
spec = importlib.util.spec_from_file_location("gen_alias_pages", sys.argv[1])
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)
traces = gen.reference_traces()
for generation, slug in gen.SLUGS.items():
    text = gen.render(gen.PAGES / f"{slug}.md", generation, traces)
    print(slug, hashlib.sha256(text.encode()).hexdigest())
"""


def _render_in_subprocess(hash_seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-c", _RENDER_ALL, str(SCRIPT)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_render_is_deterministic_across_processes():
    """Two fresh interpreters with different string-hash seeds render every page alike (set or dict
    order that depended on hashing, or state left by an earlier render in one process, would show)."""
    first, second = _render_in_subprocess("1"), _render_in_subprocess("2")
    assert len(first.splitlines()) == len(SLUGS_EXPECTED)
    assert first == second


def test_the_index_explains_every_status_the_resolver_gives():
    """docs/aliases/index.md's Statuses table lists exactly `STATUSES` (a new status word, such as
    `refused`, must be explained there), and the report colours each of them."""
    from torchlens._naming.results import _STATUS_COLORS

    text = (REPO / "docs" / "aliases" / "index.md").read_text()
    section = text.split("## Statuses", 1)[1].split("\n## ", 1)[0]
    listed = [
        line.split("|")[1].strip().strip("`")
        for line in section.splitlines()
        if line.startswith("| `")
    ]
    assert listed == list(mi.STATUSES), listed
    assert set(_STATUS_COLORS) == set(mi.STATUSES)
