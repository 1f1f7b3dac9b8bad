"""vLLM's hooks checked against a stored TorchLens trace: a test for an engine's own CI.

Copy this file with `make_references.py` and `references/`. It starts vLLM on the checkpoint the
reference was made from (`torchlens.testing.checkpoint`: the same seeded weights, a Llama with
two layers and 128 wide), installs forward hooks in the engine's worker (`LLM.apply_model`),
generates one token, and compares what the hooks read during the prefill with the stored trace
(`torchlens.load`). A wrong hook fails the test, and pytest prints the comparison, with what the
engine's tensor equals instead after `=>`. Where each site is in vLLM's Llama: the table of the
TorchLens site's serving-engines page (a decoder layer returns `(mlp_output, residual)`; the
residual stream is their sum). Without vLLM the file is skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core runs in this process
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model sends Python functions
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache (vLLM's CPU build)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
vllm = pytest.importorskip("vllm")

import torchlens as tl  # noqa: E402
import torchlens.mechinterp as mi  # noqa: E402
from torchlens import testing  # noqa: E402

REFERENCES = Path(os.environ.get("TORCHLENS_REFERENCES", Path(__file__).with_name("references")))
SETTINGS = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=256,
                vocab_size=128, max_position_embeddings=64)  # as make_references.py's "llama-vllm"


def install_hooks(model):
    """Runs in vLLM's worker: what the hooks read in each forward pass, by TorchLens "3.x" name."""
    calls = model.torchlens_calls = []

    def keep(name, tensor):
        calls[-1][name] = tensor.detach().to("cpu", copy=True)  # a copy: fused kernels write in place

    def on_embed(module, args, output):
        calls.append({})  # the embedding runs first in every forward pass
        keep("hook_embed", output)

    def on_layer(i):
        def before(module, args):
            _, hidden, residual = args  # (positions, hidden_states, residual)
            keep(f"blocks.{i}.hook_resid_pre", hidden if residual is None else hidden + residual)

        def after(module, args, output):
            mlp_out, resid_mid = output  # the residual is not added yet: the next layer's fused norm adds it
            keep(f"blocks.{i}.hook_resid_mid", resid_mid)
            keep(f"blocks.{i}.hook_mlp_out", mlp_out)
            keep(f"blocks.{i}.hook_resid_post", mlp_out + resid_mid)
        def attention(module, args, kwargs, output):  # a hook that returns a value replaces the output
            keep(f"blocks.{i}.attn.hook_in", kwargs["hidden_states"])
            keep(f"blocks.{i}.hook_attn_out", output)
        return before, after, attention

    model.model.embed_tokens.register_forward_hook(on_embed)
    for i, layer in enumerate(model.model.layers):
        before, after, attention = on_layer(i)
        layer.register_forward_pre_hook(before)
        layer.register_forward_hook(after)
        layer.self_attn.register_forward_hook(attention, with_kwargs=True)
        layer.mlp.register_forward_pre_hook(lambda m, args, i=i: keep(f"blocks.{i}.mlp.hook_in", args[0]))
    model.model.norm.register_forward_hook(
        lambda m, args, out: keep("ln_final.hook_out", out[0] if isinstance(out, tuple) else out))


@pytest.fixture(scope="module")
def reference() -> tl.Trace:
    path = REFERENCES / "llama-vllm"
    if not path.exists():
        pytest.fail(f"no stored reference at {path}: run `python make_references.py` once and commit it")
    return tl.load(path)


def test_every_vllm_hook_reads_the_tensor_its_name_says(reference, tmp_path):
    _, checkpoint = testing.checkpoint("llama", tmp_path / "checkpoint", **SETTINGS)
    ids = mi.resolve_alias(reference, "embed.hook_in", generation="4.x").tensor[0].tolist()
    llm = vllm.LLM(model=str(checkpoint), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                   max_model_len=64)
    try:
        llm.apply_model(install_hooks)
        llm.generate([{"prompt_token_ids": ids}], vllm.SamplingParams(max_tokens=1, temperature=0.0))
        prefill = llm.apply_model(lambda model: model.torchlens_calls)[0][0]
    finally:
        llm.llm_engine.engine_core.shutdown()
    report = mi.compare(reference, prefill, generation="3.x", atol=1e-5, rtol=1e-5)
    assert len(report) == 2 + 7 * len(reference.blocks)
    if report.mismatched:
        pytest.fail(f"vLLM's hooks disagree with the TorchLens reference:\n{report}", pytrace=False)
