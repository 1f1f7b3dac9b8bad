"""Names of other libraries that read a tensor the peer does not mean, from an adversarial review
of the translation layer. Ground truth: plain forward hooks on the Hugging Face modules (what the
peer's hook fires on: TransformerLens's bridge hooks a module's output, interp-engine the
projection outputs on BLOOM), never TorchLens itself.
"""

from __future__ import annotations

import pytest
import torch

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing

IDS = torch.tensor([[5, 9, 12, 7, 30, 2]])


def _hooked(model, modules: dict, run) -> dict:
    """`{key: (input 0, output)}` of each module as plain hooks see it during `run()`."""
    seen, handles = {}, []
    for key, module in modules.items():
        handles.append(
            module.register_forward_hook(
                lambda m, a, o, key=key: seen.__setitem__(
                    key,
                    (a[0].detach() if a else None, (o[0] if isinstance(o, tuple) else o).detach()),
                )
            )
        )
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return seen


def test_bloom_hook_embed_is_the_embedding_after_its_layernorm():
    """TransformerLens 2.x applies BLOOM's post-embedding LayerNorm inside its embedding, and the
    3.x bridge's hook_embed is the embedding norm's output where there is one."""
    model = testing.build("bloom", "eager")
    seen = _hooked(
        model,
        {
            "ln": model.transformer.word_embeddings_layernorm,
            "lookup": model.transformer.word_embeddings,
        },
        lambda: model(IDS),
    )
    t = tl.trace(model, IDS)
    for gen in ("2.x", "3.x"):
        r = mi.resolve_alias(t, "hook_embed", generation=gen)
        assert r.status == "real"
        torch.testing.assert_close(r.tensor, seen["ln"][1], rtol=0, atol=0)
    # where the token embedding is what enters the stream, it is still the embedding's output
    gpt2 = testing.build("gpt2", "sdpa")
    seen = _hooked(gpt2, {"wte": gpt2.transformer.wte}, lambda: gpt2(IDS))
    t2 = tl.trace(gpt2, IDS)
    for gen in ("2.x", "3.x"):
        torch.testing.assert_close(
            mi.resolve_alias(t2, "hook_embed", generation=gen).tensor,
            seen["wte"][1],
            rtol=0,
            atol=0,
        )


def test_hook_embed_of_the_bridge_is_the_encoders_embedding_norm_on_bart():
    """3.x hook_embed aliases embed_ln.hook_out, which the bridge's BART adapter puts on the
    encoder's layernorm_embedding (not the decoder's); 2.x's is the token embedding."""
    model = testing.build("bart", "eager")
    args, kwargs = testing.inputs("bart", length=5)
    seen = _hooked(
        model,
        {"enc": model.model.encoder.layernorm_embedding, "tok": model.model.encoder.embed_tokens},
        lambda: model(*args, **kwargs),
    )
    t = tl.trace(model, *args, **kwargs)
    torch.testing.assert_close(
        mi.resolve_alias(t, "hook_embed", generation="3.x").tensor, seen["enc"][1], rtol=0, atol=0
    )
    torch.testing.assert_close(
        mi.resolve_alias(t, "hook_embed", generation="2.x").tensor, seen["tok"][1], rtol=0, atol=0
    )


def test_bloom_attention_hidden_states_is_the_attention_output_with_the_residual():
    """The bridge fires attn.hook_hidden_states on the joint-QKV attention's output element 0:
    on BLOOM, whose attention adds the residual itself, that is not the dense projection's output."""
    model = testing.build("bloom", "eager")
    attn = model.transformer.h[1].self_attention
    seen = _hooked(model, {"attn": attn, "dense": attn.dense}, lambda: model(IDS))
    t = tl.trace(model, IDS)
    for gen in ("3.x", "4.x"):
        r = mi.resolve_alias(t, "blocks.1.attn.hook_hidden_states", generation=gen)
        torch.testing.assert_close(r.tensor, seen["attn"][1], rtol=0, atol=0)
        assert not torch.equal(r.tensor, seen["dense"][1])


