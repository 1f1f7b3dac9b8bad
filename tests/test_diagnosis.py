"""Tests of `compare`'s mismatch diagnosis (`Comparison.explanation`) and `tolerance="auto"`.

Each bug class of the catalogue (docs/guides/wrong-hooks.md) is reproduced by a plain-PyTorch
"engine": forward hooks on module paths written down here per family (`PATHS`), never found
through TorchLens. The engine's tensor is handed to `compare` under the name it was meant to
read, and the test asserts that the explanation names the class. Each class runs on three
families. Models are tiny random-init configs (seeded), traced on the CPU.

Tests internals: `torchlens._naming.pool.POOLS`, the per-trace pool of tensor
statistics the search keeps (it must not keep a trace alive).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import transformers as tf

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing
from torchlens.mechinterp import ToleranceError

IDS = testing.token_ids()
T = IDS.shape[1]

#: Per family: where the blocks are and what each block's submodules are called (None: absent).
_LLAMA = dict(
    layers="model.layers",
    attn="self_attn",
    mlp="mlp",
    ln1="input_layernorm",
    ln2="post_attention_layernorm",
    attn_post=None,
    q="self_attn.q_proj",
    k="self_attn.k_proj",
    embed="model.embed_tokens",
)
_GEMMA = dict(_LLAMA, ln2="pre_feedforward_layernorm", attn_post="post_attention_layernorm")
PATHS = {
    "gpt2": dict(
        layers="transformer.h",
        attn="attn",
        mlp="mlp",
        ln1="ln_1",
        ln2="ln_2",
        attn_post=None,
        q=None,
        k=None,
        embed="transformer.wte",
    ),
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "granite": _LLAMA,
    "gemma2": _GEMMA,
    "gemma3": _GEMMA,
    "vaultgemma": dict(_LLAMA, ln2="pre_feedforward_layernorm"),
    "olmo2": dict(_LLAMA, ln1=None, ln2=None, attn_post="post_attention_layernorm"),
}
HEADS, KV, D_HEAD = 4, 2, 8
_SOFTCAPPED = dict(
    head_dim=8,
    sliding_window=4,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
    attn_logit_softcapping=0.5,
)


def _build(family: str, attn: str = "eager") -> torch.nn.Module:
    if family == "granite":
        config = tf.GraniteConfig(
            residual_multiplier=0.22,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
            **testing.LLAMA_LIKE,
        )
        return testing.from_config(config, tf.GraniteForCausalLM, attn, torch.float32)
    if family == "gemma3":  # Gemma-3 caps the final logits (its attention has no softcap)
        config = tf.Gemma3TextConfig(
            final_logit_softcapping=0.5, **_SOFTCAPPED, **testing.LLAMA_LIKE
        )
        return testing.from_config(config, tf.Gemma3ForCausalLM, attn, torch.float32)
    if family == "vaultgemma":
        config = tf.VaultGemmaConfig(**_SOFTCAPPED, **testing.LLAMA_LIKE)
        return testing.from_config(config, tf.VaultGemmaForCausalLM, attn, torch.float32)
    if family == "gemma2":
        config = tf.Gemma2Config(**_SOFTCAPPED, **testing.LLAMA_LIKE)
        return testing.from_config(config, tf.Gemma2ForCausalLM, attn, torch.float32)
    return testing.build(family, attn)


def _sharpen(model: torch.nn.Module) -> None:
    """Random init gives near-zero attention logits; scale q/k so a softcap or mask matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(30.0)


@functools.cache
def traced(family: str, attn: str = "eager", sharp: bool = False):
    """(model, trace), cached: tests must not modify either."""
    model = _build(family, attn)
    if sharp:
        _sharpen(model)
    return model, tl.trace(model, IDS)


def sub(model, family: str, layer: int, part: str | None = None) -> torch.nn.Module:
    p = PATHS[family]
    block = model.get_submodule(f"{p['layers']}.{layer}")
    return block if part is None else block.get_submodule(p[part])


def run_engine(model, hooks) -> dict:
    """Run `model(IDS)` with `hooks` [(module, "pre" | "post", fn)] installed; fn writes `saved`."""
    saved: dict = {}
    handles = []
    try:
        for module, kind, fn in hooks:
            if kind == "pre":
                handles.append(
                    module.register_forward_pre_hook(
                        lambda m, args, kwargs, fn=fn: [
                            fn(saved, args[0] if args else kwargs["hidden_states"]),
                            None,
                        ][1],
                        with_kwargs=True,
                    )
                )
            else:
                handles.append(
                    module.register_forward_hook(
                        lambda m, args, out, fn=fn: [fn(saved, out), None][1]
                    )
                )
        with torch.no_grad():
            model(IDS)
    finally:
        for h in handles:
            h.remove()
    return saved


