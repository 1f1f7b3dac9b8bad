"""The site's search finds hook names the way readers paste them.

The site is built with `mkdocs build`, and its search index (`search/search_index.json`) is read
the way Material's search reads it: each section's text is split into tokens by the index's own
`separator` (mkdocs.yml), outside HTML tags, lower-cased; a query is split on whitespace and by the
same separator, English stop words dropped (the list of the lunr.js Material ships, read from its
worker's source map), and each part matches a token it begins (Material appends `*` to every
term). A name is found when one section holds every part of it.

For each naming generation a dozen of its names, written with a layer (`blocks.3.hook_mlp_out`)
and as the tables write them (`blocks.{L}.hook_mlp_out`), must be found on the translation page or
on the generation's alias page; the layer number itself is not required, since the pages write
`{L}`. A last test shows that Material's default separator (whitespace and hyphens) does not find
them, so the checks can fail. tests/test_browser.py types names into the real search box. The
same build's sitemap must list every page (it is empty without `site_url`).

Material's search matches each part of a query on its own (a page need not hold every part) and
never the name as a whole, so the page that holds a name is not always the first result: one test
runs Material's own search worker under node on the built index and checks the ranks mkdocs.yml
states (an alias page first or second, the name's own page within the first six).
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

import torchlens.mechinterp as mi

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGE_OF = {
    "2.x": "aliases/tl-2x/",
    "3.x": "aliases/tl-3x/",
    "4.x": "aliases/tl-4x/",
    "nnterp": "aliases/nnterp/",
    "interp-engine": "aliases/interp-engine/",
}
DEFAULT_SEPARATOR = r"[\s\-]+"  # Material's, for English


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("site")
    env = {key: value for key, value in os.environ.items() if key != "SITE_URL"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--quiet", "--site-dir", str(out)],
        cwd=REPO,
        env={**env, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"mkdocs build failed:\n{done.stdout}\n{done.stderr}"
    return out


@pytest.fixture(scope="module")
def index(site) -> dict:
    return json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))


def test_the_sitemap_lists_every_page(site):
    locations = re.findall(
        r"<loc>([^<]+)</loc>", (site / "sitemap.xml").read_text(encoding="utf-8")
    )
    pages = sorted(
        p.parent.relative_to(site).as_posix()
        for p in site.rglob("index.html")
        if p.parent.relative_to(site).parts[:1] not in (("search",), ("assets",))
    )
    assert len(pages) >= 20
    assert (
        sorted(loc.removeprefix("http://127.0.0.1:8000/").rstrip("/") or "." for loc in locations)
        == pages
    )


@functools.cache
def stop_words() -> frozenset[str]:
    """lunr's English stop words, from the search worker Material ships (its source map holds lunr.js)."""
    import material

    workers = (
        pathlib.Path(material.__file__).parent / "templates" / "assets" / "javascripts" / "workers"
    )
    source_map = json.loads(next(workers.glob("search.*.min.js.map")).read_text(encoding="utf-8"))
    lunr = next(
        text
        for name, text in zip(source_map["sources"], source_map["sourcesContent"])
        if name.endswith("lunr/lunr.js")
    )
    listed = re.search(
        r"lunr\.stopWordFilter = lunr\.generateStopWordFilter\(\[(.*?)\]\)", lunr, re.S
    )
    return frozenset(re.findall(r"'([^']+)'", listed[1]))


def tokens(text: str, separator: str) -> set[str]:
    """A section's tokens: its text outside tags, split by the separator, lower-cased."""
    out = set()
    for part in re.split(r"<[^>]*>", text):
        out |= {t.lower() for t in re.split(separator, part) if t}
    return out


def query_parts(query: str, separator: str) -> list[str]:
    parts = [p.lower() for term in query.split() for p in re.split(separator, term) if p]
    return [p for p in parts if p not in stop_words()]


def found_in(index: dict, query: str, separator: str) -> list[str]:
    """The locations of the sections that hold every part of `query` (a layer number aside)."""
    parts = [p for p in query_parts(query, separator) if not p.isdigit()]
    assert parts, query
    hits = []
    for doc in index["docs"]:
        have = tokens(doc["text"], separator) | tokens(doc["title"], separator)
        if all(any(t.startswith(p) for t in have) for p in parts):
            hits.append(doc["location"])
    return hits


