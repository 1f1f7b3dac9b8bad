"""An out-of-range layer is refused with a message that is true of the trace (issue 22, item 4).

On a model with no language-model stack, `LayerOutOfRange` says "this trace ran 2 decoder
blocks" while `trace.blocks` is `[]` and the model has no decoder. The rule: the message
describes the stacks the trace has, as they are: it claims no decoder block where none ran, and
it names the stacks a layer index could count.

Models: Swin (its stages' `blocks` lists), CLIP (a text and a vision tower), and SigLIP and
Swin-v2 (of the same kinds; no other test uses them), tiny seeded configs of `tests/_edge_models.py`.

Ground truth: the models' source: which `ModuleList`s hold their repeated layers (`STACKS`), and
that none of them has a decoder (no module of the model is named or classed as one).
"""

from __future__ import annotations

import functools

import _edge_models as em
import pytest

import torchlens as tl
import torchlens.mechinterp as mi

#: arch -> the module lists that hold its repeated layers, by the model's source
STACKS = {
    "swin": ("encoder.layers.0.blocks", "encoder.layers.1.blocks"),
    "swinv2": ("encoder.layers.0.blocks", "encoder.layers.1.blocks"),
    "clip": ("text_model.encoder.layers", "vision_model.encoder.layers"),
    "siglip": ("text_model.encoder.layers", "vision_model.encoder.layers"),
}
NAMES = [
    ("2.x", "blocks.9.hook_resid_post"),
    ("nnterp", "layers_output[9]"),
    ("4.x", "blocks.9.hook_out"),
]


@functools.cache
def traced(arch: str):
    model = em.build(arch)
    args, kwargs = em.inputs(arch)
    return model, tl.trace(model, *args, **kwargs)


@pytest.mark.parametrize("generation,name", NAMES)
@pytest.mark.parametrize("arch", list(STACKS))
def test_out_of_range_message_is_true_of_the_trace(arch, generation, name):
    model, trace = traced(arch)
    assert not any(
        "decoder" in a.lower() or "Decoder" in type(m).__name__ for a, m in model.named_modules()
    )
    for holder in STACKS[arch]:
        assert len(model.get_submodule(holder)) >= 1
    with pytest.raises(mi.AliasError) as caught:
        mi.resolve_alias(trace, name, generation=generation)
    message = str(caught.value)
    assert "decoder block" not in message, (
        f"no decoder block ran (trace.blocks is {trace.blocks}): {message}"
    )
    missing = [h for h in STACKS[arch] if h not in message]
    assert not missing, (
        f"the message does not name the stacks a layer could count ({missing}): {message}"
    )
