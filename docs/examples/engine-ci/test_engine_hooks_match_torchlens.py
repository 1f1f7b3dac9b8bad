"""An engine's own test: its hooks read what their names say, checked against a stored TorchLens trace.

Copy this file into the engine's test suite with `make_references.py` and the `references/` it
writes. The engine here serves Hugging Face models and lets you hook their modules with plain
PyTorch hooks; `engine_capture` is the one function to replace with your engine's own capture.

Each test loads the checkpoint the reference was made from (`torchlens.testing.checkpoint`: the
same seeded weights), reads every site of `SITES` through the engine's hooks, and hands the
tensors to `torchlens.mechinterp.compare` with the stored trace (`torchlens.load`; no eager
forward, no peer engine). A wrong hook fails the test, and pytest prints the comparison: each
site, whether it agrees, and after `=>` what the engine's tensor equals instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing

REFERENCES = Path(os.environ.get("TORCHLENS_REFERENCES", Path(__file__).with_name("references")))

#: nnterp name -> (module address, "input" or "output"): where the engine's hook reads it.
SITES = {
    "layers_input[{L}]": ("model.layers.{L}", "input"),
    "attentions_input[{L}]": ("model.layers.{L}.self_attn", "input"),
    "attentions_output[{L}]": ("model.layers.{L}.self_attn", "output"),
    "mlps_input[{L}]": ("model.layers.{L}.mlp", "input"),
    "mlps_output[{L}]": ("model.layers.{L}.mlp", "output"),
    "layers_output[{L}]": ("model.layers.{L}", "output"),
}


def engine_capture(checkpoint: Path, ids: torch.Tensor, layers: int) -> dict[str, torch.Tensor]:
    """The engine under test: load the checkpoint as it serves it (sdpa attention) and read each site
    with a forward hook, copying the tensor (a later kernel may write into it)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa").eval()
    seen, handles = {}, []

    def first(value):
        return value[0] if isinstance(value, tuple) else value

    for pattern, (address, side) in SITES.items():
        for layer in range(layers):
            name, module = pattern.replace("{L}", str(layer)), model.get_submodule(address.replace("{L}", str(layer)))
            if side == "input":
                handles.append(module.register_forward_pre_hook(
                    lambda m, args, kwargs, name=name: seen.__setitem__(
                        name, (args[0] if args else kwargs["hidden_states"]).detach().clone()), with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(
                    lambda m, args, out, name=name: seen.__setitem__(name, first(out).detach().clone())))
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.fixture(scope="module")
def reference() -> tl.Trace:
    path = REFERENCES / "llama"
    if not path.exists():
        pytest.fail(f"no stored reference at {path}: run `python make_references.py` once and commit it")
    return tl.load(path)


def test_the_reference_is_of_the_model_the_engine_loads(reference, tmp_path):
    model, _ = testing.checkpoint("llama", tmp_path / "checkpoint")
    stored, now = reference.model_info["config"], model.config.to_dict()
    shape = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    assert {k: stored[k] for k in shape} == {k: now[k] for k in shape}, "the model changed: rerun make_references.py"


def test_every_hook_reads_the_tensor_its_name_says(reference, tmp_path):
    model, checkpoint = testing.checkpoint("llama", tmp_path / "checkpoint")
    ids = mi.resolve_alias(reference, "input_ids", generation="nnterp").tensor  # the prompt the reference ran
    captured = engine_capture(checkpoint, ids, layers=len(reference.blocks))
    report = mi.compare(reference, captured, generation="nnterp", atol=1e-5, rtol=1e-5)
    assert len(report) == len(SITES) * len(reference.blocks)
    if report.mismatched:
        pytest.fail(f"the engine's hooks disagree with the TorchLens reference:\n{report}", pytrace=False)