def first(out):
    return out[0] if isinstance(out, tuple) else out


def explain(family, values, generation="2.x", attn="eager", sharp=False):
    _, trace = traced(family, attn, sharp)
    report = mi.compare(trace, values, generation=generation)
    return report


# -- the engines: one per bug class ------------------------------------------------------------------


def engine_residual_included(model, family):
    """The attention 'output' read where the residual has been added (BLOOM's sublayers)."""
    p = PATHS[family]
    after = sub(model, family, 0, "ln2") if p["ln2"] else sub(model, family, 0, "mlp")
    return {
        "blocks.0.hook_attn_out": run_engine(
            model, [(after, "pre", lambda s, x: s.setdefault("v", x.clone()))]
        )["v"]
    }


def engine_after_norm(model, family):
    """hook_resid_pre read at the attention input, after the norm (TransformerLens #1317)."""
    attn = sub(model, family, 0, "attn")
    return {
        "blocks.0.hook_resid_pre": run_engine(
            model, [(attn, "pre", lambda s, x: s.setdefault("v", x.clone()))]
        )["v"]
    }


def engine_raw_sublayer(model, family):
    """hook_attn_out read as the attention module's raw output on a post-norm family (TransformerLens #1648)."""
    attn = sub(model, family, 0, "attn")
    return {
        "blocks.0.hook_attn_out": run_engine(
            model, [(attn, "post", lambda s, o: s.setdefault("v", first(o).clone()))]
        )["v"]
    }


def engine_wrong_tuple(model, family):
    """The attention module's whole (output, weights) tuple handed for the pattern."""
    attn = sub(model, family, 0, "attn")
    out = run_engine(
        model, [(attn, "post", lambda s, o: s.setdefault("v", tuple(t.clone() for t in o)))]
    )["v"]
    return {"blocks.0.attn.hook_pattern": out}


def engine_neighbour(model, family):
    """Layer 0's output read from layer 1 (an off-by-one layer index)."""
    block = sub(model, family, 1)
    return {
        "blocks.0.hook_resid_post": run_engine(
            model, [(block, "post", lambda s, o: s.setdefault("v", first(o).clone()))]
        )["v"]
    }


