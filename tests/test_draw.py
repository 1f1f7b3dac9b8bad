"""`Trace.draw`: the op graph drawn, checked against the records and against plain forward hooks.

Ground truth comes from outside the drawing code: the node and edge counts are counted here from
`OpRecord.inputs` (each distinct producer -> consumer pair of a `Ref` is one arrow, each distinct
parameter one node); a highlighted name's mark must sit on the op whose output equals what a plain
`register_forward_hook` / `register_forward_pre_hook` saw at the module that library hooks; the
SVG is parsed with `xml.etree`. Rolled counts are one layer's ops plus the ops outside the stack.

Tests internals: `torchlens._draw` (its error classes, `MAX_NODES`, and `_layout` to show a refusal
comes before any layout).
"""

from __future__ import annotations

import re
import sys
import warnings
import xml.etree.ElementTree as ET

import pytest
import torch
import transformers

import torchlens as tl
from torchlens import _draw, testing
from torchlens._drawing import style
from torchlens.mechinterp import UnknownAlias, UnknownGeneration

SVG = "{http://www.w3.org/2000/svg}"


def _trace(family="gpt2", save="all", **settings):
    return tl.trace(testing.build(family, **settings), testing.token_ids(length=4), save=save)


@pytest.fixture(scope="module")
def gpt2():
    return _trace("gpt2")


def _groups(svg: str, cls: str) -> list[ET.Element]:
    root = ET.fromstring(svg)
    return [g for g in root.iter(SVG + "g") if g.get("class", "").split()[:2] == ["node", cls]]


def _edges(svg: str, kind: str) -> list[ET.Element]:
    root = ET.fromstring(svg)
    return [p for p in root.iter(SVG + "path") if p.get("class", "") == f"edge {kind}"]


def _flow_pairs(ops) -> set[tuple[int, int]]:
    return {(r.op, op.index) for op in ops for r in op.inputs if type(r) is tl.Ref}


def _param_pairs(ops) -> set[tuple[str, int]]:
    return {(r, op.index) for op in ops for r in op.inputs if isinstance(r, str)}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_unrolled_nodes_and_edges_are_the_recorded_ops_and_data_flow(family):
    trace = _trace(family)
    svg = trace.draw(rolled=False)
    ops = [int(g.get("data-op")) for g in _groups(svg, "op") + _groups(svg, "input")]
    assert sorted(ops) == list(range(len(trace.ops)))
    params = sorted(g.get("data-param") for g in _groups(svg, "param"))
    assert params == sorted({name for name, _ in _param_pairs(trace.ops)})
    flow = {(int(p.get("data-src")[1:]), int(p.get("data-dst")[1:])) for p in _edges(svg, "flow")}
    assert len(_edges(svg, "flow")) == len(flow) == len(_flow_pairs(trace.ops))
    assert flow == _flow_pairs(trace.ops)
    assert len(_edges(svg, "param_edge")) == len(_param_pairs(trace.ops))
    assert len(_edges(svg, "output_edge")) == 1 and len(_groups(svg, "output")) == 1
    # each op node says its index and name
    texts = {g.get("data-op"): [t.text for t in g.iter(SVG + "text")] for g in _groups(svg, "op")}
    assert all(
        texts[str(op.index)][0] in (f"#{op.index} {op.name}", f"#{op.index} written in place")
        for op in trace.ops
        if op.name != "input"
    )


def _layer_ops(trace, layers):
    return sum(layer.call.end_op - layer.call.first_op for layer in layers)


def test_rolled_draws_one_layer_and_the_rest():
    trace = _trace("gpt2", n_layer=4)
    layers = trace.structure.stacks["transformer.h"].layers
    d = trace.draw()
    drawn = len(_groups(d, "op")) + len(_groups(d, "input"))
    outside = len(trace.ops) - _layer_ops(trace, layers)
    assert drawn == outside + _layer_ops(trace, layers[:1])
    assert d.groups == [("transformer.h", (0, 1, 2, 3), "")]
    root = ET.fromstring(d)
    box = next(g for g in root.iter(SVG + "g") if "group" in g.get("class", "").split())
    label = next(g for g in root.iter(SVG + "g") if g.get("data-box") == box.get("id"))
    assert box.get("data-layers") == "0–3" and any(
        "×4" in (t.text or "") for t in label.iter(SVG + "text")
    )
    # the arrows from one layer into the next are drawn into the one drawn layer, dashed
    assert len(_edges(d, "loop")) >= 1


