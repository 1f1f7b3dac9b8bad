"""Hybrid stacks: layers of different classes or mixers are one stack, with per-layer roles (issue 22, item 4).

Models (tiny seeded configs in `tests/_edge_models.py`):

- Jamba: `model.layers` holds a `JambaMambaDecoderLayer` and a `JambaAttentionDecoderLayer`
  (two classes in one `ModuleList`); each has a `feed_forward` MLP.
- Zamba (no other test uses it): five layers, three `ZambaMambaDecoderLayer` and two
  `ZambaHybridLayer`, in one `ModuleList`.
- Qwen3-Next, Bamba and LFM2 (the last two used by no other test): one layer class, but layer 0
  mixes tokens with linear attention / a Mamba-2 mixer / a short conv instead of attention; every
  layer has an MLP (`mlp` / `feed_forward`).
- A one-block `TinyLM` of `tests/_edge_models.py` (no repeated layers, so no stack).
- Further designs no other test uses: OLMo-Hybrid (a `OlmoHybridLinearAttentionDecoderLayer` and
  a `OlmoHybridAttentionDecoderLayer` in one `ModuleList`); RecurrentGemma (layer 0 mixes tokens
  with a conv + RG-LRU recurrent block, `mlp_block` after it); Granite-MoE-hybrid without experts
  (layer 0's mixer is a Mamba-2 layer, `shared_mlp` after it).

Ground truth: plain forward hooks (`torchlens.testing.hooked_outputs`,
`_edge_models.hooked_inputs`) on `model.layers.N`, on each layer's MLP module and on the final
norm, at the addresses the models' source gives them.
"""

from __future__ import annotations

import functools
import warnings

import _edge_models as em
import pytest
import torch

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing

#: arch -> (layer addresses' pattern, number of layers, the MLP child of each layer, the final norm)
HYBRID = {
    "jamba": ("model.layers.{L}", 2, "feed_forward", "model.final_layernorm"),
    "zamba": ("model.layers.{L}", 5, None, "model.final_layernorm"),
    "olmo_hybrid": ("model.layers.{L}", 2, "mlp", "model.norm"),
}
MIXED = {
    "qwen3_next": ("model.layers.{L}", 2, "mlp", "model.norm"),
    "bamba": ("model.layers.{L}", 2, "feed_forward", "model.final_layernorm"),
    "lfm2": ("model.layers.{L}", 2, "feed_forward", "model.embedding_norm"),
    "jamba": HYBRID["jamba"],
    "olmo_hybrid": HYBRID["olmo_hybrid"],
    "recurrent_gemma": ("model.layers.{L}", 2, "mlp_block", "model.final_norm"),
    "granitemoehybrid": ("model.layers.{L}", 2, "shared_mlp", "model.norm"),
}


