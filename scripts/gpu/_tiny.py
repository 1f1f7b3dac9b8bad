"""The tiny Llama checkpoint both GPU checks use (the model of docs/guides/serving-engines.md)."""

from __future__ import annotations

import tempfile

import torch
import transformers

PROMPT = [5, 17, 42, 9, 100, 3, 77]


def tiny_llama() -> tuple[torch.nn.Module, str]:
    """A random-init 2-layer Llama (seed 0, head size 64), and a directory it is saved in."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        intermediate_size=256, vocab_size=128, max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    directory = tempfile.mkdtemp(prefix="tiny-llama-")
    model.save_pretrained(directory)
    return model, directory
