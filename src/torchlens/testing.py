"""Small seeded models and ground truth from outside TorchLens, for tests (like `torch.testing`).

TorchLens's own tests, its documentation scripts and an engine's CI need the same things: a
tiny Hugging Face decoder with fixed weights, built from a config in milliseconds without a
download, and a way to read what a module returned that does not go through TorchLens. This
module holds both:

- [`build`][torchlens.testing.build]`(family)` builds one of the [`FAMILIES`][torchlens.testing.FAMILIES]
  (GPT-2, Llama, GPT-NeoX, Gemma-2, Qwen3, Phi-3, OLMo-2, Mistral and variants): two layers, a
  32-wide residual stream, seeded weights, eval mode.
- [`from_config`][torchlens.testing.from_config] does the same for any config and model class.
- [`checkpoint`][torchlens.testing.checkpoint] saves such a model with `save_pretrained`, for
  engines that load a directory (vLLM, SGLang).
- [`token_ids`][torchlens.testing.token_ids] and [`tokenizer`][torchlens.testing.tokenizer]
  give inputs that fit these models' vocabulary.
- [`hooked_outputs`][torchlens.testing.hooked_outputs] records module outputs with plain
  forward hooks: the ground truth a TorchLens trace is checked against.

`transformers` is imported inside the functions that need it; importing this module needs only
torch.

Example:
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

import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:  # transformers stays an optional import of the library
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

__all__ = [
    "FAMILIES",
    "LLAMA_LIKE",
    "MAX_POSITIONS",
    "VOCAB",
    "Family",
    "build",
    "checkpoint",
    "from_config",
    "hooked_outputs",
    "token_ids",
    "tokenizer",
]

#: Vocabulary size of every model [`build`][torchlens.testing.build] makes.
VOCAB = 64
#: Position limit of every model [`build`][torchlens.testing.build] makes.
MAX_POSITIONS = 16

#: The shape the Llama-like families share: 2 layers, d_model 32, 4 query heads over 2 key/value
#: heads (grouped-query attention), d_head 8, d_mlp 48. Config keyword arguments.
LLAMA_LIKE: Mapping[str, int] = MappingProxyType({
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "vocab_size": VOCAB,
    "max_position_embeddings": MAX_POSITIONS,
})

_GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": VOCAB, "n_positions": MAX_POSITIONS,
         "bos_token_id": 0, "eos_token_id": 0}
_NEOX = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 48,
         "vocab_size": VOCAB, "max_position_embeddings": MAX_POSITIONS, "rotary_pct": 0.5, "bos_token_id": 0,
         "eos_token_id": 0}
_SPECIAL = {"bos_token_id": 0, "eos_token_id": 0}


@dataclass(frozen=True)
class Family:
    """One model family [`build`][torchlens.testing.build] can make.

    Attributes:
        config: the name of the `transformers` config class (`"LlamaConfig"`).
        model: the name of the `transformers` model class (`"LlamaForCausalLM"`).
        settings: the config's keyword arguments.
        attn_implementations: the attention implementations `transformers` runs this family with.
        why: why the family has only the implementations it has (empty when it has both).
    """

    config: str
    model: str
    settings: Mapping[str, Any]
    attn_implementations: tuple[str, ...] = ("eager", "sdpa")
    why: str = ""


def _family(config: str, model: str, settings: dict, impls=("eager", "sdpa"), why: str = "") -> Family:
    return Family(config, model, MappingProxyType(settings), impls, why)


#: name -> [`Family`][torchlens.testing.Family]: the families [`build`][torchlens.testing.build]
#: makes. Every one is a causal language model with a tied or untied `lm_head`.
FAMILIES: Mapping[str, Family] = MappingProxyType({
    "gpt2": _family("GPT2Config", "GPT2LMHeadModel", _GPT2),
    "gpt2_upcast": _family(
        "GPT2Config", "GPT2LMHeadModel", dict(_GPT2, reorder_and_upcast_attn=True), ("eager",),
        "`reorder_and_upcast_attn` (eager scores from a float32 `baddbmm`) changes only the eager attention"),
    "llama": _family("LlamaConfig", "LlamaForCausalLM", dict(LLAMA_LIKE)),
    "gpt_neox": _family("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_NEOX, use_parallel_residual=True)),
    "gpt_neox_sequential": _family(  # attention then MLP, like GPT-2
        "GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_NEOX, use_parallel_residual=False)),
    "gemma2": _family(
        "Gemma2Config", "Gemma2ForCausalLM",
        dict(LLAMA_LIKE, head_dim=8, sliding_window=4, pad_token_id=0, **_SPECIAL), ("eager",),
        "transformers runs Gemma-2 with eager attention only (softcapping)"),
    "qwen3": _family("Qwen3Config", "Qwen3ForCausalLM", dict(LLAMA_LIKE, head_dim=8, **_SPECIAL)),
    "phi3": _family("Phi3Config", "Phi3ForCausalLM", dict(LLAMA_LIKE, pad_token_id=0, **_SPECIAL)),
    "olmo2": _family("Olmo2Config", "Olmo2ForCausalLM", dict(LLAMA_LIKE, pad_token_id=0, **_SPECIAL)),
    "mistral": _family("MistralConfig", "MistralForCausalLM", dict(LLAMA_LIKE, sliding_window=None, **_SPECIAL)),
})


def _is_norm(name: str) -> bool:
    """Whether a parameter name says it belongs to a norm (`ln_f`, `input_layernorm`, `LayerNorm`)."""
    return "norm" in name.lower() or ".ln" in name or name.startswith("ln")


def from_config(config: PretrainedConfig, model_class: type, attn_implementation: str = "eager",
                dtype: torch.dtype = torch.float32, perturb_norms: bool = True) -> torch.nn.Module:
    """Build `model_class(config)` with seeded weights, in eval mode and `dtype`.

    torch is seeded with 0 before the model is made, so two calls with the same config give the
    same weights. Random init leaves the gains of some norms at exactly 1 and their biases at 0,
    which would make a tensor before a norm's gain equal the one after it; with `perturb_norms`
    every parameter of a module whose name says it is a norm gets seeded noise (scale 0.1)
    added, so the two differ.

    Args:
        config: a `transformers` config (its `_attn_implementation` is set to
            `attn_implementation`).
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
        raise RuntimeError(f"{model_class.__name__} was asked for {attn_implementation!r} attention but runs "
                           f"{model.config._attn_implementation!r}")
    return model