def dozen(generation: str) -> list[str]:
    """Twelve names of the generation spread over its table, rows with a site first."""
    rows = [r for r in mi.GENERATIONS[generation].rows if r.facet is not None]
    rows = rows[:: max(1, len(rows) // 12)][:12]
    return [r.name for r in rows]


def test_the_index_splits_names_into_their_parts(index):
    separator = index["config"]["separator"]
    for name, parts in {
        "blocks.3.hook_mlp_out": ["blocks", "3", "hook", "mlp", "out"],
        "blocks.{L}.hook_mlp_out": ["blocks", "l", "hook", "mlp", "out"],
        "layers_output[1]": ["layers", "output", "1"],
        "resid_post.5": ["resid", "post", "5"],
        "`transformer.h.{L}.attn`:`pattern`": ["transformer", "h", "l", "attn", "pattern"],
        "&lt;root&gt;": ["root"],
    }.items():
        assert [p.lower() for p in re.split(separator, name) if p] == parts, name


@pytest.mark.parametrize("generation", list(mi.GENERATIONS))
def test_a_dozen_names_of_each_generation_are_found_where_they_are_translated(index, generation):
    separator = index["config"]["separator"]
    names = dozen(generation)
    assert len(names) == 12
    missing = {}
    for pattern in names:
        for query in {pattern.replace("{L}", "3"), pattern, pattern.split(".")[-1]}:
            where = found_in(index, query, separator)
            if not any(w.startswith(("aliases/translation/", PAGE_OF[generation])) for w in where):
                missing[query] = where[:5]
    assert not missing, f"not found on the translation or {generation} alias page: {missing}"


def test_every_name_of_every_table_is_in_the_index(index):
    separator = index["config"]["separator"]
    pages = {}
    for doc in index["docs"]:
        page = doc["location"].split("#")[0]
        pages.setdefault(page, set()).update(tokens(doc["text"], separator))
    for generation, table in mi.GENERATIONS.items():
        have = pages[PAGE_OF[generation]] | pages["aliases/translation/"]
        for row in table.rows:
            assert set(query_parts(row.name, separator)) <= have, (generation, row.name)


def test_the_default_separator_finds_none_of_them(index):
    """Material's default splits only at spaces and hyphens: `blocks.{l}.hook_mlp_out` is one token, which
    `blocks.2.hook_mlp_out` does not begin."""
    for query in (
        "blocks.2.hook_mlp_out",
        "blocks.2.attn.hook_pattern",
        "layers_output[2]",
        "resid_post.2",
    ):
        where = found_in(index, query, DEFAULT_SEPARATOR)
        assert not any(w.startswith("aliases/") for w in where), (query, where[:5])


#: Runs Material's own search worker under node on the built index: one line per query, the
#: result pages best first (a page's sections grouped, as the search box lists them).
RANK_JS = r"""
const fs = require("fs"), vm = require("vm");
const [worker, indexPath, queriesPath] = process.argv.slice(2);
let handler = null; const out = [];
const ctx = {console, setTimeout, Promise};
ctx.self = ctx; ctx.addEventListener = (t, f) => { handler = f; };
ctx.postMessage = (m) => out.push(m); ctx.importScripts = () => {};
vm.createContext(ctx); vm.runInContext(fs.readFileSync(worker, "utf8"), ctx);
const idx = JSON.parse(fs.readFileSync(indexPath, "utf8"));
const queries = fs.readFileSync(queriesPath, "utf8").split("\n").filter(Boolean);
(async () => {
  await handler({data: {type: 0, data: {config: idx.config, docs: idx.docs, options: {suggest: true}}}});
  for (const q of queries) {
    out.length = 0; await handler({data: {type: 2, data: q}});
    console.log(JSON.stringify((out[0].data.items || []).map((g) => g[0].location.split("#")[0])));
  }
})();
"""


def material_ranks(site: pathlib.Path, queries: list[str]) -> list[list[str]]:
    """Each query's result pages, best first, from Material's search worker run under node."""
    import shutil

    import material

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (the ranks are measured with Material's search worker)")
    workers = (
        pathlib.Path(material.__file__).parent / "templates" / "assets" / "javascripts" / "workers"
    )
    script, listed = site / "rank.js", site / "queries.txt"
    script.write_text(RANK_JS, encoding="utf-8")
    listed.write_text("\n".join(queries) + "\n", encoding="utf-8")
    worker = next(workers.glob("search.*.min.js"))
    done = subprocess.run(
        [node, str(script), str(worker), str(site / "search" / "search_index.json"), str(listed)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return [list(dict.fromkeys(json.loads(line))) for line in done.stdout.splitlines()]


def test_material_search_puts_an_alias_page_first_or_second_and_the_names_page_in_six(site):
    """What mkdocs.yml and the alias pages' front matter say: search matches a name's parts, not the
    whole name, so the page of the name's generation is not always first; with the alias pages' boost
    an alias page is first or second, and the generation's page within the first six, for every name
    of every table written with layer 3."""
    queries = {
        row.name.replace("{L}", "3"): PAGE_OF[generation]
        for generation, table in mi.GENERATIONS.items()
        for row in table.rows
    }
    ranks = material_ranks(site, list(queries))
    assert len(ranks) == len(queries)
    own, alias = {}, {}
    for (query, page), pages in zip(queries.items(), ranks):
        own[query] = pages.index(page) + 1 if page in pages else 0
        alias[query] = next((i + 1 for i, p in enumerate(pages) if p.startswith("aliases/")), 0)
    assert all(0 < r <= 2 for r in alias.values()), {
        q: r for q, r in alias.items() if not 0 < r <= 2
    }
    assert all(0 < r <= 6 for r in own.values()), {q: r for q, r in own.items() if not 0 < r <= 6}
    # "names rank first" would be false: some name's own page is not the first result
    assert any(r > 1 for r in own.values())
    # a module address before `:facet` is lost, so Getting started is not first for its own name
    (pages,) = material_ranks(site, ["transformer.h.1:resid_post"])
    assert pages[0] != "getting-started/"


def test_names_are_whole_in_the_index_and_may_wrap_on_the_page(site, index):
    """On a phone a long name wraps after its dots and underscores, at a `<wbr>` that
    scripts/mkdocs_hooks.py adds to the built page after the search plugin read it: the index holds
    every name whole."""
    page = (site / "aliases" / "tl-2x" / "index.html").read_text(encoding="utf-8")
    assert "blocks.<wbr>{L}.<wbr>hook_<wbr>mlp_<wbr>out" in page
    blocks = re.findall(r"<pre\b.*?</pre>", page, re.S)  # code blocks are left as they are
    assert blocks and not any("<wbr>" in block for block in blocks)
    text = "\n".join(doc["text"] for doc in index["docs"])
    assert "<wbr>" not in text  # a page may name the tag (escaped, `&lt;wbr&gt;`), not carry it
    assert "blocks.{L}.hook_mlp_out" in text