def test_layers_that_differ_are_drawn_apart_with_the_reason():
    import transformers

    config = transformers.Qwen2MoeConfig(
        num_hidden_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        vocab_size=testing.VOCAB,
        max_position_embeddings=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        mlp_only_layers=[0],
    )
    model = testing.from_config(config, transformers.Qwen2MoeForCausalLM)
    trace = tl.trace(model, testing.token_ids(length=4), save="none")
    layers = trace.structure.layers
    d = trace.draw()
    by_layers = {g[1]: g[2] for g in d.groups}
    assert 0 in next(k for k in by_layers if 0 in k) and (0,) in by_layers
    assert "Qwen2MoeMLP" in by_layers[(0,)] and "Qwen2MoeSparseMoeBlock" in by_layers[(0,)], (
        by_layers
    )
    drawn = len(_groups(d, "op")) + len(_groups(d, "input"))
    reps = [layers[g[1][0]] for g in d.groups]
    assert drawn == len(trace.ops) - _layer_ops(trace, layers) + _layer_ops(trace, reps)
    assert "drawn apart" in "".join(t.text or "" for t in ET.fromstring(d).iter(SVG + "text"))


def test_a_block_called_twice_is_drawn_apart():
    import transformers

    config = transformers.AlbertConfig(
        num_hidden_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=48,
        vocab_size=testing.VOCAB,
        max_position_embeddings=32,
        embedding_size=16,
    )
    trace = tl.trace(
        testing.from_config(config, transformers.AlbertForMaskedLM),
        testing.token_ids(length=4),
        save="none",
    )
    ((first, again),) = [trace.draw().groups]
    assert first[1] == (0,) and first[2] == ""
    assert (
        again[1] == (1, 2)
        and "already ran as an earlier layer" in again[2]
        and "layer 0" in again[2]
    )


def test_a_sliding_window_layer_is_drawn_apart():
    trace = _trace("gemma2", save="none")
    groups = trace.draw().groups
    assert [g[1] for g in groups] == [(0,), (1,)] and groups[1][2].startswith("its op "), groups


class _TwoStreamBlock(torch.nn.Module):
    """Takes and returns (hidden, residual), adding them first (the fused add-and-norm layers)."""

    def __init__(self):
        super().__init__()
        self.norm, self.lin = torch.nn.LayerNorm(8), torch.nn.Linear(8, 8)

    def forward(self, h, res):
        res = h + res
        return self.lin(self.norm(res)), res


class _TwoStream(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_TwoStreamBlock() for _ in range(4)])

    def forward(self, x):
        h, res = x, torch.zeros_like(x)
        for layer in self.layers:
            h, res = layer(h, res)
        return h + res


def test_layers_handed_the_layer_befores_residual_are_drawn_once():
    """A layer's second input made by the layer before (its residual) is the same place for every
    layer: layers 1-3 are one group; layer 0 reads a tensor made outside the stack and is apart,
    saying so (it was every layer apart, blamed on "a mask, bias or table")."""
    torch.manual_seed(0)
    trace = tl.trace(_TwoStream().eval(), torch.randn(2, 8))
    groups = trace.draw().groups
    assert [g[1] for g in groups] == [(0,), (1, 2, 3)], groups
    assert "computed outside the layers" in groups[0][2] and "the layer before" in groups[0][2]