def test_interp_engine_sublayer_outputs_are_refused_where_the_module_adds_the_residual():
    """BLOOM's attention and MLP end by adding the residual: their module outputs are the stream,
    not the sublayer's own output (interp-engine's attn_out/mlp_out), so those names are not
    served from them; GPT-2's are."""
    model = testing.build("bloom", "eager")
    t = tl.trace(model, IDS)
    for name in ("attn_out.0", "mlp_out.1"):
        r = mi.resolve_alias(t, name, generation="interp-engine")
        assert r.status == "structurally_absent" and "adds the residual itself" in r.reason
    gpt2 = testing.build("gpt2", "sdpa")
    seen = _hooked(gpt2, {"attn": gpt2.transformer.h[0].attn}, lambda: gpt2(IDS))
    r = mi.resolve_alias(tl.trace(gpt2, IDS), "attn_out.0", generation="interp-engine")
    torch.testing.assert_close(r.tensor, seen["attn"][1], rtol=0, atol=0)


def test_cross_attention_key_and_value_inputs_are_not_the_module_input():
    """The cross-attention's k and v projections read the encoder's output; the module's input is
    the decoder stream (the q projection's input)."""
    model = testing.build("t5", "eager")
    args, kwargs = testing.inputs("t5", length=5)
    cross = model.decoder.block[0].layer[1].EncDecAttention
    seen = _hooked(model, {"q": cross.q}, lambda: model(*args, **kwargs))
    t = tl.trace(model, *args, **kwargs)
    for kv in ("k", "v"):
        r = mi.resolve_alias(t, f"decoder_blocks.0.cross_attn.{kv}.hook_in", generation="4.x")
        assert r.status == "structurally_absent" and "encoder's output" in r.reason
    q = mi.resolve_alias(t, "decoder_blocks.0.cross_attn.q.hook_in", generation="4.x")
    torch.testing.assert_close(q.tensor, seen["q"][0], rtol=0, atol=0)


