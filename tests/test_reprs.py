"""How traces and reports print: `repr`, `summary()` and the notebook `_repr_html_` tables.

The text reprs are what a terminal or a doc example shows; the HTML reprs are what Jupyter
shows. Both must be compact, name every row, escape what they print, and not lie about sites
(a name without a site shows no `module:facet`).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
import torch
import transformers

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens._naming.results import AliasReport, AliasResolution
from torchlens.mechinterp import Comparison, ComparisonReport


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.tensor([[1, 2, 3, 4]])


@pytest.fixture(scope="module")
def trace(model, ids):
    return tl.trace(model, ids, save="all")


@pytest.fixture(scope="module")
def partial(model, ids):
    return tl.trace(model, ids, save=["resid_post"])


def _parse(markup: str) -> ET.Element:
    """The HTML reprs are well-formed XML (every value escaped): parse them as such."""
    return ET.fromstring(markup)


def _rows(table: ET.Element) -> list[list[str]]:
    return [
        ["".join(td.itertext()) for td in tr.findall("td")]
        for tr in table.find("tbody").findall("tr")
    ]


def _header(table: ET.Element) -> list[str]:
    return ["".join(th.itertext()) for th in table.find("thead").iter("th")]


# -- Trace ----------------------------------------------------------------------------------------


def test_trace_repr_is_one_compact_line(trace):
    text = repr(trace)
    assert "\n" not in text and len(text) < 100
    assert re.fullmatch(
        r"Trace\(GPT2LMHeadModel: \d+ ops, 34 modules, 2 blocks, \d+ tensors saved\)", text
    )


def test_summary_lists_the_modules_that_ran(trace):
    lines = trace.summary().splitlines()
    assert lines[0].split() == ["module", "role", "calls", "facets"]
    assert re.fullmatch(
        r"\(\* = exists but not saved(; \d+ facets are checked on first read or by trace\.check\(\))?\)",
        lines[-1],
    ), lines[-1]
    block = next(line for line in lines if line.startswith("transformer.h.1 "))
    assert block.split()[1:3] == ["block", "1"] and "resid_post[1, 4, 32]" in block
    assert lines[1].startswith("<root>")
    assert len(trace.summary(max_rows=3).splitlines()) == 1 + 3 + 1


def test_trace_html_is_the_summary_as_a_table(trace):
    table = _parse(trace._repr_html_())
    assert table.get("class") == "tl-repr"
    assert table.find("caption").text == repr(trace)
    assert _header(table) == ["module", "role", "calls", "facets"]
    rows = _rows(table)
    note = rows.pop()
    summary_addresses = [line.split()[0] for line in trace.summary().splitlines()[1:-1]]
    assert [r[0] for r in rows] == summary_addresses  # same modules, same order, <root> escaped
    block = next(r for r in rows if r[0] == "transformer.h.1")
    assert block[1:3] == ["block", "1"] and "resid_post[1, 4, 32]" in block[3]
    assert "read-only" in note[0] and "not saved" not in note[0]
    # computed facets (a LayerNorm's statistics, per-head results) are set in italics
    codes = {c.text: c.get("style", "") for c in table.iter("code")}
    assert "font-style:italic" in codes["result[1, 4, 2, 32]"]
    assert "italic" not in codes["resid_post[1, 4, 32]"]


def test_trace_html_marks_unsaved_facets(partial):
    table = _parse(partial._repr_html_())
    rows = _rows(table)
    block = next(r for r in rows if r[0] == "transformer.h.0")
    assert "resid_post[1, 4, 32]" in block[3] and "resid_pre[1, 4, 32]*" in block[3]
    assert "* exists but not saved." in rows[-1][0]
    unsaved = [c for c in table.iter("code") if (c.text or "").endswith("*")]
    assert unsaved and all("color:#8c959f" in c.get("style", "") for c in unsaved)
    assert all("not saved" in c.get("title", "") for c in unsaved)


def test_trace_html_says_how_many_modules_it_left_out(trace):
    rows = _rows(_parse(trace._repr_html_(max_rows=5)))
    assert len(rows) == 5 + 1
    ran = sum(1 for r in trace.modules.values() if r.calls)
    assert rows[-1][0].startswith(f"{ran - 5} more modules ran; trace.summary() lists them all.")


# -- AliasResolution and AliasReport ----------------------------------------------------------


def test_resolution_repr_names_the_site(trace):
    r = mi.resolve_alias(trace, "layers_output[1]")
    assert (
        repr(r)
        == "AliasResolution('layers_output[1]' -> transformer.h.1:resid_post [real], generation='nnterp')"
    )
    assert repr(mi.resolve_alias(trace, "logits")).startswith(
        "AliasResolution('logits' -> <root>:logits [real]"
    )
    absent = mi.resolve_alias(trace, "attn_gate.0")
    assert "-:- [structurally_absent]" in repr(absent)


def test_report_prints_as_a_table(trace):
    report = mi.alias_report(trace, generation="nnterp")
    lines = repr(report).splitlines()
    assert lines[0].split() == ["name", "status", "site"]
    assert len(lines) == 1 + len(report) + 1
    assert lines[-1] == "(19 names: 17 real, 2 reconstructed_read_only)"
    # columns line up: every status starts where the header's does
    col = lines[0].index("status")
    assert all(line[col - 2 : col] == "  " and line[col] != " " for line in lines[1:-1])
    assert any(line.split() == ["logits", "real", "<root>:logits"] for line in lines)
    assert str(report) == repr(report)


def test_report_marks_the_rows_whose_check_has_not_run(model, ids):
    fresh = tl.trace(model, ids)
    lines = repr(mi.alias_report(fresh, generation="nnterp")).splitlines()
    probs = next(line for line in lines if line.startswith("attention_probabilities[1] "))
    assert probs.split()[1:] == [
        "reconstructed_read_only",
        "transformer.h.1.attn:pattern",
        "(not",
        "checked",
        "yet)",
    ]
    assert (
        sum(line.endswith("(not checked yet)") for line in lines) == 2
    )  # the two rebuilt patterns
    row = next(
        r
        for r in mi.alias_report(fresh, generation="nnterp")
        if r.query == "attention_probabilities[1]"
    )
    assert repr(row).endswith("[reconstructed_read_only, not checked yet], generation='nnterp')")
    fresh.check()
    lines = repr(mi.alias_report(fresh, generation="nnterp")).splitlines()
    assert lines[-1] == "(19 names: 17 real, 2 reconstructed_read_only)"
    assert "not checked" not in "\n".join(lines)


def test_report_gives_the_reason_instead_of_a_site_that_is_not_there(trace):
    report = mi.alias_report(trace, generation="interp-engine")
    text = repr(report)
    gated = next(line for line in text.splitlines() if line.startswith("mlp_pre_linear.0 "))
    assert "transformer.h.0.mlp:pre_linear" not in gated
    assert (
        gated.split()[1] == "structurally_absent"
        and "  - transformer.h.0.mlp (GPT2MLP) has no" in gated
        and "not gated" in gated
    )
    assert (
        next(line for line in text.splitlines() if line.startswith("attn_gate ")).split()[2] == "-"
    )


def test_report_html(trace, partial):
    report = mi.alias_report(partial, generation="nnterp")
    table = _parse(report._repr_html_())
    assert _header(table) == ["name", "status", "site", "shape", "reason"]
    rows = _rows(table)
    assert rows.pop()[0] == "19 names: 17 needs_capture, 2 real"
    assert [r[0] for r in rows] == [r.query for r in report]
    needs = next(r for r in rows if r[0] == "layers_input[0]")
    assert needs[1:4] == ["needs_capture", "transformer.h.0:resid_pre", "[1, 4, 32]"]
    assert "Remedy: trace again with save='all'" in needs[4]
    real = next(r for r in rows if r[0] == "layers_output[0]")
    assert "Remedy" not in real[4]
    spans = {s.text: s.get("style") for s in table.iter("span")}
    assert spans["real"] == "color:#2e7d32" and spans["needs_capture"] == "color:#ef6c00"
    one = _parse(mi.resolve_alias(trace, "blocks.0.attn.hook_pattern")._repr_html_())
    assert len(_rows(one)) == 1  # a single resolution has no count line


def test_empty_reports():
    assert repr(AliasReport()) == "AliasReport([])"
    assert repr(ComparisonReport()) == "ComparisonReport([])"
    assert _rows(_parse(AliasReport()._repr_html_())) == []
    assert _rows(_parse(ComparisonReport()._repr_html_())) == []


def test_html_escapes_what_it_prints():
    nasty = AliasResolution(
        "<b>x</b>&",
        "2.x",
        "structurally_absent",
        None,
        None,
        None,
        "a <reason> & more",
        "",
        "p",
        "m",
    )
    markup = AliasReport([nasty, nasty])._repr_html_()
    assert "<b>" not in markup and "&lt;b&gt;x&lt;/b&gt;&amp;" in markup
    rows = _rows(_parse(markup))
    assert rows[0][0] == "<b>x</b>&" and rows[0][4] == "a <reason> & more" and rows[0][2] == ""


# -- ComparisonReport -----------------------------------------------------------------------------


def test_comparison_report(trace, model, ids):
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    report = mi.compare(
        trace,
        {
            "layers_output[0]": hidden[1],
            "blocks.1.hook_resid_pre": hidden[1] + 1,  # block 1 reads block 0's output
            "blocks.0.attn.hook_rot_q": hidden[0],
        },
    )
    lines = repr(report).splitlines()
    assert lines[0].split()[:4] == ["name", "ok", "max", "|diff|"]
    assert lines[1].split()[:5] == [
        "layers_output[0]",
        "yes",
        "0",
        "real",
        "transformer.h.0:resid_post",
    ]
    assert lines[2].split()[:4] == ["blocks.1.hook_resid_pre", "NO", "1", "real"]
    absent = lines[3].split()
    assert absent[:5] == ["blocks.0.attn.hook_rot_q", "NO", "-", "structurally_absent", "-"]
    assert lines[-1] == "(3 compared: 1 agree, 2 do not)"

    table = _parse(report._repr_html_())
    assert _header(table) == ["name", "ok", "max |diff|", "status", "site", "hint"]
    rows = _rows(table)
    assert rows[-1] == ["3 compared: 1 agree, 2 do not"]
    assert rows[0][:5] == ["layers_output[0]", "yes", "0", "real", "transformer.h.0:resid_post"]
    assert rows[2][1:5] == ["no", "", "structurally_absent", "-"]
    assert "no RoPE" in rows[2][5]


def test_comparison_layout_is_shown(trace):
    z = trace.modules["transformer.h.0.attn"].facets["z"]
    report = mi.compare(trace, {"blocks.0.attn.hook_z": z.transpose(1, 2)[0]})
    assert "[token-major, batch dropped]" in repr(report)
    assert "[token-major, batch dropped]" in report._repr_html_()
    row = Comparison("n", "real", "", "logits", (1,), (1,), "as is", 0.0, True)
    assert "<root>:logits" in repr(ComparisonReport([row]))


# -- FacetSite and trace[name] ---------------------------------------------------------------------


def test_facet_site_repr_is_one_line_without_the_tensor(model, ids, trace, partial):
    site = trace.modules["transformer.h.1"].facets.site("resid_post")
    text = repr(site)
    assert "\n" not in text and "tensor(" not in text and len(text) < 120, text
    assert re.fullmatch(
        r"FacetSite\(resid_post: \[1, 4, 32\] float32, real, op #\d+, saved\)", text
    ), text
    # save= did not keep it, so it is never rebuilt: no check ran, none is pending
    pattern = partial.modules["transformer.h.1.attn"].facets.site("pattern")
    assert re.fullmatch(
        r"FacetSite\(pattern: \[1, 2, 4, 4\] float32, reconstructed, op #\d+, not saved\)",
        repr(pattern),
    ), repr(pattern)
    # kept: rebuilt and checked on first read, and the repr says which it is
    facets = tl.trace(model, ids).modules["transformer.h.1.attn"].facets
    pending = r"FacetSite\(pattern: \[1, 2, 4, 4\] float32, reconstructed, op #\d+, check pending, saved\)"
    assert re.fullmatch(pending, repr(facets.site("pattern"))), repr(facets.site("pattern"))
    assert "pattern[1, 2, 4, 4] reconstructed check pending" in repr(facets)
    facets["pattern"]
    checked = r"FacetSite\(pattern: \[1, 2, 4, 4\] float32, reconstructed, op #\d+, check error \S+, saved\)"
    assert re.fullmatch(checked, repr(facets.site("pattern"))), repr(facets.site("pattern"))
    assert "check pending" not in repr(facets.site("scores"))  # checked together with the pattern


def test_trace_getitem_reads_sites_and_other_libraries_names(model, ids, trace):
    """`trace[...]` against a forward hook on the block itself (ground truth outside TorchLens)."""
    seen = {}
    handle = model.transformer.h[1].register_forward_hook(
        lambda m, a, out: seen.setdefault("out", out if torch.is_tensor(out) else out[0])
    )
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    for name in (
        "transformer.h.1:resid_post",
        "blocks.1.hook_resid_post",
        "layers_output[1]",
        "resid_post.1",
    ):
        torch.testing.assert_close(trace[name], seen["out"], rtol=0, atol=0, msg=name)
    assert torch.equal(trace["<root>:logits"], trace.output.logits)


def test_trace_getitem_errors_teach(trace, partial):
    with pytest.raises(tl.FacetNotFound, match="resid_post"):
        trace["transformer.h.1:resid_pst"]
    with pytest.raises(tl.ModuleNotFoundInTrace, match="transformer.h.1"):
        trace["transformer.h.7:resid_post"]
    with pytest.raises(mi.UnknownAlias, match="hook_resid_post"):
        trace["blocks.1.hook_resid_pst"]
    with pytest.raises(tl.FacetNotSaved, match="save="):
        partial["blocks.1.hook_resid_pre"]
    with pytest.raises(mi.AliasError, match="structurally_absent"):
        trace["blocks.0.hook_attn_in"]
    with pytest.raises(KeyError, match="trace.ops"):
        trace[3]


# -- wording of reports and errors -------------------------------------------------------------------


def test_report_reasons_do_not_nest_parentheses(trace):
    for line in str(mi.alias_report(trace, generation="2.x")).splitlines()[1:-1]:
        if "  - " in line:
            reason = line.split("  - ", 1)[1]
            assert not reason.startswith("(") and not reason.endswith("."), line


def test_a_name_from_another_generation_gets_this_generations_name(trace):
    with pytest.raises(mi.UnknownAlias) as error:
        mi.resolve_alias(trace, "blocks.0.attn.hook_pattern", generation="nnterp")
    assert "in nnterp the same site is 'attention_probabilities[0]'" in str(error.value)
    assert "2.x" in str(error.value)
    # The suggestion resolves to the same site as the name in its own generation.
    assert (
        mi.resolve_alias(trace, "attention_probabilities[0]", generation="nnterp").facet
        == mi.resolve_alias(trace, "blocks.0.attn.hook_pattern", generation="2.x").facet
        == "pattern"
    )
    with pytest.raises(
        mi.UnknownAlias, match=r"in 2\.x the same site is 'blocks\.1\.hook_resid_post'"
    ):
        mi.resolve_alias(trace, "layers_output[1]", generation="2.x")
    with pytest.raises(
        mi.UnknownAlias, match=r"nnterp has no name for its site; pass generation='2\.x'"
    ):
        mi.resolve_alias(trace, "blocks.0.attn.hook_q", generation="nnterp")


def test_a_module_without_a_role_is_not_called_the_other_module(trace):
    with pytest.raises(tl.FacetNotFound) as error:
        trace.modules["transformer.drop"].facets["resid_post"]
    assert trace.modules["transformer.drop"].role == "other"
    assert str(error.value).startswith("the module 'transformer.drop' has no facet"), str(
        error.value
    )


def test_facets_are_listed_in_forward_order(trace):
    assert list(trace.modules["transformer.h.0"].facets.sites) == [
        "input",
        "resid_pre",
        "resid_mid",
        "resid_post",
        "output",
    ]
    mlp = list(trace.modules["transformer.h.0.mlp"].facets.sites)
    assert mlp == ["input", "pre", "act", "post", "down_out", "output"]
    row = next(line for line in trace.summary().splitlines() if line.startswith("transformer.h.1 "))
    assert (
        row.index("resid_pre")
        < row.index("resid_mid")
        < row.index("resid_post")
        < row.index("output")
    )


def test_trace_html_folds_the_rolled_op_graph_under_the_table(trace):
    """The notebook view of a trace shows its rolled op graph (what `trace.draw()` returns), folded
    in the table's footer; a trace too large for it says how to draw it instead."""
    table = _parse(trace._repr_html_())
    footer = table.find("tfoot")
    svg = footer.find(".//{http://www.w3.org/2000/svg}svg")
    assert svg is not None and footer.find(".//summary").text.startswith("op graph")
    drawn = ET.fromstring(trace.draw())
    svg.tail = drawn.tail = None
    assert ET.tostring(svg) == ET.tostring(drawn)
    small = type(trace).REPR_DRAWING_NODES
    try:
        type(trace).REPR_DRAWING_NODES = 5
        footer = _parse(trace._repr_html_()).find("tfoot")
        assert footer.find(".//{http://www.w3.org/2000/svg}svg") is None
        assert "trace.draw(focus=" in "".join(footer.itertext())
    finally:
        type(trace).REPR_DRAWING_NODES = small


def test_a_module_with_no_facet_saved_still_lists_its_facets_starred(partial):
    """Under `save=["resid_post"]` the attention saves nothing: `summary()` and the notebook
    table still list every facet it has, each starred (exists, not saved), as the docs say."""
    attn = partial.modules["transformer.h.0.attn"].calls[0].facets
    assert len(attn) == 0 and attn.sites  # nothing saved, facets exist
    row = next(
        line for line in partial.summary().splitlines() if line.startswith("transformer.h.0.attn ")
    )
    for name, site in attn.sites.items():
        assert f"{name}{list(site.shape)}*" in row
    html_table = partial._repr_html_()
    assert "pattern[1, 2, 4, 4]*" in html_table
