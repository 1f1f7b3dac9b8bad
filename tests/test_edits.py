"""`trace(..., edit=...)`: each edit checked against the same edit made without TorchLens.

Ground truth comes from outside TorchLens: plain PyTorch forward hooks on the module that
computes the site (or on the module whose input is the site, for op-level facets), the model's
own clean forward (activation patching), and nnsight's and the TransformerLens 4.x bridge's own
intervention mechanisms.
"""

from __future__ import annotations

import ast
import contextlib
import time
import warnings

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens import EditSpecError, LookupFailed, NotEditable, testing

IDS = testing.token_ids(1, 6)
ATOL = 1e-6


def _first(o):
    return o if torch.is_tensor(o) else o[0]


def _with_first(o, new):
    return new if torch.is_tensor(o) else (new,) + tuple(o[1:])


def _hooked_logits(model, module, fn, pre=False):
    """Logits of `model(IDS)` with a plain forward (pre-)hook replacing `module`'s output (input)."""
    if pre:
        h = module.register_forward_pre_hook(lambda m, a: (fn(a[0]),) + tuple(a[1:]))
    else:
        h = module.register_forward_hook(lambda m, a, o: _with_first(o, fn(_first(o))))
    try:
        with torch.no_grad():
            return model(IDS).logits
    finally:
        h.remove()


def _nothing_installed(model):
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert torch._C._len_torch_function_stack() == 0


# -- hook-level sites -----------------------------------------------------------------------------