def build(family: str, attn_implementation: str = "eager", dtype: torch.dtype = torch.float32,
          **settings: Any) -> torch.nn.Module:
    """Build a tiny random-init model of one of the [`FAMILIES`][torchlens.testing.FAMILIES].

    The weights are seeded (see [`from_config`][torchlens.testing.from_config]): the same family
    and settings give the same weights in every call and every process.

    Args:
        family: a key of `FAMILIES` (`"gpt2"`, `"llama"`, ...).
        attn_implementation: one of the family's `attn_implementations`.
        dtype: the dtype the model is returned in.
        **settings: config keyword arguments that replace or add to the family's (a wider model
            for a GPU kernel: `hidden_size=128, head_dim=64`).

    Returns:
        The model, in eval mode.

    Raises:
        KeyError: `family` is not a key of `FAMILIES` (the message lists them).
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
        ValueError: gemma2 runs with 'eager' attention, not 'sdpa': transformers runs Gemma-2 with eager attention only (softcapping)
    """
    import transformers

    if family not in FAMILIES:
        raise KeyError(f"no test family {family!r}; the families are {', '.join(FAMILIES)}")
    spec = FAMILIES[family]
    if attn_implementation not in spec.attn_implementations:
        raise ValueError(f"{family} runs with {' or '.join(map(repr, spec.attn_implementations))} attention, not "
                         f"{attn_implementation!r}: {spec.why}")
    config = getattr(transformers, spec.config)(**{**spec.settings, **settings})
    return from_config(config, getattr(transformers, spec.model), attn_implementation, dtype)


def checkpoint(family: str, directory: str | Path | None = None, *, tokenizer_too: bool = False,
               **settings: Any) -> tuple[torch.nn.Module, Path]:
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
    path = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix=f"torchlens-{family}-"))
    cast(Any, model).save_pretrained(path)  # every family builds a transformers PreTrainedModel
    if tokenizer_too:
        tokenizer().save_pretrained(path)
    return model, path


def token_ids(batch: int = 1, length: int = 7, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    """Seeded random token ids, shape `[batch, length]`, drawn from `range(vocab)`.

    Examples:
        >>> from torchlens import testing
        >>> testing.token_ids(2, 3).shape
        torch.Size([2, 3])
        >>> bool((testing.token_ids(seed=4) == testing.token_ids(seed=4)).all())
        True
    """
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen)


def tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """A word-level fast tokenizer made in memory: nothing is downloaded.

    Ids 0-3 are `<unk>`, `<bos>`, `<eos>` and `<pad>`; the words `t4` ... `t{vocab-1}` are ids 4 to
    `vocab - 1`, split on whitespace. Engines that insist on a tokenizer (nnterp) accept it.

    Returns:
        The tokenizer, a `transformers.PreTrainedTokenizerFast`.

    Examples:
        >>> from torchlens import testing
        >>> testing.tokenizer()("t5 t9 t63")["input_ids"]
        [5, 9, 63]
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<bos>": 1, "<eos>": 2, "<pad>": 3, **{f"t{i}": i for i in range(4, vocab)}}
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<bos>",
                                   eos_token="<eos>", pad_token="<pad>")


def hooked_outputs(model: torch.nn.Module, addresses: Iterable[str], *args: Any,
                   **kwargs: Any) -> dict[str, torch.Tensor]:
    """Run `model(*args, **kwargs)` once under `no_grad` and return what plain forward hooks saw.

    This is ground truth from outside TorchLens: one `register_forward_hook` per address, each
    cloning the module's output (the first element when the module returns a tuple) as it was
    returned. The hooks are removed before this returns, also when the forward raises.

    Args:
        model: the model.
        addresses: module addresses as `model.named_modules()` spells them.
        *args: the forward's positional arguments.
        **kwargs: the forward's keyword arguments.

    Returns:
        address -> the output tensor, for each address whose module ran (a module that ran more
        than once keeps its last output).

    Raises:
        KeyError: an address is not a module of `model`.

    Examples:
        >>> from torchlens import testing
        >>> model = testing.build("gpt2")
        >>> out = testing.hooked_outputs(model, ["transformer.h.1", "lm_head"], testing.token_ids(length=3))
        >>> {a: tuple(t.shape) for a, t in out.items()}
        {'transformer.h.1': (1, 3, 32), 'lm_head': (1, 3, 64)}
        >>> testing.hooked_outputs(model, ["transformer.h.7"], testing.token_ids())
        Traceback (most recent call last):
        KeyError: "not modules of GPT2LMHeadModel: ['transformer.h.7']"
    """
    seen: dict[str, torch.Tensor] = {}
    mods = dict(model.named_modules())
    wanted = list(addresses)
    missing = [a for a in wanted if a not in mods]
    if missing:
        raise KeyError(f"not modules of {type(model).__name__}: {missing}")
    handles = []
    try:
        for a in wanted:
            def hook(module, hook_args, out, a=a):
                seen[a] = (out[0] if isinstance(out, tuple) else out).detach().clone()
            handles.append(mods[a].register_forward_hook(hook))
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen
