"""The API reference pages, as built, read in the order a reader needs them.

The site is built once (`mkdocs build` into a temporary directory) and each API page's HTML is
read: no documented object has two anchors, each Returns section is one row (one value, its
description whole), no page names or links to an underscore module (`torchlens._...`), no dunder
method is listed, the entry points come before the results and the results before the errors,
no named parameter of an entry point is typed `Any`, and no doctest is rendered as quoted prose
(an `Example:` admonition instead of an `Examples:` section turns each `>>>` into a quote).
"""

from __future__ import annotations

import collections
import html
import os
import pathlib
import re
import subprocess
import sys

import pytest

import torchlens
import torchlens.mechinterp
import torchlens.testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ("api/torchlens/index.html", "api/mechinterp/index.html")


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        check=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    return {page: (out / page).read_text(encoding="utf-8") for page in PAGES}


def _text(page: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def duplicate_anchors(page: str) -> list[str]:
    ids = collections.Counter(
        i for i in re.findall(r'id="([^"]+)"', page) if i.startswith("torchlens")
    )
    return sorted(i for i, n in ids.items() if n > 1)


def broken_returns(page: str) -> list[str]:
    """The Returns sections rendered as more than one row (a value cut into several)."""
    found = []
    for m in re.finditer(
        r'doc-section-title">Returns:</span></p>\s*<table>(.*?)</table>', page, re.S
    ):
        rows = re.findall(r'<tr class="doc-section-item">', m.group(1))
        if len(rows) > 1:
            found.append(" ".join(_text(m.group(1)).split())[:120])
    return found


def private_references(page: str) -> list[str]:
    names = set(re.findall(r"torchlens(?:\.mechinterp)?\._\w+", _text(page)))
    links = set(re.findall(r'href="[^"]*#torchlens(?:\.\w+)*\._\w+', page))
    return sorted(names | links)


def dunders(page: str) -> list[str]:
    return sorted(set(re.findall(r'id="(torchlens[\w.]*\.__\w+__)"', page)))


def any_parameters(page: str) -> list[str]:
    """Named parameters typed `Any` in the signatures of the page's functions (not *args/**kwargs).

    The caller leaves out the records whose fields hold whatever the model passed (a `Trace`'s
    `output`, a `ModuleCall`'s kept aliases) and the builders' config settings.
    """
    found = []
    for m in re.finditer(r'<div class="doc-signature highlight">(.*?)</div>', page, re.S):
        sig = " ".join(_text(m.group(1)).split())
        found += [
            f"{sig.split('(')[0]}: {p}"
            for p in re.findall(r"(?<![*\w])(\w+): Any\b", sig)
            if not p.startswith("_")
        ]
    return found


def quoted_doctests(page: str) -> list[str]:
    """Doctest lines the page shows as nested quotes instead of code."""
    return [
        " ".join(_text(m.group(1)).split())[:80]
        for m in re.finditer(r"<blockquote>\s*<blockquote>(.*?)</blockquote>", page, re.S)
    ]


def test_no_doctest_is_rendered_as_a_quote(api):
    for name, page in api.items():
        assert not quoted_doctests(page), (name, quoted_doctests(page))


def test_no_object_has_two_anchors(api):
    for name, page in api.items():
        assert not duplicate_anchors(page), (name, duplicate_anchors(page))


def test_every_returns_section_is_one_value(api):
    for name, page in api.items():
        assert not broken_returns(page), (name, broken_returns(page))


def test_no_page_sends_the_reader_to_a_private_module(api):
    for name, page in api.items():
        assert not private_references(page), (name, private_references(page))
        assert not dunders(page), (name, dunders(page))


def test_entry_points_come_first_then_results_then_errors(api):
    page = api["api/torchlens/index.html"]
    order = [
        page.index(f'id="{anchor}"')
        for anchor in (
            "torchlens.trace",
            "torchlens.load",
            "torchlens.Trace",
            "torchlens.OpRecord",
            "torchlens.TorchLensError",
            "torchlens.testing",
        )
    ]
    assert order == sorted(order)
    page = api["api/mechinterp/index.html"]
    order = [
        page.index(f'id="{anchor}"')
        for anchor in (
            "torchlens.mechinterp.resolve_alias",
            "torchlens.mechinterp.compare",
            "torchlens.mechinterp.AliasResolution",
            "torchlens.mechinterp.AliasError",
        )
    ]
    assert order == sorted(order)
    assert (
        "mechinterp.GENERATIONS = {" not in _text(page)
        and "for " not in _text(page).split("GENERATIONS", 2)[-1][:80]
    )


def test_entry_points_type_their_parameters(api):
    found = [
        p
        for page in api.values()
        for p in any_parameters(page)
        # `output`: the `Trace.output` property, whatever the model returned
        if not p.split(":")[0].endswith(
            ("ModuleCall", "Family", "build", "checkpoint", "Trace", "output")
        )
    ]
    assert not found, found


def missing_names(pages: dict[str, str]) -> dict[str, list[str]]:
    """The names in `__all__` of torchlens, torchlens.mechinterp and torchlens.testing that no API page
    has an anchor for (mkdocstrings gives each documented object the id of its full name)."""
    ids = {i for page in pages.values() for i in re.findall(r'id="([^"]+)"', page)}
    out = {}
    for module in (torchlens, torchlens.mechinterp, torchlens.testing):
        missing = [n for n in module.__all__ if f"{module.__name__}.{n}" not in ids]
        if missing:
            out[module.__name__] = missing
    return out


def test_every_public_name_has_an_entry(api):
    """Getting started and the home page say the API reference lists every public name."""
    assert not missing_names(api), missing_names(api)


def test_the_api_index_lists_compare():
    index = (ROOT / "docs" / "api" / "index.md").read_text(encoding="utf-8")
    assert "compare" in index and "resolve_alias" in index and "trace" in index


def test_the_checks_catch_what_they_look_for():
    page = (
        '<h2 id="torchlens.Ref">Ref</h2><h2 id="torchlens.Ref">Ref</h2>'
        '<p><span class="doc-section-title">Returns:</span></p><table><tbody>'
        '<tr class="doc-section-item"><td>a</td></tr><tr class="doc-section-item"><td>b</td></tr></tbody></table>'
        '<p>see <code>torchlens._core.records</code></p><h3 id="torchlens.FacetSite.__getstate__">x</h3>'
        '<div class="doc-signature highlight">trace(model: Module, save: Any = "all", *args: Any)</div>'
        "<details><blockquote>\n<blockquote>\n<blockquote><p>import torchlens as tl</p>"
        "</blockquote></blockquote></blockquote></details>"
    )
    assert duplicate_anchors(page) == ["torchlens.Ref"]
    assert len(broken_returns(page)) == 1
    assert private_references(page) == ["torchlens._core"]
    assert dunders(page) == ["torchlens.FacetSite.__getstate__"]
    assert any_parameters(page) == ["trace: save"]
    assert quoted_doctests(page) == ["import torchlens as tl"]
    assert missing_names({"page": '<h2 id="torchlens.trace">trace</h2>'})["torchlens"] == [
        n for n in torchlens.__all__ if n != "trace"
    ]