def test_gpt2_zero_resid_post_matches_forward_hook():
    model = testing.build("gpt2")
    with torch.no_grad():
        clean = model(IDS).logits
        t = tl.trace(model, IDS, edit={"blocks.0.hook_resid_post": lambda x: x * 0})
    want = _hooked_logits(model, model.transformer.h[0], lambda x: x * 0)
    assert not torch.allclose(want, clean)  # the edit changes something
    torch.testing.assert_close(t.output.logits, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(t["<root>:logits"], want, atol=ATOL, rtol=0)
    assert (
        float(t.modules["transformer.h.0"].facets["resid_post"].abs().max()) == 0.0
    )  # what the model used
    (e,) = t.edits
    assert (e.module_address, e.facet, e.calls, e.how, e.where, e.applied) == (
        "transformer.h.0",
        "resid_post",
        (0,),
        "fn",
        "forward hook",
        1,
    )
    _nothing_installed(model)


@pytest.mark.parametrize(
    "key",
    [
        "blocks.0.hook_resid_post",
        "blocks.0.hook_out",
        "layers_output[0]",
        "resid_post.0",
        "transformer.h.0:resid_post",
        ("transformer.h.0", "output"),
    ],
)
def test_every_generation_names_the_same_edit(key):
    """2.x, 4.x, nnterp and interp-engine names, 'address:facet' and a tuple: one site, one edit."""
    model = testing.build("gpt2")
    with torch.no_grad():
        t = tl.trace(model, IDS, edit={key: lambda x: x * 0.5})
    torch.testing.assert_close(
        t.output.logits,
        _hooked_logits(model, model.transformer.h[0], lambda x: x * 0.5),
        atol=ATOL,
        rtol=0,
    )
    assert t.edits[0].module_address == "transformer.h.0" and t.edits[0].key == key


def test_llama_steering_resid_pre_matches_pre_hook_and_downstream_sites():
    model = testing.build("llama")
    steer = torch.linspace(-1, 1, 32)
    with torch.no_grad():
        t = tl.trace(model, IDS, edit={("model.layers.1", "resid_pre"): lambda x: x + steer})
    want = _hooked_logits(model, model.model.layers[1], lambda x: x + steer, pre=True)
    torch.testing.assert_close(t.output.logits, want, atol=ATOL, rtol=0)
    # a downstream site: layer 1's output as the model's own hidden states give it
    h = model.model.layers[1].register_forward_pre_hook(lambda m, a: (a[0] + steer,) + tuple(a[1:]))
    try:
        with torch.no_grad():
            hs = model(IDS, output_hidden_states=True).hidden_states
    finally:
        h.remove()
    torch.testing.assert_close(
        t.modules["model.layers.1"].facets["resid_pre"], hs[1] + steer, atol=ATOL, rtol=0
    )
    assert t.edits[0].where == "pre-hook"


def test_tensor_value_replaces_and_wrong_shape_teaches():
    model = testing.build("gpt2")
    with torch.no_grad():
        t0 = tl.trace(model, IDS)
        value = torch.ones_like(t0.modules["transformer.h.1.mlp"].facets["output"])
        t = tl.trace(model, IDS, edit={"transformer.h.1.mlp:output": value})
    torch.testing.assert_close(
        t.output.logits, _hooked_logits(model, model.transformer.h[1].mlp, lambda x: value)
    )
    assert t.edits[0].how == "tensor"
    with pytest.raises(EditSpecError, match=r"shape \[1, 6, 3\].*\[1, 6, 32\]"):
        tl.trace(model, IDS, edit={"transformer.h.1.mlp:output": torch.ones(1, 6, 3)})
    _nothing_installed(model)


# -- op-level sites --------------------------------------------------------------------------------


def test_gpt2_head_ablation_through_z_matches_zeroed_c_proj_columns():
    """Zeroing head 1 of z equals zeroing its d_head input columns of the output projection."""
    model = testing.build("gpt2")
    d_head = 16

    def ablate(z):  # z: [batch, heads, pos, d_head]
        z[:, 1] = 0
        return z

    def cols(x):
        x = x.clone()
        x[..., d_head : 2 * d_head] = 0
        return x

    with torch.no_grad():
        t = tl.trace(model, IDS, edit={"blocks.0.attn.hook_z": ablate})
    want = _hooked_logits(model, model.transformer.h[0].attn.c_proj, cols, pre=True)
    torch.testing.assert_close(t.output.logits, want, atol=ATOL, rtol=0)
    assert t.edits[0].where.startswith("op #") and "matmul" in t.edits[0].where


def test_llama_q_and_act_match_hooks_on_the_modules_computing_them():
    model = testing.build("llama")
    with torch.no_grad():
        t = tl.trace(
            model, IDS, edit={"blocks.0.attn.hook_q": lambda q: q * 2}
        )  # q: [b, pos, heads, d_head]
    torch.testing.assert_close(
        t.output.logits,
        _hooked_logits(model, model.model.layers[0].self_attn.q_proj, lambda x: x * 2),
        atol=ATOL,
        rtol=0,
    )
    with torch.no_grad():
        t = tl.trace(model, IDS, edit={"blocks.1.mlp.hook_post": lambda a: a.clamp(max=0.01)})
    torch.testing.assert_close(
        t.output.logits,
        _hooked_logits(
            model, model.model.layers[1].mlp.down_proj, lambda a: a.clamp(max=0.01), pre=True
        ),
        atol=ATOL,
        rtol=0,
    )


def test_gpt2_pattern_edit_matches_an_eager_manual_forward():
    """Uniform attention in layer 0: checked against the model's attention rewritten by hand."""
    model = testing.build("gpt2")

    def uniform(p):  # [batch, heads, query, key]
        n = torch.arange(1, p.shape[-1] + 1, dtype=p.dtype).view(-1, 1)
        return torch.tril(torch.ones_like(p)) / n

    with torch.no_grad():
        t = tl.trace(model, IDS, edit={"blocks.0.attn.hook_pattern": uniform})
    attn = model.transformer.h[0].attn

    def manual(module, args, out):
        x = args[0]
        b, n, d = x.shape
        q, k, v = attn.c_attn(x).split(d, dim=2)
        v = v.view(b, n, 2, d // 2).transpose(1, 2)
        p = uniform(torch.empty(b, 2, n, n))
        z = (p @ v).transpose(1, 2).reshape(b, n, d)
        return _with_first(out, attn.c_proj(z))

    h = attn.register_forward_hook(manual)
    try:
        with torch.no_grad():
            want = model(IDS).logits
    finally:
        h.remove()
    torch.testing.assert_close(t.output.logits, want, atol=1e-5, rtol=0)


def test_llama_rot_q_matches_an_attention_function_that_edits_the_kernel_input():
    """rot_q is the query the attention function receives (after RoPE): edited there by an
    attention implementation registered with transformers, for layer 0 only."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def edited(module, query, key, value, attention_mask, **kw):
        if module.layer_idx == 0:
            query = query.clone()
            query[:, 1] = 0  # head 1, head-major here
        return eager_attention_forward(module, query, key, value, attention_mask, **kw)

    def zero_head(q):  # [batch, pos, heads, d_head], token-major in TorchLens
        q[:, :, 1] = 0
        return q

    model = testing.build("llama")
    with torch.no_grad():
        t = tl.trace(model, IDS, edit={("model.layers.0.self_attn", "rot_q"): zero_head})
        AttentionInterface.register("torchlens_test_edit_rot_q", edited)
        AttentionMaskInterface.register(
            "torchlens_test_edit_rot_q", eager_mask
        )  # the eager causal mask
        model.config._attn_implementation = "torchlens_test_edit_rot_q"
        want = model(IDS).logits
    torch.testing.assert_close(t.output.logits, want, atol=ATOL, rtol=0)


def test_llama_rot_k_is_edited_before_the_cache_and_the_kv_repeat():
    """rot_k is the rotated key of the forward's positions as it enters the KV cache (before the
    cache joins cached keys and before grouped-query attention repeats each kv head), so under
    GQA one kv head is one tensor and can be edited: checked against an attention function that
    zeroes that kv head of the key it receives (kv heads, before `repeat_kv`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def edited(module, query, key, value, attention_mask, **kw):
        if module.layer_idx == 0:
            key = key.clone()
            key[:, 1] = 0  # kv head 1, head-major here
        return eager_attention_forward(module, query, key, value, attention_mask, **kw)

    def zero_kv_head(k):  # [batch, pos, kv_heads, d_head], token-major in TorchLens
        k[:, :, 1] = 0
        return k

    model = testing.build("llama")
    with torch.no_grad():
        t = tl.trace(model, IDS, edit={("model.layers.0.self_attn", "rot_k"): zero_kv_head})
        AttentionInterface.register("torchlens_test_edit_rot_k", edited)
        AttentionMaskInterface.register("torchlens_test_edit_rot_k", eager_mask)
        model.config._attn_implementation = "torchlens_test_edit_rot_k"
        want = model(IDS).logits
    assert (
        t.modules["model.layers.0.self_attn"].facets["rot_k"].shape[2] == 2
    )  # the model's kv heads
    torch.testing.assert_close(t.output.logits, want, atol=ATOL, rtol=0)


def test_gpt2_resid_mid_matches_the_block_written_out_by_hand():
    """resid_mid (the residual after the attention add) feeds both ln_2 and the MLP's residual add,
    so no hook on a module can replace it; the block's forward written out by hand can."""
    model = testing.build("gpt2")
    d = torch.linspace(0, 1, 32)
    fn = lambda mid: mid + d

    def manual(block, args, kwargs, out):
        x = args[0]
        mask = (
            args[2] if len(args) > 2 else kwargs.get("attention_mask")
        )  # GPT2Model passes it third
        attn = block.attn(block.ln_1(x), attention_mask=mask)
        mid = fn(x + _first(attn))
        return _with_first(out, mid + block.mlp(block.ln_2(mid)))

    with torch.no_grad():
        t = tl.trace(model, IDS, edit={"blocks.1.hook_resid_mid": fn})
    h = model.transformer.h[1].register_forward_hook(manual, with_kwargs=True)
    try:
        with torch.no_grad():
            want = model(IDS).logits
    finally:
        h.remove()
    torch.testing.assert_close(t.output.logits, want, atol=1e-5, rtol=0)
    assert "add" in t.edits[0].where
    assert (
        "this trace edited it"
        in t.modules["transformer.h.1"].facets.check("resid_mid")["resid_mid"]
    )


def test_hook_and_op_edits_together_match_plain_hooks():
    """A hook edit records an `edited` op; the op edits after it are still placed on their ops."""
    model = testing.build("gpt2")

    def ablate(z):
        z[:, 0] = 0
        return z

    def cols(m, args):
        x = args[0].clone()
        x[..., :16] = 0
        return (x,)

    with torch.no_grad():
        t = tl.trace(
            model,
            IDS,
            edit={
                "blocks.0.hook_resid_pre": lambda x: x + 1,
                "blocks.1.attn.hook_z": ablate,
                "blocks.1.hook_resid_post": lambda x: x * 2,
            },
        )
    hs = [
        model.transformer.h[0].register_forward_pre_hook(lambda m, a: (a[0] + 1,) + tuple(a[1:])),
        model.transformer.h[1].attn.c_proj.register_forward_pre_hook(cols),
        model.transformer.h[1].register_forward_hook(lambda m, a, o: _with_first(o, _first(o) * 2)),
    ]
    try:
        with torch.no_grad():
            want = model(IDS).logits
    finally:
        for h in hs:
            h.remove()
    torch.testing.assert_close(t.output.logits, want, atol=ATOL, rtol=0)
    assert [e.applied for e in t.edits] == [1, 1, 1]


# -- several calls -------------------------------------------------------------------------------


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(torch.relu(self.lin(x)))


def test_module_run_twice_is_edited_on_every_call_unless_the_key_names_one():
    model, x = _Twice(), torch.randn(2, 4)
    seen = []

    def fn(y):
        seen.append(1)
        return y + 1

    t = tl.trace(model, x, edit={("lin", "output"): fn})
    h = model.lin.register_forward_hook(lambda m, a, o: o + 1)
    want = model(x)
    h.remove()
    torch.testing.assert_close(t.output, want)
    assert len(seen) == 2 and t.edits[0].calls == (0, 1)
    t1 = tl.trace(model, x, edit={("lin", "output", 1): lambda y: y + 1})
    torch.testing.assert_close(t1.output, model(x) + 1)
    assert t1.edits[0].calls == (1,)
    with pytest.raises(EditSpecError, match="ran 2 time"):
        tl.trace(model, x, edit={("lin", "output", 2): lambda y: y})


# -- activation patching ---------------------------------------------------------------------------


def test_activation_patching_resid_post_restores_the_clean_logits():
    model = testing.build("gpt2")
    clean_ids, corrupt_ids = IDS, testing.token_ids(1, 6, seed=3)
    with torch.no_grad():
        clean_logits = model(clean_ids).logits
        clean = tl.trace(model, clean_ids, save=["resid_post"])
        site = clean.modules["transformer.h.0"].facets["resid_post"]
        patched = tl.trace(model, corrupt_ids, edit={"blocks.0.hook_resid_post": site})
        corrupt_logits = model(corrupt_ids).logits
    assert not torch.allclose(clean_logits, corrupt_logits)
    torch.testing.assert_close(patched.output.logits, clean_logits, atol=ATOL, rtol=0)


class _WritesInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        h += 1  # writes the tensor the edit put there
        return self.b(h)


def test_a_patched_tensor_is_not_written_by_the_model():
    model, x = _WritesInPlace(), torch.randn(2, 4)
    value = torch.full((2, 4), 3.0)
    held = torch.full((2, 4), 5.0)
    t = tl.trace(model, x, edit={("a", "output"): value})
    torch.testing.assert_close(t.output, model.b(value + 1))
    assert bool((value == 3).all())
    tl.trace(model, x, edit={("a", "output"): lambda h: held})
    assert bool((held == 5).all())


@pytest.mark.parametrize(
    "site",
    [("transformer.h.1.mlp", "output"), ("transformer.h.1.attn", "pattern")],
    ids=["hook-edit", "op-edit"],
)
@pytest.mark.parametrize("outer", [None, "device", "trace"])
@pytest.mark.parametrize("write", ["mul_", "data"])
def test_an_edit_that_writes_into_a_kept_tensor_leaves_its_facet_as_the_model_made_it(
    outer, write, site
):
    # The edit of block 1's MLP output (placed in a forward hook) or of its attention pattern
    # (placed on an op) also halves, in place, block 0's output, which a user hook stashed: block
    # 0's output facet must stay what block 0 returned, with a torch function mode below the trace
    # (`torch.device`, an outer trace) or not.
    model = testing.build("gpt2")
    with torch.no_grad():
        truth = testing.hooked_outputs(model, ["transformer.h.0"], IDS)["transformer.h.0"]
    stash = {}
    handle = model.transformer.h[0].register_forward_hook(
        lambda m, a, o: stash.update(b0=o[0] if isinstance(o, tuple) else o)
    )

    def edit(y):
        (stash["b0"].data if write == "data" else stash["b0"]).mul_(0.5)
        return y * 3

    def run():
        return tl.trace(model, IDS, edit={site: edit})

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an outer trace warns about the write it cannot attribute
        try:
            if outer == "device":
                with torch.device("cpu"):
                    t = run()
            elif outer == "trace":
                inner = {}

                class Wrap(torch.nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.model = model

                    def forward(self, ids):
                        inner["t"] = run()
                        return ids

                tl.trace(Wrap(), IDS)
                t = inner["t"]
            else:
                t = run()
        finally:
            handle.remove()
    torch.testing.assert_close(t.modules["transformer.h.0"].facets["output"], truth, rtol=0, atol=0)


@pytest.mark.parametrize("outer", [None, "device"])
def test_an_edit_that_calls_a_module_of_the_model_is_one_edited_op(outer):
    # The edit runs block 1's first norm on block 0's output: that call is the edit's computation,
    # not a module call of the forward, and none of its ops are recorded, so op positions stay those
    # of the locating pass and an op-level edit after it is still placed.
    model = testing.build("gpt2")
    ln = model.transformer.h[1].ln_1
    plain = tl.trace(model, IDS)
    with torch.device("cpu") if outer else contextlib.nullcontext():
        t = tl.trace(
            model,
            IDS,
            edit={
                "transformer.h.0:resid_post": lambda x: ln(x) * 2 + 1,
                "transformer.h.1.attn:pattern": lambda p: p * 1.0,
            },
        )
    assert [r.where.split(" #")[0] for r in t.edits] == ["forward hook", "op"]  # both placed
    assert len(t.modules["transformer.h.1.ln_1"].calls) == 1
    assert [op.name for op in t.ops if op.name != "edited"] == [op.name for op in plain.ops]
    with torch.no_grad():
        expected = ln(plain.modules["transformer.h.0"].facets["resid_post"]) * 2 + 1
    torch.testing.assert_close(
        t.modules["transformer.h.1"].facets["resid_pre"], expected, rtol=0, atol=0
    )


def test_training_mode_dropout_draws_the_same_masks_as_an_unedited_forward():
    """The locating pass consumes no randomness the edited forward would have drawn."""
    model = testing.build("gpt2").train()
    torch.manual_seed(5)
    t = tl.trace(model, IDS, edit={"blocks.1.hook_resid_pre": lambda x: x})
    torch.manual_seed(5)
    with torch.no_grad():
        want = model(IDS).logits
    torch.testing.assert_close(t.output.logits.detach(), want, atol=ATOL, rtol=0)


# -- refusals and errors ---------------------------------------------------------------------------


def test_sdpa_pattern_is_not_editable_and_says_use_eager():
    model = testing.build("gpt2", "sdpa")
    with pytest.raises(
        NotEditable, match=r"transformer\.h\.0\.attn:pattern.*fused.*attn_implementation=\"eager\""
    ):
        tl.trace(model, IDS, edit={"blocks.0.attn.hook_pattern": lambda p: p})
    _nothing_installed(model)


def test_computed_and_fused_sites_are_not_editable():
    model = testing.build("gpt2")
    with pytest.raises(NotEditable, match=r"attn:result.*edit 'z'"):
        tl.trace(model, IDS, edit={"blocks.0.attn.hook_result": lambda r: r})
    neox = testing.build("gpt_neox")
    with pytest.raises(NotEditable, match=r"attention:q.*slice of op"):
        tl.trace(neox, IDS, edit={"blocks.0.attn.hook_q": lambda q: q})
    _nothing_installed(neox)


def test_neox_resid_post_matches_forward_hook():
    model = testing.build("gpt_neox")
    with torch.no_grad():
        t = tl.trace(model, IDS, edit={"blocks.1.hook_resid_post": lambda x: x * 0.5})
    want = _hooked_logits(model, model.gpt_neox.layers[1], lambda x: x * 0.5)
    torch.testing.assert_close(t.output.logits, want, atol=ATOL, rtol=0)


def test_bad_keys_and_values_teach():
    model = testing.build("gpt2")
    with pytest.raises(LookupFailed, match="blocks.0.hook_resid_post"):
        tl.trace(model, IDS, edit={"blocks.0.hook_resid_pst": lambda x: x})
    with pytest.raises(LookupFailed, match="transformer.h.0"):
        tl.trace(model, IDS, edit={("transformer.h.00", "resid_post"): lambda x: x})
    with pytest.raises(LookupFailed, match="resid_post"):
        tl.trace(model, IDS, edit={("transformer.h.0", "resid_pst"): lambda x: x})
    with pytest.raises(
        EditSpecError, match=r"module address, not a site.*'transformer.h.0:output'"
    ):
        tl.trace(model, IDS, edit={"transformer.h.0": lambda x: x})
    with pytest.raises(EditSpecError, match="function fn"):
        tl.trace(model, IDS, edit={"blocks.0.hook_resid_post": 0})
    with pytest.raises(EditSpecError, match="takes a dict"):
        tl.trace(model, IDS, edit=[("transformer.h.0", "output")])
    with pytest.raises(EditSpecError, match="returned NoneType"):
        tl.trace(model, IDS, edit={"blocks.0.hook_resid_post": lambda x: None})
    with pytest.raises(EditSpecError, match="same site"):
        tl.trace(
            model,
            IDS,
            edit={
                "blocks.0.hook_resid_post": lambda x: x,
                ("transformer.h.0", "resid_post"): lambda x: x,
            },
        )
    # a result on another device surfaced as a bare error from the next op; a meta tensor given
    # as the value, as NotImplementedError; True was taken for call 1
    with pytest.raises(EditSpecError, match="result is on the meta device, which holds no values"):
        tl.trace(model, IDS, edit={"blocks.0.hook_resid_post": lambda x: x.to("meta")})
    with pytest.raises(EditSpecError, match="meta device, which holds no values"):
        tl.trace(
            model, IDS, edit={"blocks.0.hook_resid_post": torch.empty(1, 6, 32, device="meta")}
        )
    with pytest.raises(EditSpecError, match="a tuple key is"):
        tl.trace(model, IDS, edit={("transformer.h.0", "resid_post", True): lambda x: x})
    _nothing_installed(model)


def test_nothing_installed_outlives_an_edit_that_raises():
    model = testing.build("gpt2")

    def boom(x):
        raise RuntimeError("user fn failed")

    with pytest.raises(RuntimeError, match="user fn failed"):
        tl.trace(model, IDS, edit={"blocks.0.attn.hook_z": boom})
    with pytest.raises(RuntimeError, match="user fn failed"):
        tl.trace(model, IDS, edit={"blocks.0.hook_resid_pre": boom})
    _nothing_installed(model)


# -- peer engines ----------------------------------------------------------------------------------


def test_nnsight_intervention_parity():
    from nnsight import NNsight

    model = testing.build("gpt2")
    engine = NNsight(model)
    with torch.no_grad(), engine.trace(IDS):
        engine.transformer.h[0].output[:] = 0
        h1 = engine.transformer.h[1].output.save()
        logits = engine.output.save()
    with torch.no_grad():
        t = tl.trace(model, IDS, edit={"blocks.0.hook_resid_post": lambda x: x * 0})
    torch.testing.assert_close(t.output.logits, logits.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(
        t.modules["transformer.h.1"].facets["resid_post"], _first(h1), atol=ATOL, rtol=0
    )


def test_transformer_lens_bridge_run_with_hooks_parity_and_a_misplaced_edit_is_caught():
    from fixtures import engine_runs

    from torchlens import mechinterp as mi

    bridge, _ = engine_runs._bridge(
        "gpt2", "eager"
    )  # boot wraps that model's modules in bridge components
    hf_model = engine_runs.model("gpt2", "eager")  # the same weights, unwrapped
    ids = engine_runs.IDS
    cache = {}

    def save(name):
        def hook(x, hook):
            cache[name] = x.detach().clone()

        return hook

    names = ["blocks.1.hook_resid_pre", "blocks.1.hook_resid_post"]
    with torch.no_grad():
        logits = bridge.run_with_hooks(
            ids,
            fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: x * 0.5)]
            + [(n, save(n)) for n in names],
        )
        t = tl.trace(hf_model, ids, edit={"blocks.0.hook_resid_post": lambda x: x * 0.5})
    torch.testing.assert_close(t.output.logits, logits, atol=1e-5, rtol=0)
    report = mi.compare(t, cache, generation="2.x")
    assert report.ok, report
    # an engine that put the same edit on the block's input instead: its values land elsewhere
    with torch.no_grad():
        wrong = {}
        bridge.run_with_hooks(
            ids,
            fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: x * 0.5)]
            + [(n, save(n)) for n in names],
        )
        wrong = dict(cache)
    bad = mi.compare(t, wrong, generation="2.x")
    assert not bad.ok and set(bad.mismatched) == set(names), bad
    # ... and where it landed: TorchLens's trace edited at the block's input agrees with it
    with torch.no_grad():
        at_input = tl.trace(hf_model, ids, edit={"blocks.0.hook_resid_pre": lambda x: x * 0.5})
    assert mi.compare(at_input, wrong, generation="2.x").ok


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_transformer_lens_bridge_op_level_edits_parity(family):
    """z (head 1 zeroed; the bridge's z is token-major) and pattern, edited by run_with_hooks and by
    TorchLens: same downstream residual and logits."""
    from fixtures import engine_runs

    from torchlens import mechinterp as mi

    bridge, _ = engine_runs._bridge(family, "eager")
    hf_model = engine_runs.model(family, "eager")
    ids = engine_runs.IDS

    def tl_z(z):  # [batch, heads, pos, d_head]
        z[:, 1] = 0
        return z

    def bridge_z(z, hook):  # [batch, pos, heads, d_head]
        z = z.clone()
        z[:, :, 1] = 0
        return z

    cases = [
        ("blocks.0.attn.hook_z", tl_z, bridge_z),
        ("blocks.0.attn.hook_pattern", lambda p: p * 0.5, lambda p, hook: p * 0.5),
    ]
    for name, ours, theirs in cases:
        cache = {}
        with torch.no_grad():
            logits = bridge.run_with_hooks(
                ids,
                fwd_hooks=[
                    (name, theirs),
                    (
                        "blocks.1.hook_resid_post",
                        lambda x, hook: cache.__setitem__("blocks.1.hook_resid_post", x.clone()),
                    ),
                ],
            )
            t = tl.trace(hf_model, ids, edit={name: ours})
            assert not torch.allclose(logits, hf_model(ids).logits)
        torch.testing.assert_close(t.output.logits, logits, atol=1e-5, rtol=0)
        assert mi.compare(t, cache, generation="2.x").ok