def test_layers_reading_equal_constants_made_outside_are_drawn_once():
    """A cache makes one `torch.tensor(window)` per layer outside the layers; with their values
    kept, equal ones do not split identical layers (Mistral's sliding window: 3 groups before).
    Ground truth: the attention patterns HF returns are the same shape of band in every layer."""
    config = transformers.MistralConfig(
        num_hidden_layers=3,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=testing.VOCAB,
        max_position_embeddings=32,
        sliding_window=2,
    )
    model = testing.from_config(config, transformers.MistralForCausalLM, "eager")
    ids = testing.token_ids(length=6)
    with torch.no_grad():
        zeros = {int((a == 0).sum()) for a in model(ids, output_attentions=True).attentions}
    assert len(zeros) == 1
    groups = tl.trace(model, ids).draw().groups
    assert [g[1] for g in groups] == [(0, 1, 2)], groups


def test_highlight_facets_marks_a_site_whose_check_fails_refused_before_it_is_read():
    """DistilBERT's resid_mid check fails (the block's residual add is followed by its norm
    before the MLP): the drawing runs the pending checks of what it marks, so it does not show
    the site as real until someone reads it."""
    trace = tl.trace(testing.build("distilbert"), testing.token_ids(length=4))
    block = "distilbert.transformer.layer.0"
    first = trace.draw(focus=block, highlight="facets")
    with pytest.raises(tl.FacetNotFound):
        trace.modules[block].calls[0].facets["resid_mid"]
    assert trace.draw(focus=block, highlight="facets") == first
    assert f"{block}:resid_mid is refused" in first


# -- highlight ------------------------------------------------------------------------------------

#: name -> (module address pattern, "output" or "input"): where each library reads, as its own
#: documentation says, for a decoder block `L` (GPT-2 addresses; Llama's below).
WHERE = {
    ("2.x", "blocks.1.hook_resid_pre"): ("block", "input"),
    ("2.x", "blocks.1.hook_resid_post"): ("block", "output"),
    ("2.x", "blocks.1.hook_attn_out"): ("attn", "output"),
    ("2.x", "blocks.1.hook_mlp_out"): ("mlp", "output"),
    ("2.x", "blocks.1.hook_mlp_in"): ("ln2", "input"),
    ("4.x", "blocks.1.hook_in"): ("block", "input"),
    ("4.x", "blocks.1.hook_out"): ("block", "output"),
    ("4.x", "blocks.1.attn.hook_out"): ("attn", "output"),
    ("4.x", "blocks.1.mlp.hook_in"): ("mlp", "input"),
    ("4.x", "blocks.1.mlp.hook_out"): ("mlp", "output"),
    ("nnterp", "layers_input[1]"): ("block", "input"),
    ("nnterp", "layers_output[1]"): ("block", "output"),
    ("nnterp", "attentions_output[1]"): ("attn", "output"),
    ("nnterp", "mlps_input[1]"): ("mlp", "input"),
    ("nnterp", "mlps_output[1]"): ("mlp", "output"),
}
MODULES = {
    "gpt2": {
        "block": "transformer.h.1",
        "attn": "transformer.h.1.attn",
        "mlp": "transformer.h.1.mlp",
        "ln2": "transformer.h.1.ln_2",
    },
    "llama": {
        "block": "model.layers.1",
        "attn": "model.layers.1.self_attn",
        "mlp": "model.layers.1.mlp",
        "ln2": "model.layers.1.post_attention_layernorm",
    },
}


