"""`trace_generate` and `GenerationTrace.check_decode`.

Ground truth comes from outside TorchLens: `model.generate` itself (its sequences, for the same
arguments and seed; its `output_attentions`, `output_hidden_states` and `output_logits` per
step), plain forward hooks registered inside `model.generate` (a module's output at each call,
and edits made by returning a changed output), and, for the decode check, models with a cache bug
planted in their decode path (`tests/cache_bugs.py`), which the check must find and name.

Tests internals: `torchlens._generation.decode_sites.AUTO_FACTOR` against
`torchlens.mechinterp._auto_tolerance.AUTO_FACTOR`, `torchlens._capture.compiled.CompiledRunsEagerly`
(its depth after a failed call), `torchlens._edits.plan_edits` and `EditPlan` (a plan moved one op
off, which `EditPlan.check_placed` must refuse).
"""

from __future__ import annotations

import gc

import cache_bugs
import pytest
import torch
import transformers
from transformers import DynamicCache

import torchlens as tl
from torchlens import GenerateSpecError, testing
from torchlens._capture import collector
from torchlens._capture.compiled import CompiledRunsEagerly
from torchlens._edits import EditPlan, plan_edits
from torchlens._generation.decode_sites import AUTO_FACTOR
from torchlens.mechinterp._auto_tolerance import AUTO_FACTOR as COMPARE_FACTOR

IDS = testing.token_ids(batch=3, length=6, seed=3, vocab=60) + 3
MASK = torch.ones_like(IDS)
MASK[0, :3] = 0  # three prompts of 3, 5 and 6 tokens, left-padded
MASK[1, :1] = 0
GREEDY = dict(
    attention_mask=MASK, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None
)


def _hooks(model):
    """Every module hook on `model` (transformers installs output-capturing hooks of its own, on
    first use of `output_attentions`, and keeps them)."""
    return {
        (name, kind, hid)
        for name, m in model.named_modules()
        for kind, hooks in (("post", m._forward_hooks), ("pre", m._forward_pre_hooks))
        for hid in hooks
    }


def _nothing_installed(model, before=frozenset()):
    assert gc.isenabled() and not collector._DEPTHS  # paused for the call, on again
    assert _hooks(model) <= set(before)
    assert torch._C._len_torch_function_stack() == 0
    assert CompiledRunsEagerly._depth == 0


