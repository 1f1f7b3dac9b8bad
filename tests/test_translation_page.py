"""The translation page (docs/aliases/translation.md) must be what the naming tables give today.

`scripts/gen_translation_page.py --check` renders the page from the tables, resolving every name of
every generation on a trace of each family of `torchlens.testing.FAMILIES`; the first test runs it on
the working tree. The others check that the page covers every family, that its vLLM column comes from
names the serving page really uses, that an edited table makes the check fail, and that a row says
what `translate` says.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import script_modules

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing

gen = script_modules.load("gen_translation_page")


def _section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _row(section: str, address: str, facet: str) -> list[str]:
    """The site's cells across the section's two tables, as site, status, 2.x, 3.x, 4.x, nnterp,
    interp-engine and the vLLM hook (the first table holds the TransformerLens names, the second
    the status and the other libraries' names)."""
    shown = "{L}" + address.split("{L}", 1)[1] if "{L}" in address else address
    rows = [
        [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        for line in section.splitlines()
        if line.startswith(f"| `{shown}`<br>`{facet}` |")
    ]
    assert len(rows) == 2, (address, facet, rows)
    return rows[0][:1] + rows[1][1:2] + rows[0][1:] + rows[1][2:]


def test_the_committed_page_is_current(capsys):
    before = gen.PAGE.read_text(encoding="utf-8")
    rc = gen.main(["--check"])
    out = capsys.readouterr().out
    assert rc == 0, (
        f"stale translation page; run `python scripts/gen_translation_page.py` and commit it:\n{out}"
    )
    assert gen.PAGE.read_text(encoding="utf-8") == before, "--check must not write the page"


def test_the_page_says_which_versions_it_was_made_with_the_pinned_ones():
    """A status can change with transformers (a model's code changes), so the page names the versions it
    was computed with; the committed page is made in the environment constraints.txt pins."""
    pins = dict(
        re.findall(
            r"^(torch|transformers)==(\S+)$", (gen.ROOT / "constraints.txt").read_text(), re.M
        )
    )
    said = re.search(
        r"made with transformers (\S+) and torch (\S+?)\.\s", gen.PAGE.read_text(encoding="utf-8")
    )
    assert said, "the page does not say which transformers and torch it was made with"
    assert (said[1], said[2].split("+")[0]) == (pins["transformers"], pins["torch"]), (
        said.groups(),
        pins,
    )


def test_every_family_has_a_table_with_a_column_per_generation():
    text = gen.PAGE.read_text(encoding="utf-8")
    for family in testing.FAMILIES:
        section = _section(text, gen.TITLES[family])
        headers = [
            [c.strip() for c in line.strip("|").split("|")]
            for line in section.splitlines()
            if line.startswith("| site |")
        ]
        assert len(headers) == 2, (family, headers)
        first, second = headers
        assert first[:2] == ["site", "2.x"] and first[2].startswith("3.x"), first
        assert first[3:] == ["4.x"], first
        assert second[:4] == ["site", "status", "nnterp", "interp-engine"], second
        assert (second[4:] == ["vLLM hook"]) == (family in gen.VLLM_FAMILIES), (family, second)
        # the two tables list the same sites in the same order
        rows = [line.split(" | ", 1)[0] for line in section.splitlines() if line.startswith("| `")]
        assert rows[: len(rows) // 2] == rows[len(rows) // 2 :], family


def test_the_vllm_column_reads_names_the_serving_page_uses_and_the_3x_table_has():
    hooks, names = gen.serving_hooks(gen.SERVING.read_text(encoding="utf-8"))
    assert len(names) >= 14 and set(gen.VLLM_FAMILIES.values()) <= {
        w for c in hooks for w in re.findall(r"[\w-]+", c)
    }
    trace = tl.trace(testing.build("llama"), testing.token_ids(length=3))
    for name in names:  # each is a 3.x name (resolving raises UnknownAlias otherwise)
        mi.resolve_alias(trace, name.replace("{L}", "0"), generation="3.x")
    section = _section(gen.PAGE.read_text(encoding="utf-8"), "Llama")
    assert (
        _row(section, "model.layers.{L}", "resid_mid")[-1] == "`model.layers.{L}` output element 1"
    )
    assert _row(section, "model.layers.{L}.self_attn", "pattern")[-1].startswith("no tensor")


def test_a_row_says_what_translate_says_gemma2_hook_mlp_out():
    """On Gemma-2, 2.x hook_mlp_out reads the post-MLP norm's output: neither 4.x nor nnterp has a name for it."""
    section = _section(gen.PAGE.read_text(encoding="utf-8"), "Gemma-2")
    cells = _row(section, "model.layers.{L}.post_feedforward_layernorm", "output")
    assert cells[2] == "`blocks.{L}.hook_mlp_out`" and cells[4] == "—" and cells[5] == "—"
    for target in ("4.x", "nnterp"):
        assert (
            mi.translate(
                "blocks.0.hook_mlp_out",
                from_generation="2.x",
                to_generation=target,
                family="gemma2",
            ).status
            == "no_name"
        )
    gpt2 = _row(
        _section(gen.PAGE.read_text(encoding="utf-8"), "GPT-2"), "transformer.h.{L}.mlp", "output"
    )
    assert (
        cells != gpt2 and gpt2[4] == "`blocks.{L}.mlp.hook_out`" and gpt2[5] == "`mlps_output[{L}]`"
    )


def disagreements(section: str, trace: tl.Trace) -> list[tuple]:
    """Where a family's section and `resolve_alias` disagree: each name of a row, at layers 0 and 1, must
    resolve to the row's module (block `{L}`'s shorthand and `{L}` filled in), facet and call, with one of
    the row's statuses; each name listed as `ambiguous` must resolve `ambiguous` at both layers."""
    block = re.search(r"lock `\{L\}` is `([^`]+)`, and a site inside", section)
    found, kind = [], None
    for line in section.splitlines():
        if line.startswith("| site |"):
            kind = "status" if "status" in line else "names"
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        address, facet, *call = re.findall(r"`([^`]+)`", cells[0])
        if block and address.startswith("{L}"):
            address = block[1] + address[len("{L}") :]
        if kind == "names":
            names = dict(zip(("2.x", "3.x", "4.x"), cells[1:4]))
            statuses = None
        else:
            names = dict(zip(("nnterp", "interp-engine"), cells[2:4]))
            statuses = set(re.findall(r">(\w+)</span>", cells[1]))
        for generation, cell in names.items():
            for name in re.findall(r"`([^`]+)`", cell):
                for layer in ("0", "1") if "{L}" in name else ("",):
                    r = mi.resolve_alias(trace, name.replace("{L}", layer), generation=generation)
                    want = (
                        address.replace("{L}", layer),
                        facet,
                        int(call[0].replace("{L}", layer)) if call else None,
                    )
                    if (r.module_address or "<root>", r.facet, r.call) != want or (
                        statuses and r.status not in statuses
                    ):
                        found.append(
                            (name, layer, want, (r.module_address, r.facet, r.call, r.status))
                        )
    listed = section.split("resolve `ambiguous` on", 1)[1:]
    for generation, names in re.findall(
        r"^- ([\w.-]+): (.*)$", "".join(listed).split("\n\nNames with no site")[0], re.M
    ):
        for name in re.findall(r"`([^`]+)`", names):
            for layer in ("0", "1"):
                status = mi.resolve_alias(
                    trace, name.replace("{L}", layer), generation=generation
                ).status
                if status != "ambiguous":
                    found.append((name, layer, "ambiguous", status))
    return found


@pytest.mark.parametrize("family", sorted(testing.FAMILIES))
def test_every_name_resolves_where_its_row_says_at_layers_0_and_1(family):
    """Every family of the page: shared-layer (ALBERT), two-stack (T5, BART, LLaVA), no-block
    (CLIP) and plain ones."""
    args, kwargs = testing.inputs(family)
    trace = tl.trace(testing.build(family), *args, save="all", **kwargs)
    section = _section(gen.PAGE.read_text(encoding="utf-8"), gen.TITLES[family])
    assert not disagreements(section, trace)


def test_the_page_writes_layer_l_of_every_stack_and_call_l_of_a_shared_layer():
    text = gen.PAGE.read_text(encoding="utf-8")
    t5 = _section(text, "T5")
    assert "| `encoder.block.{L}`<br>`resid_pre` | `encoder.{L}.hook_resid_pre` |" in t5
    assert "encoder.block.0" not in t5
    albert = _section(text, "ALBERT")
    assert (
        "layer `{L}` is call `{L}` of `albert.encoder.albert_layer_groups.0.albert_layers.0`"
        in albert
    )
    assert "albert_layers.{L}" not in albert and "albert_layers.1" not in albert
    assert (
        "| `albert.encoder.albert_layer_groups.0.albert_layers.0`<br>`resid_pre`<br>call `{L}` |"
        in albert
    )
    # a global name that reads block 0 only has a row of its own, not the per-layer one
    bert = _section(text, "BERT")
    assert "| `bert.encoder.layer.0`<br>`resid_pre` | `hook_full_embed` |" in bert
    clip = _section(text, "CLIP")
    assert "2 stacks of layers, `vision_model.encoder.layers.{L}` (2 layers) and" in clip
    assert "(none)" not in clip and "0 layers" not in clip
    ambiguous = clip.split("resolve `ambiguous` on CLIP", 1)[1].split("Names with no site", 1)[0]
    assert "`blocks.{L}.hook_resid_pre`" in ambiguous


def test_the_disagreement_check_finds_a_layer_0_address_and_a_missing_call():
    trace = tl.trace(testing.build("albert"), testing.token_ids(length=3))
    row = "| `albert.encoder.albert_layer_groups.0.albert_layers.{L}`<br>`resid_pre` | `blocks.{L}.hook_resid_pre` | — | — |"
    assert [d[1] for d in disagreements("| site |\n" + row, trace)] == ["0", "1"]
    trace = tl.trace(testing.build("t5"), *testing.inputs("t5")[0], **testing.inputs("t5")[1])
    row = "| `encoder.block.0`<br>`resid_pre` | `encoder.{L}.hook_resid_pre` | — | — |"
    assert [d[1] for d in disagreements("| site |\n" + row, trace)] == ["1"]


def test_an_edited_table_changes_the_page(monkeypatch):
    vllm, _ = gen.serving_hooks(gen.SERVING.read_text(encoding="utf-8"))
    before = "\n".join(gen.family_section("gpt2", vllm))
    table = mi.GENERATIONS["nnterp"]
    rows = [
        dataclasses.replace(r, facet="resid_pre") if r.name == "layers_output[{L}]" else r
        for r in table.rows
    ]
    monkeypatch.setitem(mi.GENERATIONS, "nnterp", dataclasses.replace(table, rows=tuple(rows)))
    after = "\n".join(gen.family_section("gpt2", vllm))
    assert before != after
    assert "`layers_input[{L}]`<br>`layers_output[{L}]`" in after


@pytest.mark.parametrize("generation", list(mi.GENERATIONS))
def test_every_name_of_every_table_is_on_the_page_or_an_alias_page(generation):
    """Search finds a name only where a page prints it: the translation page (by family) or its alias page."""
    slug = {"2.x": "tl-2x", "3.x": "tl-3x", "4.x": "tl-4x"}.get(generation, generation)
    text = gen.PAGE.read_text(encoding="utf-8")
    alias = (gen.ROOT / "docs" / "aliases" / f"{slug}.md").read_text(encoding="utf-8")
    for row in mi.GENERATIONS[generation].rows:
        assert f"`{row.name}`" in text + alias, row.name
