"""Structure rules (torchlens._analysis.structure, an internal module): stacks, layers, sublayers, heads, roles=.

Ground truth is plain forward hooks, the model's own returned tensors, or the module objects
named by hand; the tiny models are built here or from transformers configs (random weights).

Tests internals: the naming tables' targets and facets are checked against
`torchlens._naming.targets.TARGETS` and `torchlens._core.facet_spec.ALL_FACETS`.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf
from torch import nn

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing

V = 16


class Attn(nn.Module):
    def __init__(self, d=8, h=2):
        super().__init__()
        self.h = h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, kv=None):
        kv = x if kv is None else kv
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.h, -1).transpose(1, 2)
        k = self.k(kv).view(b, kv.shape[1], self.h, -1).transpose(1, 2)
        v = self.v(kv).view(b, kv.shape[1], self.h, -1).transpose(1, 2)
        p = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)
        return self.o((p @ v).transpose(1, 2).reshape(b, t, d))


class FF(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Block(nn.Module):
    """Names no rule knows: `mix` and `chew`, no `attn` / `mlp` attribute."""

    def __init__(self, d=8):
        super().__init__()
        self.n1, self.mix, self.n2, self.chew = nn.LayerNorm(d), Attn(d), nn.LayerNorm(d), FF(d)

    def forward(self, x):
        x = x + self.mix(self.n1(x))
        return x + self.chew(self.n2(x))


class SeqLM(nn.Module):
    """Blocks held in an nn.Sequential."""

    def __init__(self, d=8, n=3):
        super().__init__()
        self.tok = nn.Embedding(V, d)
        self.body = nn.Sequential(*(Block(d) for _ in range(n)))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, V)

    def forward(self, ids):
        return self.head(self.norm(self.body(self.tok(ids))))


def _hook_outputs(modules):
    """Plain forward hooks saving each module's output (element 0 of a tuple output)."""
    seen = {}

    def save(name, out):
        out = out[0] if isinstance(out, tuple) else out
        seen.setdefault(name, []).append(out.detach().clone())

    handles = [
        m.register_forward_hook(lambda mod, a, o, n=n: save(n, o)) for n, m in modules.items()
    ]
    return seen, handles


def test_blocks_in_a_sequential_without_mlp_names():
    torch.manual_seed(0)
    model = SeqLM().eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    seen, handles = _hook_outputs(
        {f"body.{i}": model.body[i] for i in range(3)} | {"chew": model.body[1].chew}
    )
    try:
        t = tl.trace(model, ids)
    finally:
        for h in handles:
            h.remove()
    assert t.blocks == ["body.0", "body.1", "body.2"]
    layer = t.structure.layers[1]
    assert (layer.attention.address, layer.mlp.address) == ("body.1.mix", "body.1.chew")
    for i in range(3):
        torch.testing.assert_close(
            mi.resolve_alias(t, f"blocks.{i}.hook_resid_post").tensor,
            seen[f"body.{i}"][0],
            rtol=0,
            atol=0,
        )
    torch.testing.assert_close(
        mi.resolve_alias(t, "blocks.1.hook_mlp_out").tensor, seen["chew"][0], rtol=0, atol=0
    )
    assert mi.resolve_alias(t, "blocks.1.ln2.hook_normalized").module_address == "body.1.n2"
    assert t.structure.final_norm.address == "norm" and t.structure.unembed.address == "head"


class Wrapper(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.inner = lm

    def forward(self, ids):
        return self.inner(ids).logits


def _gpt2(model_cls=tf.GPT2LMHeadModel):
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=V, n_positions=8, bos_token_id=0, eos_token_id=0
    )
    return model_cls(cfg).eval()