def _hooked_inputs(model, addresses, ids) -> dict[str, torch.Tensor]:
    """What a plain forward pre-hook saw as each module's first positional input (or hidden_states)."""
    seen, mods, handles = {}, dict(model.named_modules()), []
    try:
        for a in addresses:

            def hook(module, args, kwargs, a=a):
                x = args[0] if args else kwargs["hidden_states"]
                seen[a] = x.detach().clone()

            handles.append(mods[a].register_forward_pre_hook(hook, with_kwargs=True))
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_each_mark_sits_on_the_op_whose_output_a_plain_hook_saw(family):
    model = testing.build(family)
    ids = testing.token_ids(length=4)
    mods = MODULES[family]
    outputs = testing.hooked_outputs(model, mods.values(), ids)
    inputs = _hooked_inputs(model, mods.values(), ids)
    trace = tl.trace(model, ids, save="all")
    highlight: dict[str, list[str]] = {}
    for gen, name in WHERE:
        highlight.setdefault(gen, []).append(name)
    svg = trace.draw(rolled=False, highlight=highlight)
    marks = {}
    for g in ET.fromstring(svg).iter(SVG + "g"):
        if g.get("class", "").startswith("node "):
            for m in g.iter(SVG + "g"):
                if m.get("class") == "mark":
                    marks[(m.get("data-generation"), m.get("data-name"))] = (
                        int(g.get("data-op")),
                        m.get("data-status"),
                    )
    assert set(marks) == set(WHERE), set(WHERE) ^ set(marks)
    for key, (role, side) in WHERE.items():
        op, status = marks[key]
        truth = (outputs if side == "output" else inputs)[mods[role]]
        assert status == "real", key
        assert torch.equal(trace.ops[op].tensor, truth), (key, op, trace.ops[op])


def test_several_generations_share_one_picture_and_names_without_a_site_are_listed(gpt2):
    d = gpt2.draw(
        focus="transformer.h.1",
        highlight={
            "2.x": ["blocks.1.hook_resid_post", "hook_pos_embed", "blocks.0.hook_resid_post"],
            "nnterp": ["layers_output[1]"],
        },
    )
    marks = [m for m in ET.fromstring(d).iter(SVG + "g") if m.get("class") == "mark"]
    texts = {"".join(t.text or "" for t in m.iter(SVG + "text")) for m in marks}
    assert (
        "2.x blocks.1.hook_resid_post · real" in texts and "nnterp layers_output[1] · real" in texts
    )
    # blocks.0.hook_resid_post is h.0's output: the op just before the focus, drawn as a stub
    stub = next(
        g
        for g in _groups(d, "stub")
        if any(m.get("data-name") == "blocks.0.hook_resid_post" for m in g.iter(SVG + "g"))
    )
    assert int(stub.get("data-op")) == gpt2.modules["transformer.h.0"].facets.sites["output"].op
    # hook_pos_embed is the position embedding, outside the focus: listed with the reason
    assert (
        list(d.unplaced) == ["2.x hook_pos_embed"]
        and "outside this drawing" in d.unplaced["2.x hook_pos_embed"]
    )
    assert "hook_pos_embed: no mark" in "".join(
        t.text or "" for t in ET.fromstring(d).iter(SVG + "text")
    )


def test_a_name_with_no_site_is_listed_with_its_status(gpt2):
    d = gpt2.draw(depth=1, highlight=["blocks.0.attn.hook_rot_k"], generation="2.x")
    assert d.unplaced["blocks.0.attn.hook_rot_k"].startswith("structurally_absent: ")


def test_highlight_facets_marks_every_facet_of_the_drawn_modules(gpt2):
    d = gpt2.draw(focus="transformer.h.0", highlight="facets")
    marked = {
        m.get("data-site") for m in ET.fromstring(d).iter(SVG + "g") if m.get("class") == "mark"
    }
    for address in ("transformer.h.0", "transformer.h.0.attn", "transformer.h.0.mlp"):
        sites = gpt2.modules[address].facets.sites
        assert {f"{address}:{f}" for f in sites if f not in ("input", "output")} <= marked


def test_a_hook_name_focuses_on_its_module_and_marks_it(gpt2):
    d = gpt2.draw(focus="blocks.1.hook_resid_mid")
    assert d == gpt2.draw(focus="transformer.h.1", highlight=["blocks.1.hook_resid_mid"])
    site = gpt2.modules["transformer.h.1"].facets.sites["resid_mid"]
    node = next(g for g in _groups(d, "op") if g.get("data-op") == str(site.op))
    assert any(m.get("data-name") == "blocks.1.hook_resid_mid" for m in node.iter(SVG + "g"))


