"""The block diagrams (docs/assets/diagrams/*.svg) and their page must match a fresh run.

`scripts/gen_diagrams.py --check` traces one small model per family, draws it, and reports the
committed files that differ. The first test runs that check on the working tree; the others
make sure it can fail (an edited naming table, an edited SVG) and that what it draws is what
the trace and the tables say.

Tests internals: `_naming.targets.find` (the script's public lookup must find the same modules).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shutil
import xml.etree.ElementTree as ET

import pytest
import script_modules

import torchlens as tl
import torchlens.mechinterp as mi

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gen_diagrams.py"
SVG_NS = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def gen():
    return script_modules.load("gen_diagrams")


@pytest.fixture(scope="module")
def fresh(gen):
    """What a fresh run writes: {path: text}."""
    return gen.outputs()


@pytest.fixture
def fresh_parser_cache():
    """Nothing to reset: each row compiles its own pattern (`Row.pattern`), so an edited table
    never meets a pattern cached from the table it replaced."""
    yield


def _texts(svg: str) -> list[str]:
    root = ET.fromstring(svg)
    return [t.text or "" for t in root.iter(SVG_NS + "text")]


def test_committed_files_are_current(gen, fresh):
    stale = [
        str(p.relative_to(REPO))
        for p, text in fresh.items()
        if not p.exists() or p.read_text(encoding="utf-8") != text
    ]
    assert not stale, (
        f"stale diagrams; run `python scripts/gen_diagrams.py` and commit them: {stale}"
    )
    assert {p.name for p in gen.OUT.glob("*.svg")} == {f"{s}.svg" for s in gen.FAMILIES}


def test_check_mode_passes_and_writes_nothing(gen, capsys, tmp_path, monkeypatch):
    out, page = tmp_path / "diagrams", tmp_path / "diagrams.md"
    shutil.copytree(gen.OUT, out)
    shutil.copy(gen.PAGE, page)
    monkeypatch.setattr(gen, "OUT", out)
    monkeypatch.setattr(gen, "PAGE", page)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    before = {p: p.read_bytes() for p in [*out.glob("*.svg"), page]}
    assert gen.main(["--check"]) == 0, capsys.readouterr().out
    assert {p: p.read_bytes() for p in before} == before


def test_check_reports_an_edited_svg(gen, capsys, tmp_path, monkeypatch):
    out = tmp_path / "diagrams"
    shutil.copytree(gen.OUT, out)
    monkeypatch.setattr(gen, "OUT", out)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    svg = out / "llama.svg"
    svg.write_text(svg.read_text().replace("layers_output[0]", "layers_output[9]"))
    assert gen.main(["--check", "llama", "gpt2"]) == 1
    report = capsys.readouterr().out
    assert "diagrams/llama.svg" in report and "gpt2.svg" not in report


def test_an_edited_table_changes_the_drawing(gen, fresh, monkeypatch, fresh_parser_cache):
    """The names come from the tables, through alias_report: rename one and the SVG follows."""
    table = mi.GENERATIONS["nnterp"]
    rows = list(table.rows)
    i = next(i for i, r in enumerate(rows) if r.name == "layers_output[{L}]")
    rows[i] = dataclasses.replace(rows[i], name="layer_outputs_renamed[{L}]")
    monkeypatch.setitem(mi.GENERATIONS, "nnterp", dataclasses.replace(table, rows=tuple(rows)))
    svg = gen.render("gpt2")
    assert svg != fresh[gen.OUT / "gpt2.svg"]
    texts = _texts(svg)
    assert "layer_outputs_renamed[0]" in texts and "layers_output[0]" not in texts


_RENDER_IN_A_FRESH_PROCESS = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("gen_diagrams", sys.argv[1])
gen = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gen
spec.loader.exec_module(gen)
outputs = {str(p): t for p, t in gen.outputs().items()}
json.dump({"order": list({"GPT-2", "Llama", "eager", "sdpa"}), "outputs": outputs}, sys.stdout)
"""