# -- cost ------------------------------------------------------------------------------------------


def measure_cost(repeats: int = 3) -> dict[str, float]:
    """Edited vs unedited trace time on a GPT-2-small-shaped model (run by hand, not a test)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 50257, (1, 128))
    edit = {"blocks.5.hook_resid_post": lambda x: x * 0, "blocks.3.attn.hook_z": lambda z: z * 0}

    def best(fn):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    with torch.no_grad():
        out = {
            "forward": best(lambda: model(ids)),
            "trace_all": best(lambda: tl.trace(model, ids)),
            "trace_none": best(lambda: tl.trace(model, ids, save="none")),
            "trace_all_edited": best(lambda: tl.trace(model, ids, edit=edit)),
            "trace_none_edited": best(lambda: tl.trace(model, ids, save="none", edit=edit)),
        }
    return out


if __name__ == "__main__":
    for k, v in measure_cost().items():
        print(f"{k:20s} {v * 1000:8.1f} ms")


def _opt_model():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.OPTConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        ffn_dim=64,
        vocab_size=64,
        max_position_embeddings=16,
        word_embed_proj_dim=32,
    )
    return testing.from_config(cfg, transformers.OPTForCausalLM)


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_resid_mid_and_mlp_in_edits_reach_what_transformer_lens_edits(family):
    """TransformerLens's hook_resid_mid is the residual stream itself; its hook_mlp_in is a copy
    only the MLP branch reads. Zeroing each: the block output is mlp(ln2(0)) for resid_mid, and
    resid_mid + mlp(ln2(0)) for mlp_in. Ground truth: the block's own modules, called by hand."""
    model = _opt_model() if family == "opt" else testing.build("gpt2")
    ids = testing.token_ids(length=5)
    layer = model.model.decoder.layers[0] if family == "opt" else model.transformer.h[0]
    ln2, mlp = (
        (layer.final_layer_norm, lambda x: layer.fc2(layer.activation_fn(layer.fc1(x))))
        if family == "opt"
        else (layer.ln_2, layer.mlp)
    )
    block = "model.decoder.layers.0" if family == "opt" else "transformer.h.0"
    seen = {}
    handle = ln2.register_forward_pre_hook(
        lambda m, a: seen.__setitem__("mid", a[0].detach().clone())
    )
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    mid = seen["mid"].reshape(1, 5, -1)
    with torch.no_grad():
        branch = mlp(ln2(torch.zeros_like(seen["mid"]))).reshape(1, 5, -1)
    for name, truth in (
        ("blocks.0.hook_resid_mid", branch),
        ("blocks.0.hook_mlp_in", mid + branch),
    ):
        with torch.no_grad():
            tr = tl.trace(model, ids, edit={name: torch.zeros_like})
        got = tr.modules[block].facets["resid_post"]
        assert torch.allclose(got, truth, atol=1e-6), (name, float((got - truth).abs().max()))