# -- what any drawing must be ----------------------------------------------------------------------


def _rects(svg: str, cls: str) -> list[tuple[float, float, float, float, ET.Element]]:
    """(x, y, w, h, group) of the first rect of each group whose first class is `cls`."""
    out = []
    for g in ET.fromstring(svg).iter(SVG + "g"):
        if g.get("class", "").split()[:1] == [cls]:
            r = g.find(SVG + "rect")
            out.append(
                (
                    float(r.get("x")),
                    float(r.get("y")),
                    float(r.get("width")),
                    float(r.get("height")),
                    g,
                )
            )
    return out


def _overlap(a, b) -> bool:
    return (
        a[0] < b[0] + b[2] - 0.5
        and b[0] < a[0] + a[2] - 0.5
        and a[1] < b[1] + b[3] - 0.5
        and b[1] < a[1] + a[3] - 0.5
    )


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"rolled": False},
        {"depth": 2, "highlight": "facets"},
        {
            "focus": "transformer.h.1",
            "depth": 1,
            "highlight": {"2.x": ["blocks.1.hook_resid_mid"], "4.x": ["blocks.1.hook_out"]},
        },
    ],
)
def test_the_svg_parses_and_no_label_overlaps_another(gpt2, options):
    svg = gpt2.draw(**options)
    root = ET.fromstring(svg)
    assert (
        root.tag == SVG + "svg" and root.find(SVG + "title").text and root.find(SVG + "desc").text
    )
    sizes = {float(t.get("font-size")) for t in root.iter(SVG + "text")}
    assert min(sizes) >= 11
    nodes = _rects(svg, "node")
    labels = _rects(svg, "box-label")
    for i, a in enumerate(nodes):
        for b in nodes[i + 1 :] + labels:
            assert not _overlap(a, b), (a[4].get("id"), b[4].get("id") or b[4].get("data-box"))
        # every line of text fits inside its node, at the drawing's own character width
        for t in a[4].iter(SVG + "text"):
            width = len(t.text) * style.CW * float(t.get("font-size"))
            assert float(t.get("x")) + width <= a[0] + a[2] + 0.5, (a[4].get("id"), t.text)
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            assert not _overlap(a, b)
    # status is in the words, not only the colour
    for m in root.iter(SVG + "g"):
        if m.get("class") == "mark":
            word = style.STATUS_STYLE[m.get("data-status")][2]
            assert "".join(t.text for t in m.iter(SVG + "text")).endswith(" · " + word)


def test_a_drawing_is_the_same_every_time_and_shows_in_a_notebook(gpt2):
    d = gpt2.draw(depth=2)
    assert d == gpt2.draw(depth=2) and d._repr_svg_() == str(d) and isinstance(d, str)
    assert re.match(r"Drawing\(\d+ nodes, \d+ edges, \d+ characters of SVG\)", repr(d))