@functools.cache
def traced(arch: str):
    """(model, args, kwargs, trace, the torchlens warnings the trace issued), cached."""
    model = em.build(arch)
    args, kwargs = em.inputs(arch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace = tl.trace(model, *args, **kwargs, save="all")
    notes = [str(w.message) for w in caught if str(w.message).startswith("torchlens")]
    return model, args, kwargs, trace, notes


def _layers(arch: str, table: dict) -> list[str]:
    pattern, n, *_ = table[arch]
    return [pattern.format(L=i) for i in range(n)]


@pytest.mark.parametrize("arch", list(HYBRID))
def test_layers_of_two_classes_are_one_stack(arch):
    """Every layer of `model.layers` is a layer of the trace, in order, and nnterp
    `layers_output[i]` serves what a plain hook on `model.layers.i` saw."""
    model, args, kwargs, trace, _ = traced(arch)
    layers = _layers(arch, HYBRID)
    assert len({type(model.get_submodule(a)) for a in layers}) == 2, (
        "the model mixes two layer classes"
    )
    assert trace.blocks == layers
    truth = testing.hooked_outputs(model, layers, *args, **kwargs)
    for i, address in enumerate(layers):
        r = mi.resolve_alias(trace, f"layers_output[{i}]", generation="nnterp")
        assert r.status == "real" and r.module_address == address, r
        assert torch.equal(r.tensor, truth[address]), address


@pytest.mark.parametrize("arch", list(HYBRID))
def test_repeated_layers_give_a_stack_or_a_warning(arch):
    """The coverage guide's promise: a model with repeated modules and no block found gets a
    warning saying so."""
    *_, trace, notes = traced(arch)
    assert trace.blocks or any("block" in n for n in notes), notes


@pytest.mark.parametrize("arch", list(HYBRID))
def test_final_norm_input_is_served_or_truly_absent(arch):
    """The final norm reads the last layer's output and runs before the unembedding (plain hooks
    show it), so 4.x `ln_final.hook_in` serves its input, or is absent for another reason than
    "no norm runs between the last block and the unembedding"."""
    model, args, kwargs, trace, _ = traced(arch)
    last, norm = _layers(arch, HYBRID)[-1], HYBRID[arch][3]
    outs = testing.hooked_outputs(model, [last, "lm_head"], *args, **kwargs)
    ins = em.hooked_inputs(model, [norm, "lm_head"], *args, **kwargs)
    assert torch.equal(ins[norm], outs[last])  # the norm reads the last layer's output ...
    assert not torch.equal(
        ins["lm_head"], outs[last]
    )  # ... and something (the norm) runs before the head
    for generation, name in (("4.x", "ln_final.hook_in"), ("2.x", "ln_final.hook_normalized")):
        r = mi.resolve_alias(trace, name, generation=generation)
        if r.status == "real" and name.endswith("hook_in"):
            assert r.module_address == norm and torch.equal(r.tensor, ins[norm]), r
        elif r.status not in ("real", "reconstructed_read_only"):
            assert "no norm runs between the last block and the unembedding" not in r.reason, (
                name,
                r.reason,
            )


@pytest.mark.parametrize("arch", ["jamba", "zamba", "one_block"])
def test_alias_report_lists_only_names_resolve_alias_accepts(arch):
    """Every name an alias_report row carries, in every generation, resolves with resolve_alias
    (to the row's status): a report must not list a spelling that the resolver then rejects."""
    if arch == "one_block":
        model, trace = em.one_block_lm(), None
        trace = tl.trace(model, testing.token_ids(length=5), save="all")
    else:
        trace = traced(arch)[3]
    rejected = []
    for generation in mi.GENERATIONS:
        for row in mi.alias_report(trace, generation=generation):
            try:
                r = mi.resolve_alias(trace, row.query, generation=generation)
            except mi.AliasError as e:
                rejected.append(f"{generation} {row.query!r} [{row.status}]: {type(e).__name__}")
                continue
            if r.status != row.status and row.checked:
                rejected.append(
                    f"{generation} {row.query!r}: report says {row.status}, resolve_alias {r.status}"
                )
    assert not rejected, f"{len(rejected)} rows, e.g.\n" + "\n".join(rejected[:8])


@pytest.mark.parametrize("arch", list(MIXED))
def test_every_layer_mlp_is_found_whatever_its_mixer(arch):
    """A layer whose token mixer is linear attention, an SSM or a conv still has its MLP: nnterp
    `mlps_output[i]` serves what a plain hook on `model.layers.i.<mlp>` saw, at every layer."""
    model, args, kwargs, trace, _ = traced(arch)
    mlps = [f"{a}.{MIXED[arch][2]}" for a in _layers(arch, MIXED)]
    truth = testing.hooked_outputs(model, mlps, *args, **kwargs)
    wrong = []
    for i, address in enumerate(mlps):
        try:
            r = mi.resolve_alias(trace, f"mlps_output[{i}]", generation="nnterp")
        except mi.AliasError as e:
            wrong.append(f"mlps_output[{i}]: {type(e).__name__}: {e}")
            continue
        if (
            r.status != "real"
            or r.module_address != address
            or not torch.equal(r.tensor, truth[address])
        ):
            wrong.append(f"mlps_output[{i}] -> {r.module_address} [{r.status}]: {r.reason}")
    assert not wrong, "\n".join(wrong)
