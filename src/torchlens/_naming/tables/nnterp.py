"""nnterp `StandardizedTransformer` accessor and property names (checked against nnterp 1.3.0).

The table holds nnterp's seven per-layer accessors and the global names that read a forward
tensor on a non-norm module. nnterp standardizes no norm names: its module-level spellings of
the final norm (`ln_final.input`, `ln_final.output`, and `lm_head.input`, which is the final
norm's output) have no row, and resolving one says where to read the tensor instead.
"""

from torchlens._naming.tables import Row, Table

ROWS = (
    Row("layers_input[{L}]", "block", "resid_pre", "decoder layer input"),
    Row("attentions_input[{L}]", "attention", "input", "attention input (normed residual)",
        "nnterp reads the first keyword tensor when the attention is called with keywords only"),
    Row("attention_probabilities[{L}]", "attention", "pattern", "attention softmax output",
        "nnterp needs enable_attention_probs=True (eager attention) to read it"),
    Row("attentions_output[{L}]", "attention", "output", "attention output (element 0)"),
    Row("mlps_input[{L}]", "mlp", "input", "MLP input (normed residual)"),
    Row("mlps_output[{L}]", "mlp", "output", "MLP output"),
    Row("layers_output[{L}]", "block", "resid_post", "decoder layer output (element 0)"),
    Row("input_ids", "token_embed", "indices", "token ids entering the embedding"),
    Row("token_embeddings", "token_embed", "output", "token embedding (no position embedding)"),
    Row("embed_tokens.output", "token_embed", "output", "token embedding module output"),
    Row("logits", "root", "logits", "logits the model returns (nnterp reads output.logits)",
        "after any step that follows the unembedding (Gemma-2's final logit softcap); lm_head.output is "
        "the unembedding's own output"),
    Row("lm_head.output", "unembed", "output", "unembedding module output"),
)

_FINAL_NORM = (
    "nnterp standardizes no norm names, so the nnterp table has no row for {name}. "
)

UNMAPPED = {
    "ln_final.input": _FINAL_NORM.format(name="ln_final.input")
    + "The tensor is the final norm's input: trace.modules[''].facets['final_norm_input'], "
    "or the 4.x name ln_final.hook_in.",
    "ln_final.output": _FINAL_NORM.format(name="ln_final.output")
    + "No facet names the final norm's output: read final_norm_input and apply the norm, address the "
    "norm module directly (trace.modules[<final norm address>].facets['output']), or use the 4.x name "
    "ln_final.hook_out.",
    "lm_head.input": _FINAL_NORM.format(name="lm_head.input")
    + "It is the final norm's output: use the 4.x name unembed.hook_in, or the lm_head module's 'input' facet.",
    "next_token_probs": "next_token_probs is derived (softmax of the last position's logits), not a forward "
    "tensor: compute it from logits.",
    "attention_mask": "attention_mask is a model input, not a captured site: it is what you passed to the forward.",
}

TABLE = Table(
    "nnterp", "nnterp 1.3 StandardizedTransformer accessors", ROWS, unmapped=UNMAPPED, negative_layers=True,
    decoder_only=True,
)