class _LoopedBias(nn.Module):
    """Multi-head attention whose scores get one or three per-key bias adds, by its input (the
    same op name in the same call each time): an edit upstream changes how many."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.bias = nn.Parameter(torch.randn(3, 5) * 0.5)

    def forward(self, x):
        b, p, d = x.shape
        q, k, v = (
            f(x).view(b, p, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        scores = q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5
        for i in range(1 if x[..., 0].mean() < 1.0 else 3):
            scores = scores + self.bias[i]
        z = torch.softmax(scores, -1) @ v
        return self.o(z.transpose(1, 2).reshape(b, p, d))


class _Block(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = _LoopedBias(d)
        self.mlp = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _TwoStages(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(20, d)
        self.blocks = nn.ModuleList([_Block(d), _Block(d)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, 20)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def test_an_op_edit_a_changed_path_would_misplace_raises():
    """The locating pass places the second edit on the first bias add (the one whose output its
    site names there); the first edit makes the path add three biases, so that position is no
    longer the site's. The trace raises instead of serving a forward whose edit replaced another
    tensor (it did, silently, before)."""
    torch.manual_seed(0)
    model, ids = _TwoStages().eval(), torch.tensor([[1, 2, 3, 4, 5]])
    steer = torch.zeros(16)
    steer[0] = 10.0  # block 1's attention then adds three biases, not one
    ops_before = [op.name for op in tl.trace(model, ids).ops]
    with pytest.raises(EditSpecError, match="disagree on where the site is"):
        tl.trace(
            model,
            ids,
            edit={
                "blocks.0:resid_post": lambda t: t + steer,
                "blocks.1.attn:scores": lambda t: t * 2,
            },
        )
    assert [op.name for op in tl.trace(model, ids).ops] == ops_before  # nothing left behind
    # an edit that leaves the path alone is placed, and served
    edited = tl.trace(
        model,
        ids,
        edit={"blocks.0:resid_post": lambda t: t * 1.01, "blocks.1.attn:scores": lambda t: t * 2},
    )
    assert edited.edits[1].applied == 1


@pytest.mark.parametrize(
    "names",
    [
        ("transformer.h.0:output", "transformer.h.0:resid_post"),
        ("transformer.h.1:input", "transformer.h.1:resid_pre"),
    ],
)
def test_two_names_of_one_module_output_are_refused(names):
    """`output` and `resid_post` of a block (`input` and `resid_pre`) are one tensor: two edits of
    it would be composed in the dict's order, so two keys naming it are refused, as two keys of
    one site are."""
    model = testing.build("gpt2")
    edit = {names[0]: lambda t: t * 2, names[1]: lambda t: t + 1}
    with pytest.raises(EditSpecError, match="name one tensor"):
        tl.trace(model, testing.token_ids(length=5), edit=edit)


def test_an_ambiguous_hook_name_as_an_edit_key_names_the_sites_to_key_instead():
    """ALBERT runs one layer module per layer: 'blocks.1.hook_resid_post' has a site in 3.x and
    none in 2.x. The refusal suggested generation=, which edit= does not take; it now lists each
    generation's site as a key, and that key edits (applied once, at layer 1's call)."""
    model = testing.build("albert")
    ids = testing.token_ids(length=5)
    with pytest.raises(EditSpecError, match="Name the site itself as the key") as info:
        tl.trace(model, ids, edit={"blocks.1.hook_resid_post": lambda x: x + 1})
    assert "None:" not in str(info.value) and "pass generation=" not in str(info.value)
    key = ast.literal_eval(str(info.value).split("3.x: ")[-1].rstrip("."))  # the suggested key
    t = tl.trace(model, ids, edit={key: lambda x: x + 1})
    assert t.edits[0].applied == 1 and t.edits[0].calls == (key[2],)


# -- the locating pass leaves no state behind ---------------------------------------------------


class _WritesInput(nn.Module):
    """Multiplies its input in place, then a linear layer."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(3)
        return self.l(x)