def test_a_wrapper_around_a_causal_lm_keeps_its_logits():
    t = tl.trace(Wrapper(_gpt2()), torch.tensor([[1, 2, 3]]))
    r = mi.resolve_alias(t, "unembed.hook_out")
    assert r.status == "real" and r.module_address == "inner.lm_head"
    torch.testing.assert_close(t.modules[""].facets["logits"], t.output, rtol=0, atol=0)
    assert mi.resolve_alias(t, "blocks.1.hook_resid_post").module_address == "inner.transformer.h.1"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_model_given_inputs_embeds_keeps_its_unembedding_and_logits(family):
    """No token embedding runs, so the unembedding is known by the vocabulary of the embedding
    that did not run (GPT-2's wte, where wpe ran): logits are the model's own; hook_embed is
    absent, and its reason says why and what to do."""
    model = testing.build(family, "sdpa")
    ids = torch.tensor([[1, 2, 3, 4]])
    emb = model.get_input_embeddings()(ids).detach()
    t = tl.trace(model, inputs_embeds=emb)
    with torch.no_grad():
        expected = model(inputs_embeds=emb).logits
    assert t.structure.token_embed is None and t.structure.unembed.address == "lm_head"
    torch.testing.assert_close(t.modules[""].facets["logits"], expected, rtol=0, atol=0)
    r = mi.resolve_alias(t, "hook_embed")
    assert r.status == "structurally_absent" and "inputs_embeds=" in r.reason


class Classifier(nn.Module):
    """A classifier head called `output` (3 labels): not an unembedding."""

    def __init__(self, d=8):
        super().__init__()
        self.tok = nn.Embedding(V, d)
        self.layers = nn.ModuleList([Block(d), Block(d)])
        self.output = nn.Linear(d, 3)

    def forward(self, ids):
        x = self.tok(ids)
        for layer in self.layers:
            x = layer(x)
        return self.output(x[:, 0])


def test_a_classifier_head_named_output_is_not_the_unembedding():
    torch.manual_seed(0)
    t = tl.trace(Classifier().eval(), torch.tensor([[1, 2, 3]]))
    assert t.structure.unembed is None
    assert "logits" not in t.modules[""].facets.sites
    assert t.modules["output"].role == "other"
    assert mi.resolve_alias(t, "unembed.hook_out").status == "structurally_absent"


def test_final_norm_is_found_with_and_without_a_head():
    """One rule: GPT2Model (no lm_head) has final_norm_input like GPT2LMHeadModel, and it agrees with ln_f's input."""
    for cls, prefix in ((tf.GPT2Model, ""), (tf.GPT2LMHeadModel, "transformer.")):
        model = _gpt2(cls)
        seen = {}
        h = model.get_submodule(prefix + "ln_f").register_forward_pre_hook(
            lambda m, a: seen.setdefault("x", a[0])
        )
        try:
            t = tl.trace(model, torch.tensor([[1, 2, 3]]))
        finally:
            h.remove()
        torch.testing.assert_close(
            t.modules[""].facets["final_norm_input"], seen["x"], rtol=0, atol=0
        )
        assert mi.resolve_alias(t, "ln_final.hook_in").module_address == prefix + "ln_f"
        assert mi.resolve_alias(t, "layers_output[-1]", "nnterp").status == "real"


class Scrambled(nn.Module):
    """Repeated layers that do not chain: each reads the embedding, the outputs are summed."""

    def __init__(self, d=8):
        super().__init__()
        self.tok = nn.Embedding(V, d)
        self.layers = nn.ModuleList([Block(d), Block(d)])

    def forward(self, ids):
        x = self.tok(ids)
        return sum(layer(x) for layer in self.layers)


def test_repeated_layers_without_a_block_warn_and_roles_names_them():
    torch.manual_seed(0)
    model = Scrambled().eval()
    ids = torch.tensor([[1, 2, 3]])
    with pytest.warns(
        UserWarning, match=r"layers hold repeated modules, but none was taken as a block.*roles="
    ):
        t = tl.trace(model, ids)
    assert t.blocks == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        named = tl.trace(
            model,
            ids,
            roles={"layers.*": "block", "layers.*.mix": "attention", "layers.*.chew": "mlp"},
        )
    assert named.blocks == ["layers.0", "layers.1"]
    assert named.structure.layers[1].mlp.address == "layers.1.chew"
    seen, handles = _hook_outputs({"l1": model.layers[1], "mix": model.layers[0].mix})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tl.trace(model, ids)
    finally:
        for h in handles:
            h.remove()
    torch.testing.assert_close(
        mi.resolve_alias(named, "blocks.1.hook_resid_post").tensor, seen["l1"][0], rtol=0, atol=0
    )
    torch.testing.assert_close(
        mi.resolve_alias(named, "blocks.0.hook_attn_out").tensor, seen["mix"][0], rtol=0, atol=0
    )


