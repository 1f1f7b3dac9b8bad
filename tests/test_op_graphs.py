"""The op-graph drawings (docs/assets/op-graphs/*.svg) and their page must match a fresh run.

`scripts/gen_op_graphs.py --check` traces the page's models, draws them with `Trace.draw`, and
reports the committed files that differ. These tests run that check, make sure it can fail (an
edited SVG), and that every block diagram's link lands on a drawing of this page.
"""

from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET

import pytest
import script_modules

SVG_NS = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def gen():
    return script_modules.load("gen_op_graphs")


@pytest.fixture(scope="module")
def fresh(gen):
    return gen.outputs()


def test_committed_files_are_current(gen, fresh):
    stale = [
        str(p.relative_to(gen.ROOT))
        for p, text in fresh.items()
        if not p.exists() or p.read_text(encoding="utf-8") != text
    ]
    assert not stale, (
        f"stale op graphs; run `python scripts/gen_op_graphs.py` and commit them: {stale}"
    )
    assert {p.name for p in gen.OUT.glob("*.svg")} == {p.name for p in fresh if p.suffix == ".svg"}


def test_check_mode_passes_and_reports_an_edited_svg(gen, fresh, capsys, tmp_path, monkeypatch):
    out, page = tmp_path / "op-graphs", tmp_path / "op-graph.md"
    shutil.copytree(gen.OUT, out)
    shutil.copy(gen.PAGE, page)
    monkeypatch.setattr(gen, "OUT", out)
    monkeypatch.setattr(gen, "PAGE", page)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    monkeypatch.setattr(
        gen,
        "outputs",
        lambda: {out / p.name if p.suffix == ".svg" else page: t for p, t in fresh.items()},
    )
    assert gen.main(["--check"]) == 0, capsys.readouterr().out
    svg = out / "gpt2-names.svg"
    svg.write_text(svg.read_text().replace("blocks.1.hook_resid_mid", "blocks.1.hook_resid_mad"))
    assert gen.main(["--check"]) == 1
    report = capsys.readouterr().out
    assert "op-graphs/gpt2-names.svg" in report and "gpt2-block.svg" not in report


def test_each_drawing_fits_the_column_and_says_what_it_is(gen, fresh):
    for path, text in fresh.items():
        if path.suffix != ".svg":
            continue
        root = ET.fromstring(text)
        assert root.find(SVG_NS + "title").text and root.find(SVG_NS + "desc").text
        assert float(root.get("width")) <= gen.MAX_WIDTH, path.name
        assert min(float(t.get("font-size")) for t in root.iter(SVG_NS + "text")) >= 11
        assert not re.search(r"\d{4}-\d{2}-\d{2}", text), "no dates in a generated file"


def test_the_names_drawings_mark_all_three_generations(fresh, gen):
    for slug in ("gpt2", "llama"):
        root = ET.fromstring(fresh[gen.OUT / f"{slug}-names.svg"])
        gens = {
            m.get("data-generation") for m in root.iter(SVG_NS + "g") if m.get("class") == "mark"
        }
        assert gens == {"2.x", "4.x", "nnterp"}, (slug, gens)


def test_every_block_diagram_links_to_a_drawing_on_this_page(gen, fresh):
    diagrams = script_modules.load("gen_diagrams")
    page = fresh[gen.PAGE]
    diagram_page = diagrams.PAGE.read_text(encoding="utf-8")
    for slug in diagrams.FAMILIES:
        assert f"(op-graph.md#{slug}-block)" in diagram_page, slug
        assert f"{{#{slug}-block}}" in page and f"(../assets/op-graphs/{slug}-block.svg)" in page, (
            slug
        )


def test_the_page_shows_the_names_the_script_highlights(gen):
    """The page's block that lists the names is the script's `DECODER_NAMES`."""
    text = gen.PAGE.read_text(encoding="utf-8")
    block = next(
        b
        for b in re.findall(r"```python\n(.*?)```", text, re.S)
        if b.count("DECODER_NAMES = {") == 1
    )
    namespace: dict = {}
    exec(block, namespace)
    assert namespace["DECODER_NAMES"] == gen.DECODER_NAMES
