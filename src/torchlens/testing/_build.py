"""Building the tiny seeded models: any config (`from_config`, one seeding and norm-perturbation
rule), a family of the registry (`build`), and a family saved as a checkpoint (`checkpoint`)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from torchlens._core.errors import LookupFailed, did_you_mean
from torchlens.testing._inputs import tokenizer
from torchlens.testing._rows import FAMILIES

if TYPE_CHECKING:  # transformers stays an optional import of the library
    from transformers import PretrainedConfig


def _is_norm(name: str) -> bool:
    """Whether a parameter name says it belongs to a norm (`ln_f`, `input_layernorm`, `LayerNorm`)."""
    return "norm" in name.lower() or ".ln" in name or name.startswith("ln")


def from_config(
    config: PretrainedConfig,
    model_class: type,
    attn_implementation: str = "eager",
    dtype: torch.dtype = torch.float32,
    perturb_norms: bool = True,
) -> torch.nn.Module:
    """Build `model_class(config)` with seeded weights, in eval mode and `dtype`.

    torch is seeded with 0 before the model is made, so two calls with the same config give the
    same weights. Random init leaves the gains of some norms at exactly 1 and their biases at 0,
    which would make a tensor before a norm's gain equal the one after it; with `perturb_norms`
    every parameter of a module whose name says it is a norm gets seeded noise (scale 0.1)
    added, so the two differ.

    Args:
        config: a `transformers` config (its `_attn_implementation`, and that of its
            `text_config` and `vision_config` where it has them, is set to `attn_implementation`).
        model_class: the model class to build from it (`transformers.LlamaForCausalLM`).
        attn_implementation: `"eager"` or `"sdpa"`.
        dtype: the dtype the model is returned in.
        perturb_norms: add seeded noise to the norm parameters (see above).

    Returns:
        The model, in eval mode.

    Raises:
        RuntimeError: `transformers` did not keep `attn_implementation` on the built model.
    """
    torch.manual_seed(0)
    for sub in ("text_config", "vision_config"):  # a multimodal config's towers run it too
        if getattr(config, sub, None) is not None:
            getattr(config, sub)._attn_implementation = attn_implementation
    config._attn_implementation = attn_implementation
    model = model_class(config)
    if perturb_norms:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if _is_norm(name):
                    p.add_(0.1 * torch.randn(p.shape, generator=gen))
    model = model.to(dtype).eval()
    if model.config._attn_implementation != attn_implementation:
        raise RuntimeError(
            f"{model_class.__name__} was asked for {attn_implementation!r} attention but runs "
            f"{model.config._attn_implementation!r}"
        )
    return model


def build(
    family: str,
    attn_implementation: str = "eager",
    dtype: torch.dtype = torch.float32,
    **settings: Any,
) -> torch.nn.Module:
    """Build a tiny random-init model of one of the [`FAMILIES`][torchlens.testing.FAMILIES].

    The weights are seeded (see [`from_config`][torchlens.testing.from_config]): the same family
    and settings give the same weights in every call and every process.

    Args:
        family: a key of `FAMILIES` (`"gpt2"`, `"llama"`, `"t5"`, ...).
        attn_implementation: one of the family's `attn_implementations`.
        dtype: the dtype the model is returned in.
        **settings: config keyword arguments that replace or add to the family's (a wider model
            for a GPU kernel: `hidden_size=128, head_dim=64`).

    Returns:
        The model, in eval mode.

    Raises:
        LookupFailed: `family` is not a key of `FAMILIES` (a `KeyError`; the message gives the
            close matches and lists them). A setting is not checked: a config keeps any keyword
            as an attribute, and a model may read one its config does not list (`layer_types`),
            so a misspelt one (`n_layers=` for GPT-2's `n_layer`) builds the family's default.
        ValueError: the family does not run `attn_implementation` (the message says why).

    Examples:
        >>> from torchlens import testing
        >>> model = testing.build("gpt2", "sdpa")
        >>> model.config.n_layer, model.config._attn_implementation
        (2, 'sdpa')
        >>> testing.build("gpt2", hidden_size=64).config.n_embd  # a setting overridden
        64
        >>> testing.build("gemma2", "sdpa")
        Traceback (most recent call last):
        ValueError: gemma2 runs with 'eager' attention, not 'sdpa': transformers runs Gemma-2 with ...
    """
    if family not in FAMILIES:
        hint = did_you_mean(str(family), FAMILIES)
        raise LookupFailed(
            f"no test family {family!r}.{hint} The families are {', '.join(FAMILIES)}."
        )
    spec = FAMILIES[family]
    if attn_implementation not in spec.attn_implementations:
        raise ValueError(
            f"{family} runs with {' or '.join(map(repr, spec.attn_implementations))} attention, not "
            f"{attn_implementation!r}: {spec.why}"
        )
    return from_config(spec.make_config(**settings), spec.model_class(), attn_implementation, dtype)


def checkpoint(
    family: str,
    directory: str | Path | None = None,
    *,
    tokenizer_too: bool = False,
    **settings: Any,
) -> tuple[torch.nn.Module, Path]:
    """Build a family's model (float32, eager) and `save_pretrained` it into a directory.

    For engines that load a checkpoint from disk: the model returned holds the weights the
    directory holds, so a trace of it is the ground truth for what the engine loads. The saved
    config does not record the attention implementation: `from_pretrained` picks its default
    (sdpa) unless given `attn_implementation="eager"`. Loaded eager, the model computes what the
    returned one does bit for bit; loaded with sdpa, to rounding.

    Args:
        family: a key of `FAMILIES`.
        directory: where to save; a fresh temporary directory when None (not deleted).
        tokenizer_too: also save [`tokenizer`][torchlens.testing.tokenizer]`()` there (the
            model's vocabulary must then be at least 64 tokens).
        **settings: config keyword arguments, as for [`build`][torchlens.testing.build].

    Returns:
        The model and the directory.

    Examples:
        >>> import tempfile, torch, transformers
        >>> from torchlens import testing
        >>> ids = testing.token_ids()
        >>> with tempfile.TemporaryDirectory() as directory:
        ...     model, path = testing.checkpoint("llama", directory)
        ...     loaded = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        >>> torch.equal(loaded(ids).logits, model(ids).logits)
        True
    """
    model = build(family, **settings)
    path = (
        Path(directory)
        if directory is not None
        else Path(tempfile.mkdtemp(prefix=f"torchlens-{family}-"))
    )
    cast(Any, model).save_pretrained(path)  # every family builds a transformers PreTrainedModel
    if tokenizer_too:
        tokenizer().save_pretrained(path)
    return model, path