def test_roles_names_the_unembedding_and_rejects_bad_values():
    torch.manual_seed(0)
    t = tl.trace(Classifier().eval(), torch.tensor([[1, 2]]), roles={"output": "unembed"})
    assert t.structure.unembed.address == "output"
    with pytest.raises(tl.TorchLensError, match=r"'blok' is not a role\. Did you mean 'block'\?"):
        tl.trace(Classifier().eval(), torch.tensor([[1, 2]]), roles={"layers.*": "blok"})
    with pytest.raises(tl.TorchLensError, match=r"'layer\.\*' names no module.*Did you mean"):
        tl.trace(Classifier().eval(), torch.tensor([[1, 2]]), roles={"layer.*": "block"})
    with pytest.raises(tl.TorchLensError, match=r"roles= takes a dict"):
        tl.trace(Classifier().eval(), torch.tensor([[1, 2]]), roles=["layers.0"])


class CrossBlock(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.self_attn, self.cross, self.ff = Attn(d), Attn(d), FF(d)

    def forward(self, x, memory):
        x = x + self.self_attn(x)
        x = x + self.cross(x, memory)
        return x + self.ff(x)


class EncDec(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.tok = nn.Embedding(V, d)
        self.enc = nn.ModuleList([Block(d), Block(d)])
        self.dec = nn.ModuleList([CrossBlock(d), CrossBlock(d)])
        self.head = nn.Linear(d, V)

    def forward(self, src, tgt):
        m = self.tok(src)
        for layer in self.enc:
            m = layer(m)
        x = self.tok(tgt)
        for layer in self.dec:
            x = layer(x, m)
        return self.head(x)


def test_self_and_cross_attention_are_both_kept_and_stacks_are_numbered_apart():
    torch.manual_seed(0)
    model = EncDec().eval()
    seen, handles = _hook_outputs({"cross": model.dec[1].cross, "self": model.dec[1].self_attn})
    try:
        t = tl.trace(model, torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5]]))
    finally:
        for h in handles:
            h.remove()
    s = t.structure
    assert s.kind == "encoder-decoder" and list(s.stacks) == ["enc", "dec"] and s.lm_stack == "dec"
    layer = s.stacks["dec"].layers[1]
    assert (layer.attention.address, layer.cross_attention.address) == (
        "dec.1.self_attn",
        "dec.1.cross",
    )
    torch.testing.assert_close(
        layer.cross_attention.facets["output"], seen["cross"][0], rtol=0, atol=0
    )
    assert layer.cross_attention.facets["pattern"].shape == (
        1,
        2,
        2,
        3,
    )  # [batch, heads, query=2, key=3]
    assert layer.mlp.address == "dec.1.ff"
    assert t.blocks == ["dec.0", "dec.1"]  # decoder-only names read the language-model stack
    torch.testing.assert_close(
        mi.resolve_alias(t, "blocks.1.attn.hook_pattern").tensor,
        layer.attention.facets["pattern"],
        rtol=0,
        atol=0,
    )
    report = mi.alias_report(t, generation="nnterp")
    assert {r.status for r in report} == {"structurally_absent"}
    assert all("decoder-only" in r.reason and "encoder-decoder" in r.reason for r in report)


def _clip():
    torch.manual_seed(0)
    cfg = tf.CLIPConfig(
        text_config=dict(
            num_hidden_layers=2,
            hidden_size=16,
            num_attention_heads=2,
            intermediate_size=24,
            vocab_size=V,
            max_position_embeddings=8,
        ),
        vision_config=dict(
            num_hidden_layers=2,
            hidden_size=16,
            num_attention_heads=2,
            intermediate_size=24,
            image_size=16,
            patch_size=8,
        ),
        projection_dim=8,
    )
    return tf.CLIPModel(cfg).eval()


def test_two_towers_make_per_layer_names_ambiguous():
    t = tl.trace(
        _clip(), input_ids=torch.tensor([[1, 2, 3]]), pixel_values=torch.randn(1, 3, 16, 16)
    )
    assert t.structure.kind == "multi-tower" and len(t.structure.stacks) == 2
    r = mi.resolve_alias(t, "blocks.0.hook_resid_post")
    assert (
        r.status == "ambiguous"
        and "2 stacks" in r.reason
        and "vision_model.encoder.layers" in r.reason
    )
    rows = [r for r in mi.alias_report(t, "2.x") if r.pattern == "blocks.{L}.hook_resid_post"]
    assert rows and {r.status for r in rows} == {"ambiguous"}


