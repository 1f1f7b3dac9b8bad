"""The tiny Llama checkpoint both GPU checks use (the model of docs/guides/serving-engines.md)."""

from __future__ import annotations

import torch

from torchlens import testing

PROMPT = [5, 17, 42, 9, 100, 3, 77]
#: A 2-layer Llama with head size 64 (what the GPU attention kernels accept), one key/value head.
SETTINGS = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "intermediate_size": 256,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}


def tiny_llama() -> tuple[torch.nn.Module, str]:
    """The seeded random-init Llama (`torchlens.testing.build("llama", **SETTINGS)`) and a fresh
    directory it is saved in with `save_pretrained`."""
    model, directory = testing.checkpoint("llama", **SETTINGS)
    return model, str(directory)
