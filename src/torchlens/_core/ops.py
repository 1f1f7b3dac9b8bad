"""What TorchLens knows about ops: how a torch function is named and classified, and every set
of op names the facet, structure and diagnosis code looks for.

An op is named as the recorder sees it: the torch function's `__name__`, with one leading
underscore removed from private names (`torch._softmax` is recorded as `softmax`), and a
property read such as `x.T` named after the property. Every op-name set below is written in
that spelling, so no set needs a private spelling of a name it already holds.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["classify", "SKIP", "PLAIN", "INPLACE", "REPOINT"]

# -- classifying a torch function ------------------------------------------------------------

#: How the recorder treats a torch function: not recorded (metadata only), recorded, recorded as
#: a write into one of its inputs, or (`x.data = y`) not recorded but noted as giving its first
#: argument other memory.
SKIP, PLAIN, INPLACE, REPOINT = 0, 1, 2, 3
#: Property setters that reach the mode: `x.data = y` gives `x` other memory and moves no version
#: counter; the others (`x.grad = g`, `x.requires_grad = b`) change no values. (`x.real = y` does
#: not reach a torch function mode on torch 2.13: a write the mode cannot see.)
SETTERS = {"data": REPOINT}
#: Ops whose output can be memory they did not allocate: a NumPy array's, a buffer's, another
#: library's (`torch.as_tensor(array)` shares the array's memory). Their output's memory is
#: treated as made outside the forward, since whatever holds it may write into it later. (On torch
#: 2.13 only `as_tensor` and `asarray` reach a torch function mode; a tensor the others made is an
#: input from outside the forward where an op reads it.)
FOREIGN_MEMORY_OPS = frozenset({"as_tensor", "asarray", "from_numpy", "frombuffer", "from_dlpack"})
#: Attribute reads that never produce a tensor: answered without any bookkeeping.
METADATA_GETTERS = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "ndim",
        "is_cuda",
        "is_sparse",
        "is_quantized",
        "is_meta",
        "layout",
        "requires_grad",
        "is_leaf",
        "names",
        "itemsize",
        "nbytes",
        "_version",
        "grad_fn",
        "output_nr",
    }
)
#: Methods that return metadata, Python scalars or views of the storage, never a new tensor.
METADATA_METHODS = frozenset(
    {
        "size",
        "dim",
        "numel",
        "stride",
        "storage_offset",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
        "element_size",
        "data_ptr",
        "__len__",
        "__bool__",
        "item",
        "tolist",
        "__repr__",
        "__format__",
        "__hash__",
        "__index__",
        "__int__",
        "__float__",
        "get_device",
        "untyped_storage",
        "__reduce_ex__",
        "__deepcopy__",
        "__array__",
        "__iter__",
        "__contains__",
        "has_names",
        "is_inference",
        "__dlpack__",
        "__dlpack_device__",
    }
)
#: Operators that write into their left operand (besides the `name_` methods, which all do).
INPLACE_DUNDERS = frozenset(
    {
        "__setitem__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
        "__imatmul__",
    }
)


def _classify(func: Any) -> tuple[str, int]:
    name = getattr(func, "__name__", None) or type(func).__name__
    if (
        name == "__set__"
    ):  # a property write such as `x.data = y`: it returns None, so nothing is recorded
        owner = getattr(getattr(func, "__self__", None), "__name__", "")
        return (f"{owner}.__set__", SETTERS.get(owner, SKIP))
    if name == "__get__":  # a property read such as `x.shape` or `x.T`
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", name)
        kind = SKIP if name in METADATA_GETTERS else PLAIN
    elif name in METADATA_METHODS:
        kind = SKIP
    elif name in INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__")):
        kind = INPLACE
    else:
        kind = PLAIN
    return (name[1:] if name.startswith("_") and not name.startswith("__") else name, kind)


_cached = functools.lru_cache(maxsize=4096)(_classify)


def classify(func: Any) -> tuple[str, int]:
    """The recorded name of a torch function and whether it is `SKIP`, `PLAIN` or `INPLACE`.

    Answers are cached for the 4096 functions seen most recently (a model calls a few hundred
    distinct ones), so a process that traces many models, or a callable created afresh on every
    call, never grows the cache without bound. An unhashable callable is classified each time.

    Examples:
        >>> classify(torch.softmax)
        ('softmax', 1)
        >>> classify(torch.Tensor.add_)
        ('add_', 2)
    """
    try:
        return _cached(func)
    except TypeError:  # unhashable
        return _classify(func)


# -- op-name sets ------------------------------------------------------------------------------

#: The softmax of an eager attention.
SOFTMAX_OPS = frozenset({"softmax"})
#: Fused attention kernels whose pattern TorchLens rebuilds from the inputs.
FUSED_ATTENTION_OPS = frozenset({"scaled_dot_product_attention"})
#: Ops whose arguments are kept (detached) so that the facets they hide can be rebuilt and
#: checked: fused attention kernels, and `F.multi_head_attention_forward`, inside which
#: `nn.MultiheadAttention` runs everything (a torch function mode sees it as one op).
REBUILT_OPS = FUSED_ATTENTION_OPS | {"multi_head_attention_forward"}
#: Products of two tensors (matmul-like), used to find z = pattern @ v and q @ k^T.
MATMUL_OPS = frozenset({"matmul", "__matmul__", "bmm", "einsum", "baddbmm"})
#: Which tensor arguments of a matmul-like op are its two factors, where not the first two
#: (`baddbmm(input, batch1, batch2)`: GPT-2's `reorder_and_upcast_attn` scores).
MATMUL_OPERANDS = {"baddbmm": (1, 2)}
#: Elementwise products: the gate of a gated MLP, RoPE, a norm's gain.
MUL_OPS = frozenset({"mul", "__mul__", "__rmul__", "mul_", "__imul__"})
#: Products and quotients by a constant (OPT's `q_proj(x) * scaling`, a softcap's division).
SCALE_OPS = MUL_OPS | {"div", "__truediv__"}
#: Additions: the residual stream between attention and MLP.
ADD_OPS = frozenset({"add", "__add__", "__radd__", "add_", "__iadd__"})
#: Subtractions: a norm written out with `rsqrt` that subtracts (centres) is a LayerNorm, else RMS.
SUB_OPS = frozenset({"sub", "__sub__", "__rsub__", "sub_", "__isub__"})
#: Ops that compute a norm's statistics or the whole norm: their presence on a path means the
#: values were normalized, not just moved.
NORM_OPS = frozenset({"rsqrt", "rms_norm", "layer_norm"})
#: Dtype casts.
CAST_OPS = frozenset({"to", "type", "type_as", "float", "half", "bfloat16"})
#: Ops that only pass a value through (casts, copies, identity dropout in eval).
PASS_THROUGH_OPS = CAST_OPS | {"contiguous", "clone", "dropout"}
#: Elementwise activation functions (and their in-place forms): an MLP's `act` is served from
#: one of these, or from an activation module's output, and only where its input is the output
#: of the MLP's up projection (`pre`).
ACTIVATION_OPS = frozenset(
    {
        "relu",
        "relu_",
        "gelu",
        "gelu_",
        "silu",
        "silu_",
        "sigmoid",
        "sigmoid_",
        "tanh",
        "tanh_",
        "softplus",
        "mish",
        "mish_",
        "elu",
        "elu_",
        "selu",
        "selu_",
        "celu",
        "celu_",
        "leaky_relu",
        "leaky_relu_",
        "hardswish",
        "hardswish_",
        "hardsigmoid",
        "hardsigmoid_",
        "hardtanh",
        "hardtanh_",
        "relu6",
        "prelu",
        "rrelu",
        "rrelu_",
        "logsigmoid",
        "softsign",
        "threshold",
        "threshold_",
    }
)
#: Ops that mix positions: a convolution slides over the sequence. A block's sublayer running one
#: is a token mixer (a Mamba mixer, a gated delta net, a short conv), never its MLP, which maps
#: each position on its own. (A cumulative sum is no sign: an MoE's routing counts tokens with one.)
TOKEN_MIXING_OPS = frozenset({"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d"})
#: Elementwise ops that map logits to logits (a final softcap, casts): the model's output is
#: taken as `logits` only when nothing else runs between the unembedding and it (not a
#: log_softmax, which gives log-probabilities).
LOGIT_MAP_OPS = (
    frozenset({"__truediv__", "div", "tanh", "__mul__", "mul", "__rmul__", "contiguous", "clone"})
    | CAST_OPS
)
#: Ops that split one tensor into several along a dimension.
SPLIT_OPS = frozenset({"split", "chunk", "tensor_split", "unbind", "split_with_sizes"})
#: Ops that reshape without changing values.
RESHAPE_OPS = frozenset({"view", "reshape", "unflatten"})
#: Transposes: `k.transpose(-1, -2)` on its way into q @ k^T.
TRANSPOSE_OPS = frozenset({"transpose", "mT", "T"})
#: Indexing (`x[..., :d]`, `x[0]`).
INDEX_OPS = frozenset({"__getitem__"})
#: Ops that take part of a tensor or give it another shape, values unchanged.
SLICE_OPS = SPLIT_OPS | RESHAPE_OPS | INDEX_OPS
#: Integer casts: token ids on their way to an embedding.
INT_CAST_OPS = frozenset({"long", "int"})
#: How a KV cache joins a forward's new keys to the cached ones before the kernel reads them: a
#: concatenation (a dynamic cache, a sliding window's) or a write into a preallocated buffer (a
#: static cache's `index_copy_`, a slice assignment). `rot_q`/`rot_k` are read before it.
CACHE_JOIN_OPS = frozenset(
    {"cat", "concat", "concatenate", "index_copy_", "index_copy", "__setitem__"}
)


def reconstruction_tolerance(dtype: torch.dtype) -> float:
    """Absolute tolerance (relative to the checked output's scale) for a recomputed tensor.

    A rebuilt or computed facet is served only when a relation the model fixes holds within
    this tolerance times the scale of the values compared (at least 1).
    """
    return {
        torch.float64: 1e-10,
        torch.float32: 1e-5,
        torch.bfloat16: 2e-2,
        torch.float16: 2e-3,
    }.get(dtype, 1e-4)