class _Steps(nn.Module):
    """Replaces a buffer by assignment each call (`self.steps = self.steps + 1`)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps = self.steps + 1
        return self.l(x) * self.steps


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize(
    "build, x, key, module",
    [
        (  # BatchNorm in training mode: running statistics written by the kernel, counter by add_
            lambda: nn.Sequential(
                nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1)
            ).train(),
            lambda: torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1)),
            "0:output",
            lambda m: m[0],
        ),
        (  # an embedding with max_norm renormalizes rows of its weight in place
            lambda: nn.Sequential(nn.Embedding(10, 4, max_norm=0.5), nn.Linear(4, 4)),
            lambda: torch.tensor([[1, 2, 3, 2]]),
            "0:output",
            lambda m: m[0],
        ),
        (
            _Steps,
            lambda: torch.randn(2, 4, generator=torch.Generator().manual_seed(2)),
            "l:output",
            lambda m: m.l,
        ),
    ],
    ids=["batchnorm-train", "embedding-max-norm", "buffer-reassigned"],
)
def test_an_edited_trace_leaves_the_state_of_one_edited_forward(build, x, key, module):
    """The locating pass's writes (a BatchNorm's running statistics and counter, a max_norm
    embedding's renormalized rows, a buffer a module replaces) are undone before the edited
    forward: the model's state afterwards, and the output, equal those of one forward with the
    same edit made by a plain forward hook."""
    torch.manual_seed(0)
    ref = build()
    torch.manual_seed(0)
    model = build()
    _same_state(_state(ref), _state(model))
    h = module(ref).register_forward_hook(lambda m, a, o: o * 0.5)
    try:
        expected = ref(x())
    finally:
        h.remove()
    tr = tl.trace(model, x(), edit={key: lambda t: t * 0.5})
    assert torch.allclose(tr.output, expected, atol=ATOL)
    _same_state(_state(model), _state(ref))


def test_an_edited_trace_of_a_model_writing_its_input_sees_the_input_once():
    """A model that writes its input in place (`x.mul_(3)`): the locating pass's write is undone,
    so the edited forward reads the caller's tensor as the caller passed it, and the caller's
    tensor is left as one forward leaves it."""
    torch.manual_seed(0)
    ref, model = _WritesInput(), _WritesInput()
    model.load_state_dict(ref.state_dict())
    x0 = torch.randn(2, 4, generator=torch.Generator().manual_seed(3))
    x_ref, x = x0.clone(), x0.clone()
    h = ref.l.register_forward_hook(lambda m, a, o: o + 1)
    try:
        expected = ref(x_ref)
    finally:
        h.remove()
    tr = tl.trace(model, x, edit={"l:output": lambda t: t + 1})
    assert torch.allclose(tr.output, expected, atol=ATOL)
    assert torch.equal(x, x_ref)  # 3 * x0, as after one forward (not 9 * x0)
    assert torch.allclose(tr["l:input"], x0 * 3)


class _WritesViewedInput(nn.Module):
    """Given a row of a tensor and the tensor, writes the tensor in place."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(2, 2)

    def forward(self, row, x):
        x.mul_(3)
        return self.l(x) + row.sum()