def test_a_loaded_trace_and_a_save_none_trace_draw_the_same_picture(gpt2, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the KV cache in the output is not stored
        gpt2.save(tmp_path)
    loaded = tl.load(tmp_path)
    assert loaded.draw() == gpt2.draw()
    assert _trace("gpt2", save="none").draw(rolled=False) == gpt2.draw(rolled=False)
    # the sites exist without their tensors: the mark says so
    d = _trace("gpt2", save="none").draw(highlight=["blocks.0.hook_resid_mid"])
    assert 'data-status="needs_capture"' in d and "needs capture" in d


def test_in_place_writes_are_drawn_as_such():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.a(x)
            y.relu_()
            y[0] = 0
            return self.b(y) + x

    trace = tl.trace(Model(), torch.ones(2, 4))
    svg = trace.draw()
    texts = " ".join(t.text or "" for t in ET.fromstring(svg).iter(SVG + "text"))
    writes = [op for op in trace.ops if op.mutated and op.name != "written_in_place"]
    after = [op for op in trace.ops if op.name == "written_in_place"]
    assert writes and after
    assert len(writes) == texts.count("writes its input in place")
    # the entry for a tensor used after a write no recorded op returned (y[0] = 0) writes nothing
    assert len(after) == texts.count("a tensor after an in-place write")


def test_files_are_written_in_the_format_their_name_says(gpt2, tmp_path):
    gpt2.draw(tmp_path / "g.svg", depth=2)
    assert ET.parse(tmp_path / "g.svg").getroot().tag == SVG + "svg"
    gpt2.draw(tmp_path / "g.png", depth=2)
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    gpt2.draw(tmp_path / "g.pdf", depth=2)
    assert (tmp_path / "g.pdf").read_bytes()[:5] == b"%PDF-"


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, error, words",
    [
        ({"depth": -1}, _draw.DrawSpecError, "whole number >= 0"),
        ({"depth": 1.5}, _draw.DrawSpecError, "depth= takes None"),
        ({"rolled": "yes"}, _draw.DrawSpecError, "rolled= takes True"),
        ({"focus": "transformer.h.9"}, _draw.DrawSpecError, "Modules like it: 'transformer.h.1'"),
        ({"focus": 3}, _draw.DrawSpecError, "module address"),
        ({"focus": "transformer.h.1:resid_mdi"}, _draw.DrawSpecError, "Did you mean 'resid_mid'"),
        (
            {"highlight": ["blocks.0.hook_resid_mdi"]},
            UnknownAlias,
            "Did you mean 'blocks.0.hook_resid_mid'",
        ),
        ({"highlight": ["blocks.7.hook_resid_mid"]}, tl.LookupFailed, "layers are 0..1"),
        (
            {"highlight": ["blocks.0.hook_resid_mid"], "generation": "2x"},
            UnknownGeneration,
            "Did you mean '2.x'",
        ),
        (
            {"highlight": {"2.y": ["blocks.0.hook_resid_mid"]}},
            UnknownGeneration,
            "Did you mean '2.x'",
        ),
        (
            {"highlight": {"2.x": "blocks.0.hook_resid_mid"}},
            _draw.DrawSpecError,
            "takes a list of names",
        ),
        ({"highlight": {"2.x": []}, "generation": "2.x"}, _draw.DrawSpecError, "drop generation="),
        ({"highlight": 5}, _draw.DrawSpecError, '"facets"'),
        ({"max_nodes": 0}, _draw.DrawSpecError, "positive whole number or None"),
        ({"path": b"g.svg"}, _draw.DrawSpecError, "a str or a pathlib.Path"),
    ],
)
def test_bad_input_raises_and_says_what_to_pass(gpt2, options, error, words):
    with pytest.raises(error) as info:
        gpt2.draw(**options)
    assert isinstance(info.value, tl.TorchLensError) and words in str(info.value), str(info.value)


def test_a_path_of_another_format_is_refused(gpt2, tmp_path):
    with pytest.raises(_draw.DrawSpecError, match=r"\.svg, \.png or \.pdf"):
        gpt2.draw(tmp_path / "g.jpg")
    assert not (tmp_path / "g.jpg").exists()


def test_a_large_drawing_is_refused_before_its_layout_with_smaller_ones(gpt2, monkeypatch):
    def no_layout(scene):
        raise AssertionError("the layout started")

    monkeypatch.setattr(_draw, "layout", no_layout)
    with pytest.raises(_draw.DrawingTooLarge) as info:
        gpt2.draw(rolled=False, max_nodes=100)
    message = str(info.value)
    assert (
        "rolled=True (" in message
        and "depth=2 (" in message
        and "focus='transformer.h.0' (" in message
    )
    assert "max_nodes=None" in message
    sizes = [int(n) for n in re.findall(r"\((\d+) nodes", message)]
    assert sizes and all(n < int(re.search(r"has (\d+) nodes", message).group(1)) for n in sizes)
    # a drawing already narrowed is offered only drawings smaller still (depth=2 was offered at its
    # own size)
    for options in ({"depth": 2}, {"depth": 1}, {}):
        with pytest.raises(_draw.DrawingTooLarge) as info:
            gpt2.draw(max_nodes=2, **options)
        message = str(info.value)
        count = int(re.search(r"has (\d+) nodes", message).group(1))
        assert all(int(n) < count for n in re.findall(r"\((\d+) nodes", message)), message