@pytest.mark.parametrize(
    "family, norms",
    [
        ("bart", ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")),
        ("t5", ("layer.0.layer_norm", "layer.1.layer_norm", "layer.2.layer_norm")),
    ],
)
def test_decoder_norms_are_numbered_by_their_sublayer(family, norms):
    """ln1, ln2, ln3 of a decoder layer go with its self-attention, cross-attention and MLP: the
    norm after each on post-LN BART, before each on pre-LN T5 (as the bridge's adapters read them)."""
    model = testing.build(family, "eager")
    args, kwargs = testing.inputs(family, length=5)
    layer = model.get_decoder().layers[1] if family == "bart" else model.decoder.block[1]
    modules = {n: layer.get_submodule(n) for n in norms}
    seen = _hooked(model, modules, lambda: model(*args, **kwargs))
    t = tl.trace(model, *args, **kwargs)
    for i, n in enumerate(norms, start=1):
        for side, k in (("hook_in", 0), ("hook_out", 1)):
            r = mi.resolve_alias(t, f"decoder_blocks.1.ln{i}.{side}", generation="4.x")
            assert r.status == "real", (n, side, r.reason)
            torch.testing.assert_close(r.tensor, seen[n][k], rtol=0, atol=0)


def test_opt_interp_engine_mlp_names_read_the_layer_held_mlp():
    model = testing.build("opt", "eager")
    layer = model.model.decoder.layers[0]
    seen = _hooked(
        model,
        {"fc1": layer.fc1, "fc2": layer.fc2, "norm": model.model.decoder.final_layer_norm},
        lambda: model(IDS),
    )
    t = tl.trace(model, IDS)
    expected = {
        "mlp_in.0": seen["fc1"][0],
        "mlp_pre.0": seen["fc1"][1],
        "mlp_act.0": seen["fc2"][0],
        "mlp_out.0": seen["fc2"][1],
    }
    for name, want in expected.items():
        r = mi.resolve_alias(t, name, generation="interp-engine")
        assert r.status == "real", (name, r.reason)
        torch.testing.assert_close(r.tensor, want, rtol=0, atol=0)
    # the user's spec lists interp-engine's final_norm among its points without a TorchLens site;
    # the reason says where the tensor is, and it is there
    r = mi.resolve_alias(t, "final_norm", generation="interp-engine")
    assert r.status == "structurally_absent" and "final norm module's output" in r.reason
    norm = t.modules["model.decoder.final_layer_norm"].facets["output"]
    torch.testing.assert_close(norm, seen["norm"][1], rtol=0, atol=0)


def _o_proj_input(model, ids) -> torch.Tensor:
    seen = _hooked(model, {"o": model.model.layers[0].self_attn.o_proj}, lambda: model(ids))
    return seen["o"][0]


def test_compare_does_not_pass_a_layout_it_cannot_tell_from_the_shape():
    """With as many heads as positions, token-major and head-major z have one shape: the right
    (token-major) tensor passes, one with the transpose forgotten does not, and its row says why;
    with another length the right one passes and the wrong one fails."""
    model = testing.build("llama", "eager")  # 4 heads, head_dim 8
    ids = IDS[:, :4]
    t = tl.trace(model, ids)
    token_major = _o_proj_input(model, ids).view(1, 4, 4, 8)  # [batch, pos, head, d_head]
    assert mi.compare(t, {"blocks.0.attn.hook_z": token_major}, generation="2.x")[0].passed
    flat = token_major.reshape(4, 32)
    assert mi.compare(t, {"z.0": flat}, generation="interp-engine")[0].passed
    forgot = token_major.transpose(1, 2).contiguous()
    for name, gen, value in (
        ("blocks.0.attn.hook_z", "2.x", forgot),
        ("z.0", "interp-engine", forgot[0].reshape(4, 32)),
        ("blocks.0.attn.o.hook_in", "4.x", forgot.reshape(1, 4, 32)),
    ):
        row = mi.compare(t, {name: value}, generation=gen, explain=False)[0]
        assert not row.passed and "ambiguous layout" in row.hint, (name, row)
    # the keys and values repeated per query head, token-major as the names lay them out, pass;
    # in the kernel's head-major layout the shape cannot tell, and the row says so
    seen = _hooked(model, {"k": model.model.layers[0].self_attn.k_proj}, lambda: model(ids))
    k = seen["k"][1].view(1, 4, 2, 8).repeat_interleave(2, dim=2)  # [batch, pos, heads, d_head]
    assert mi.compare(t, {"blocks.0.attn.hook_k": k}, generation="2.x")[0].passed
    row = mi.compare(t, {"blocks.0.attn.hook_k": k.transpose(1, 2)}, generation="2.x")[0]
    assert not row.passed and "ambiguous layout" in row.hint and row.explanation == ""
    t6 = tl.trace(model, IDS)
    right = _o_proj_input(model, IDS).view(1, 6, 4, 8)
    assert mi.compare(t6, {"blocks.0.attn.hook_z": right}, generation="2.x")[0].passed
    wrong = right.transpose(1, 2).reshape(1, 6, 4, 8)
    assert not mi.compare(t6, {"blocks.0.attn.hook_z": wrong}, generation="2.x", explain=False)[
        0
    ].passed


def test_compare_scores_masks_by_each_sides_dtype_and_does_not_explain_an_extra_mask_as_rounding():
    model = testing.build("gpt2", "eager")
    t = tl.trace(model, IDS)
    name = "blocks.0.attn.hook_attn_scores"
    scores = mi.resolve_alias(t, name, generation="2.x").tensor
    masked = scores <= torch.finfo(torch.float32).min / 2
    assert bool(masked.any())
    # a float16 engine fills masked entries with float16's minimum
    half = scores.clamp(min=torch.finfo(torch.float16).min).half()
    row = mi.compare(t, {name: half}, generation="2.x", atol=1e-2, rtol=1e-2)[0]
    assert row.passed, row.hint
    # an engine that masks the diagonal too (an off-by-one causal mask)
    extra = scores.masked_fill(
        torch.eye(scores.shape[-1], dtype=torch.bool), torch.finfo(torch.float32).min
    )
    row = mi.compare(t, {name: extra}, generation="2.x")[0]
    assert not row.passed and "rounded to" not in row.explanation


def test_compare_makes_a_failed_row_of_a_value_that_is_not_a_tensor():
    t = tl.trace(testing.build("gpt2", "sdpa"), IDS)
    for value in (None, ()):
        row = mi.compare(t, {"blocks.0.hook_resid_pre": value}, explain=False)[0]
        assert not row.passed and "not a tensor" in row.hint
    with pytest.raises(mi.CompareSpecError, match="dict"):
        mi.compare(t, [("blocks.0.hook_resid_pre", torch.zeros(1))])


def test_an_interp_engine_address_asked_of_another_generation_says_whose_it_is():
    t = tl.trace(testing.build("gpt2", "sdpa"), IDS)
    for name in ("resid_pre.0.stream-1", "path.transformer"):
        with pytest.raises(mi.UnknownAlias, match="generation='interp-engine'"):
            mi.resolve_alias(t, name, generation="2.x")


class _IdsOnlyTokenizer:
    """What interp-engine's EagerModel reads from a tokenizer when it is given token ids."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 3
    chat_template = None


#: Decoder language models: every causal-LM family of the registry, and two that scale each
#: sublayer's output before the residual add (Granite's residual_multiplier 0.22, MiniCPM3's
#: scale_depth / sqrt(layers)).
_DECODERS = ["granite", "minicpm3"] + [
    name for name, f in testing.FAMILIES.items() if f.model.endswith(("ForCausalLM", "LMHeadModel"))
]


@pytest.mark.parametrize("arch", _DECODERS)
def test_the_sublayer_contributions_are_interp_engines_post_sublayer_points(arch):
    """TransformerLens 2.x's `blocks.L.hook_attn_out`/`hook_mlp_out` read the sublayer's residual
    contribution: after a sandwich norm (Gemma-2, OLMo-2), times the residual multiplier. Where
    TorchLens serves them, they equal interp-engine's own capture of `attn_out_post.L`/
    `mlp_out_post.L` (the same meaning), bit for bit, and the two add up to what the layer adds to
    the stream (its output minus its input, from plain hooks on the layer). interp-engine's names
    themselves have no site (the user's spec lists them so), and their reason points here."""
    pytest.importorskip("interp_engine")
    import asyncio

    import _edge_models as em
    from interp_engine import EagerModel

    model = em.build(arch) if arch in em.CONFIGS else testing.build(arch, "eager")
    ids = IDS[:, :5]
    t = tl.trace(model, ids)
    layers = t.blocks
    if not layers:
        pytest.skip(f"{arch}: no decoder layers found")
    ours = {}
    for i in range(len(layers)):
        for side, point in (("attn", "attn_out_post"), ("mlp", "mlp_out_post")):
            own = mi.resolve_alias(t, f"{point}.{i}", generation="interp-engine")
            assert own.status == "structurally_absent" and f"hook_{side}_out" in own.reason
            r = mi.resolve_alias(t, f"blocks.{i}.hook_{side}_out", generation="2.x")
            assert r.status in ("real", "structurally_absent"), (arch, i, side, r.status, r.reason)
            if r.status == "real":
                ours[f"{point}.{i}"] = r.tensor
    if not ours:
        return
    try:
        engine = EagerModel(
            f"local-{arch}", hf_model=model, tokenizer=_IdsOnlyTokenizer(), device="cpu"
        )
    except Exception as exc:  # an architecture interp-engine does not know
        pytest.skip(f"interp-engine does not load {arch}: {type(exc).__name__}")
    asked = [n for n in ours if engine.refuses(n) is None]
    theirs = {str(k): v for k, v in asyncio.run(engine.capture(ids[0].tolist(), asked)).items()}
    for name in asked:  # interp-engine gives [tokens, width] of the one prompt
        mine = ours[name]
        assert mine.numel() == theirs[name].numel(), (name, mine.shape, theirs[name].shape)
        torch.testing.assert_close(mine.reshape(theirs[name].shape), theirs[name], rtol=0, atol=0)
    seen = _hooked(
        model, {i: model.get_submodule(a) for i, a in enumerate(layers)}, lambda: model(ids)
    )
    for i in range(len(layers)):
        pair = (f"attn_out_post.{i}", f"mlp_out_post.{i}")
        if all(n in ours for n in pair):
            added = seen[i][1] - seen[i][0]
            total = (ours[pair[0]] + ours[pair[1]]).reshape(added.shape)
            torch.testing.assert_close(total, added, rtol=1e-5, atol=1e-6)


def test_a_contribution_summed_with_another_branch_after_a_multiplier_is_absent():
    """Falcon-H1 multiplies its attention's output by `attention_out_multiplier` and sums it with
    the Mamba mixer's before the residual add: no one tensor of the forward is the attention's
    contribution, and the attention's output is not it (it was served as such)."""
    import _edge_models as em
    import transformers as tf

    config = tf.FalconH1Config(
        **em._LL, head_dim=8, mamba_d_ssm=32, **em._MAMBA, attention_out_multiplier=0.7
    )
    model = testing.from_config(config, tf.FalconH1ForCausalLM, "eager", torch.float32)
    t = tl.trace(model, IDS[:, :5])
    r = mi.resolve_alias(t, "blocks.0.hook_attn_out", generation="2.x")
    assert r.status == "structurally_absent", r.status
    assert "Falcon-H1" in r.reason