def test_nnterp_and_interp_engine_say_they_are_decoder_only_on_bert():
    torch.manual_seed(0)
    cfg = tf.BertConfig(
        num_hidden_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        intermediate_size=24,
        vocab_size=V,
        max_position_embeddings=8,
    )
    t = tl.trace(tf.BertModel(cfg).eval(), torch.tensor([[1, 2, 3]]))
    assert t.structure.kind == "encoder-only"
    for gen in ("nnterp", "interp-engine"):
        report = mi.alias_report(t, gen)
        assert report and all(
            r.status == "structurally_absent" and "decoder-only" in r.reason for r in report
        )
    assert mi.resolve_alias(t, "blocks.1.hook_resid_post", "2.x").status == "real"


def test_falcon_multi_query_heads_are_split_from_the_fused_projection():
    torch.manual_seed(0)
    cfg = tf.FalconConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=V,
        multi_query=True,
        new_decoder_architecture=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = tf.FalconForCausalLM(cfg).eval()
    seen, handles = _hook_outputs({"qkv": model.transformer.h[1].self_attention.query_key_value})
    try:
        t = tl.trace(model, torch.tensor([[1, 2, 3, 4, 5]]))
    finally:
        for h in handles:
            h.remove()
    fused = seen["qkv"][0].view(
        1, 5, 4 + 2, 8
    )  # HF's multi-query layout: 4 query heads, then k, then v
    f = t.modules["transformer.h.1.self_attention"].facets
    for name, truth in (("q", fused[:, :, :4]), ("k", fused[:, :, 4:5]), ("v", fused[:, :, 5:])):
        torch.testing.assert_close(f[name], truth, rtol=0, atol=0)
    for name in ("rot_q", "rot_k"):
        assert tuple(f.sites[name].shape) == tuple(f[name].shape)
    assert f.sites["rot_q"].shape[2] == 4 and f.sites["rot_k"].shape[2] == 1


def test_hooked_encoder_names_resolve_on_bert():
    """TL 2.x names on an encoder-only trace read HookedEncoder's (post-LN) sites, checked against hooks."""
    torch.manual_seed(0)
    cfg = tf.BertConfig(
        num_hidden_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        intermediate_size=24,
        vocab_size=V,
        max_position_embeddings=8,
    )
    model = tf.BertForMaskedLM(cfg).eval()
    layer = model.bert.encoder.layer[1]
    outs = {
        "attn_out": layer.attention.output.dense,
        "pre": layer.intermediate.dense,
        "mlp_out": layer.output.dense,
        "ln1": layer.attention.output.LayerNorm,
        "ln2": layer.output.LayerNorm,
        "block": layer,
    }
    ins = {
        "resid_mid": layer.attention.output.LayerNorm,
        "resid_post": layer.output.LayerNorm,
        "post": layer.output.dense,
    }
    seen, handles = _hook_outputs(outs)
    handles += [
        m.register_forward_pre_hook(
            lambda mod, a, n=n: seen.setdefault(n, []).append(a[0].detach().clone())
        )
        for n, m in ins.items()
    ]
    try:
        t = tl.trace(model, torch.tensor([[1, 2, 3, 4]]))
    finally:
        for h in handles:
            h.remove()
    expect = {
        "hook_attn_out": "attn_out",
        "mlp.hook_pre": "pre",
        "hook_mlp_out": "mlp_out",
        "ln1.hook_normalized": "ln1",
        "ln2.hook_normalized": "ln2",
        "hook_normalized_resid_post": "block",
        "hook_resid_mid": "resid_mid",
        "hook_resid_post": "resid_post",
        "mlp.hook_post": "post",
    }
    for name, key in expect.items():
        r = mi.resolve_alias(t, f"blocks.1.{name}", "2.x")
        assert r.status == "real", r
        torch.testing.assert_close(r.tensor, seen[key][0], rtol=0, atol=0)
    assert mi.resolve_alias(t, "blocks.0.hook_resid_pre", "2.x").status == "real"
    # Beyond the 32 real and 8 derived: the embedding and MLM-head norms' outputs (2 real) and scales
    # (2 derived), hook_mlp_in per layer (2 real); the per-head input copies (3 per layer) and hook_result
    # (BERT's W_O lies outside its attention) have no site
    assert mi.alias_report(t, "2.x").counts() == {
        "real": 36,
        "reconstructed_read_only": 10,
        "structurally_absent": 8,
    }


