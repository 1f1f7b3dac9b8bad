"""The test model builders, under the names the tests have always used.

The builders live in [`torchlens.testing`][torchlens.testing] (public, documented, shared with
the scripts); this module only keeps the old spellings (`_models.gpt2()`, `_models.FAMILIES`
as `name -> (factory, attention implementations)`, `_models._build`) for the test files that
use them. New code imports `torchlens.testing`.
"""

from __future__ import annotations

import torch

from torchlens import testing
from torchlens.testing import MAX_POSITIONS as MAX_POS
from torchlens.testing import VOCAB, build, hooked_outputs, token_ids

__all__ = ["FAMILIES", "MAX_POS", "VOCAB", "build", "gemma2", "gpt2", "gpt2_upcast", "gpt_neox", "gpt_neox_sequential",
           "hooked_outputs", "llama", "mistral", "olmo2", "phi3", "qwen3", "token_ids"]

_LLAMA_LIKE = dict(testing.LLAMA_LIKE)


def _build(config_cls, model_cls, attn_implementation: str, dtype: torch.dtype, **config) -> torch.nn.Module:
    """`testing.from_config(config_cls(**config), model_cls, ...)`, the old signature."""
    return testing.from_config(config_cls(**config), model_cls, attn_implementation, dtype)


def _factory(family: str):
    def factory(attn_implementation: str = "eager", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        return build(family, attn_implementation, dtype)

    factory.__name__ = factory.__qualname__ = family
    factory.__doc__ = f"`torchlens.testing.build({family!r}, attn_implementation, dtype)`."
    return factory


#: name -> (factory, attention implementations transformers supports for it)
FAMILIES = {name: (_factory(name), spec.attn_implementations) for name, spec in testing.FAMILIES.items()}

gpt2, gpt2_upcast, llama, gpt_neox, gpt_neox_sequential, gemma2, qwen3, phi3, olmo2, mistral = (
    FAMILIES[n][0] for n in ("gpt2", "gpt2_upcast", "llama", "gpt_neox", "gpt_neox_sequential", "gemma2", "qwen3",
                             "phi3", "olmo2", "mistral"))
