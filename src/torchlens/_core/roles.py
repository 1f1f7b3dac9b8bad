"""What TorchLens knows about modules: the roles they can have and how to read their parameters.

The rules that give modules their roles from the recorded data flow (block, attention, MLP,
norm, embedding, unembedding) live in `torchlens._analysis.structure`, the `roles=` override with them.
This module holds the data those rules read: the role names, the attribute and class-name hints,
the norm classes, weight layouts and where a norm keeps its epsilon. What TorchLens knows about
ops (names, classification, tolerances) is in `torchlens._core.ops`. Supporting a new family means
adding a name here or there, never an `if family == ...` branch.

The attribute and class-name hints (`ATTENTION_ATTRS`, `MLP_ATTRS`, ...) are used only *before*
the forward, to guess which tensors `save=` needs; after it, roles are settled from the data flow.
"""

from __future__ import annotations

from torch import nn

#: Attribute names under which decoder blocks keep their attention sublayer.
ATTENTION_ATTRS = ("attn", "self_attn", "attention", "self_attention")
#: Attribute names under which decoder blocks keep their MLP sublayer.
MLP_ATTRS = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "mlp_block", "DenseReluDense")
#: Class-name fragments that mark an attention or MLP child of a block.
ATTENTION_CLASS_FRAGMENTS = ("Attention",)
MLP_CLASS_FRAGMENTS = ("MLP", "Mlp", "FeedForward")
#: Norm classes by type, and by class-name suffix (covers every `*RMSNorm` of transformers).
NORM_CLASSES = (nn.LayerNorm, nn.GroupNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
NORM_SUFFIXES = ("RMSNorm", "LayerNorm", "Norm")
#: Class names ending like a norm's that are none: batch statistics, and the weight
#: parametrizations of `torch.nn.utils.parametrizations` (`spectral_norm`, `weight_norm`), which
#: rescale a weight, not the activations.
NOT_NORMS = ("BatchNorm", "_SpectralNorm", "_WeightNorm")
#: Attribute names a norm keeps its epsilon under.
EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps")
#: Names of the output projection (unembedding), a hint used before the forward only: after it the
#: unembedding is the linear layer whose width is the vocabulary and whose output reaches the model
#: output.
UNEMBED_ATTRS = ("lm_head", "embed_out", "output", "unembed")
#: `config.model_type` of encoder-only families (bidirectional attention, no causal mask).
ENCODER_MODEL_TYPES = frozenset(
    {
        "bert",
        "roberta",
        "distilbert",
        "albert",
        "electra",
        "deberta",
        "deberta-v2",
        "xlm-roberta",
        "camembert",
        "mpnet",
        "vit",
        "deit",
        "beit",
        "dinov2",
        "clip_vision_model",
        "siglip_vision_model",
        "modernbert",
    }
)
#: Class-name fragments of the module holding an encoder stack (`BertEncoder`, `CLIPEncoder`).
ENCODER_CLASS_FRAGMENTS = ("Encoder",)

#: How a projection layer stores its weight. `"out_in"` is `nn.Linear` (`[out, in]`, y = x W^T);
#: `"in_out"` is GPT-2's `Conv1D` (`[in, out]`, y = x W). Looked up by class name.
WEIGHT_LAYOUT = {"Linear": "out_in", "Conv1D": "in_out"}

ROLES = ("root", "block", "attention", "mlp", "norm", "embedding", "unembed", "other")


def is_norm(module: nn.Module) -> bool:
    """Whether `module` is a normalization layer (LayerNorm, any RMSNorm, GroupNorm)."""
    if isinstance(module, NORM_CLASSES):
        return True
    name = type(module).__name__
    return name.endswith(NORM_SUFFIXES) and not name.endswith(NOT_NORMS)


def child_role(attr: str, module: nn.Module) -> str | None:
    """A guess, from the attribute and class name, of a block child's role (used before the forward only)."""
    cls = type(module).__name__
    if attr in ATTENTION_ATTRS or any(f in cls for f in ATTENTION_CLASS_FRAGMENTS):
        return "attention"
    if attr in MLP_ATTRS or any(f in cls for f in MLP_CLASS_FRAGMENTS):
        return "mlp"
    return None


def weight_layout(module: nn.Module) -> str | None:
    """`"out_in"` or `"in_out"` for a projection layer, from `WEIGHT_LAYOUT`; None if unknown."""
    return WEIGHT_LAYOUT.get(type(module).__name__) or (
        "out_in" if isinstance(module, nn.Linear) else None
    )


def norm_eps(module: nn.Module) -> float | None:
    """The epsilon a norm adds under its square root (read from the module, default 1e-5); None
    for torch's `nn.RMSNorm` given `eps=None`, which adds its input dtype's `finfo.eps`."""
    for attr in EPS_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    if hasattr(nn, "RMSNorm") and isinstance(module, nn.RMSNorm) and module.eps is None:
        return None
    return 1e-5


def is_rms_norm(module: nn.Module) -> bool:
    """Whether the norm divides by the root mean square (no centering, no bias)."""
    return "RMS" in type(module).__name__ or (
        hasattr(nn, "RMSNorm") and isinstance(module, nn.RMSNorm)
    )