def test_bridge_names_on_t5_read_each_stack():
    """TL 4.x names on an encoder-decoder read the T5 adapter's stacks, each numbered from 0, against hooks."""
    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(
        tf.T5Config(num_layers=2, d_model=16, d_ff=24, num_heads=2, d_kv=8, vocab_size=V)
    ).eval()
    enc, dec = model.encoder, model.decoder
    outs = {
        "enc1": enc.block[1],
        "cross1": dec.block[1].layer[1].EncDecAttention,
        "ln2": dec.block[0].layer[1].layer_norm,
        "ln3": dec.block[0].layer[2].layer_norm,
        "enc_final": enc.final_layer_norm,
        "mlp1": dec.block[1].layer[2].DenseReluDense,
        "enc_mlp0": enc.block[0].layer[1].DenseReluDense,
    }
    seen, handles = _hook_outputs(outs)
    try:
        t = tl.trace(
            model, torch.tensor([[1, 2, 3, 4]]), decoder_input_ids=torch.tensor([[1, 2, 3]])
        )
    finally:
        for h in handles:
            h.remove()
    expect = {
        "encoder_blocks.1.hook_out": "enc1",
        "decoder_blocks.1.cross_attn.hook_out": "cross1",
        "decoder_blocks.1.hook_cross_attn_out": "cross1",
        "decoder_blocks.0.ln2.hook_out": "ln2",
        "decoder_blocks.0.ln3.hook_out": "ln3",
        "encoder_ln_final.hook_out": "enc_final",
        "decoder_blocks.1.hook_mlp_out": "mlp1",
        "encoder_blocks.0.mlp.hook_out": "enc_mlp0",
    }
    for name, key in expect.items():
        r = mi.resolve_alias(t, name, "4.x")
        assert r.status == "real", r
        torch.testing.assert_close(r.tensor, seen[key][0], rtol=0, atol=0)
    pattern = mi.resolve_alias(t, "decoder_blocks.1.cross_attn.hook_pattern", "4.x")
    assert pattern.shape == (1, 2, 3, 4)  # [batch, heads, decoder positions, encoder positions]
    assert mi.resolve_alias(t, "pos_embed.hook_out", "4.x").status == "structurally_absent"
    with pytest.raises(mi.LayerOutOfRange):
        mi.resolve_alias(t, "encoder_blocks.2.hook_out", "4.x")


def test_trace_getitem_reads_the_call_of_the_layer():
    """`trace[name]` on a block object run twice reads the call the layer index names."""
    torch.manual_seed(0)
    block = Block()
    model = SeqLM(n=1).eval()
    model.body = nn.Sequential(block, block)
    seen, handles = _hook_outputs({"b": block})
    try:
        t = tl.trace(model, torch.tensor([[1, 2, 3]]))
    finally:
        for h in handles:
            h.remove()
    assert t.blocks == ["body.0", "body.0"]
    for i in (0, 1):
        torch.testing.assert_close(t[f"blocks.{i}.hook_resid_post"], seen["b"][i], rtol=0, atol=0)


def test_a_report_on_a_model_without_layers_says_so_per_name():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = tl.trace(Scrambled().eval(), torch.tensor([[1, 2, 3]]))
    report = mi.alias_report(t, "2.x")
    per_layer = [r for r in report if "{L}" in r.pattern]
    assert len(per_layer) == sum(1 for row in mi.table("2.x") if row.per_layer)
    with_site = [
        r
        for r in per_layer
        if mi.table("2.x")[[x.name for x in mi.table("2.x")].index(r.pattern)].facet
    ]
    assert with_site and all(
        r.status == "structurally_absent" and "no stack of layers" in r.reason for r in with_site
    )
    assert all("roles=" in r.remedy for r in with_site)


