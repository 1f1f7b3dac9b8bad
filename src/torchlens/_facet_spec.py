"""The facet specification: every facet TorchLens can produce, by role, with its layout.

This is the vocabulary `save=` selections and the naming tables are checked against, and the
source of the facet documentation.
"""

from __future__ import annotations

__all__ = ["FACETS", "ALL_FACETS"]

#: Every facet name TorchLens can produce, by role, with its layout. This is the vocabulary
#: `save=` selections and the alias tables are checked against.
FACETS: dict[str, dict[str, str]] = {
    "any": {
        "input": "the module's first positional argument, or its first tensor keyword argument when called with keywords only",
        "output": "the module's output tensor, or else the first tensor in its output, depth first: element 0 of a tuple, the first tensor value of a dict/ModelOutput, inside nested tuples/lists/dicts",
    },
    "block": {
        "resid_pre": "[batch, pos, d_model] residual stream entering the block (the block input)",
        "resid_mid": "[batch, pos, d_model] residual stream after the attention add, before the MLP; absent on parallel attention+MLP blocks",
        "resid_post": "[batch, pos, d_model] residual stream leaving the block (the block output)",
    },
    "attention": {
        "q": "[batch, pos, heads, d_head] query projection viewed per head, before the transpose and before RoPE",
        "k": "[batch, pos, kv_heads, d_head] key projection viewed per head (kv heads under GQA), before RoPE",
        "v": "[batch, pos, kv_heads, d_head] value projection viewed per head (kv heads under GQA)",
        "rot_q": "[batch, pos, heads, d_head] query as the attention kernel receives it (after RoPE and any QK-norm), token-major; only where it differs from q",
        "rot_k": "[batch, pos, kv_heads, d_head] key as the attention kernel receives it, token-major, kv heads; only where it differs from k",
        "scores": "[batch, heads, query, key] the tensor entering softmax: scaled, softcapped and masked as the model does (masked entries hold the model's fill, HF: the dtype minimum)",
        "pattern": "[batch, heads, query, key] softmax output, in the model dtype",
        "z": "[batch, heads, pos, d_head] pattern @ v, head-major as the kernel returns it",
        "result": "[batch, pos, heads, d_model] each head's contribution to the output projection (bias excluded); sums over heads plus bias to the projection output",
    },
    "mlp": {
        "pre": "[batch, pos, d_mlp] input of the activation function (GPT-2 c_fc output, Llama gate_proj output)",
        "pre_linear": "[batch, pos, d_mlp] the gated MLP's linear branch (Llama up_proj output); absent on a non-gated MLP",
        "act": "[batch, pos, d_mlp] activation output, act(pre)",
        "gated_out": "[batch, pos, d_mlp] act(pre) * pre_linear; absent on a non-gated MLP",
        "post": "[batch, pos, d_mlp] input of the down projection: act on a plain MLP, gated_out on a gated one",
        "down_out": "[batch, pos, d_model] output of the down projection, before any dropout",
    },
    "norm": {
        "normalized": "[batch, pos, d_model] input centred (LayerNorm) and divided by its RMS/std over the norm's normalized shape (per group for GroupNorm), before the gain and bias; served only where normalized * gain + bias equals the norm's output",
        "inv_rms": "[batch, pos, 1] 1/sqrt(mean(x^2)+eps) of an RMSNorm",
        "inv_std": "[batch, pos, 1] 1/sqrt(var(x)+eps) of a LayerNorm",
        "scale": "[batch, pos, 1] the divisor sqrt(mean(x^2)+eps) or sqrt(var(x)+eps): 1/inv_rms (TransformerLens hook_scale)",
    },
    "embedding": {
        "indices": "[batch, pos] token ids entering the embedding",
        "lookup": "[batch, pos, d_model] the rows looked up, before anything the module does after the lookup (Gemma's sqrt(d_model) scaling); equals output elsewhere",
    },
    "root": {
        "final_norm_input": "[batch, pos, d_model] input of the final norm (the last block's output)",
        "logits": "[batch, pos, vocab] the model's logits: the unembedding's output, or the root output when it is computed from it with the same shape (e.g. Gemma-2's final softcap)",
    },
}

ALL_FACETS: frozenset[str] = frozenset(n for table in FACETS.values() for n in table)