def _per_call(model, addresses, **kwargs):
    """Each module's output at each of its calls inside a plain `model.generate`, by forward hooks."""
    seen = {a: [] for a in addresses}
    modules = dict(model.named_modules())
    hooks = [
        modules[a].register_forward_hook(
            lambda m, args, out, a=a: seen[a].append(
                (out[0] if isinstance(out, tuple) else out).detach().clone()
            )
        )
        for a in addresses
    ]
    try:
        out = model.generate(IDS, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return out, seen


def t5():
    config = transformers.T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return testing.from_config(config, transformers.T5ForConditionalGeneration)


def bart():
    config = transformers.BartConfig(
        vocab_size=64,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        max_position_embeddings=64,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    return testing.from_config(config, transformers.BartForConditionalGeneration)


# -- the generation itself -----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
def test_sequences_are_what_generate_returns_and_each_step_is_that_forward(family):
    model = testing.build(family)
    blocks = [f"{'transformer.h' if family == 'gpt2' else 'model.layers'}.{i}" for i in range(2)]
    plain, seen = _per_call(model, blocks, **GREEDY)
    gen = tl.trace_generate(model, IDS, **GREEDY)
    _nothing_installed(model)
    assert torch.equal(gen.sequences, plain)
    assert len(gen.steps) == len(seen[blocks[0]]) == 6
    assert [i.kind for i in gen.info] == ["prefill"] + ["decode"] * 5
    assert [i.new_tokens for i in gen.info] == [6, 1, 1, 1, 1, 1]
    assert [i.past_length for i in gen.info] == [0, 6, 7, 8, 9, 10]
    for step, t in enumerate(gen.steps):
        for b in blocks:
            torch.testing.assert_close(t[f"{b}:resid_post"], seen[b][step], atol=0, rtol=0)


def test_the_collector_is_off_at_every_step_and_between_them_and_on_after():
    """`generate`'s own code between the forwards runs paused too (a logits processor sees it)."""
    model = testing.build("gpt2")
    at_steps, between = [], []
    hook = model.transformer.register_forward_hook(lambda *_: at_steps.append(gc.isenabled()))

    class Watch(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            between.append(gc.isenabled())
            return scores

    try:
        gen = tl.trace_generate(
            model, IDS, logits_processor=transformers.LogitsProcessorList([Watch()]), **GREEDY
        )
    finally:
        hook.remove()
    assert len(gen.steps) == 6
    assert at_steps == [False] * 6 and between == [False] * 6
    _nothing_installed(model)


@pytest.mark.parametrize(
    "cache", [{}, {"cache_implementation": "static"}], ids=["dynamic", "static"]
)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_each_steps_pattern_covers_the_cached_keys_as_output_attentions_does(family, cache):
    """The pattern of a decode step is one query row per new token over every key the step read
    (`[batch, heads, 1, keys]`), and equals what `generate(output_attentions=True)` returns."""
    model = testing.build(family)
    kwargs = dict(
        GREEDY,
        return_dict_in_generate=True,
        output_attentions=True,
        output_hidden_states=True,
        **cache,
    )
    plain = model.generate(IDS, **kwargs)
    gen = tl.trace_generate(model, IDS, **kwargs)
    assert torch.equal(gen.sequences, plain.sequences)
    attn = [a for a in (gen.steps[0].by_role("attention"))]
    for step, t in enumerate(gen.steps):
        for layer, address in enumerate(attn):
            pattern = t[f"{address}:pattern"]
            want = plain.attentions[step][layer]
            assert pattern.shape == want.shape
            assert pattern.shape[2] == (6 if step == 0 else 1)
            torch.testing.assert_close(pattern, want, atol=1e-6, rtol=0)
        # hidden_states[step][-1] is after the final norm; [1] is block 0's output
        torch.testing.assert_close(
            t[f"{t.blocks[0]}:resid_post"], plain.hidden_states[step][1], atol=0, rtol=0
        )
    if not cache:
        assert [gen.steps[s][f"{attn[0]}:pattern"].shape[-1] for s in range(1, 6)] == [
            7,
            8,
            9,
            10,
            11,
        ]


def test_a_sliding_window_cache_keeps_the_window_and_the_pattern_says_so():
    model = cache_bugs.mistral(
        window=3
    )  # the correct model: DynamicCache keeps sliding-window layers
    kwargs = dict(GREEDY, return_dict_in_generate=True, output_attentions=True)
    plain = model.generate(IDS, **kwargs)
    gen = tl.trace_generate(model, IDS, **kwargs)
    assert torch.equal(gen.sequences, plain.sequences)
    for step in range(1, 6):
        pattern = gen.steps[step]["model.layers.0.self_attn:pattern"]
        assert pattern.shape == plain.attentions[step][0].shape == (3, 4, 1, 3)
        torch.testing.assert_close(pattern, plain.attentions[step][0], atol=1e-6, rtol=0)
    assert gen.check_decode().ok


def test_sampling_with_a_seed_gives_the_sequences_generate_gives():
    model = testing.build("llama")
    kwargs = dict(GREEDY, do_sample=True, temperature=1.5, top_k=0)
    torch.manual_seed(11)
    plain = model.generate(IDS, **kwargs)
    torch.manual_seed(11)
    gen = tl.trace_generate(model, IDS, **kwargs)
    assert torch.equal(gen.sequences, plain)
    torch.manual_seed(12)
    other = model.generate(IDS, **kwargs)
    assert not torch.equal(other, plain)  # the seed matters, so the equality above says something


@pytest.mark.parametrize("build", [t5, bart], ids=["t5", "bart"])
def test_encoder_decoder_step_0_holds_both_stacks_and_later_steps_the_decoder(build):
    model = build()
    ids = testing.token_ids(batch=2, length=5, seed=1, vocab=60) + 3
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=4,
        do_sample=False,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_attentions=True,
    )
    model.generate(ids, **kwargs)  # transformers installs its output-capturing hooks on first use
    before = _hooks(model)
    gen = tl.trace_generate(model, ids, **kwargs)
    encoder = "encoder" if build is t5 else "model.encoder"
    decoder = "decoder" if build is t5 else "model.decoder"
    enc_block = f"{encoder}.block.1" if build is t5 else f"{encoder}.layers.1"
    dec_block = f"{decoder}.block.1" if build is t5 else f"{decoder}.layers.1"
    plain_hooks = [enc_block, dec_block]
    plain, seen = None, {a: [] for a in plain_hooks}
    modules = dict(model.named_modules())
    hooks = [
        modules[a].register_forward_hook(
            lambda m, a_, o, a=a: seen[a].append(
                (o[0] if isinstance(o, tuple) else o).detach().clone()
            )
        )
        for a in plain_hooks
    ]
    try:
        plain = model.generate(ids, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    _nothing_installed(model, before)
    assert torch.equal(gen.sequences, plain.sequences)
    assert gen.encoder_decoder and gen.steps[0].structure.kind == "encoder-decoder"
    assert len(gen.steps[0].structure.stacks) == 2 and len(gen.steps[1].structure.stacks) == 1
    assert len(seen[enc_block]) == 1  # generate runs the encoder once: in step 0
    torch.testing.assert_close(
        gen.steps[0][f"{enc_block}:resid_post"], seen[enc_block][0], atol=0, rtol=0
    )
    cross = f"{dec_block}.layer.1.EncDecAttention" if build is t5 else f"{dec_block}.encoder_attn"
    for step, t in enumerate(gen.steps):
        torch.testing.assert_close(
            t[f"{dec_block}:resid_post"], seen[dec_block][step], atol=0, rtol=0
        )
        torch.testing.assert_close(
            t[f"{cross}:pattern"], plain.cross_attentions[step][1], atol=1e-6, rtol=0
        )
    assert gen.check_decode().ok


def test_steps_keeps_tensors_only_at_the_steps_named_and_save_applies_there():
    model = testing.build("llama")
    plain, seen = _per_call(model, ["model.layers.1"], **GREEDY)
    gen = tl.trace_generate(model, IDS, save=["resid_post"], steps=[0, 3], **GREEDY)
    assert [i.kept for i in gen.info] == [True, False, False, True, False, False]
    for step, t in enumerate(gen.steps):
        facets = t.modules["model.layers.1"].calls[0].facets
        assert "resid_post" in facets.sites  # every step has the records
        if gen.info[step].kept:
            torch.testing.assert_close(
                facets["resid_post"], seen["model.layers.1"][step], atol=0, rtol=0
            )
            assert "pattern" not in t.modules["model.layers.1.self_attn"].calls[0].facets
        else:
            assert "resid_post" not in facets and not any(o.tensors[0] is not None for o in t.ops)
    assert torch.equal(gen.sequences, plain)


def test_a_directory_store_gets_one_directory_per_step(tmp_path):
    model = testing.build("gpt2")
    plain, seen = _per_call(model, ["transformer.h.0"], **dict(GREEDY, max_new_tokens=3))
    gen = tl.trace_generate(
        model, IDS, store=tmp_path, save=["resid_post"], **dict(GREEDY, max_new_tokens=3)
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000", "step-0001", "step-0002"]
    for step, t in enumerate(gen.steps):
        torch.testing.assert_close(
            t["transformer.h.0:resid_post"], seen["transformer.h.0"][step], atol=0, rtol=0
        )


# -- edits -------------------------------------------------------------------------------------


def test_an_edit_at_every_step_and_one_at_a_named_step_equal_forward_hooks_inside_generate():
    model = testing.build("llama")
    kwargs = dict(GREEDY, return_dict_in_generate=True, output_logits=True)
    plain = model.generate(IDS, **kwargs)
    calls = {"n": 0}

    def halve(module, args, out):  # every step: block 0's output halved
        return (out[0] * 0.5,) + tuple(out[1:]) if isinstance(out, tuple) else out * 0.5

    def count(module, args, kw):
        calls["n"] += 1

    def zero_head(
        module, args, out
    ):  # step 2 only (the third forward): head 0 of layer 1's q zeroed
        if calls["n"] == 3:
            out = out.clone()
            out[..., :8] = 0
        return out

    hooks = [
        model.model.layers[0].register_forward_hook(halve),
        model.register_forward_pre_hook(count, with_kwargs=True),
        model.model.layers[1].self_attn.q_proj.register_forward_hook(zero_head),
    ]
    try:
        want = model.generate(IDS, **kwargs)
    finally:
        for h in hooks:
            h.remove()

    def zero_head_q(q):  # [batch, pos, heads, d_head]
        q[:, :, 0] = 0
        return q

    gen = tl.trace_generate(
        model,
        IDS,
        edit={
            "model.layers.0:resid_post": lambda x: x * 0.5,
            (2, ("model.layers.1.self_attn", "q")): zero_head_q,
        },
        **kwargs,
    )
    _nothing_installed(model)
    assert torch.equal(gen.sequences, want.sequences) and not torch.equal(
        gen.sequences, plain.sequences
    )
    for mine, theirs in zip(gen.output.logits, want.logits):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    assert [len(s.edits) for s in gen.steps] == [1, 1, 2, 1, 1, 1]
    assert all(r.applied == 1 for s in gen.steps for r in s.edits)
    assert gen.steps[2].edits[1].where.startswith("op #")
    with pytest.raises(GenerateSpecError, match="edit="):
        gen.check_decode()


# Per family: the encoder's and decoder's block prefixes and the self-attention's query projection
# (module path under a block), for the encoder-decoder edits below.
ENCDEC = {
    "t5": ("encoder.block", "decoder.block", "layer.0.SelfAttention", "q"),
    "bart": ("model.encoder.layers", "model.decoder.layers", "self_attn", "q_proj"),
}
ENCDEC_KWARGS = dict(
    max_new_tokens=5, do_sample=False, eos_token_id=None, decoder_start_token_id=0, pad_token_id=0
)
ENCDEC_IDS = testing.token_ids(batch=2, length=6, seed=5, vocab=60) + 3


def _zero_head_0(module, args, out):
    """A forward hook on a query projection: head 0's 8 columns zeroed."""
    out = out.clone()
    out[..., :8] = 0
    return out


def _hooked_encdec_generate(model, family, kwargs):
    """The same edits as the test's `edit=`, made by plain forward hooks inside `model.generate`:
    the encoder's block 0 output halved and its block 1 queries' head 0 zeroed (its one call), the
    decoder's block 1 output scaled by 1.5 at every forward, the decoder's block 0 queries' head 0
    zeroed at forwards 0 and 2; with the outputs of encoder block 1 and both decoder blocks seen
    after the edits, per call."""
    enc, dec, attn, q = ENCDEC[family]
    modules = dict(model.named_modules())
    forwards = {"n": -1}
    seen = {a: [] for a in (f"{enc}.1", f"{dec}.0", f"{dec}.1")}

    def count(module, args, kwargs):  # the model's own calls: one per decoder forward
        forwards["n"] += 1

    def scale(by):
        def hook(module, args, out):
            return (out[0] * by,) + tuple(out[1:]) if isinstance(out, tuple) else out * by

        return hook

    def at_forwards_0_and_2(module, args, out):
        return _zero_head_0(module, args, out) if forwards["n"] in (0, 2) else None

    def keep(address):
        def hook(module, args, out):
            seen[address].append((out[0] if isinstance(out, tuple) else out).detach().clone())

        return hook

    hooks = [
        model.register_forward_pre_hook(count, with_kwargs=True),
        modules[f"{enc}.0"].register_forward_hook(scale(0.5)),
        modules[f"{enc}.1.{attn}.{q}"].register_forward_hook(_zero_head_0),
        modules[f"{dec}.1"].register_forward_hook(scale(1.5)),
        modules[f"{dec}.0.{attn}.{q}"].register_forward_hook(at_forwards_0_and_2),
    ]
    hooks += [modules[a].register_forward_hook(keep(a)) for a in seen]  # after the edits: sees them
    try:
        out = model.generate(ENCDEC_IDS, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return out, seen


def _zero_head_0_q(q):  # TorchLens's q: [batch, pos, heads, d_head]
    q[:, :, 0] = 0
    return q


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_encoder_decoder_edits_equal_forward_hooks_inside_generate(family):
    """An encoder site edited in the encoder's one call (a module output and a query head), a
    decoder site at every decoder forward and one at named steps: the sequences and every step's
    saved sites equal those of plain forward hooks making the same edits inside `generate`."""
    model = testing.build(family)
    enc, dec, attn, q = ENCDEC[family]
    kwargs = dict(ENCDEC_KWARGS, return_dict_in_generate=True, output_logits=True)
    plain = model.generate(ENCDEC_IDS, **kwargs)
    want, seen = _hooked_encdec_generate(model, family, kwargs)
    gen = tl.trace_generate(
        model,
        ENCDEC_IDS,
        save=["resid_post"],
        edit={
            f"{enc}.0:resid_post": lambda x: x * 0.5,
            (f"{enc}.1.{attn}", "q"): _zero_head_0_q,
            f"{dec}.1:resid_post": lambda x: x * 1.5,
            ((0, 2), f"{dec}.0.{attn}:q"): _zero_head_0_q,
        },
        **kwargs,
    )
    _nothing_installed(model)
    assert torch.equal(gen.sequences, want.sequences)
    for mine, theirs, unedited in zip(gen.output.logits, want.logits, plain.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=0, rtol=0)
        assert not torch.allclose(theirs, unedited)  # the edits change every step's logits
    assert len(gen.steps) == len(seen[f"{dec}.1"]) == 5 and len(seen[f"{enc}.1"]) == 1
    torch.testing.assert_close(
        gen.steps[0][f"{enc}.1:resid_post"], seen[f"{enc}.1"][0], atol=0, rtol=0
    )
    for step, t in enumerate(gen.steps):
        for block in (f"{dec}.0", f"{dec}.1"):
            torch.testing.assert_close(t[f"{block}:resid_post"], seen[block][step], atol=0, rtol=0)
    assert [len(s.edits) for s in gen.steps] == [4, 1, 2, 1, 1]
    assert all(r.applied == 1 for s in gen.steps for r in s.edits)
    assert gen.edits[0][:2] == (f"{enc}.0:resid_post", (f"{enc}.1.{attn}", "q"))
    assert [r.where.startswith("op #") for r in gen.steps[0].edits] == [False, True, False, True]


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_encoder_decoder_edits_by_another_librarys_names_equal_forward_hooks(family):
    """TransformerLens 2.x's `HookedEncoderDecoder` names, resolved once on the encoder-decoder
    trace (a decoder forward's own trace is of the decoder-only kind, where `decoder.0` names
    nothing), edit the encoder's block 1 and the decoder's block 0 as forward hooks do."""
    model = testing.build(family)
    enc, dec, _, _ = ENCDEC[family]
    modules = dict(model.named_modules())
    kwargs = dict(ENCDEC_KWARGS, return_dict_in_generate=True, output_logits=True)

    def add(by):
        def hook(module, args, out):
            return (out[0] + by,) + tuple(out[1:]) if isinstance(out, tuple) else out + by

        return hook

    hooks = [
        modules[f"{enc}.1"].register_forward_hook(add(1.0)),
        modules[f"{dec}.0"].register_forward_hook(add(-1.0)),
    ]
    try:
        want = model.generate(ENCDEC_IDS, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    plain = model.generate(ENCDEC_IDS, **kwargs)
    gen = tl.trace_generate(
        model,
        ENCDEC_IDS,
        save="none",
        edit={
            "encoder.1.hook_resid_post": lambda x: x + 1.0,
            "decoder.0.hook_resid_post": lambda x: x - 1.0,
        },
        **kwargs,
    )
    _nothing_installed(model)
    assert torch.equal(gen.sequences, want.sequences)
    for mine, theirs, unedited in zip(gen.output.logits, want.logits, plain.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=0, rtol=0)
        assert not torch.allclose(theirs, unedited)
    assert [[r.module_address for r in s.edits] for s in gen.steps] == [
        [f"{enc}.1", f"{dec}.0"]
    ] + [[f"{dec}.0"]] * 4


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_bad_encoder_decoder_edits_are_refused_saying_what_is_accepted_and_leave_nothing(family):
    model = testing.build(family)
    enc, dec, _, _ = ENCDEC[family]
    for steps in (2, range(0, 3)):
        with pytest.raises(
            GenerateSpecError,
            match=r"runs in the encoder .* once, in step 0.*Key an encoder site without a step .* or at step 0",
        ):
            tl.trace_generate(
                model,
                ENCDEC_IDS,
                edit={(steps, f"{enc}.0:resid_post"): lambda x: x},
                **ENCDEC_KWARGS,
            )
        _nothing_installed(model)
    shared = (
        "shared" if family == "t5" else "model.shared"
    )  # the tied embedding's holder, never called
    with pytest.raises(
        GenerateSpecError, match=rf"'{shared}:output': {shared} runs neither in the encoder's call"
    ):
        tl.trace_generate(
            model, ENCDEC_IDS, edit={f"{shared}:output": lambda x: x}, **ENCDEC_KWARGS
        )
    _nothing_installed(model)
    with pytest.raises(
        GenerateSpecError, match=r"step 7 is outside the generation, .* \(steps 0..4"
    ):
        tl.trace_generate(
            model, ENCDEC_IDS, edit={(7, f"{dec}.0:resid_post"): lambda x: x}, **ENCDEC_KWARGS
        )
    _nothing_installed(model)
    # the first new token ends the generation as an end-of-sequence token: step 3 never runs
    first = model.generate(ENCDEC_IDS[:1], **ENCDEC_KWARGS)
    kwargs = dict(ENCDEC_KWARGS, eos_token_id=int(first[0, 1]))
    assert len(tl.trace_generate(model, ENCDEC_IDS[:1], save="none", **kwargs).steps) == 1
    with pytest.raises(
        GenerateSpecError,
        match=r"steps \[3\]: step 3 never ran: generation stopped after 1 .*\(steps 0..0;",
    ):
        tl.trace_generate(
            model, ENCDEC_IDS[:1], edit={(3, f"{dec}.0:resid_post"): lambda x: x}, **kwargs
        )
    _nothing_installed(model)


def test_a_plan_moved_one_op_off_is_refused_by_the_placement_check():
    """The check each edited step passes (the step's own trace finds every edited site at the op
    replaced) can fail: the same plan, its ops moved one position on, is refused."""
    model = testing.build("llama")
    key = {"model.layers.0.self_attn:q": lambda q: q * 0}
    located = tl.trace(model, IDS[:1], save="none")
    edited = tl.trace(model, IDS[:1], save="none", edit=key)
    plan = plan_edits(located, key)
    plan.check_placed(edited)
    moved = EditPlan()
    moved.merge_hooks(plan)
    moved.merge_ops(plan, 1)
    with pytest.raises(
        tl.EditSpecError, match=r"replaced the op\(s\) at position\(s\) \[\d+\], but the edited"
    ):
        moved.check_placed(edited)


def _full_prefix(model, gen, step, addresses):
    """Ground truth for decode step `step`, outside TorchLens: one plain forward over the whole
    prefix the step extends (prompt and tokens fed so far), no cache, with generate's mask and the
    positions it implies; plain hooks on the blocks and `output_attentions` for the patterns."""
    n = IDS.shape[1] + step
    ids = gen.sequences[:, :n]
    mask = torch.cat([MASK, torch.ones(MASK.shape[0], step, dtype=MASK.dtype)], dim=-1)
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    seen = testing.hooked_outputs(
        model, addresses, ids, attention_mask=mask, position_ids=pos, use_cache=False
    )
    with torch.no_grad():
        out = model(
            ids, attention_mask=mask, position_ids=pos, use_cache=False, output_attentions=True
        )
    return seen, out.attentions


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
def test_every_decode_steps_sites_equal_a_plain_full_forward_on_the_same_prefix(family):
    """Each decode step's block outputs (its one new position) and attention pattern (its one row
    over every key) equal a plain forward over the prefix without a cache, read by plain hooks and
    `output_attentions`: the cached path is held against ground truth, not against TorchLens."""
    model = testing.build(family)
    gen = tl.trace_generate(model, IDS, save=["resid_post", "pattern"], **GREEDY)
    blocks, attn = gen.steps[0].blocks, gen.steps[0].by_role("attention")
    for step in range(1, len(gen.steps)):
        seen, patterns = _full_prefix(model, gen, step, blocks)
        for b in blocks:
            torch.testing.assert_close(
                gen.steps[step][f"{b}:resid_post"], seen[b][:, -1:], atol=1e-5, rtol=1e-4
            )
        for layer, a in enumerate(attn):
            full = patterns[layer][:, :, -1:]  # the new token's row over the whole prefix
            for row in range(IDS.shape[0]):  # a padded key gets no weight on either side
                keep = torch.cat([MASK[row], torch.ones(step, dtype=MASK.dtype)]).bool()
                mine = gen.steps[step][f"{a}:pattern"][row]
                torch.testing.assert_close(
                    mine[..., keep], full[row][..., keep], atol=1e-6, rtol=1e-5
                )
                assert bool((mine[..., ~keep] == 0).all())
    assert gen.check_decode().ok


def test_a_planted_cache_bug_breaks_the_plain_full_forward_equality_too():
    """The equality above can fail: with RoPE off by one at decode, the plain full forward on the
    same prefix disagrees with the step, as the decode check says."""
    model = cache_bugs.llama(cache_bugs.RotaryOffByOne)
    gen = tl.trace_generate(model, IDS, save=["resid_post"], **GREEDY)
    seen, _ = _full_prefix(model, gen, 1, ["model.layers.0"])
    with pytest.raises(
        AssertionError, match="Tensor-likes are not close"
    ):  # the tolerance the correct model passes
        torch.testing.assert_close(
            gen.steps[1]["model.layers.0:resid_post"],
            seen["model.layers.0"][:, -1:],
            atol=1e-5,
            rtol=1e-4,
        )
    assert 1 in gen.check_decode().failed_steps


# -- the decode check --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family,cache",
    [
        ("gpt2", {}),
        ("llama", {}),
        ("qwen3", {}),
        ("gemma2", {}),
        ("llama", {"cache_implementation": "static"}),
        ("gpt2", {"cache_implementation": "static"}),
    ],
)
def test_a_correct_cached_decode_path_agrees_with_the_full_forward(family, cache):
    gen = tl.trace_generate(testing.build(family), IDS, **GREEDY, **cache)
    report = gen.check_decode()
    assert report.ok, report
    assert sorted(report.steps) == [1, 2, 3, 4, 5]
    assert {r.step for r in report} == {1, 2, 3, 4, 5} and len(report) > 100 * 5


def test_the_check_reruns_with_positions_from_the_mask_so_left_padding_matters():
    """With the padding dropped from the full forward's mask the padded rows differ: the check
    reads the step's mask, so a test passing above is not a check that cannot fail."""
    gen = tl.trace_generate(testing.build("llama"), IDS, **GREEDY)
    for info in gen.info:
        info.attention_mask = torch.ones_like(info.attention_mask)
    report = gen.check_decode(explain=False)
    assert not report.ok and {s for s, _ in report.mismatched} == {1, 2, 3, 4, 5}


def test_rope_rotated_one_position_too_far_at_decode_is_found_and_explained():
    model = cache_bugs.llama(cache_bugs.RotaryOffByOne)
    gen = tl.trace_generate(model, IDS, **GREEDY)
    report = gen.check_decode()
    assert report.failed_steps == [1, 2, 3, 4, 5]
    verdict = report.steps[1]
    assert verdict.first.site == "model.rotary_emb:output"
    assert "position ids are off by +1" in verdict.explanation
    assert verdict.candidates[0].matches and "+1" in verdict.candidates[0].relation
    held = verdict.candidates[0]
    assert (held.factor, held.module_address, held.facet) == (None, "model.rotary_emb", "output")


def test_a_cache_read_before_its_update_is_found_and_explained():
    model = cache_bugs.llama()
    gen = tl.trace_generate(model, IDS, cache=cache_bugs.ReadBeforeWrite(), **GREEDY)
    report = gen.check_decode()
    assert report.failed_steps == [1, 2, 3, 4, 5]
    assert report.steps[1].first.site == "model.layers.0.self_attn:scores"
    assert "read the cache before writing this step's keys" in report.steps[1].explanation
    assert "own key position(s) 6" in report.steps[1].explanation  # the prefix is 7 long at step 1
    held = next(c for c in report.steps[1].candidates if c.matches)
    assert (held.factor, held.module_address, held.facet) == (
        None,
        "model.layers.0.self_attn",
        "scores",
    )


def test_a_sliding_window_applied_on_the_prefill_only_is_found_and_explained():
    model = cache_bugs.mistral(cache_bugs.WindowOnPrefillOnly, window=3)
    gen = tl.trace_generate(model, IDS, cache=DynamicCache(), **GREEDY)
    report = gen.check_decode()
    assert report.failed_steps == [1, 2, 3, 4, 5]
    assert "sliding window is not applied at decode" in report.steps[1].explanation
    assert "older than the model's sliding window of 3" in report.steps[1].explanation


def test_a_padded_rows_cache_not_masked_is_found_and_explained():
    model = cache_bugs.llama(cache_bugs.PaddingUnmasked)
    gen = tl.trace_generate(model, IDS, **GREEDY)
    report = gen.check_decode()
    assert report.failed_steps == [1, 2, 3, 4, 5]
    text = report.steps[1].explanation
    assert "a padded row's cache is not masked" in text and "row(s) 0, 1" in text
    assert "key position(s) 0, 1, 2" in text
    held = next(c for c in report.steps[1].candidates if c.matches)
    assert (held.factor, held.module_address, held.facet) == (
        None,
        "model.layers.0.self_attn",
        "pattern",
    )


def test_the_decode_tolerance_factor_is_compares():
    assert AUTO_FACTOR == COMPARE_FACTOR


def test_check_decode_refuses_steps_it_cannot_compare():
    gen = tl.trace_generate(testing.build("gpt2"), IDS, steps=[0, 2], **GREEDY)
    assert sorted(gen.check_decode().steps) == [2]
    with pytest.raises(GenerateSpecError, match="step 1 kept no tensors"):
        gen.check_decode(steps=1)
    with pytest.raises(GenerateSpecError, match="step 9 is outside"):
        gen.check_decode(steps=[9])
    with pytest.raises(GenerateSpecError, match="tolerance="):
        gen.check_decode(tolerance="loose")


def test_an_edit_that_raises_mid_generation_propagates_naming_the_step_and_leaves_nothing():
    model = testing.build("llama")

    def fail(x):
        raise ZeroDivisionError("planted")

    with pytest.raises(ZeroDivisionError, match="planted") as info:
        tl.trace_generate(model, IDS, edit={(3, "model.layers.0:resid_post"): fail}, **GREEDY)
    assert "step 3 (decode forward 3)" in info.value.__notes__[-1]
    _nothing_installed(model)
    with pytest.raises(
        tl.EditSpecError, match=r"shape \[3, 0, 32\], but the site is \[3, 1, 32\]"
    ) as info:
        tl.trace_generate(
            model, IDS, edit={(4, "model.layers.0:resid_post"): lambda x: x[:, :0]}, **GREEDY
        )
    assert "step 4 (decode forward 4)" in info.value.__notes__[-1]
    _nothing_installed(model)


def test_an_interrupt_inside_generate_leaves_nothing_installed():
    """A `BaseException` (Ctrl-C) that module hooks do not see still closes the capture under way."""
    model = testing.build("llama")

    class Stop(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if input_ids.shape[-1] == IDS.shape[-1] + 2:
                raise KeyboardInterrupt
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    with pytest.raises(KeyboardInterrupt) as info:
        tl.trace_generate(
            model, IDS, stopping_criteria=transformers.StoppingCriteriaList([Stop()]), **GREEDY
        )
    assert "generate itself, between forward calls (2 steps done)" in info.value.__notes__[-1]
    _nothing_installed(model)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_beams=2), "num_beams=2"),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (
            dict(max_new_tokens=None, max_length=5),
            "max_length=5 leaves -1 new tokens after the 6-token prompt",
        ),
        (dict(steps="all"), r"steps='all': give a step number .* a range or a list"),
        (dict(steps=[0, 1.5]), r"1.5 is not a step number"),
        (
            dict(edit={"model.layers.0:resid_pots": lambda x: x}),
            r"no facet 'resid_pots'. Did you mean 'resid_post'",
        ),
        (dict(steps=[0, 9]), r"steps=\[0, 9\]: step 9 is outside the generation"),
        (dict(steps=-1), "steps=-1: step -1 is negative"),
        (
            dict(edit={(7, "model.layers.0:resid_post"): lambda x: x}),
            r"edit= key .*step 7 is outside",
        ),
        (dict(edit={}), "edit= takes a non-empty dict"),
        (dict(prefill_chunk_size=2), "prefill_chunk_size=2"),
    ],
)
def test_bad_arguments_name_the_argument_and_leave_nothing_installed(kwargs, match):
    model = testing.build("llama")
    args = dict(GREEDY)
    args.update(
        {
            k: v
            for k, v in kwargs.items()
            if k in ("num_beams", "max_new_tokens", "max_length", "prefill_chunk_size")
        }
    )
    args = {k: v for k, v in args.items() if v is not None}
    rest = {
        k: v
        for k, v in kwargs.items()
        if k not in args and k not in ("max_new_tokens", "max_length")
    }
    with pytest.raises(tl.TorchLensError, match=match) as info:
        tl.trace_generate(model, IDS, **args, **rest)
    if "edit" in rest and not isinstance(
        info.value, GenerateSpecError
    ):  # raised in a step's locating pass
        assert (
            "torchlens: trace_generate raised in locating the edit= keys of step 0"
            in info.value.__notes__[-1]
        )
    _nothing_installed(model)


def test_a_model_without_generate_is_refused():
    model = torch.nn.Linear(3, 3)
    with pytest.raises(GenerateSpecError, match="model: Linear has no generate method"):
        tl.trace_generate(model, torch.ones(1, 3))
    _nothing_installed(model)


def test_a_step_that_never_ran_is_refused_after_an_early_stop():
    """An end-of-sequence token stops generation before max_new_tokens: a step named after it never ran."""
    model = testing.build("llama")
    plain = model.generate(
        IDS[:1], max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    eos = int(plain[0, IDS.shape[1] + 1])  # the second new token ends it: two forward calls
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=eos)
    assert len(tl.trace_generate(model, IDS[:1], save="none", **kwargs).steps) == 2
    with pytest.raises(
        GenerateSpecError,
        match=r"edit= key .*steps \[4\]: step 4 never ran: generation stopped after 2",
    ):
        tl.trace_generate(
            model, IDS[:1], edit={(4, "model.layers.0:resid_post"): lambda x: x}, **kwargs
        )
    with pytest.raises(GenerateSpecError, match="steps=3: step 3 never ran"):
        tl.trace_generate(model, IDS[:1], steps=3, **kwargs)
    _nothing_installed(model)


def test_generate_raising_in_a_step_propagates_with_a_note_and_leaves_nothing():
    model = testing.build("llama")
    calls = {"n": 0}

    def fail_on_third(module, args, out):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("planted failure")
        return None

    h = model.model.layers[1].mlp.register_forward_hook(fail_on_third)
    try:
        with pytest.raises(RuntimeError, match="planted failure") as info:
            tl.trace_generate(model, IDS, **GREEDY)
    finally:
        h.remove()
    notes = getattr(info.value, "__notes__", [])
    assert any(n.startswith("torchlens: raised") and "model.layers.1" in n for n in notes)
    assert (
        "torchlens: trace_generate raised in step 2 (decode forward 2)" in notes[-1]
    )  # the third forward
    _nothing_installed(model)
    # and the model generates normally afterwards, with no capture open
    assert torch.equal(
        tl.trace_generate(model, IDS, save="none", **GREEDY).sequences,
        model.generate(IDS, **GREEDY),
    )


def test_a_state_space_models_generation_is_traced_with_its_positions_counted():
    """Mamba's cache keeps a convolution and a scan state per layer, and no positions
    (`get_seq_length` raises): `trace_generate` still runs `generate` as it runs alone (the same
    sequences), counts each step's cached positions from the positions generate passed (0, then
    the prompt's 5, then 6), and every step's `resid_post` is what a plain forward hook cloned at
    that call; each decode step agrees with a full forward on its prefix."""
    model = testing.build("mamba")
    ids = torch.tensor([[5, 9, 3, 7, 2]])
    kwargs = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **kwargs)
    blocks = [f"backbone.layers.{i}" for i in range(len(model.backbone.layers))]
    seen: list[torch.Tensor] = []
    handles = [
        model.get_submodule(b).register_forward_hook(
            lambda m, a, out: seen.append(_first(out).detach().clone())
        )
        for b in blocks
    ]
    try:
        gen = tl.trace_generate(model, ids, **kwargs)
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(gen.sequences, expected)
    assert [i.past_length for i in gen.info] == [0, 5, 6]
    served = [step[b + ":resid_post"] for step in gen.steps for b in blocks]
    assert len(served) == len(seen) == 3 * len(blocks)
    for got, truth in zip(served, seen):
        assert torch.equal(got, truth)
    assert gen.check_decode().ok


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def test_one_site_keyed_for_every_step_and_for_a_step_is_refused():
    """`{key: f, (2, key): g}` would run only one of them at step 2 (the later entry replaced the
    earlier, silently): two edits of one site at one step are refused, as `trace` refuses two
    edits of one site, before generate runs."""
    model = testing.build("gpt2")
    key = "transformer.h.0:resid_post"
    for edit in (
        {key: lambda t: t * 0.5, (2, key): lambda t: t + 1},
        {(range(0, 3), key): lambda t: t, (range(2, 4), key): lambda t: t},
    ):
        with pytest.raises(tl.EditSpecError, match="give one edit per site and step"):
            tl.trace_generate(model, IDS, edit=edit, **GREEDY)
        assert not model._forward_hooks and not model._forward_pre_hooks
    # disjoint steps are two edits, each at its own steps
    gen = tl.trace_generate(
        model,
        IDS,
        edit={(0, key): lambda t: t, (range(1, 6), key): lambda t: t},
        **GREEDY,
    )
    assert [len(e) for e in gen.edits.values()] == [1] * 6


def test_a_cross_attention_key_edited_at_every_step_says_to_key_it_at_step_0():
    """A decoder's cross-attention computes its keys and values from the encoder's output at step
    0 only; a key for every step fails at step 1 with a note that says so and how to key it."""
    model = t5()
    ids = testing.token_ids(batch=2, length=6, seed=5, vocab=60) + 3
    kw = dict(
        max_new_tokens=3,
        do_sample=False,
        eos_token_id=None,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    key = "decoder.block.1.layer.1.EncDecAttention:k"
    with pytest.raises(tl.FacetNotFound) as info:
        tl.trace_generate(model, ids, edit={key: lambda x: x * 0}, **kw)
    assert any("key such an edit as (0, key)" in n for n in info.value.__notes__)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    tl.trace_generate(model, ids, edit={(0, key): lambda x: x * 0}, **kw)  # keyed at step 0: placed


def test_a_k_read_back_from_a_sliding_window_static_cache_is_refused_for_what_it_is():
    """With a sliding-window static cache, a decode step's kernel reads the keys from the cache the
    forward rolled and wrote in place: k per head is refused, and the reason says that (it said the
    keys were cut from a fused projection, which Mistral's separate k_proj is not)."""
    config = transformers.MistralConfig(
        **{**testing.LLAMA_LIKE, "max_position_embeddings": 64, "sliding_window": 3}
    )
    model = testing.from_config(config, transformers.MistralForCausalLM, "sdpa")
    ids = testing.token_ids(batch=2, length=6, seed=3, vocab=60) + 3
    gen = tl.trace_generate(
        model,
        ids,
        max_new_tokens=2,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        cache_implementation="static",
    )
    facets = gen.steps[1].modules["model.layers.0.self_attn"].facets
    assert "wrote in place" in facets.refused["k"] and "fused projection" not in facets.refused["k"]