def test_hooked_encoder_decoder_names_resolve_on_t5():
    """TL 2.x names on an encoder-decoder read HookedEncoderDecoder's sites, each stack from 0, against hooks."""
    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(
        tf.T5Config(num_layers=2, d_model=16, d_ff=24, num_heads=2, d_kv=8, vocab_size=V)
    ).eval()
    enc, dec = model.encoder, model.decoder
    outs = {
        "enc_mid1": enc.block[1].layer[0],
        "dec_mid_cross0": dec.block[0].layer[1],
        "dec_cross1": dec.block[1].layer[1].EncDecAttention,
        "dec_post1": dec.block[1],
        "enc_attn0": enc.block[0].layer[0].SelfAttention,
        "dec_mlp0": dec.block[0].layer[2].DenseReluDense,
    }
    seen, handles = _hook_outputs(outs)
    handles.append(
        enc.final_layer_norm.register_forward_pre_hook(
            lambda m, a: seen.setdefault("enc_final_in", []).append(a[0].detach().clone())
        )
    )  # returns None
    try:
        t = tl.trace(
            model, torch.tensor([[1, 2, 3, 4]]), decoder_input_ids=torch.tensor([[1, 2, 3]])
        )
    finally:
        for h in handles:
            h.remove()
    expect = {
        "encoder.1.hook_resid_mid": "enc_mid1",
        "decoder.0.hook_resid_mid_cross": "dec_mid_cross0",
        "decoder.1.hook_cross_attn_out": "dec_cross1",
        "decoder.1.hook_resid_post": "dec_post1",
        "encoder.0.hook_attn_out": "enc_attn0",
        "decoder.0.hook_mlp_out": "dec_mlp0",
        "encoder.1.hook_resid_post": "enc_final_in",
    }
    for name, key in expect.items():
        r = mi.resolve_alias(t, name, "2.x")
        assert r.status == "real", r
        torch.testing.assert_close(r.tensor, seen[key][0], rtol=0, atol=0)
    assert mi.resolve_alias(t, "decoder.1.cross_attn.hook_pattern", "2.x").shape == (1, 2, 3, 4)
    assert (
        mi.resolve_alias(t, "decoder_final_ln.hook_scale", "2.x").module_address
        == "decoder.final_layer_norm"
    )
    assert (
        mi.resolve_alias(t, "decoder.0.ln2.hook_normalized", "2.x").module_address
        == "decoder.block.0.layer.1.layer_norm"
    )
    assert (
        mi.resolve_alias(t, "encoder.0.ln2.hook_normalized", "2.x").module_address
        == "encoder.block.0.layer.1.layer_norm"
    )
    with pytest.raises(mi.LayerOutOfRange):
        mi.resolve_alias(t, "decoder.2.hook_resid_post", "2.x")


def test_every_row_of_every_table_names_a_known_target_and_facet():
    """A mistyped target or facet in a (kind-specific) table would read as structurally_absent: refuse it here."""
    from torchlens._core.facet_spec import ALL_FACETS
    from torchlens._naming import targets

    tables = [t for g in mi.GENERATIONS.values() for t in (g, *dict(g.by_kind).values())]
    assert len(tables) >= 8
    for table in tables:
        names = [r.name for r in table.rows]
        assert len(names) == len(set(names)), table.title
        for row in table.rows:
            if row.facet is None:
                continue
            assert row.target in targets.TARGETS, (table.title, row.name, row.target)
            assert set(row.facets) <= ALL_FACETS, (table.title, row.name, row.facet)
            assert row.stack in (None, "encoder", "decoder"), (table.title, row.name)


