"""Small seeded models and ground truth from outside TorchLens, for tests (like `torch.testing`).

TorchLens's own tests, its documentation scripts and an engine's CI need the same things: a
tiny Hugging Face model with fixed weights, built from a config in milliseconds without a
download, and a way to read what a module returned that does not go through TorchLens. This
module holds both:

- [`FAMILIES`][torchlens.testing.FAMILIES] is the one registry of the model families the
  repository builds (GPT-2, Llama, GPT-NeoX, Gemma-2, Qwen3, BERT, T5, CLIP, ...: two layers, a
  32-wide residual stream), each a [`Family`][torchlens.testing.Family] row: its config, its
  title, and where the repository uses it (the tests run over [`SUITE`][torchlens.testing.SUITE],
  the model zoo checks each `structure`, the site draws each `diagram` and `op_graph`, the peer
  engines read the `engines` ones). The rows are checked when this module is imported.
- [`build`][torchlens.testing.build]`(family)` builds one: seeded weights, eval mode.
- [`from_config`][torchlens.testing.from_config] does the same for any config and model class.
- [`checkpoint`][torchlens.testing.checkpoint] saves such a model with `save_pretrained`, for
  engines that load a directory (vLLM, SGLang).
- [`token_ids`][torchlens.testing.token_ids] and [`tokenizer`][torchlens.testing.tokenizer]
  give inputs that fit these models' vocabulary.
- [`hooked_outputs`][torchlens.testing.hooked_outputs] records module outputs with plain
  forward hooks: the ground truth a TorchLens trace is checked against.

`transformers` is imported inside the functions that need it; importing this module needs only
torch.

Examples:
    >>> import torchlens as tl
    >>> from torchlens import testing
    >>> model = testing.build("llama")
    >>> ids = testing.token_ids(length=5)
    >>> truth = testing.hooked_outputs(model, ["model.layers.0"], ids)
    >>> trace = tl.trace(model, ids)
    >>> import torch
    >>> torch.equal(trace.modules["model.layers.0"].facets["resid_post"], truth["model.layers.0"])
    True
"""

from __future__ import annotations

from torchlens.testing._build import build, checkpoint, from_config
from torchlens.testing._family import IMPLEMENTATIONS as IMPLEMENTATIONS
from torchlens.testing._family import INPUTS as INPUTS
from torchlens.testing._family import KINDS as KINDS
from torchlens.testing._family import Family, OpGraph, Stack, Structure
from torchlens.testing._family import check_families as check_families
from torchlens.testing._hooks import hooked_outputs
from torchlens.testing._inputs import inputs, token_ids, tokenizer
from torchlens.testing._rows import FAMILIES, LLAMA_LIKE, MAX_POSITIONS, SUITE, VOCAB

# Also public, though not in `__all__` (imported `as` themselves): the vocabularies the rows are
# checked against (`IMPLEMENTATIONS`, `KINDS`, `INPUTS`) and `check_families`.
__all__ = [
    "FAMILIES",
    "LLAMA_LIKE",
    "MAX_POSITIONS",
    "SUITE",
    "VOCAB",
    "Family",
    "OpGraph",
    "Stack",
    "Structure",
    "build",
    "checkpoint",
    "from_config",
    "hooked_outputs",
    "inputs",
    "token_ids",
    "tokenizer",
]