class _KeepsTensorAttribute(nn.Module):
    """Keeps a tensor as a plain attribute (no buffer) and writes it in place each call."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.acc = torch.zeros(4)

    def forward(self, x):
        self.acc.add_(x.sum(0))
        return self.l(x) + self.acc


def _hooked_edit(model, module, fn, *inputs):
    h = module.register_forward_hook(lambda m, a, o: fn(o))
    try:
        return model(*inputs)
    finally:
        h.remove()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_the_locating_pass_is_undone_for_an_input_passed_with_a_view_of_it(mode):
    """The locating pass's write into an input is undone over its whole memory: an input passed
    with a view of it first (`model(x[0], x)`), and under inference mode, where the input has
    no version counter."""
    torch.manual_seed(0)
    ref, model = _WritesViewedInput(), _WritesViewedInput()
    model.load_state_dict(ref.state_dict())
    x0 = torch.randn(3, 2, generator=torch.Generator().manual_seed(4))
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with context():
        x_ref, x = x0.clone(), x0.clone()
        expected = _hooked_edit(ref, ref.l, lambda t: t + 1, x_ref[0], x_ref)
        tr = tl.trace(model, x[0], x, edit={"l:output": lambda t: t + 1})
    assert torch.allclose(tr.output, expected, atol=ATOL)
    assert torch.equal(x, x_ref)  # 3 * x0, once


def test_the_locating_pass_is_undone_for_a_tensor_kept_as_a_plain_attribute():
    torch.manual_seed(0)
    ref, model = _KeepsTensorAttribute(), _KeepsTensorAttribute()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(5))
    expected = _hooked_edit(ref, ref.l, lambda t: t * 2, x)
    tr = tl.trace(model, x, edit={"l:output": lambda t: t * 2})
    assert torch.allclose(tr.output, expected, atol=ATOL)
    assert torch.equal(model.acc, ref.acc)


def test_an_input_the_locating_pass_only_read_keeps_its_version_also_with_a_nan():
    """A storage the locating pass did not change is not written back (its bytes are compared,
    so a NaN equals itself): the caller's autograd graph that saved the input stays usable."""
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    leaf = torch.randn(3, 2, requires_grad=True)
    x = leaf * 1.0
    with torch.no_grad():
        x[0, 0] = float("nan")
    y = (x * x).sum()  # saves x for the backward
    version = x._version
    tl.trace(model, x.detach(), edit={":output": lambda t: t * 0})
    assert x._version == version
    y.backward()  # raised "modified by an inplace operation" when the restore wrote x back