def _render_in_fresh_processes(seeds: tuple[str, ...]) -> list[dict]:
    """Every output of the script, rendered once per seed, each in a fresh interpreter started with
    that `PYTHONHASHSEED` (the torchlens this test imports, run in parallel)."""
    return script_modules.json_per_hash_seed(
        _RENDER_IN_A_FRESH_PROCESS,
        [str(SCRIPT)],
        seeds,
        timeout=600,
        env={"PYTHONPATH": str(pathlib.Path(tl.__file__).parents[1])},
    )


def test_render_is_deterministic_across_processes(fresh):
    """Two fresh interpreters with different hash seeds (so a set or a hash-ordered dict would
    iterate differently) render every file byte for byte the same, and the same as this process."""
    first, second = _render_in_fresh_processes(("0", "1"))
    assert first["order"] != second["order"], (
        "the two seeds must iterate a small set of strings differently"
    )
    differ = sorted(p for p in first["outputs"] if first["outputs"][p] != second["outputs"].get(p))
    assert not differ and first["outputs"].keys() == second["outputs"].keys(), (
        f"rendered differently: {differ}"
    )
    assert first["outputs"] == {str(p): t for p, t in fresh.items()}


@pytest.mark.parametrize("slug", ["gpt2", "gemma-2"])
def test_every_readable_name_is_drawn(gen, fresh, slug):
    """Each layer-0 or global name with a site is on the diagram; a name without one is not."""
    d = gen.build(slug)
    texts = set(_texts(fresh[gen.OUT / f"{slug}.svg"]))
    readable, absent = set(), set()
    for generation in mi.GENERATIONS:
        for r in mi.alias_report(d.trace, generation=generation):
            if r.layer in (None, 0):
                (readable if r.readable else absent).add(r.query)
    assert readable and absent
    assert sorted(readable - texts) == []
    assert sorted((absent - readable) & texts) == []


def test_svgs_are_well_formed_and_self_describing(fresh, gen):
    for path, text in fresh.items():
        if path.suffix != ".svg":
            continue
        root = ET.fromstring(text)
        assert root.tag == SVG_NS + "svg"
        assert root.find(SVG_NS + "title") is not None and root.find(SVG_NS + "desc") is not None
        x0, y0, w, h = map(int, root.get("viewBox").split())
        assert (x0, y0) == (0, 0)
        # Shown larger than drawn (bigger text where the window has room), never distorted.
        assert (int(root.get("width")), int(root.get("height"))) == (
            round(w * gen.SCALE),
            round(h * gen.SCALE),
        )
        assert gen.SCALE >= 1.2
        # Issue 27, item 9: at most MAX_WIDTH wide, so that fitted to the site's column at 1280 px
        # its 11 px text stays 11 px (tests/test_browser.py measures it); 1500 to 1570 wide, it was 8.
        assert 600 < w <= gen.MAX_WIDTH <= 998 and 1000 < h < 4000, (path.name, w, h)
        sizes = [float(t.get("font-size")) for t in root.iter(SVG_NS + "text")]
        assert min(sizes) >= 11, (path.name, min(sizes))
        assert not re.search(r"\d{4}-\d{2}-\d{2}", text), "no dates in a generated file"


