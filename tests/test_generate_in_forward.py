"""A model that runs its language model several times in one forward (issue 22, item 4).

A wrapper whose `forward` calls `generate` runs every block once per decoding step. Today the
steps are chained into one stack (2 layers run 3 times become 6 "layers", `blocks.2` being
layer 0 of step 2), and the root's `logits` silently serves the last `lm_head` call. The rule: a
layer index counts the layers of one pass through the stack (each block once), a per-layer name
says which call (step) of its block it reads, and `logits` is not served as `real` without
saying which of the unembedding's calls it is.

Designs: a Llama (`torchlens.testing.build("llama")`) under `generate(max_new_tokens=3)`; MBart
(no other test uses it) under `generate` (its decoder runs once per step); and a greedy loop that
calls the Llama three times on a growing prompt without `generate` (no cache); and StarCoder2 (no
other test uses it) under `generate`.

Ground truth: plain forward hooks that keep every call's output (`_all_calls`), and the configs'
`num_hidden_layers` / `decoder_layers`.
"""

from __future__ import annotations

import functools

import _edge_models as em
import pytest
import torch
import transformers as tf
from torch import nn

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing

STEPS = 3


class Generates(nn.Module):
    """forward(ids) = lm.generate(ids, greedy, exactly STEPS new tokens)."""

    def __init__(self, lm: nn.Module, **kwargs):
        super().__init__()
        self.lm, self.kwargs = lm, kwargs

    def forward(self, ids):
        return self.lm.generate(
            ids, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, **self.kwargs
        )


class GreedyLoop(nn.Module):
    """forward(ids): STEPS times, run the LM on the whole prompt and append its argmax token."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        for _ in range(STEPS):
            logits = self.lm(ids).logits
            ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
        return ids


#: design -> (builder, the language model's blocks pattern, its number of layers, its unembedding)
DESIGNS = {
    "llama_generate": (
        lambda: Generates(testing.build("llama")),
        "lm.model.layers.{L}",
        2,
        "lm.lm_head",
    ),
    "mbart_generate": (
        lambda: Generates(em.build("mbart"), decoder_start_token_id=2),
        "lm.model.decoder.layers.{L}",
        2,
        "lm.lm_head",
    ),
    "llama_loop": (
        lambda: GreedyLoop(testing.build("llama")),
        "lm.model.layers.{L}",
        2,
        "lm.lm_head",
    ),
    "starcoder2_generate": (
        lambda: Generates(
            testing.from_config(
                tf.Starcoder2Config(
                    num_hidden_layers=2,
                    hidden_size=32,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    intermediate_size=48,
                    vocab_size=64,
                    max_position_embeddings=32,
                    bos_token_id=0,
                    eos_token_id=0,
                    pad_token_id=0,
                ),
                tf.Starcoder2ForCausalLM,
                "eager",
                torch.float32,
            )
        ),
        "lm.model.layers.{L}",
        2,
        "lm.lm_head",
    ),
}


def _all_calls(model: nn.Module, addresses: list[str], *args) -> dict[str, list[torch.Tensor]]:
    """address -> the output of each of its calls, in order, by plain forward hooks."""
    seen: dict[str, list[torch.Tensor]] = {a: [] for a in addresses}
    mods = dict(model.named_modules())
    handles = [
        mods[a].register_forward_hook(
            lambda m, i, o, a=a: seen[a].append(
                (o[0] if isinstance(o, tuple) else o).detach().clone()
            )
        )
        for a in addresses
    ]
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for h in handles:
            h.remove()
    return seen


@functools.cache
def traced(design: str):
    build, pattern, n, head = DESIGNS[design]
    model = build().eval()
    ids = testing.token_ids(length=4)
    trace = tl.trace(model, ids, save="all")
    blocks = [pattern.format(L=i) for i in range(n)]
    calls = _all_calls(model, blocks + [head], ids)
    return model, trace, blocks, calls


@pytest.mark.parametrize("design", list(DESIGNS))
def test_a_layer_index_counts_one_pass(design):
    model, trace, blocks, calls = traced(design)
    assert all(len(calls[b]) == STEPS for b in blocks), {
        b: len(calls[b]) for b in blocks
    }  # the design runs STEPS passes
    assert trace.blocks == blocks, (
        f"{len(blocks)} layers ran {STEPS} times each, listed as {trace.blocks}"
    )
    prefix = "decoder" if design.startswith("mbart") else "blocks"
    with pytest.raises(mi.LayerOutOfRange):
        mi.resolve_alias(trace, f"{prefix}.{len(blocks)}.hook_resid_post", generation="2.x")


@pytest.mark.parametrize("design", list(DESIGNS))
def test_per_layer_names_say_their_call(design):
    """Each layer's resid_post names the call of its block it reads and serves that call's output."""
    model, trace, blocks, calls = traced(design)
    prefix = (
        "decoder" if design.startswith("mbart") else "blocks"
    )  # 2.x names T5-like stacks decoder.{L}
    for i, block in enumerate(blocks):
        r = mi.resolve_alias(trace, f"{prefix}.{i}.hook_resid_post", generation="2.x")
        if r.status not in ("real", "reconstructed_read_only"):
            continue
        assert r.module_address == block and r.call is not None, r
        assert torch.equal(r.tensor, calls[block][r.call]), (block, r.call)


@pytest.mark.parametrize("design", list(DESIGNS))
def test_logits_say_which_unembedding_call(design):
    """The unembedding ran once per step: `logits` is not served as one of them without saying which."""
    model, trace, blocks, calls = traced(design)
    head = DESIGNS[design][3]
    assert len(calls[head]) == STEPS
    for generation, name in (("nnterp", "logits"), ("4.x", "unembed.hook_out")):
        try:
            r = mi.resolve_alias(trace, name, generation=generation)
        except mi.UnknownAlias:
            continue
        if r.status not in ("real", "reconstructed_read_only"):
            continue
        assert r.call is not None, (
            f"{generation} {name} serves one of {STEPS} {head} calls without saying which: {r}"
        )
        assert torch.equal(r.tensor, calls[head][r.call])