def _q_heads(model, family) -> torch.Tensor:
    """The query projection per head, token-major [1, T, heads, d_head], read by a hook."""
    if PATHS[family]["q"] is None:  # GPT-2: the fused c_attn, split into q, k, v
        c_attn = sub(model, family, 0, "attn").c_attn
        out = run_engine(model, [(c_attn, "post", lambda s, o: s.setdefault("v", o.clone()))])["v"]
        d = out.shape[-1] // 3
        return out[..., :d].view(1, T, -1, d // model.config.n_head)
    q = model.get_submodule(f"{PATHS[family]['layers']}.0.{PATHS[family]['q']}")
    return run_engine(model, [(q, "post", lambda s, o: s.setdefault("v", o.clone()))])["v"].view(
        1, T, HEADS, D_HEAD
    )


def engine_head_major(model, family):
    """hook_q handed head-major [batch, heads, pos, d_head], as the attention kernel takes it."""
    return {"blocks.0.attn.hook_q": _q_heads(model, family).transpose(1, 2)}


def _k_heads(model, family) -> torch.Tensor:
    k = model.get_submodule(f"{PATHS[family]['layers']}.0.{PATHS[family]['k']}")
    return run_engine(model, [(k, "post", lambda s, o: s.setdefault("v", o.clone()))])["v"].view(
        1, T, KV, D_HEAD
    )


def engine_kv_tiled(model, family):
    """hook_k expanded to the query heads with repeat (tiling) instead of repeat_interleave."""
    return {"blocks.0.attn.hook_k": _k_heads(model, family).repeat(1, 1, HEADS // KV, 1)}


def engine_rope_missing(model, family):
    """hook_rot_q read before RoPE is applied."""
    return {"blocks.0.attn.hook_rot_q": _q_heads(model, family)}


def engine_scale(model, family):
    """Granite: the attention's contribution as the residual receives it (x residual_multiplier);
    Gemma: the raw embedding lookup, before the sqrt(d_model) normalizer, handed as hook_embed
    (TransformerLens 2.x folds the normalizer into W_E, so its hook_embed is the scaled one)."""
    if (
        family == "granite"
    ):  # TorchLens has no hook_attn_out here (the output is scaled before the add)
        hooks = [
            (sub(model, family, 0), "pre", lambda s, x: s.setdefault("in", x.clone())),
            (sub(model, family, 0, "ln2"), "pre", lambda s, x: s.setdefault("mid", x.clone())),
        ]
        saved = run_engine(model, hooks)
        return {"blocks.0.attn.hook_out": saved["mid"] - saved["in"]}
    embed = model.get_submodule(PATHS[family]["embed"])
    return {"hook_embed": torch.nn.functional.embedding(IDS, embed.weight).detach()}


def engine_fused_norm(model, family):
    """A vLLM-style fused add+norm writes its output into the saved attention output (nnsight PR #642)."""
    p = PATHS[family]
    source = sub(model, family, 0, "attn_post") if p["attn_post"] else sub(model, family, 0, "attn")

    def keep(s, o):
        s["v"] = first(o)  # saved by reference, as an engine that does not clone

    def fused(s, o):
        s["v"].copy_(o)  # the norm writes its result into its input buffer

    saved = run_engine(
        model, [(source, "post", keep), (sub(model, family, 0, "ln2"), "post", fused)]
    )
    return {"blocks.0.hook_attn_out": saved["v"]}


def engine_softcap_dropped(model, family):
    """An engine that runs the attention without its logit softcap (SGLang #33915); on Gemma-3,
    the final logits read before their softcap."""
    if family == "gemma3":
        head = model.get_submodule("lm_head")
        return {
            "logits": run_engine(
                model, [(head, "post", lambda s, o: s.setdefault("v", o.clone()))]
            )["v"]
        }
    twin = copy.deepcopy(model)
    for m in twin.modules():
        if hasattr(m, "attn_logit_softcapping"):
            m.attn_logit_softcapping = None
    attn = sub(twin, family, 0, "attn")
    out = run_engine(twin, [(attn, "post", lambda s, o: s.setdefault("v", o[1].clone()))])["v"]
    return {"blocks.0.attn.hook_pattern": out}


def engine_eager_copy(model, family):
    """Under sdpa, the pattern taken from an eager copy of the attention, called outside the forward."""
    twin = copy.deepcopy(model)
    twin.config._attn_implementation = "eager"
    eager_attn = sub(twin, family, 0, "attn")
    got = {}

    def capture(m, args, kwargs):
        kw = {k: v for k, v in kwargs.items() if k in ("position_embeddings",)}
        hidden = args[0] if args else kwargs["hidden_states"]
        out = eager_attn(
            hidden, attention_mask=None, **kw
        )  # the mask is built by the model, not the module
        got["v"] = out[1].detach().clone()

    h = sub(model, family, 0, "attn").register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            model(IDS)
    finally:
        h.remove()
    return {"blocks.0.attn.hook_pattern": got["v"]}


def engine_bf16(model, family):
    """The right tensors, computed in float32 and rounded to bfloat16 by the engine."""
    with torch.no_grad():
        hidden = model(IDS, output_hidden_states=True).hidden_states
    return {"blocks.0.hook_resid_post": hidden[1].to(torch.bfloat16)}


#: class -> (engine, families, phrase the explanation must contain, attention implementation, sharpen q/k)
CLASSES = {
    "residual included": (
        engine_residual_included,
        ("gpt2", "llama", "olmo2"),
        "the residual is included",
        "eager",
        False,
    ),
    "after the norm": (
        engine_after_norm,
        ("gpt2", "llama", "gemma2"),
        "after the norm",
        "eager",
        False,
    ),
    "raw sublayer output": (
        engine_raw_sublayer,
        ("gemma2", "olmo2", "gemma3"),
        "the norm not applied",
        "eager",
        False,
    ),
    "wrong tuple element": (
        engine_wrong_tuple,
        ("gpt2", "llama", "olmo2"),
        "the wrong tuple element",
        "eager",
        False,
    ),
    "neighbouring layer": (
        engine_neighbour,
        ("gpt2", "llama", "gemma2"),
        "the neighbouring layer (1 instead of 0)",
        "eager",
        False,
    ),
    "head-major": (
        engine_head_major,
        ("gpt2", "llama", "gemma2"),
        "head-major instead of token-major",
        "eager",
        False,
    ),
    "kv heads tiled": (
        engine_kv_tiled,
        ("llama", "gemma2", "mistral"),
        "kv heads tiled",
        "eager",
        False,
    ),
    "RoPE not applied": (
        engine_rope_missing,
        ("llama", "gemma2", "mistral"),
        "before RoPE instead of after",
        "eager",
        False,
    ),
    "scale factor": (engine_scale, ("granite",), "a scale factor", "eager", False),
    "fused norm in place": (
        engine_fused_norm,
        ("gpt2", "llama", "gemma2"),
        "fused add+norm",
        "eager",
        False,
    ),
    "softcap dropped": (
        engine_softcap_dropped,
        ("gemma2", "vaultgemma", "gemma3"),
        "softcap (tanh)",
        "eager",
        True,
    ),
    "eager copy under sdpa": (
        engine_eager_copy,
        ("gpt2", "llama", "mistral"),
        "no causal or attention mask",
        "sdpa",
        True,
    ),
    "bfloat16 rounding": (
        engine_bf16,
        ("gpt2", "llama", "gemma2"),
        "rounded to bfloat16",
        "eager",
        False,
    ),
}

CASES = [(cls, fam) for cls, (_, fams, *_rest) in CLASSES.items() for fam in fams]


@pytest.mark.parametrize("cls,family", CASES, ids=[f"{c}-{f}" for c, f in CASES])
def test_each_class_is_diagnosed(cls, family):
    engine, _, phrase, attn, sharp = CLASSES[cls]
    model, trace = traced(family, attn, sharp)
    values = engine(model, family)
    try:  # the 2.x names where the engine used them (on Gemma the bare hook_embed is ambiguous)
        report = mi.compare(trace, values, generation="2.x")
    except mi.UnknownAlias:
        report = mi.compare(trace, values)
    (row,) = report
    assert not row.passed, f"{cls} on {family}: the wrong hook passed"
    assert row.candidates and row.candidates[0].matches, row.explanation
    assert row.explanation.startswith(("equals ", "element 1 of the engine's tuple is "))
    assert phrase in row.explanation, row.explanation
    assert f"=> {row.explanation}" in repr(report)  # the printed report shows it
    assert phrase in report._repr_html_()


def test_scale_factor_is_reported():
    model, trace = traced("granite")
    (row,) = mi.compare(trace, engine_scale(model, "granite"), generation="4.x")
    assert row.explanation.startswith("equals 0.22 × blocks.0.attn.hook_out: a scale factor"), (
        row.explanation
    )
    assert row.candidates[0].factor == pytest.approx(0.22, rel=1e-4)
    for family in (
        "gemma2",
        "gemma3",
    ):  # an engine that left out Gemma's sqrt(d_model): the raw lookup
        model, trace = traced(family)
        (row,) = mi.compare(trace, engine_scale(model, family), generation="2.x")
        assert (
            not row.passed and row.module_address == "model.embed_tokens" and row.facet == "output"
        )
        assert row.explanation == "equals model.embed_tokens:lookup: 1 op before the site (mul)", (
            row.explanation
        )


def test_a_scaled_tensor_without_an_op_gets_the_least_squares_factor():
    _, trace = traced("llama")
    mlp_out = trace.modules["model.layers.1.mlp"].facets["output"]
    (row,) = mi.compare(trace, {"blocks.1.hook_mlp_out": -3.5 * mlp_out}, generation="2.x")
    assert row.explanation == "equals -3.5 × blocks.1.hook_mlp_out: a scale factor"


def test_the_vllm_pair_is_explained_by_its_sum():
    """vLLM decoder layers return (mlp_out, residual): element 0 is not the layer output."""
    model, trace = traced("llama")
    hooks = [
        (sub(model, "llama", 0, "mlp"), "post", lambda s, o: s.setdefault("mlp", o.clone())),
        (sub(model, "llama", 0, "ln2"), "pre", lambda s, x: s.setdefault("resid", x.clone())),
    ]
    saved = run_engine(model, hooks)
    (row,) = mi.compare(
        trace, {"layers_output[0]": (saved["mlp"], saved["resid"])}, generation="nnterp"
    )
    assert not row.passed
    assert "the residual was not added" in row.explanation
    assert any(c.site == "mlps_output[0]" and c.matches for c in row.candidates)


def test_kv_heads_repeated_per_head_pass():
    """The right expansion (repeat_interleave, as transformers' repeat_kv) is a layout, not a bug."""
    model, trace = traced("llama")
    (row,) = mi.compare(
        trace, {"blocks.0.attn.hook_k": _k_heads(model, "llama").repeat_interleave(2, dim=2)}
    )
    assert row.passed and "kv heads repeated" in row.layout and row.explanation == ""


def test_the_sum_of_two_sites():
    _, trace = traced("gpt2")
    f = trace.modules
    value = f["transformer.h.1.attn"].facets["output"] + f["transformer.h.0.mlp"].facets["output"]
    (row,) = mi.compare(trace, {"blocks.1.hook_attn_out": value}, generation="2.x")
    assert row.explanation == (
        "equals blocks.0.hook_mlp_out + blocks.1.hook_attn_out: the sum of two sites"
    )


def test_random_noise_matches_nothing():
    for family in ("gpt2", "llama", "gemma2"):
        _, trace = traced(family)
        ref = trace.modules[trace.blocks[1]].facets["resid_post"]
        noise = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3))
        (row,) = mi.compare(trace, {"blocks.1.hook_resid_post": noise}, generation="2.x")
        assert row.explanation.startswith(
            "matches no tensor of the trace; nearest by relative error: "
        )
        assert not any(c.matches for c in row.candidates)
        assert [c.error for c in row.candidates] == sorted(c.error for c in row.candidates)
        assert all(c.error > 0.5 for c in row.candidates)


def test_a_passed_row_has_no_explanation():
    model, trace = traced("llama")
    with torch.no_grad():
        hidden = model(IDS, output_hidden_states=True).hidden_states
    (row,) = mi.compare(trace, {"blocks.0.hook_resid_post": hidden[1]})
    assert row.passed and row.explanation == "" and row.candidates == ()


@pytest.mark.parametrize(
    "generation,name,expected",
    [
        (
            "2.x",
            "blocks.0.hook_resid_post",
            "equals blocks.1.hook_resid_post: the neighbouring layer",
        ),
        ("4.x", "blocks.0.hook_out", "equals blocks.1.hook_out: the neighbouring layer"),
        ("nnterp", "layers_output[0]", "equals layers_output[1]: the neighbouring layer"),
        ("interp-engine", "resid_post.0", "equals resid_post.1: the neighbouring layer"),
    ],
)
def test_the_explanation_speaks_the_generation_asked_for(generation, name, expected):
    model, trace = traced("llama")
    value = engine_neighbour(model, "llama")["blocks.0.hook_resid_post"]
    (row,) = mi.compare(trace, {name: value}, generation=generation)
    assert row.explanation.startswith(expected), row.explanation


def test_the_search_does_not_keep_a_trace_alive():
    import gc
    import weakref

    from torchlens._naming import pool as _pool

    model, _ = traced("gpt2")
    trace = tl.trace(model, IDS)
    (row,) = mi.compare(trace, engine_neighbour(model, "gpt2"))
    assert "neighbouring layer" in row.explanation and trace in _pool.POOLS
    ref = weakref.ref(trace)
    del trace, row
    gc.collect()
    assert ref() is None


# -- tolerance="auto" --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_auto_tolerance_passes_a_bf16_engine_and_fails_wrong_hooks(family):
    """A bf16 engine with the right hooks passes under tolerance="auto" (against a float32 and a
    bf16 trace); the same engine with wrong hooks fails on the same sites."""
    model, trace32 = traced(family)
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    trace16 = tl.trace(model16, IDS)
    with torch.no_grad():
        hidden = model(IDS, output_hidden_states=True).hidden_states
    # hidden_states[-1] is the final norm's output in transformers, so only the first two are used.
    right = {
        "blocks.0.hook_resid_pre": hidden[0],
        "blocks.0.hook_resid_post": hidden[1],
        "blocks.1.hook_resid_pre": hidden[1],
    }
    right = {k: v.to(torch.bfloat16) for k, v in right.items()}
    wrong = {
        "blocks.0.hook_resid_post": engine_neighbour(model, family)["blocks.0.hook_resid_post"],
        "blocks.1.hook_resid_pre": hidden[0],
        "blocks.0.hook_resid_pre": engine_after_norm(model, family)["blocks.0.hook_resid_pre"],
    }
    wrong = {k: v.to(torch.bfloat16) for k, v in wrong.items()}
    weights = [p.detach().clone() for p in model.parameters()]
    for trace, m in ((trace32, model), (trace16, model16)):
        assert not mi.compare(trace, right).ok  # the default tolerance is float32's
        report = mi.compare(trace, right, tolerance="auto", model=m, inputs=IDS)
        assert report.ok, [(c.name, c.max_abs_error, c.tolerance) for c in report]
        bad = mi.compare(trace, wrong, tolerance="auto", model=m, inputs=IDS)
        assert bad.mismatched == list(wrong)
        assert "neighbouring layer" in bad[0].explanation and "after the norm" in bad[2].explanation
        assert "neighbouring layer" in bad[1].explanation
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters())), (
        "the user's model was changed"
    )
    assert next(model.parameters()).dtype == torch.float32


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_auto_tolerance_passes_every_site_rounded_to_bf16(family):
    """Every readable 2.x site of a float32 run, rounded to bfloat16 (the engine's dtype), passes
    under tolerance="auto" against the float32 trace and against a bfloat16 trace of the same weights."""
    model, trace32 = traced(family)
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    trace16 = tl.trace(model16, IDS)
    names = [r.query for r in mi.alias_report(trace32, generation="2.x") if r.readable]
    values = {}
    for name in names:
        t = mi.resolve_alias(trace32, name, generation="2.x").tensor
        values[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    for trace, m in ((trace32, model), (trace16, model16)):
        report = mi.compare(trace, values, generation="2.x", tolerance="auto", model=m, inputs=IDS)
        # A site the float64 rerun does not serve keeps atol/rtol, and the row says so (Gemma's
        # RMSNorm computes in float32 even in a float64 model, and the float64 trace refuses its
        # derived facets); every other site passes.
        unavailable = [c.name for c in report if "tolerance='auto' unavailable here" in c.hint]
        assert all(c.passed for c in report if c.name not in unavailable), [
            (c.name, c.max_abs_error, c.tolerance) for c in report if not c.passed
        ]
        trace64 = tl.trace(copy.deepcopy(model).to(torch.float64), IDS)
        trace64.check()  # `in` computes nothing: run the pending checks, so refused facets are out of the map
        for name in unavailable:  # only where the float64 trace does not serve the site
            res = mi.resolve_alias(trace32, name, generation="2.x")
            assert res.facet not in trace64.modules[res.module_address].facets, name
        assert family == "gemma2" or not unavailable
        assert len(report) == len(names) > 30


def test_a_float64_trace_serves_resid_mid_and_normalized():
    model, _ = traced("gpt2")
    trace = tl.trace(copy.deepcopy(model).to(torch.float64), IDS)
    assert "resid_mid" in trace.modules["transformer.h.0"].facets
    assert "normalized" in trace.modules["transformer.h.0.ln_2"].facets


def test_explain_false_and_a_trace_without_tensors():
    model, trace = traced("gpt2")
    value = engine_neighbour(model, "gpt2")
    (row,) = mi.compare(trace, value, explain=False)
    assert not row.passed and row.explanation == "" and row.candidates == ()
    bare = tl.trace(model, IDS, save="none")
    (row,) = mi.compare(bare, value)
    assert "kept no tensors" in row.explanation


def test_auto_tolerance_needs_the_model():
    _, trace = traced("gpt2")
    values = {"blocks.0.hook_resid_post": trace["transformer.h.0:resid_post"]}
    with pytest.raises(ToleranceError, match="model="):
        mi.compare(trace, values, tolerance="auto")
    with pytest.raises(ToleranceError, match="'auto'"):
        mi.compare(trace, values, tolerance="loose")


def test_the_norm_output_hint_reads_the_call_a_shared_block_layer_names():
    """A block object run for two layers: the hint reads layer 1's call of the shared norm."""
    torch.manual_seed(0)
    config = tf.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = tf.GPT2LMHeadModel(config).eval()
    model.transformer.h[1] = model.transformer.h[0]
    with torch.no_grad():  # a gain and bias that are not the identity, so output != normalized
        model.transformer.h[0].ln_1.weight.normal_()
        model.transformer.h[0].ln_1.bias.normal_()
    seen = []  # ground truth: what the shared norm returned on each call, from a plain hook
    handle = model.transformer.h[0].ln_1.register_forward_hook(
        lambda m, a, out: seen.append(out.detach().clone())
    )
    model(IDS)
    handle.remove()
    trace = tl.trace(model, IDS)
    (row,) = mi.compare(trace, {"blocks.1.ln1.hook_normalized": seen[1]}, generation="2.x")
    assert not row.passed
    assert "this norm's output, after the gain and bias" in row.hint