def test_a_name_is_drawn_once_with_every_generation_it_is_a_name_in(gen, fresh):
    """Beside a facet, a name of several generations is one line, its generations marked after it
    in their own columns; the marks are what alias_report says on the trace."""
    d = gen.build("gpt2")
    want: dict[str, set[str]] = {}
    for generation in mi.GENERATIONS:
        for r in mi.alias_report(d.trace, generation=generation):
            if r.readable and r.layer in (None, 0):
                want.setdefault(r.query, set()).add(generation)
    root = ET.fromstring(fresh[gen.OUT / "gpt2.svg"])
    texts = list(root.iter(SVG_NS + "text"))
    layout = gen.Layout(d)
    name_x, slot_x = str(layout.name_x), {str(x): g for g, x in layout.col_x.items()}
    drawn: dict[str, set[str]] = {}
    headings = (*gen.Layout.NAME_HEADING, "–")
    lines = [t for t in texts if t.get("x") == name_x and t.text not in headings]
    for line in lines:
        marks = {
            slot_x[t.get("x")]
            for t in texts
            if t.get("y") == line.get("y") and t.get("x") in slot_x and t.text == slot_x[t.get("x")]
        }
        assert line.text not in drawn, f"{line.text} drawn twice"
        drawn[line.text] = marks
    assert drawn == want
    assert drawn["blocks.0.hook_resid_pre"] >= {"2.x", "3.x"}


def test_structure_follows_the_data_flow(gen, fresh):
    """Sandwich norms, QK-norm and the parallel block come from the trace, not the family name."""
    neox = _texts(fresh[gen.OUT / "gpt-neox.svg"])
    assert "resid_mid" not in neox and any("parallel" in t for t in neox)
    gemma = gen.build("gemma-2")
    assert [b.address.rsplit(".", 1)[-1] for b in gemma.attn_branch] == [
        "input_layernorm",
        "self_attn",
        "post_attention_layernorm",
    ]
    assert [b.address.rsplit(".", 1)[-1] for b in gemma.mlp_branch] == [
        "pre_feedforward_layernorm",
        "mlp",
        "post_feedforward_layernorm",
    ]
    olmo = gen.build("olmo-2")
    assert [b.address.rsplit(".", 1)[-1] for b in olmo.attn_branch] == [
        "self_attn",
        "post_attention_layernorm",
    ]
    qwen = gen.build("qwen3")
    inner = [
        e.address.rsplit(".", 1)[-1]
        for e in qwen.attn_branch[0 if qwen.attn_branch[0].role == "attention" else 1].entries
        if isinstance(e, gen.Box)
    ]
    assert inner == ["q_norm", "k_norm", "o_proj"]


def test_page_embeds_every_diagram(gen):
    text = gen.PAGE.read_text(encoding="utf-8")
    for slug, (title, _) in gen.FAMILIES.items():
        assert f"## {title}\n" in text
        assert f"(../assets/diagrams/{slug}.svg)" in text


def test_page_keeps_the_navigation_and_jumps_to_every_diagram(gen):
    """Issue 27, item 9: the page hid the nav and the table of contents across eight tall
    diagrams, had no jump list, and claimed to draw every family the test suite covers."""
    from markdown.extensions.toc import slugify

    from torchlens import testing

    text = gen.PAGE.read_text(encoding="utf-8")
    assert not text.startswith("---"), "the page has front matter (it hid navigation and toc)"
    head, generated = text.split(gen.BEGIN, 1)
    assert "each model family the test suite covers" not in head
    first = generated.strip().split("\n", 1)[0]
    assert first.startswith("Jump to a diagram")
    assert f"{len(gen.FAMILIES)} of the {len(testing.FAMILIES)} families" in first
    for title, _ in gen.FAMILIES.values():
        assert f"[{title}](#{slugify(title, '-')})" in first


@pytest.mark.parametrize("slug", ["gpt2", "gemma-2", "olmo-2"])
def test_module_lookup_through_the_tables_is_the_target_finder(gen, slug):
    """The script finds a target's module through the public resolver (`module_of`); that is the
    module the internal target finder names, on every target the diagram draws."""
    from torchlens._naming import targets as _targets

    trace = gen.build(slug).trace
    for target in (
        "token_embed",
        "pos_embed",
        "ln1",
        "attention",
        "attn_post_norm",
        "ln2",
        "mlp",
        "mlp_post_norm",
    ):
        assert gen.module_of(trace, target) == _targets.find(trace, target, 0)[0], target
    with pytest.raises(LookupError, match="no naming table"):
        gen.module_of(trace, "no_such_target")
