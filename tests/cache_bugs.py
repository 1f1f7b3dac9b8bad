"""Tiny models with a cache bug planted in their decode path, for the decode check's tests.

Each is a Hugging Face model class whose prefill is right and whose cached decode forward is
wrong in one way a serving stack has been wrong:

- `RotaryOffByOne`: the position ids of a decode forward are one too far, so RoPE rotates the
  new token's query and key at the wrong angle;
- `ReadBeforeWrite` (a cache): attention reads the cache buffer before this step's keys and
  values are written, so the new token's own slot still holds zeros;
- `WindowOnPrefillOnly`: a sliding-window model whose decode forward builds its mask without the
  window (and keeps every key in its cache);
- `PaddingUnmasked`: a decode forward that drops the attention mask, so a left-padded row attends
  to its padding.
"""

from __future__ import annotations

import torch
import transformers
from transformers import DynamicCache

from torchlens import testing


def _cache(kwargs):
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _decoding(kwargs) -> bool:
    cache = _cache(kwargs)
    return cache is not None and cache.get_seq_length() > 0


class RotaryOffByOne(transformers.LlamaForCausalLM):
    """Llama whose decode forwards take position ids one too far."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        if _decoding(kwargs) and position_ids is not None:
            position_ids = position_ids + 1
        return super().forward(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        )


class ReadBeforeWrite(DynamicCache):
    """A cache whose buffer is read before this step's keys and values are written: attention gets
    the cached positions and, in the new positions' slots, what a fresh buffer holds (zeros)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        decoding = layer_idx < len(self.layers) and self.layers[layer_idx].get_seq_length() > 0
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if not decoding:
            return keys, values
        n = key_states.shape[-2]
        stale_k, stale_v = keys.clone(), values.clone()
        stale_k[..., -n:, :] = 0
        stale_v[..., -n:, :] = 0
        return stale_k, stale_v


class WindowOnPrefillOnly(transformers.MistralForCausalLM):
    """Mistral (sliding window) whose decode forwards mask without the window."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        if not _decoding(kwargs):
            return super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **kwargs,
            )
        window, self.config.sliding_window = self.config.sliding_window, None
        try:
            return super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **kwargs,
            )
        finally:
            self.config.sliding_window = window


class PaddingUnmasked(transformers.LlamaForCausalLM):
    """Llama whose decode forwards attend to every cached position, padding included."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        if _decoding(kwargs) and attention_mask is not None:
            attention_mask = torch.ones_like(attention_mask)
        return super().forward(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        )


def llama(cls=transformers.LlamaForCausalLM, **settings):
    config = transformers.LlamaConfig(
        **{
            **testing.LLAMA_LIKE,
            "max_position_embeddings": 64,
            "bos_token_id": 0,
            "eos_token_id": 0,
            **settings,
        }
    )
    return testing.from_config(config, cls)


def mistral(cls=transformers.MistralForCausalLM, window=3, **settings):
    config = transformers.MistralConfig(
        **{
            **testing.LLAMA_LIKE,
            "max_position_embeddings": 64,
            "bos_token_id": 0,
            "eos_token_id": 0,
            "sliding_window": window,
            **settings,
        }
    )
    return testing.from_config(config, cls)