def test_bridge_mlp_in_on_t5_is_the_residual_entering_the_mlp_wrapper():
    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(
        tf.T5Config(num_layers=2, d_model=16, d_ff=24, num_heads=2, d_kv=8, vocab_size=V)
    ).eval()
    seen = {}

    def keep(key):
        def hook(module, args):
            seen[key] = args[0].detach().clone()  # returns None: the input is not replaced

        return hook

    handles = [
        model.encoder.block[0].layer[1].register_forward_pre_hook(keep("enc")),
        model.decoder.block[1].layer[2].register_forward_pre_hook(keep("dec")),
    ]
    try:
        t = tl.trace(
            model, torch.tensor([[1, 2, 3, 4]]), decoder_input_ids=torch.tensor([[1, 2, 3]])
        )
    finally:
        for h in handles:
            h.remove()
    for name, key in (
        ("encoder_blocks.0.hook_mlp_in", "enc"),
        ("decoder_blocks.1.hook_mlp_in", "dec"),
    ):
        r = mi.resolve_alias(t, name, "4.x")
        assert r.status == "real", r
        torch.testing.assert_close(r.tensor, seen[key], rtol=0, atol=0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_model_wrapped_by_the_transformer_lens_bridge_keeps_its_layers(family):
    """TransformerLens 4.x's boot wraps every submodule of the HF model in a bridge component, so
    q/k/v/o become same-class non-leaf siblings of equal width. Linked through the attention kernel,
    they must not be taken for a stack of layers (they were: blocks.0 read attn.v). Ground truth: a
    plain forward hook on each decoder layer of the wrapped model."""
    from fixtures import engine_runs

    bridge, hf_model = engine_runs._bridge(family, "eager")
    layers = hf_model.transformer.h if family == "gpt2" else hf_model.model.layers
    seen = []
    handles = [
        m.register_forward_hook(
            lambda m, a, out: seen.append(
                (out[0] if isinstance(out, tuple) else out).detach().clone()
            )
        )
        for m in layers
    ]
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        hf_model(ids)
    for h in handles:
        h.remove()
    t = tl.trace(hf_model, ids)
    prefix = "transformer.h" if family == "gpt2" else "model.layers"
    assert t.blocks == [f"{prefix}.{i}" for i in range(len(layers))]
    for i in range(len(layers)):
        torch.testing.assert_close(
            mi.resolve_alias(t, f"blocks.{i}.hook_resid_post").tensor, seen[i], rtol=0, atol=0
        )


def test_every_stack_has_its_final_norm_by_the_one_rule():
    """Each stack's final norm comes from the same rule as the language-model stack's: on T5 the
    encoder's norm reads the encoder's last block output (a forward hook on both says so) and the
    decoder's is `Structure.final_norm`; a CLIP-style pair of towers gets one per tower."""
    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(
        tf.T5Config(num_layers=2, d_model=16, d_ff=24, num_heads=2, d_kv=8, vocab_size=V)
    ).eval()
    seen, handles = _hook_outputs(
        {"enc_last": model.encoder.block[1], "dec_last": model.decoder.block[1]}
    )
    inputs = {}
    handles += [
        m.register_forward_pre_hook(lambda mod, args, k=k: inputs.__setitem__(k, args[0].clone()))
        for k, m in (
            ("enc_norm", model.encoder.final_layer_norm),
            ("dec_norm", model.decoder.final_layer_norm),
        )
    ]
    try:
        t = tl.trace(
            model, torch.tensor([[1, 2, 3, 4]]), decoder_input_ids=torch.tensor([[1, 2, 3]])
        )
    finally:
        for h in handles:
            h.remove()
    stacks = t.structure.stacks
    assert {n: s.final_norm.address for n, s in stacks.items()} == {
        "encoder.block": "encoder.final_layer_norm",
        "decoder.block": "decoder.final_layer_norm",
    }
    assert t.structure.final_norm is stacks[t.structure.lm_stack].final_norm
    torch.testing.assert_close(inputs["enc_norm"], seen["enc_last"][0], rtol=0, atol=0)
    torch.testing.assert_close(
        t.modules["encoder.final_layer_norm"].facets["input"], inputs["enc_norm"], rtol=0, atol=0
    )

    clip = tf.CLIPModel(
        tf.CLIPConfig(
            text_config=dict(
                vocab_size=V,
                hidden_size=16,
                intermediate_size=24,
                num_hidden_layers=2,
                num_attention_heads=2,
                max_position_embeddings=16,
            ),
            vision_config=dict(
                hidden_size=16,
                intermediate_size=24,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=8,
                patch_size=4,
            ),
        )
    ).eval()
    t = tl.trace(clip, input_ids=torch.tensor([[1, 2, 3]]), pixel_values=torch.zeros(1, 3, 8, 8))
    finals = {
        n: (s.final_norm.address if s.final_norm else None) for n, s in t.structure.stacks.items()
    }
    assert finals == {
        "text_model.encoder.layers": "text_model.final_layer_norm",
        "vision_model.encoder.layers": "vision_model.post_layernorm",
    }, finals


def test_find_walks_the_module_tree_when_the_roles_carry_no_groups(monkeypatch):
    """`find` reads the repeated-module groups `static_roles` found, and walks the module tree
    itself when the roles carry none (`Roles.groups` is None until `static_roles` sets it): that
    walk called `find`'s own local `groups` (unbound there: UnboundLocalError) instead of
    `role_rules.groups`."""
    import torchlens._tracing as tracing

    torch.manual_seed(0)
    model = SeqLM().eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    expected = tl.trace(model, ids).blocks
    static_roles = tracing.static_roles

    def without_groups(*args, **kwargs):
        roles = static_roles(*args, **kwargs)
        roles.groups = None
        return roles

    monkeypatch.setattr(tracing, "static_roles", without_groups)
    assert tl.trace(model, ids).blocks == expected == ["body.0", "body.1", "body.2"]


def test_sublayers_in_parallel_module_lists_are_not_taken_for_blocks():
    """XLM keeps its attentions, norms and feed-forward networks in separate module lists, with no
    module per layer: the attentions chain only through the feed-forward networks, so they are not
    layers, and no resid_post is served that is not the residual stream (HF's hidden states)."""
    cfg = tf.XLMConfig(n_layers=2, emb_dim=32, n_heads=4, vocab_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model = tf.XLMWithLMHeadModel(cfg).eval()
    ids = torch.tensor([[5, 9, 12, 7, 30, 2, 8]])
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    t = tl.trace(model, ids)
    assert "transformer.attentions.0" not in t.blocks
    for i, block in enumerate(t.blocks):
        torch.testing.assert_close(t.modules[block].facets["resid_post"], hidden[i + 1])


def test_a_named_attention_or_mlp_outside_any_layer_keeps_its_role():
    """`roles=` names an attention and an MLP that lie in no layer (a wrapper around one
    `nn.MultiheadAttention`, then an MLP): the named role wins, so their facets are found and
    served, checked against the module's own attention weights and plain forward hooks."""

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
            self.ff = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

        def forward(self, x):
            return self.ff(self.attn(x, x, x)[0])

    torch.manual_seed(0)
    model = Wrap().eval()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    seen = {}
    handles = [
        model.ff[i].register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o.clone()))
        for i in range(3)
    ]
    try:
        with torch.no_grad():
            _, weights = model.attn(x, x, x, need_weights=True, average_attn_weights=False)
            tr = tl.trace(model, x, roles={"attn": "attention", "ff": "mlp"})
    finally:
        for h in handles:
            h.remove()
    assert tr.modules["attn"].role == "attention" and tr.modules["ff"].role == "mlp"
    torch.testing.assert_close(tr["attn:pattern"], weights, rtol=1e-5, atol=1e-6)
    for name, i in (("pre", 0), ("act", 1), ("post", 1), ("down_out", 2)):
        torch.testing.assert_close(tr[f"ff:{name}"], seen[i], rtol=0, atol=0)
    # without roles=, neither is an attention or an MLP (no layer confirms them)
    with torch.no_grad():
        plain = tl.trace(model, x)
    assert plain.modules["attn"].role == "other"


def test_weight_parametrizations_named_like_norms_are_not_norms():
    """`spectral_norm` and `weight_norm` parametrizations rescale a weight, not activations:
    their modules (`_SpectralNorm`, `_WeightNorm`) are not norms, so no norm facet is listed for
    them (each was listed and refused on every read)."""
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    model = nn.Sequential(
        parametrizations.spectral_norm(nn.Linear(4, 4)),
        parametrizations.weight_norm(nn.Linear(4, 4)),
        nn.LayerNorm(4),
    )
    tr = tl.trace(model, torch.randn(2, 4, generator=torch.Generator().manual_seed(1)))
    roles = {a: r.role for a, r in tr.modules.items() if ".parametrizations." in a}
    assert roles and set(roles.values()) == {"other"}, roles
    assert tr.modules["2"].role == "norm"  # a real norm still is one