def test_gpt2_small_unrolled_is_within_the_default_limit():
    """GPT-2 small's shape (12 layers, d_model 768) unrolled is drawn without max_nodes=; a model eight
    times as deep is refused by default."""
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12)
    ).eval()
    trace = tl.trace(model, torch.arange(8).unsqueeze(0), save="none")
    d = trace.draw(rolled=False)
    assert d.counts["op"] + d.counts["input"] == len(trace.ops)
    deep = tl.trace(testing.build("gpt2", n_layer=96), testing.token_ids(length=4), save="none")
    with pytest.raises(_draw.DrawingTooLarge):
        deep.draw(rolled=False)
    assert len(deep.draw().groups) == 1  # rolled, it draws


def test_without_the_layout_engine_the_error_says_how_to_install_it(gpt2, monkeypatch):
    monkeypatch.setitem(sys.modules, "pygraphviz", None)
    with pytest.raises(_draw.LayoutEngineMissing, match=r"pip install -e .\.\[draw\]."):
        gpt2.draw()


_DRAW_IN_A_FRESH_PROCESS = """
import json, torchlens as tl
from torchlens import testing
trace = tl.trace(testing.build("llama"), testing.token_ids(length=4), save="none")
json.dump([trace.draw(depth=2), trace.draw(focus="model.layers.1", depth=1, highlight="facets")], __import__("sys").stdout)
"""


def test_a_drawing_is_the_same_bytes_in_every_process():
    """Node ids, order and coordinates come from the records, not from object ids or hash order."""
    import pathlib

    import script_modules

    first, second = script_modules.json_per_hash_seed(
        _DRAW_IN_A_FRESH_PROCESS,
        [],
        ("0", "1"),
        env={"PYTHONPATH": str(pathlib.Path(tl.__file__).parents[1])},
    )
    trace = _trace("llama", save="none")
    here = [trace.draw(depth=2), trace.draw(focus="model.layers.1", depth=1, highlight="facets")]
    assert first == second == here


def test_a_mark_on_part_of_an_ops_output_says_so():
    """GPT-NeoX's q is a third of its fused query_key_value projection viewed per head: its mark
    sits on that view, whose output holds q, k and v, and the drawing's notes say the mark reads
    part of it (ground truth: the model's own fused projection is 3 x hidden wide)."""
    model = testing.build("gpt_neox", "eager")
    fused = model.gpt_neox.layers[0].attention.query_key_value
    assert fused.out_features == 3 * model.config.hidden_size
    trace = tl.trace(model, testing.token_ids(length=4))
    svg = trace.draw(highlight=["blocks.0.attn.hook_q", "blocks.0.hook_resid_post"])
    notes = [t.text or "" for t in ET.fromstring(svg).iter(SVG + "text")]
    assert any("blocks.0.attn.hook_q is a part" in n and "not all of it" in n for n in notes)
    assert not any("hook_resid_post is" in n for n in notes)


def test_layers_reading_buffers_say_the_buffers_are_not_compared():
    """GPT-Neo's global and local layers run one op sequence and differ only in the mask buffer
    each reads (ground truth: HF's attention patterns have different numbers of zeros). No record
    holds a buffer's values, so the rolled group says they are not compared; a stack whose layers
    read no buffer says nothing of the kind."""
    model = testing.build("gpt_neo", "eager")
    ids = testing.token_ids(length=6)
    with torch.no_grad():
        zeros = [int((a == 0).sum()) for a in model(ids, output_attentions=True).attentions]
    assert len(set(zeros)) > 1
    svg = tl.trace(model, ids).draw()
    assert "buffers they read are not compared" in svg
    assert "buffers they read are not compared" not in _trace("gpt2").draw()
